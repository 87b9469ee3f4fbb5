"""QuantizeWeights with calibrated scales (toolchain/calibration.py chooses them): the codes come back exactly."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kvforge.passes.quantize import QuantizedWeight, QuantizeWeights
from kvforge.passes.weight_layout import StackedRows
from tests.passes.fusion_testing import ort_outputs
from tests.passes.test_quantize import projection_graph

RNG = np.random.default_rng(7)


def on_a_grid(n: int, k: int) -> QuantizedWeight:
    """Codes in -3 .. 3 (round to nearest would stretch them to -8 .. 7) and positive scales."""
    codes = RNG.integers(-3, 4, (n, k)).astype(np.int8)
    scales = RNG.uniform(0.01, 0.1, (n, k // 32)).astype(np.float32)
    return QuantizedWeight(codes, scales, None, 4, 32)


def packed_graph(parts: dict[str, QuantizedWeight], k: int) -> ir.Model:
    rows = sum(q.codes.shape[0] for q in parts.values())
    model = projection_graph(k, rows, np.zeros((rows, k), np.float32), name="qkv")
    stacked = StackedRows([q.dequantize() for q in parts.values()], ir.DataType.FLOAT, "qkv", list(parts))
    model.graph.initializers["qkv"].const_value = stacked
    return model


def test_a_packed_weight_takes_its_parts_calibrated_scales_and_keeps_their_codes() -> None:
    k = 64
    parts = {name: on_a_grid(n, k) for name, n in (("q", 16), ("k", 8), ("v", 8))}
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    want = x @ np.concatenate([q.dequantize() for q in parts.values()]).T

    model = packed_graph(parts, k)
    quantize = QuantizeWeights(4, 32, scales={name: q.scales for name, q in parts.items()})
    quantize(model)
    assert quantize.counts == {"quantized": 1, "calibrated": 1} and quantize.calibrated == ["qkv"]
    (got,) = ort_outputs(model, {"x": x})
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)  # the grid's own values, to the kernel's rounding

    # without them (or with a part's missing) the weight is rounded to nearest, onto another grid
    for scales in (None, {"q": parts["q"].scales, "k": parts["k"].scales}):
        model = packed_graph(parts, k)
        plain = QuantizeWeights(4, 32, scales=scales)
        plain(model)
        assert plain.counts == {"quantized": 1} and not plain.calibrated
        (rounded,) = ort_outputs(model, {"x": x})
        assert np.abs(rounded - want).max() > 1e-3


def test_calibrated_scales_apply_to_symmetric_4_bit_weights_only() -> None:
    k = 64
    part = on_a_grid(8, k)
    for settings in ({"bits": 8}, {"bits": 4, "symmetric": False}):
        model = projection_graph(k, 8, part.dequantize())
        quantize = QuantizeWeights(block_size=32, scales={"w": part.scales}, **settings)  # type: ignore[arg-type]
        quantize(model)
        assert "calibrated" not in quantize.counts
