"""The engine's decisions, without TensorRT: profiles from the KV contract, the timing cache's
key, the manifest entry, and what `build-engine` says where TensorRT or a GPU is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.passes.targets import TARGETS
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ArtifactError
from kvforge.toolchain.emit import tensorrt as engine

IO = DecoderIO(
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=384,
    kv_mode="shared",
    logits_positions="last",
    capacity=256,
)


def test_two_profiles_derived_from_the_contract() -> None:
    decode, prefill = engine.profiles(IO, engine.EngineOptions(max_batch=4, max_prefill=64, opt_batch=2))
    assert (decode.name, prefill.name) == ("decode", "prefill")
    assert list(decode.shapes) == [t.name for t in IO.inputs]  # every input, in the contract's order
    ids = decode.shapes["input_ids"]
    assert (ids.min, ids.opt, ids.max) == ((1, 1), (2, 1), (4, 1))  # one token per row, batch 1..4
    ids = prefill.shapes["input_ids"]
    assert (ids.min, ids.opt, ids.max) == ((1, 1), (2, 64), (4, 64))  # 1..max_prefill tokens per row
    for profile in (decode, prefill):
        mask = profile.shapes["attention_mask"]
        assert mask.min[1] == 1 and mask.max[1] == 256  # up to the whole fixed cache
        cache = profile.shapes["past_key_values.1.value"]
        assert cache.min == (1, 2, 256, 16) and cache.max == (4, 2, 256, 16)  # S_max fixed in every profile
        assert profile.shapes["position_ids"] == profile.shapes["input_ids"]


def test_default_prefill_is_512_or_the_capacity() -> None:
    small = engine.profiles(IO, engine.EngineOptions())[1]
    assert small.shapes["input_ids"].max == (8, 256)
    from dataclasses import replace

    large = engine.profiles(replace(IO, capacity=4096), engine.EngineOptions())[1]
    assert large.shapes["input_ids"].max == (8, 512)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (engine.EngineOptions(max_prefill=257), "--max-prefill 257"),
        (engine.EngineOptions(max_batch=2, opt_batch=3), "--opt-batch 3"),
        (engine.EngineOptions(optimization_level=6), "--optimization-level 6"),
        (engine.EngineOptions(workspace_mib=0), "--workspace-mib 0"),
    ],
)
def test_options_out_of_range_are_refused_by_name(options: engine.EngineOptions, message: str) -> None:
    with pytest.raises(engine.EngineError, match=message):
        engine.profiles(IO, options)


def test_an_artifact_without_fixed_capacity_gets_no_engine() -> None:
    from dataclasses import replace

    with pytest.raises(engine.EngineError, match="--target tensorrt"):
        engine.profiles(replace(IO, capacity=None), engine.EngineOptions())


def test_an_artifact_whose_graph_takes_logits_to_keep_gets_no_engine() -> None:
    """TensorRT's parser would take the input's default (an initializer) as a constant."""
    from dataclasses import replace

    with pytest.raises(engine.EngineError, match="logits_to_keep"):
        engine.profiles(replace(IO, logits_positions="keep"), engine.EngineOptions())


def test_timing_cache_is_keyed_by_tensorrt_version_and_gpu() -> None:
    a = engine.timing_cache_name("10.15.1.29", "NVIDIA H200", "9.0")
    assert a == "timing-trt10.15.1.29-sm9.0-nvidia-h200.cache"
    assert engine.timing_cache_name("10.16.0", "NVIDIA H200", "9.0") != a
    assert engine.timing_cache_name("10.15.1.29", "NVIDIA L4", "8.9") != a
    assert "/" not in engine.timing_cache_name("10.15", "../../etc/passwd", "9.0")


def test_manifest_entry_records_what_the_runner_checks() -> None:
    entry = engine.engine_entry(
        sha256="ab" * 32,
        tensorrt_version="10.15.1.29",
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        io=IO,
        options=engine.EngineOptions(max_batch=4, workspace_mib=1024),
    )
    assert entry["file"] == engine.ENGINE_FILE and entry["sha256"] == "ab" * 32
    assert (entry["tensorrt"], entry["compute_capability"], entry["capacity"]) == ("10.15.1.29", "9.0", 256)
    assert [p["name"] for p in entry["profiles"]] == ["decode", "prefill"]
    assert entry["flags"]["max_batch"] == 4 and entry["flags"]["max_prefill"] == 256
    assert entry["flags"]["workspace_mib"] == 1024 and entry["flags"]["strongly_typed"] is True
    assert "timing_cache_dir" not in entry["flags"]  # where the cache lives does not shape the engine
    json.dumps(entry)  # JSON-able, for the manifest


def test_with_engine_adds_the_engine_file_hash_and_the_tensorrt_version(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"graph")
    (tmp_path / engine.ENGINE_FILE).write_bytes(b"plan")
    manifest = {"files": {"model.onnx": "old"}, "tools": {"onnx": "1.20"}}
    updated = engine.with_engine(manifest, tmp_path, {"tensorrt": "10.15.1", "file": engine.ENGINE_FILE})
    assert set(updated["files"]) == {"model.onnx", engine.ENGINE_FILE}
    assert updated["tools"] == {"onnx": "1.20", "tensorrt": "10.15.1"} and updated["engine"]["file"] == "engine.plan"
    assert manifest["files"] == {"model.onnx": "old"}  # the recorded manifest is not changed in place


def test_write_atomically_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "engine.plan"
    path.write_bytes(b"old")
    engine.write_atomically(path, b"new bytes")
    assert path.read_bytes() == b"new bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["engine.plan"]  # no temporary left behind


def test_unavailable_says_why_when_tensorrt_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import fails, as on a machine without TensorRT
    reason = engine.unavailable()
    assert reason is not None and "tensorrt" in reason and engine.MIN_TENSORRT in reason
    with pytest.raises(engine.EngineError, match="kvforge build-engine"):
        engine.build_engine(Path("."), IO, engine.EngineOptions())


def test_build_engine_command_refuses_a_directory_that_is_no_artifact(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["build-engine", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "not an artifact directory" in result.output


def test_build_engine_refuses_other_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvforge.runners.manifest import MANIFEST, SCHEMA_VERSION, sha256_file

    (tmp_path / "model.onnx").write_bytes(b"graph")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "target": "onnx",
        "files": {"model.onnx": sha256_file(tmp_path / "model.onnx")},
    }
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not 'tensorrt'"):
        engine.add_engine(tmp_path, engine.EngineOptions())


def test_tensorrt_build_settings_are_resolved_and_checked_before_any_work() -> None:
    from kvforge.passes.quantize import WeightQuantization
    from kvforge.toolchain.build import BuildOptions, _target_options

    class Spec:
        max_positions = 256

    resolved = _target_options(BuildOptions(target=TARGETS["tensorrt"]), Spec())  # type: ignore[arg-type]
    assert resolved.capacity == 256 and resolved.flags()["capacity"] == 256
    assert "capacity" not in BuildOptions(target=TARGETS["onnx"]).flags()  # other targets' manifests are unchanged
    with pytest.raises(ArtifactError, match="--capacity 300 must be between 1 and the model's context of 256"):
        _target_options(BuildOptions(target=TARGETS["tensorrt"], capacity=300), Spec())  # type: ignore[arg-type]
    asymmetric = WeightQuantization(4, 32, symmetric=False)
    with pytest.raises(ArtifactError, match="symmetric weight quantization only"):
        _target_options(BuildOptions(target=TARGETS["tensorrt"], weights=asymmetric), Spec())  # type: ignore[arg-type]
