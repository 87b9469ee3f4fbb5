"""Routed experts under --weights: MoE -> QMoE (ort-cpu), int8 gathered slices (gather form).

One-node models on onnxruntime against numpy with the dequantized weights (the kernels read the
codes as written), then built tiny qwen3_moe artifacts: the gate passes and the experts' bytes
in the manifest shrink.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.fuse_moe import interleave_gate_up
from kvforge.passes.quantize import WeightQuantization, quantize_blockwise
from kvforge.passes.quantize_experts import QuantizeExperts
from kvforge.passes.targets import TARGETS
from tests.passes.fusion_testing import op_count, ort_outputs
from tests.passes.test_fuse_moe import (
    GPT_OSS_SWIGLU,
    INTER,
    E,
    H,
    T,
    clamped_experts,
    clamped_reference,
    experts,
    moe_attributes,
    one_node,
    reference,
)

RNG = np.random.default_rng(1)


def dequantized(weight: np.ndarray, bits: int, block: int | None) -> np.ndarray:
    """What the quantized [E, N, K] stack stands for (blocks along K; None: one per row)."""
    return np.stack([quantize_blockwise(w, bits, block or w.shape[1], True).dequantize() for w in weight])


@pytest.mark.parametrize(("bits", "block"), [(8, None), (4, 32), (4, 16)])
def test_moe_becomes_qmoe_that_computes_with_the_dequantized_weights(bits: int, block: int | None) -> None:
    gate_up, down = experts()
    x = RNG.standard_normal((T, H)).astype(np.float32)
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    w1 = interleave_gate_up(gate_up)
    model = one_node("MoE", ["x", "logits", "w1", "", "w2"], {"w1": w1, "w2": down}, **moe_attributes(1))
    quantize = QuantizeExperts(bits, block_size=block or 32, form="qmoe")
    assert quantize(model).modified
    assert quantize.counts == {"qmoe": 1} and not quantize.notes
    assert op_count(model, "QMoE", "com.microsoft") == 1 and op_count(model, "MoE", "com.microsoft") == 0
    qmoe = next(iter(model.graph))
    assert qmoe.attributes.get_int("expert_weight_bits") == bits
    assert qmoe.attributes.get_int("block_size", None) == (block if bits == 4 else None)
    assert qmoe.attributes.get_int("accuracy_level", 0) == 0  # 4 would quantize the activations too
    names = {f"{w}.q{bits}{part}" for w in ("w1", "w2") for part in ("", ".scales")}
    assert set(model.graph.initializers) == names
    (y,) = ort_outputs(model, {"x": x, "logits": logits})
    d1 = dequantized(w1, bits, block if bits == 4 else None)
    d2 = dequantized(down, bits, block if bits == 4 else None)
    d1_as_stored = np.concatenate([d1[:, 0::2], d1[:, 1::2]], axis=1)  # back to gate rows, then up rows
    np.testing.assert_allclose(y, reference(x, logits, d1_as_stored, d2, True), atol=5e-5, rtol=1e-4)
    exact = reference(x, logits, gate_up, down, True)
    assert np.abs(y - exact).max() < (0.05 if bits == 8 else 1.0) * np.abs(exact).max()


@pytest.mark.parametrize(("bits", "block"), [(8, None), (4, 32)])
def test_clamped_moe_with_biases_becomes_qmoe_that_keeps_them(bits: int, block: int | None) -> None:
    w1, b1, w2, b2 = clamped_experts()
    x = RNG.standard_normal((T, H)).astype(np.float32)
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    weights = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    attributes = {**moe_attributes(1), **GPT_OSS_SWIGLU}
    model = one_node("MoE", ["x", "logits", "w1", "b1", "w2", "b2"], weights, **attributes)
    quantize = QuantizeExperts(bits, block_size=block or 32, form="qmoe")
    assert quantize(model).modified and quantize.counts == {"qmoe": 1}
    qmoe = next(iter(model.graph))
    assert [v.name if v is not None else None for v in qmoe.inputs][4::3] == ["b1", "b2"]  # biases as they were
    assert qmoe.attributes.get_float("swiglu_limit") == 7.0
    (y,) = ort_outputs(model, {"x": x, "logits": logits})
    d1, d2 = dequantized(w1, bits, block), dequantized(w2, bits, block)
    np.testing.assert_allclose(y, clamped_reference(x, logits, d1, b1, d2, b2), atol=5e-5, rtol=1e-4)


def test_int4_blocks_fall_back_to_per_channel_when_the_width_is_not_a_multiple() -> None:
    gate_up, down = experts()
    model = one_node(
        "MoE", ["x", "logits", "w1", "", "w2"], {"w1": interleave_gate_up(gate_up), "w2": down}, **moe_attributes(0)
    )
    quantize = QuantizeExperts(4, block_size=64, form="qmoe")  # INTER = 32 is not a multiple of 64
    quantize(model)
    assert next(iter(model.graph)).attributes.get_int("block_size", None) is None
    assert "per output channel" in quantize.notes["w1"]


def gathered_matmul(weight: np.ndarray, right: bool) -> ir.Model:
    """y = GatherND(W, idx) @ v (W [E, N, K], v [n, K, 1]) or v @ GatherND(W, idx) (v [n, 1, N])."""
    inputs = ["v", "slices"] if right else ["slices", "v"]
    name = "model.layers.0.mlp.experts.down_proj"
    nodes = [helper.make_node("GatherND", [name, "idx"], ["slices"]), helper.make_node("MatMul", inputs, ["y"])]
    n = 3
    v_shape = [n, 1, weight.shape[1]] if right else [n, weight.shape[2], 1]
    out_shape = [n, 1, weight.shape[2]] if right else [n, weight.shape[1], 1]
    graph = helper.make_graph(
        nodes,
        "gathered",
        [
            helper.make_tensor_value_info("idx", TensorProto.INT64, [n, 1]),
            helper.make_tensor_value_info("v", TensorProto.FLOAT, v_shape),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        [numpy_helper.from_array(weight, name)],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


@pytest.mark.parametrize("right", [False, True])
@pytest.mark.parametrize("bits", [8, 4])
def test_gathered_stack_is_stored_int8_and_dequantized_per_slice(bits: int, right: bool) -> None:
    weight = (RNG.standard_normal((E, H, INTER)) * 0.2).astype(np.float32)
    model = gathered_matmul(weight, right)
    idx = np.array([[2], [0], [2]], np.int64)
    v = RNG.standard_normal((3, 1, H) if right else (3, INTER, 1)).astype(np.float32)
    (exact,) = ort_outputs(model, {"idx": idx, "v": v})
    quantize = QuantizeExperts(bits, form="gather")
    assert quantize(model).modified and quantize.counts == {"gather_int8": 1}
    codes = model.graph.initializers["model.layers.0.mlp.experts.down_proj.q8"].const_value
    scales = model.graph.initializers["model.layers.0.mlp.experts.down_proj.q8.scales"].const_value
    assert codes is not None and codes.dtype == ir.DataType.INT8
    assert scales is not None and tuple(scales.shape) == ((E, 1, INTER) if right else (E, H, 1))  # one per output
    assert ("int8, not int4" in quantize.notes.get("model.layers.0.mlp.experts.down_proj", "")) == (bits == 4)
    (y,) = ort_outputs(model, {"idx": idx, "v": v})
    axis = 1 if right else 2
    step = np.abs(weight).max(axis=axis, keepdims=True) / 127
    dequant = np.clip(np.rint(weight / step), -127, 127) * step
    slices = dequant[idx[:, 0]]
    expected = v @ slices if right else slices @ v
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=1e-5)
    assert np.abs(y - exact).max() < 0.02 * np.abs(exact).max()
    assert not quantize(model).modified  # nothing float left to quantize


def _expert_bytes(artifact: Path) -> int:
    return int(json.loads((artifact / "manifest.json").read_text())["experts"]["weight_bytes"])


@pytest.fixture(scope="module")
def quantized_artifact(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory):
    from kvforge import BuildOptions, build

    made: dict[tuple[str, int, str], Path] = {}

    def get(target: str, bits: int, model_type: str = "qwen3_moe") -> Path:
        if (target, bits, model_type) not in made:
            out = tmp_path_factory.mktemp(f"moe-{model_type}-{target}-int{bits}") / "out"
            options = BuildOptions(target=TARGETS[target], weights=WeightQuantization(bits))
            made[(target, bits, model_type)] = build(tiny_checkpoint(model_type), out, options).output
        return made[(target, bits, model_type)]

    return get


@pytest.mark.slow  # builds the tiny qwen3_moe three times
@pytest.mark.parametrize(("target", "bits", "op"), [("ort-cpu", 8, "QMoE"), ("ort-cpu", 4, "QMoE"), ("onnx", 8, None)])
def test_quantized_moe_build_passes_the_gate_with_smaller_experts(
    target: str, bits: int, op: str | None, quantized_artifact: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    artifact = quantized_artifact(target, bits)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    after = manifest["passes"]["histogram_after"]
    fired = {r["name"]: r["fusions"] for r in manifest["passes"]["passes"]}
    if op is not None:
        assert after[f"com.microsoft::{op}"] == 2 and fired["QuantizeExperts"] == {"qmoe": 2}
    else:
        assert fired["QuantizeExperts"] == {"gather_int8": 4}
    full = _expert_bytes(built_artifact("qwen3_moe"))
    # fp32 -> int8 codes + one scale per output channel (/ 3.7 or better); int4 about half again
    assert _expert_bytes(artifact) < full / (6 if bits == 4 else 3.5)


@pytest.mark.slow  # builds the tiny gpt_oss twice
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_gpt_oss_build_fuses_to_qmoe_and_passes_the_gate(
    bits: int, quantized_artifact: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    artifact = quantized_artifact("ort-cpu", bits, "gpt_oss")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    fired = {r["name"]: r["fusions"] for r in manifest["passes"]["passes"]}
    assert fired["moe_ort"] == {"moe_swiglu": 2} and fired["QuantizeExperts"] == {"qmoe": 2}
    after = manifest["passes"]["histogram_after"]
    assert after["com.microsoft::QMoE"] == 2 and "com.microsoft::MoE" not in after
    full = _expert_bytes(built_artifact("gpt_oss"))
    assert _expert_bytes(artifact) < full / (6 if bits == 4 else 3.5)
