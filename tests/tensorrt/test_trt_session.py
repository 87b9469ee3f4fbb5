"""The TensorRT runner's decisions, without TensorRT: which engine it may deserialize, how a long
prompt is chunked, and the fixed-capacity contract the generation loop allocates from."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ArtifactError, GenerationError
from kvforge.runners.generate import empty_cache, position_ids
from kvforge.runners.trt_session import (
    DECODE_PROFILE,
    PREFILL_PROFILE,
    EngineEntry,
    check_engine,
    chunk_feeds,
    prefill_chunks,
    profile_for,
    read_engine_bytes,
    read_engine_entry,
)

IO = DecoderIO(2, 2, 16, 384, kv_mode="shared", logits_positions="last", capacity=64)
PLAN = b"serialized engine"
DIGEST = hashlib.sha256(PLAN).hexdigest()


def _manifest(**engine: object) -> dict:
    entry = {
        "file": "engine.plan",
        "sha256": DIGEST,
        "tensorrt": "10.15.1.29",
        "compute_capability": "9.0",
        "capacity": 64,
        "flags": {"max_batch": 8, "max_prefill": 32},
    }
    entry.update(engine)
    return {"files": {"model.onnx": "00" * 32, "engine.plan": DIGEST}, "engine": entry}


def test_a_listed_engine_entry_is_read() -> None:
    entry = read_engine_entry(Path("art"), _manifest())
    assert entry == EngineEntry("engine.plan", DIGEST, "10.15.1.29", "9.0", 64, 8, 32)


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({"files": {"model.onnx": "00"}}, "no engine section"),
        (_manifest(file="other.plan"), "not a file the manifest lists"),
        (_manifest(file="../engine.plan"), "not a file the manifest lists"),
        (_manifest(sha256="ff" * 32), r"does not match files\['engine.plan'\]"),
        (_manifest(tensorrt=None), "engine.tensorrt is missing"),
        (_manifest(capacity=0), "capacity must be a positive integer"),
    ],
)
def test_an_engine_the_manifest_does_not_vouch_for_is_refused(manifest: dict, message: str) -> None:
    with pytest.raises(ArtifactError, match=message):
        read_engine_entry(Path("art"), manifest)


def test_engine_of_another_tensorrt_gpu_or_cache_is_refused_with_rebuild_advice() -> None:
    entry = read_engine_entry(Path("art"), _manifest())
    check_engine(entry, IO, tensorrt_version="10.15.1.29", compute_capability="9.0")  # the machine it was built on
    with pytest.raises(ArtifactError, match="built by TensorRT 10.15.1.29, this is TensorRT 10.16.0.*build-engine"):
        check_engine(entry, IO, tensorrt_version="10.16.0", compute_capability="9.0")
    with pytest.raises(ArtifactError, match="compute capability 9.0, this GPU has 8.9.*build-engine"):
        check_engine(entry, IO, tensorrt_version="10.15.1.29", compute_capability="8.9")
    with pytest.raises(ArtifactError, match="capacity 64 differs"):
        check_engine(entry, replace(IO, capacity=128), tensorrt_version="10.15.1.29", compute_capability="9.0")


def test_engine_bytes_are_hashed_again_when_read(tmp_path: Path) -> None:
    entry = read_engine_entry(tmp_path, _manifest())
    (tmp_path / "engine.plan").write_bytes(PLAN)
    assert read_engine_bytes(tmp_path, entry) == PLAN
    (tmp_path / "engine.plan").write_bytes(PLAN + b"!")  # swapped after the manifest check
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        read_engine_bytes(tmp_path, entry)
    (tmp_path / "engine.plan").unlink()
    (tmp_path / "engine.plan").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ArtifactError, match="not a plain file"):
        read_engine_bytes(tmp_path, entry)


def test_long_prompts_are_chunked_and_the_write_index_advances() -> None:
    assert prefill_chunks(1, 32) == [(0, 1)]
    assert prefill_chunks(70, 32) == [(0, 32), (32, 64), (64, 70)]
    ids = np.arange(14, dtype=np.int64).reshape(2, 7)
    mask = np.ones((2, 7), dtype=np.int64)
    mask[1, :3] = 0  # left padding
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask, 7)}
    chunks = [chunk_feeds(feeds, start, end) for start, end in prefill_chunks(7, 3)]
    # the graph writes at mask length - chunk length: 0, then 3, then 6
    assert [c["attention_mask"].shape[1] - c["input_ids"].shape[1] for c in chunks] == [0, 3, 6]
    np.testing.assert_array_equal(np.concatenate([c["input_ids"] for c in chunks], axis=1), ids)
    np.testing.assert_array_equal(chunks[-1]["attention_mask"], mask)
    np.testing.assert_array_equal(np.concatenate([c["position_ids"] for c in chunks], axis=1), feeds["position_ids"])
    assert [profile_for(c["input_ids"].shape[1]) for c in chunks] == [PREFILL_PROFILE, PREFILL_PROFILE, DECODE_PROFILE]


def test_fixed_capacity_contract_round_trips_and_sizes_the_cache() -> None:
    data = IO.to_dict()
    assert data["capacity"] == 64 and data["inputs"][3]["dims"] == ["batch", 2, 64, 16]
    assert DecoderIO.from_dict(data) == IO
    assert "capacity" not in replace(IO, capacity=None).to_dict()  # other targets' manifests are unchanged
    cache = empty_cache(IO, batch=2, capacity=10)
    assert cache["past_key_values.0.key"].shape == (2, 2, 64, 16)  # the graph's S_max, whatever was asked
    with pytest.raises(GenerationError, match="holds 64"):
        empty_cache(IO, batch=1, capacity=65)


@pytest.mark.parametrize("bad", [0, -1, True, "64", 1 << 30])
def test_a_bad_capacity_in_the_manifest_is_refused(bad: object) -> None:
    data = IO.to_dict()
    data["capacity"] = bad
    with pytest.raises(ArtifactError, match="io.capacity"):
        DecoderIO.from_dict(data)


def test_capacity_only_with_a_shared_cache() -> None:
    data = replace(IO, kv_mode="concat").to_dict()
    with pytest.raises(ArtifactError, match="only a shared cache"):
        DecoderIO.from_dict(data)


def test_opening_a_session_without_an_engine_section_says_how_to_add_one(tmp_path: Path) -> None:
    from kvforge.runners.manifest import MANIFEST, SCHEMA_VERSION
    from kvforge.runners.trt_session import TrtSession

    (tmp_path / "model.onnx").write_bytes(b"graph")
    digest = hashlib.sha256(b"graph").hexdigest()
    manifest = {"schema_version": SCHEMA_VERSION, "files": {"model.onnx": digest}, "io": IO.to_dict()}
    import json

    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="kvforge build-engine"):
        TrtSession(tmp_path)
