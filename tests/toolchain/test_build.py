"""Artifacts: reproducible bytes, all-or-nothing publishing, the gate, --force, verify."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir
import pytest

from kvforge.runners.errors import ArtifactError, ParityError
from kvforge.toolchain import build as build_module
from kvforge.toolchain.build import BuildOptions, build, verify

pytestmark = pytest.mark.slow


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_rebuild_with_force_replaces_and_is_byte_identical(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    reference = built_artifact("llama")
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    (out / "generation_config.json").write_text("{}")  # a stale artifact to be replaced
    with pytest.raises(ArtifactError, match="--force"):
        build(tiny_checkpoint("llama"), out)
    build(tiny_checkpoint("llama"), out, BuildOptions(force=True))
    assert tree_bytes(out) == tree_bytes(reference)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or retired directories left


def test_directory_that_is_not_an_artifact_is_never_replaced(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="not a kvforge artifact"):
        build(tiny_checkpoint("llama"), out, BuildOptions(force=True))
    assert (out / "notes.txt").read_text() == "keep me"


def test_failing_gate_publishes_nothing_and_keeps_previous_artifact(
    tmp_path: Path,
    tiny_checkpoint: Callable[..., Path],
    built_artifact: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    shutil.copytree(built_artifact("llama"), out)
    before = tree_bytes(out)
    real_to_onnx = build_module.to_onnx

    def corrupted(program, io):  # type: ignore[no-untyped-def]
        model = real_to_onnx(program, io)
        weight = model.graph.initializers["model.layers.1.mlp.down_proj.weight"]
        array = weight.const_value.numpy().copy()
        array[0, 0] += 0.5
        weight.const_value = ir.tensor(array, name=weight.name)
        return model

    monkeypatch.setattr(build_module, "to_onnx", corrupted)
    with pytest.raises(ParityError, match=r"does not match the eager model: .*max abs"):
        build(tiny_checkpoint("llama"), out, BuildOptions(force=True))
    assert tree_bytes(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_manifest_records_hashes_versions_contract_and_parity(
    tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    from kvforge.runners.manifest import sha256_file

    artifact = built_artifact("llama")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in artifact.iterdir()} - {"manifest.json"}
    assert all(sha256_file(artifact / n) == h for n, h in manifest["files"].items())
    checkpoint = tiny_checkpoint("llama")
    assert manifest["sources"]["model.safetensors"] == sha256_file(checkpoint / "model.safetensors")
    assert manifest["tools"]["torch"] and manifest["tools"]["onnxruntime"]
    assert manifest["spec"]["num_layers"] == 2 and manifest["io"]["kv_mode"] == "shared"
    assert manifest["parity"]["passed"] and manifest["parity"]["prefill"]
    passes = manifest["passes"]
    assert sum(passes["histogram_after"].values()) < sum(passes["histogram_before"].values())
    assert all("seconds" not in record for record in passes["passes"])  # timings would break reproducibility
    assert {"model.onnx", "model.onnx.data", "tokenizer.json", "generation_config.json"} <= set(manifest["files"])


def test_verify_reruns_the_gate_and_rejects_another_checkpoint(
    tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    report = verify(built_artifact("llama"), tiny_checkpoint("llama"))
    assert report.passed and report.decode_steps == 8
    with pytest.raises(ArtifactError, match="differ from the checkpoint"):
        verify(built_artifact("llama"), tiny_checkpoint("qwen2"))


def test_a_context_given_to_the_build_is_recorded_and_verify_reads_it(
    tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    artifact = built_artifact("bloom")  # built with BuildOptions(context=256): its config names none
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["flags"]["context"] == manifest["spec"]["max_positions"] == 256
    assert verify(artifact, tiny_checkpoint("bloom")).passed


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_checkpoints_build(dtype: str, tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    result = build(tiny_checkpoint("llama", dtype), tmp_path / "out")
    assert result.parity.passed
    assert result.manifest["spec"]["dtype"] == dtype
    assert result.manifest["flags"]["dtype"] == "float32"  # computed in fp32 on the CPU


def test_logits_default_to_keep_where_the_target_takes_the_input(tmp_path: Path) -> None:
    from kvforge.passes.targets import TARGETS

    assert build_module.logits_positions(BuildOptions()) == "keep"
    assert build_module.logits_positions(BuildOptions(target=TARGETS["onnx"])) == "keep"
    assert build_module.logits_positions(BuildOptions(target=TARGETS["tensorrt"])) == "last"
    assert build_module.logits_positions(BuildOptions(target=TARGETS["tensorrt"], logits="all")) == "all"
    assert BuildOptions().flags().get("logits") is None and BuildOptions(logits="last").flags()["logits"] == "last"
    # refused before any work: the checkpoint is never read
    with pytest.raises(ArtifactError, match="--logits keep: target tensorrt takes no logits_to_keep input"):
        build(tmp_path / "missing", tmp_path / "out", BuildOptions(target=TARGETS["tensorrt"], logits="keep"))
    with pytest.raises(ArtifactError, match="logits must be one of keep, last, all"):
        build(tmp_path / "missing", tmp_path / "out", BuildOptions(logits="first"))
    assert not (tmp_path / "out").exists()
