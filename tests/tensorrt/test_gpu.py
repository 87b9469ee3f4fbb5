"""The TensorRT engine on a GPU: build, parity with the eager model, chunked prefill, decode speed,
and the runner's refusal of a modified engine. These need TensorRT >= 10.15, cuda-python and a
CUDA device; elsewhere they skip with the reason (docs/tensorrt.md: running them on a GPU machine).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvforge.passes.targets import TARGETS
from kvforge.toolchain.emit import tensorrt as engine_build

_MISSING = engine_build.unavailable()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(_MISSING is not None, reason=f"needs TensorRT and a CUDA device: {_MISSING}"),
]


@pytest.fixture(scope="module")
def engine_artifact(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tensorrt-target artifact of the tiny llama, with an engine whose prefill chunk is short."""
    from kvforge import BuildOptions, build

    out = tmp_path_factory.mktemp("trt-engine") / "out"
    build(tiny_checkpoint("llama"), out, BuildOptions(target=TARGETS["tensorrt"], capacity=128))
    options = engine_build.EngineOptions(
        max_batch=4, max_prefill=8, timing_cache_dir=tmp_path_factory.mktemp("timing-cache")
    )
    engine_build.add_engine(out, options)
    return out


def test_engine_is_built_and_recorded_in_the_manifest(engine_artifact: Path) -> None:
    from kvforge.runners.manifest import read_manifest, verify_files

    manifest = read_manifest(engine_artifact)
    verify_files(engine_artifact, manifest)
    entry = manifest["engine"]
    assert manifest["files"][entry["file"]] == entry["sha256"]
    assert entry["capacity"] == 128 and [p["name"] for p in entry["profiles"]] == ["decode", "prefill"]
    assert manifest["tools"]["tensorrt"] == entry["tensorrt"]


def test_engine_matches_the_eager_model(engine_artifact: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    from kvforge.runners.contract import DecoderIO
    from kvforge.runners.torch_session import TorchSession
    from kvforge.runners.trt_session import TrtSession
    from kvforge.toolchain import checkpoint as checkpoints
    from kvforge.toolchain.export import DecoderWrapper, eager_model
    from kvforge.toolchain.spec import DecoderSpec
    from kvforge.toolchain.verify import compare_with_reference, record_reference

    ckpt = checkpoints.load(tiny_checkpoint("llama"))
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    reference = TorchSession(DecoderWrapper(eager_model(ckpt, spec), spec.num_layers), DecoderIO.for_spec(spec))
    candidate = TrtSession(engine_artifact, mirror_cache=True)
    recorded = record_reference(reference, max_positions=128, decode_steps=8)
    report = compare_with_reference(recorded, candidate, max_positions=128, dtype="float32")
    assert report.passed, report.failures()


def test_chunked_prefill_on_the_engine_equals_one_prefill_on_onnxruntime(engine_artifact: Path) -> None:
    from kvforge.runners.generate import empty_cache, position_ids
    from kvforge.runners.manifest import read_io, read_manifest
    from kvforge.runners.session import OrtSession
    from kvforge.runners.trt_session import TrtSession

    io = read_io(engine_artifact, read_manifest(engine_artifact))
    ids = np.random.default_rng(0).integers(3, 300, (2, 21)).astype(np.int64)  # 21 > max_prefill 8: 3 chunks
    mask = np.ones_like(ids)
    mask[0, :5] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask, 21)}
    gpu = TrtSession(engine_artifact, mirror_cache=True).run(feeds | empty_cache(io, 2, 21))
    cpu = OrtSession(engine_artifact / "model.onnx", io).run(feeds | empty_cache(io, 2, 21))
    np.testing.assert_allclose(gpu["logits"], cpu["logits"], atol=1e-3, rtol=1e-3)


def test_decode_is_faster_than_onnxruntime_on_the_cpu(engine_artifact: Path) -> None:
    from kvforge.runners.core import logit_steps
    from kvforge.runners.decoding import batch_decoders
    from kvforge.runners.manifest import read_io, read_manifest
    from kvforge.runners.sampling import SamplingParams
    from kvforge.runners.session import OrtSession
    from kvforge.runners.trt_session import TrtSession

    io = read_io(engine_artifact, read_manifest(engine_artifact))

    def tokens_per_second(session: object) -> float:
        steps = logit_steps(
            session,  # type: ignore[arg-type]
            [[5, 6, 7, 8]] * 4,
            max_new_tokens=64,
            max_positions=128,
            decoders=batch_decoders(SamplingParams(temperature=0.0), [[5, 6, 7, 8]] * 4),
        )
        next(steps)  # the prefill
        start = time.perf_counter()
        count = sum(1 for _ in steps)
        return count * 4 / (time.perf_counter() - start)

    gpu = tokens_per_second(TrtSession(engine_artifact))
    cpu = tokens_per_second(OrtSession(engine_artifact / "model.onnx", io))
    assert gpu > cpu, f"TensorRT decode {gpu:.0f} tokens/s, onnxruntime CPU {cpu:.0f} tokens/s"


def test_a_modified_engine_is_refused_before_deserializing(engine_artifact: Path, tmp_path: Path) -> None:
    import shutil

    from kvforge.runners.errors import ArtifactError
    from kvforge.runners.trt_session import TrtSession

    copy = tmp_path / "copy"
    shutil.copytree(engine_artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    with open(copy / manifest["engine"]["file"], "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactError, match="sha256 does not match"):
        TrtSession(copy)
