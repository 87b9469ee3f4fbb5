"""`--dtype fp16|bf16`: half-precision graphs per target, verified against the eager model at that precision."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from kvforge.passes.quantize import WeightQuantization
from kvforge.passes.targets import TARGETS
from kvforge.runners.engine import Engine
from kvforge.runners.errors import ArtifactError
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain.build import BuildOptions, build, verify
from kvforge.toolchain.export import eager_model
from kvforge.toolchain.footprint import footprint
from kvforge.toolchain.spec import DecoderSpec
from kvforge.toolchain.verify import TOLERANCES, ParityReport

pytestmark = pytest.mark.slow

_ELEMENT_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


def float_types(model_path: Path) -> dict[str, int]:
    """Element type -> how many float initializers of at least 1024 elements (weights, not constants) have it."""
    model = onnx.load(model_path, load_external_data=False)
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    counts: dict[str, int] = {}
    for tensor in model.graph.initializer:
        if tensor.data_type in floats and int(np.prod(tensor.dims)) >= 1024:
            name = TensorProto.DataType.Name(tensor.data_type)
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize(
    "model_type, dtype, target",
    [
        ("llama", "float16", "ort-cpu"),
        ("gemma", "float16", "onnx"),  # norms scale in float32 inside a float16 model
        ("qwen2", "bfloat16", "ort-cpu"),
        ("phi3", "bfloat16", "tensorrt"),  # partial rotary, tables cast to the compute dtype
        ("gpt2", "float16", "tensorrt"),
    ],
)
def test_half_precision_build_is_verified_and_stores_its_weights_at_that_width(
    model_type: str, dtype: str, target: str, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    result = build(tiny_checkpoint(model_type), tmp_path / "out", BuildOptions(target=TARGETS[target], dtype=dtype))
    assert result.parity.passed
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["flags"]["dtype"] == dtype
    assert manifest["io"]["kv_dtype"] == dtype and manifest["io"]["logits_dtype"] == "float32"
    assert manifest["parity"]["dtype"] == dtype
    # onnxruntime's CPU provider has no bfloat16 MatMul, and runs fp16 from float32 copies of every
    # weight: the gate ran the graph in float32, each weight cast as it is read
    assert manifest["parity"]["computed_in"] == "float32"
    assert set(float_types(tmp_path / "out" / "model.onnx")) == {TensorProto.DataType.Name(_ELEMENT_TYPES[dtype])}


def test_float16_artifact_generates_what_the_float16_eager_model_does(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from tests.tiny import hf_greedy

    ckpt_dir = tiny_checkpoint("llama")
    build(ckpt_dir, tmp_path / "out", BuildOptions(dtype="float16"))
    engine = Engine.load(tmp_path / "out")
    assert engine.session.io.kv_dtype == "float16"
    ckpt = checkpoints.load(ckpt_dir)
    model = eager_model(ckpt, DecoderSpec.from_config(ckpt.config, ckpt.generation_config), torch.float16)
    prompt = engine.encode("def fibonacci(n):")
    expected = hf_greedy(model, prompt, 6)
    got = engine.generate_tokens([prompt], max_new_tokens=6, temperature=0.0)[0]
    # fp16 roundings differ between torch and onnxruntime: the tokens agree up to a near tie at most
    agree = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    assert agree >= 3, (expected, got)


def test_quantized_half_precision_build_keeps_scales_in_the_compute_dtype(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    result = build(
        tiny_checkpoint("llama"), tmp_path / "out", BuildOptions(dtype="float16", weights=WeightQuantization(4))
    )
    assert result.parity.passed
    model = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    scales = [t for t in model.graph.initializer if t.name.endswith(".scales")]
    assert scales and {t.data_type for t in scales} == {TensorProto.FLOAT16}


def test_verify_reruns_the_gate_at_the_artifacts_dtype(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    build(tiny_checkpoint("qwen3"), tmp_path / "out", BuildOptions(dtype="bfloat16"))
    report = verify(tmp_path / "out", tiny_checkpoint("qwen3"))
    assert isinstance(report, ParityReport)
    assert report.passed and report.dtype == "bfloat16" and report.tolerance == TOLERANCES["bfloat16"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the graph it ran is gone
    assert (tmp_path / "out" / "model.onnx.data").stat().st_nlink == 1  # and so is its link to the weights


def test_verify_beside_a_read_only_artifact_runs_in_the_system_temporary_directory(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build(tiny_checkpoint("llama"), tmp_path / "out", BuildOptions(dtype="float16"))
    real = tempfile.TemporaryDirectory
    places: list[str | None] = []

    def temporary_directory(*args: Any, dir: str | Path | None = None, **kwargs: Any) -> Any:
        places.append(None if dir is None else str(dir))
        if dir is not None and Path(dir) == tmp_path:
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryDirectory", temporary_directory)
    assert verify(tmp_path / "out", tiny_checkpoint("llama")).passed
    assert places == [str(tmp_path), None]  # beside the artifact first, then the system's
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_device_memory_counts_half_precision_weights_and_cache(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    ckpt_dir = tiny_checkpoint("llama")
    ckpt = checkpoints.load(ckpt_dir)
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    fp = footprint(ckpt, spec, batch=1, seq=spec.max_positions, compute_bytes=2)
    half = fp.weight_bytes_at["fp16"] + fp.kv_bytes_total["fp16"]
    assert half * 2 == fp.weight_bytes_at["fp32"] + fp.kv_bytes_total["fp32"]
    fits = BuildOptions(dtype="bfloat16", device_memory=half)
    build(ckpt_dir, tmp_path / "fits", fits)  # exactly enough at half precision
    with pytest.raises(ArtifactError, match=r"bf16 weights .* \+ bfloat16 KV cache"):
        build(ckpt_dir, tmp_path / "short", BuildOptions(dtype="bfloat16", device_memory=half - 1))
    assert not (tmp_path / "short").exists()


def test_unknown_dtype_is_refused_before_any_work(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="unknown dtype 'float8'"):
        build(tiny_checkpoint("llama"), tmp_path / "out", BuildOptions(dtype="float8"))
    assert not (tmp_path / "out").exists()


def test_bfloat16_artifact_is_refused_by_the_onnxruntime_runner_with_the_way_out(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    build(tiny_checkpoint("llama"), tmp_path / "out", BuildOptions(dtype="bfloat16", target=TARGETS["tensorrt"]))
    with pytest.raises(ArtifactError, match=r"bfloat16, which onnxruntime's CPU provider cannot run.*build-engine"):
        Engine.load(tmp_path / "out")


def test_a_quantized_half_precision_build_of_a_trained_model_keeps_its_distributions(tmp_path: Path) -> None:
    """The bundled example model has peaked next-token distributions (a tiny random model's are
    nearly flat, so even uniform logits stay within its KL threshold): fp16 int8 must agree with
    the fp16 eager model where it is decisive, and its perplexity must stay the eager one's."""
    from tests.examples.conftest import EXAMPLE_MODEL

    result = build(EXAMPLE_MODEL, tmp_path / "out", BuildOptions(dtype="float16", weights=WeightQuantization(8)))
    report = result.parity
    assert report.passed and report.decisive_positions >= 20 and report.top1_decisive == 1.0
    assert abs(np.exp(report.nll_compiled) / np.exp(report.nll_eager) - 1) < 0.02
