"""Weight-only quantization: the quantizer's error bound, both representations on onnxruntime, what is kept."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import kvforge.passes.quantize as quantize_module
import kvforge.passes.storage as storage
from kvforge.passes.quantize import (
    LM_HEAD,
    ImportQuantizedWeights,
    QuantizedWeight,
    QuantizeWeights,
    WeightQuantization,
    quantize_blockwise,
    quantize_free_min,
    stack_rows,
)
from kvforge.passes.storage import HALF_SCALE_LEAST, HALF_WEIGHT_MOST, half_scales_fit, more_bits
from kvforge.passes.weight_layout import StackedRows
from tests.passes.fusion_testing import op_count, ort_outputs


@pytest.fixture(autouse=True)
def _half_scales_of_small_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """These weights are so small that a build keeps their scales in float32 (its constant
    folding would widen their Cast anyway: `HALF_SCALES_FOLDED`); here they take the float16
    path of larger weights."""
    monkeypatch.setattr(storage, "HALF_SCALES_FOLDED", 0)


RNG = np.random.default_rng(0)
CASES = [(bits, symmetric) for bits in (4, 8) for symmetric in (True, False)]


@pytest.mark.parametrize("bits, symmetric", CASES)
def test_chunks_quantized_on_threads_give_the_codes_of_one_thread(
    bits: int, symmetric: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rebuilds stay byte-identical whatever the machine's CPU count."""
    weight = RNG.standard_normal((70, 96)).astype(np.float16)  # 9 chunks of 8 rows, the last short
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(quantize_module, "QUANTIZE_THREADS", threads)
        results.append(quantize_blockwise(weight, bits, 32, symmetric, rows_per_chunk=8))
    one, several = results
    assert np.array_equal(one.codes, several.codes) and np.array_equal(one.scales, several.scales)
    assert (one.zero_points is None) == symmetric
    if not symmetric:
        assert np.array_equal(one.zero_points, several.zero_points)  # type: ignore[arg-type]
    whole = quantize_blockwise(weight, bits, 32, symmetric, rows_per_chunk=70)  # one chunk: no threads
    assert np.array_equal(whole.codes, several.codes) and np.array_equal(whole.scales, several.scales)


@pytest.mark.parametrize("bits, symmetric", CASES)
@pytest.mark.parametrize("k", [64, 80, 50])  # whole blocks, a short last block, less than one block
def test_every_weight_is_within_half_a_step_of_its_code(bits: int, symmetric: bool, k: int) -> None:
    weight = RNG.standard_normal((24, k)).astype(np.float32)
    weight[3] = 0.0  # an all-zero row: its blocks must still dequantize exactly
    q = quantize_blockwise(weight, bits, 32, symmetric)
    step = np.repeat(q.scales, 32, axis=1)[:, :k]
    error = np.abs(q.dequantize() - weight)
    assert np.array_equal(q.dequantize()[3], np.zeros(k, np.float32))
    assert (q.scales > 0).all()  # TensorRT's block-wise DequantizeLinear needs positive scales
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        assert q.zero_points is None and q.codes.min() >= -qmax - 1 and q.codes.max() <= qmax
        # within half a step of its code, except the values a searched scale clips: those by
        # less than the clipped range
        lowest, highest = (-qmax - 1) * step, qmax * step
        inside = (weight >= lowest - step / 2) & (weight <= highest + step / 2)
        assert (error[inside] <= step[inside] / 2 * (1 + 1e-5) + 1e-7).all()
        clipped_to = np.where(weight > 0, highest, lowest)
        np.testing.assert_allclose(q.dequantize()[~inside], clipped_to[~inside], rtol=1e-5)
        # never worse, block by block, than rounding against the scale that clips nothing (the
        # squared error weighted by w², what the search minimizes)
        blocks = np.pad(weight, ((0, 0), (0, -k % 32))).reshape(24, -1, 32)
        unclipped = np.maximum(-blocks.min(axis=-1) / (qmax + 1), blocks.max(axis=-1) / qmax)
        unclipped = np.where(unclipped > 0, unclipped, 1.0)[..., None]
        plain = np.clip(np.rint(blocks / unclipped), -qmax - 1, qmax) * unclipped
        ours = np.pad(q.dequantize(), ((0, 0), (0, -k % 32))).reshape(24, -1, 32)
        weighted = [(np.square(q - blocks) * np.square(blocks)).sum(-1) for q in (ours, plain)]
        assert (weighted[0] <= weighted[1] * (1 + 1e-5) + 1e-12).all()
    else:
        top = 2**bits - 1
        assert q.zero_points is not None and q.codes.max() <= top and q.zero_points.max() <= top
        # within half a step of its code, except the values a searched step clips: those to the
        # block's lowest or highest value
        zero = np.repeat(q.zero_points.astype(np.float32), 32, axis=1)[:, :k]
        lowest, highest = -zero * step, (top - zero) * step
        inside = (weight >= lowest - step / 2) & (weight <= highest + step / 2)
        assert (error[inside] <= step[inside] / 2 * (1 + 1e-5) + 1e-7).all()
        clipped_to = np.where(weight > 0, highest, lowest)
        np.testing.assert_allclose(q.dequantize()[~inside], clipped_to[~inside], rtol=1e-5)
        # never worse, block by block, than min..max over the codes (the quantizer before the
        # search), in the squared error weighted by rms + |w|, what the search minimizes
        blocks = np.pad(weight, ((0, 0), (0, -k % 32))).reshape(24, -1, 32)
        low, high = np.minimum(blocks.min(axis=-1), 0.0), np.maximum(blocks.max(axis=-1), 0.0)
        plain_step = np.where(high > low, (high - low) / top, 1.0)[..., None]
        plain_zero = np.clip(np.rint(-low[..., None] / plain_step), 0, top)
        plain = (np.clip(np.rint(blocks / plain_step) + plain_zero, 0, top) - plain_zero) * plain_step
        ours = np.pad(q.dequantize(), ((0, 0), (0, -k % 32))).reshape(24, -1, 32)
        importance = np.sqrt(np.square(blocks).mean(axis=-1, keepdims=True)) + np.abs(blocks)
        weighted = [(np.square(q - blocks) * importance).sum(-1) for q in (ours, plain)]
        assert (weighted[0] <= weighted[1] * (1 + 1e-4) + 1e-12).all()


def test_the_searched_int4_scales_beat_round_to_nearest_of_the_largest_magnitude() -> None:
    """At 4 bits clipping outliers a little pays: the searched scales must cut the w²-weighted squared
    error of absmax / 7 rounding (the quantizer before the search) by at least 15% on Gaussian
    weights, and its plain squared error too."""
    weight = RNG.standard_normal((256, 512)).astype(np.float32)
    blocks = weight.reshape(256, -1, 32)
    scale = np.abs(blocks).max(axis=-1, keepdims=True) / 7
    plain = np.clip(np.rint(blocks / scale), -7, 7) * scale - blocks
    searched = quantize_blockwise(weight, 4, 32, True).dequantize().reshape(blocks.shape) - blocks
    importance = np.square(blocks)
    assert (np.square(searched) * importance).mean() <= 0.85 * (np.square(plain) * importance).mean()
    assert np.square(searched).mean() < np.square(plain).mean()


def projection_graph(
    k: int, n: int, weight: np.ndarray, transposed: bool = True, name: str = "w", output: str = "logits"
) -> ir.Model:
    """y = x @ W: W stored [N, K] and read through Transpose as exported, or stored [K, N]; the
    output named `output` (`logits`: the MatMul is the graph's LM head)."""
    nodes = [helper.make_node("Transpose", [name], ["wt"], perm=[1, 0])] if transposed else []
    nodes.append(helper.make_node("MatMul", ["x", "wt" if transposed else name], [output]))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, [2, 3, n])],
        [onnx.numpy_helper.from_array(weight, name)],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


@pytest.mark.parametrize(
    "form, op",
    [
        ("matmul_nbits", "MatMulNBits"),
        ("dequantize_linear", "DequantizeLinear"),
        ("dequantize_linear_channel", "DequantizeLinear"),
    ],
)
@pytest.mark.parametrize("bits, symmetric", CASES)
@pytest.mark.parametrize("transposed", [True, False])
def test_both_representations_compute_x_times_the_dequantized_weight(
    form: str, op: str, bits: int, symmetric: bool, transposed: bool
) -> None:
    """onnxruntime, its optimizations off, computes exactly x @ dequantize(W) from either form; the float
    weight and its Transpose leave the graph."""
    k, n = 80, 24  # K with a short last block
    weight_nk = RNG.standard_normal((n, k)).astype(np.float32)
    model = projection_graph(k, n, weight_nk if transposed else np.ascontiguousarray(weight_nk.T), transposed)
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    quantize = QuantizeWeights(bits, 32, symmetric, form)
    result = quantize(model)
    assert result.modified and quantize.counts == {"quantized": 1}
    domain = "com.microsoft" if op == "MatMulNBits" else ""
    assert op_count(model, op, domain) == 1 and op_count(model, "Transpose") == 0
    assert "w" not in model.graph.initializers
    (got,) = ort_outputs(model, {"x": x})
    block = k if form == "dequantize_linear_channel" else 32  # per channel: one block of all K inputs
    half = np.float16 if form == "matmul_nbits" else None  # MatMulNBits' scales are float16 values
    want = x @ quantize_blockwise(weight_nk, bits, block, symmetric, scale_dtype=half).dequantize().T
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert np.abs(got - x @ weight_nk.T).max() > 1e-3  # and it is not the float product
    assert not quantize(model).modified  # nothing left to quantize: a second run changes nothing


def test_half_scales_fit_bounds_every_block_s_scale() -> None:
    """float16 holds a weight's scales unless a block that is not all zeros spans so little that
    its scale would lose float16's precision, or a weight is too large for a finite scale."""
    weight = RNG.standard_normal((4, 64)).astype(np.float32)
    assert half_scales_fit(weight, 32, 4) and half_scales_fit(weight, 32, 8)
    tiny = weight.copy()
    tiny[1, 32:] *= 2**5.5 * HALF_SCALE_LEAST / np.abs(tiny[1, 32:]).max()  # spans 2^5.5 of the least
    assert half_scales_fit(tiny, 32, 4) and not half_scales_fit(tiny, 32, 8)
    tiny[1, 32:] = 0.0  # an all-zero block takes any scale
    assert half_scales_fit(tiny, 32, 8)
    huge = weight.copy()
    huge[3, 5] = 2 * HALF_WEIGHT_MOST
    assert not half_scales_fit(huge, 32, 4)


@pytest.mark.parametrize("fits", [True, False])
def test_a_float32_build_stores_matmul_nbits_scales_as_float16_where_they_fit(fits: bool) -> None:
    """Scales chosen as float16 values, stored as float16 and read through a Cast to float32; a
    weight with a block too small for float16's scales keeps float32 scales, read directly."""
    k, n = 64, 16
    weight = RNG.standard_normal((n, k)).astype(np.float32)
    if not fits:
        weight[2, :32] *= 1e-7
    model = projection_graph(k, n, weight)
    QuantizeWeights(4, 32, True, "matmul_nbits")(model)
    scales = model.graph.initializers["w.q4.scales"]
    assert scales.dtype == (ir.DataType.FLOAT16 if fits else ir.DataType.FLOAT)
    assert op_count(model, "Cast") == (1 if fits else 0)
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    q = quantize_blockwise(weight, 4, 32, True, scale_dtype=np.float16 if fits else None)
    np.testing.assert_array_equal(scales.const_value.numpy(), q.scales)
    np.testing.assert_allclose(got, x @ q.dequantize().T, atol=2e-4, rtol=1e-4)
    if not fits:  # the small block keeps its own codes, not zeros
        assert np.abs(q.dequantize()[2, :32] - weight[2, :32]).max() < 0.2 * np.abs(weight[2, :32]).max()


def test_a_weight_of_few_scales_keeps_them_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """At most HALF_SCALES_FOLDED scales stay float32, with no Cast: the build's constant folding
    would turn such a Cast into a float32 initializer anyway."""
    monkeypatch.setattr(storage, "HALF_SCALES_FOLDED", 1024)
    for n, want in ((1024, ir.DataType.FLOAT), (1056, ir.DataType.FLOAT16)):  # 1024 and 1056 scales of 32
        model = projection_graph(32, n, RNG.standard_normal((n, 32)).astype(np.float32))
        QuantizeWeights(4, 32, True, "matmul_nbits")(model)
        assert model.graph.initializers["w.q4.scales"].dtype == want
        assert op_count(model, "Cast") == (1 if want == ir.DataType.FLOAT16 else 0)


def test_a_weight_read_twice_is_quantized_once() -> None:
    k, n = 64, 16
    model = projection_graph(k, n, RNG.standard_normal((n, k)).astype(np.float32))
    graph = model.graph
    matmul = next(node for node in graph if node.op_type == "MatMul")
    second = ir.node("MatMul", [matmul.inputs[0], matmul.inputs[1]])
    graph.insert_after(matmul, second)
    added = ir.node("Add", [matmul.outputs[0], second.outputs[0]])
    graph.insert_after(second, added)
    logits = graph.outputs[0]
    ir.convenience.replace_all_uses_with(logits, added.outputs[0], replace_graph_outputs=True)
    quantize = QuantizeWeights(4, 32, True, "matmul_nbits")
    quantize(model)
    assert quantize.counts == {"quantized": 2}
    assert sorted(graph.initializers) == ["w.q4", "w.q4.scales"]


def square_weight_model(nodes: list[onnx.NodeProto], weight: np.ndarray) -> ir.Model:
    """`nodes` over the input x [2, 3, K] and the square initializer w [K, K], to logits [2, 3, K]."""
    k = weight.shape[0]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, k])],
        [onnx.numpy_helper.from_array(weight, "w")],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def test_a_weight_read_directly_and_transposed_is_two_matrices() -> None:
    """x @ W^T + x @ W of one square initializer: each MatMul gets the quantization of what it reads."""
    k = 64
    weight = RNG.standard_normal((k, k)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["a"]),
        helper.make_node("MatMul", ["x", "w"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["logits"]),
    ]
    model = square_weight_model(nodes, weight)
    quantize = QuantizeWeights(8, 32, True, "dequantize_linear")
    quantize(model)
    assert quantize.counts == {"quantized": 2}
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    transposed, direct = (quantize_blockwise(w, 8, 32, True).dequantize() for w in (weight, weight.T))
    np.testing.assert_allclose(got, x @ transposed.T + x @ direct.T, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("keep", [("w",), ("lm_*",), (LM_HEAD,)])
def test_kept_weights_stay_at_full_precision(keep: tuple[str, ...]) -> None:
    """By glob on the weight's name, or `lm_head`: the projection that produces the logits."""
    k, n = 64, 16
    name = "lm_head.weight" if keep == ("lm_*",) else "w"
    model = projection_graph(k, n, RNG.standard_normal((n, k)).astype(np.float32), name=name)
    quantize = QuantizeWeights(4, 32, True, "matmul_nbits", keep=keep)
    assert not quantize(model).modified
    assert quantize.counts == {"kept": 1} and op_count(model, "MatMul") == 1
    assert "full precision" in quantize.skipped[name]


def test_a_weight_that_is_not_float_is_skipped_with_the_reason() -> None:
    model = projection_graph(64, 16, RNG.integers(-3, 3, (16, 64)).astype(np.int32))
    quantize = QuantizeWeights(8, 32, True, "dequantize_linear")
    assert not quantize(model).modified
    assert quantize.counts == {"skipped": 1} and "not a float" in quantize.skipped["w"]


def test_unsupported_settings_are_refused() -> None:
    for bits, block, form in ((3, 32, "matmul_nbits"), (4, 48, "matmul_nbits"), (4, 32, "gguf")):
        with pytest.raises(ValueError, match="unsupported quantization"):
            QuantizeWeights(bits, block, True, form)


def two_projections(k: int, weights: dict[str, np.ndarray]) -> ir.Model:
    """logits = x @ up^T, then @ lm_head.weight^T: two weights, the second the LM head."""
    (first, a), (second, b) = weights.items()
    nodes = [
        helper.make_node("Transpose", [first], ["t1"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "t1"], ["h"]),
        helper.make_node("Transpose", [second], ["t2"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "t2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, b.shape[0]])],
        [onnx.numpy_helper.from_array(a, first), onnx.numpy_helper.from_array(b, second)],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


@pytest.mark.parametrize("int8", [("*down*",), (LM_HEAD,), ("*down*", LM_HEAD), ()])
@pytest.mark.parametrize(
    "form, int8_form", [("matmul_nbits", "matmul_nbits"), ("dequantize_linear", "dequantize_linear_channel")]
)
def test_int8_picks_weights_to_quantize_at_8_bits_in_an_int4_build(
    int8: tuple[str, ...], form: str, int8_form: str
) -> None:
    """A mixed recipe: the weights `int8` names (by glob, or `lm_head`) at 8 bits in the 8-bit form,
    the others at 4; onnxruntime computes exactly the product with each weight's own dequantization."""
    k, hidden, vocab = 64, 96, 40
    weights = {
        "layer.down.weight": RNG.standard_normal((hidden, k)).astype(np.float32),
        "head.weight": RNG.standard_normal((vocab, hidden)).astype(np.float32),
    }
    model = two_projections(k, weights)
    quantize = QuantizeWeights(4, 32, True, form, int8=int8, int8_form=int8_form)
    quantize(model)
    wide = {"layer.down.weight": "*down*" in int8, "head.weight": LM_HEAD in int8}
    assert sorted(quantize.wider) == sorted(name for name, w in wide.items() if w)
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    want = x
    for name, weight in weights.items():
        bits = 8 if wide[name] else 4
        block = weight.shape[1] if bits == 8 and int8_form == "dequantize_linear_channel" else 32
        assert f"{name}.q{bits}" in model.graph.initializers
        half = np.float16 if (int8_form if bits == 8 else form) == "matmul_nbits" else None
        want = want @ quantize_blockwise(weight, bits, block, True, scale_dtype=half).dequantize().T
    (got,) = ort_outputs(model, {"x": x})
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-4)
    if form == "matmul_nbits":
        bits = sorted(n.attributes.get_int("bits") for n in model.graph if n.op_type == "MatMulNBits")
        assert bits == sorted(8 if w else 4 for w in wide.values())


@pytest.mark.parametrize("form, block_size", [("matmul_nbits", 32), ("matmul_nbits", 64), ("dequantize_linear", 32)])
def test_an_int4_builds_8_bit_weights_are_read_by_matmul_nbits_in_blocks_of_128(form: str, block_size: int) -> None:
    """The weights an int4 recipe keeps at 8 bits: where MatMulNBits reads them, in blocks of 128
    where K is whole blocks of it (`wide_block`), their codes and the node's block_size agreeing;
    elsewhere in the recipe's blocks. onnxruntime computes the product with each weight's own
    dequantization."""
    k, hidden, vocab = 256, 96, 40
    weights = {
        "layer.down.weight": RNG.standard_normal((hidden, k)).astype(np.float32),  # K = 256: blocks of 128
        "head.weight": RNG.standard_normal((vocab, hidden)).astype(np.float32),  # K = 96: the recipe's
    }
    model = two_projections(k, weights)
    quantize = QuantizeWeights(4, block_size, True, form, int8=("*down*", LM_HEAD), int8_form=form)
    quantize(model)
    wide = 128 if form == "matmul_nbits" else block_size
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    want = x
    for weight, block in zip(weights.values(), (wide, block_size)):
        half = np.float16 if form == "matmul_nbits" else None
        want = want @ quantize_blockwise(weight, 8, block, True, scale_dtype=half).dequantize().T
    (got,) = ort_outputs(model, {"x": x})
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-4)
    if form == "matmul_nbits":
        nbits = [n for n in model.graph if n.op_type == "MatMulNBits"]
        blocks = {n.inputs[1].name: n.attributes.get_int("block_size") for n in nbits}
        assert blocks == {"layer.down.weight.q8": 128, "head.weight.q8": block_size}
        codes = model.graph.initializers["layer.down.weight.q8"].const_value
        assert codes is not None and codes.shape.numpy() == (hidden, k // 128, 128)


def test_int8_weights_need_a_4_bit_quantization() -> None:
    with pytest.raises(ValueError, match="bits=4"):
        QuantizeWeights(8, 32, True, "matmul_nbits", int8=("*",), int8_form="matmul_nbits")
    with pytest.raises(ValueError, match="int4 build"):
        WeightQuantization(8, int8=("*",))


def test_a_weight_the_lm_head_shares_is_int8_for_every_reader() -> None:
    """logits = (x @ W^T) @ W^T, the second MatMul the LM head: `--int8 lm_head` makes W itself 8-bit,
    so the first reader, which is not the head, computes with the same 8-bit codes."""
    k = 64
    weight = RNG.standard_normal((k, k)).astype(np.float32)
    nodes = [
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "wt"], ["h"]),
        helper.make_node("MatMul", ["h", "wt"], ["logits"]),
    ]
    model = square_weight_model(nodes, weight)
    quantize = QuantizeWeights(4, 32, True, "matmul_nbits", int8=(LM_HEAD,), int8_form="matmul_nbits")
    quantize(model)
    assert quantize.wider == ["w"] and sorted(model.graph.initializers) == ["w.q8", "w.q8.scales"]
    assert [n.attributes.get_int("bits") for n in model.graph if n.op_type == "MatMulNBits"] == [8, 8]
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    w8 = quantize_blockwise(weight, 8, 32, True, scale_dtype=np.float16).dequantize()
    (got,) = ort_outputs(model, {"x": x})
    np.testing.assert_allclose(got, x @ w8.T @ w8.T, atol=2e-3, rtol=1e-4)


def test_more_bits_picks_the_layers_llama_cpps_use_more_bits_picks() -> None:
    """The first and last eighth of the layers and every third layer between (src/llama-quant.cpp)."""
    assert [i for i in range(12) if more_bits(i, 12)] == [0, 3, 6, 9, 10, 11]
    assert [i for i in range(24) if more_bits(i, 24)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    assert [i for i in range(30) if more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
    assert [i for i in range(2) if more_bits(i, 2)] == [1]


def layer_chain(k: int, names: list[str]) -> ir.Model:
    """x through one [k, k] projection per name, in order, the last one producing the logits."""
    nodes, inputs, values = [], "x", []
    for i, name in enumerate(names):
        out = "logits" if i == len(names) - 1 else f"h{i}"
        nodes += [
            helper.make_node("Transpose", [name], [f"t{i}"], perm=[1, 0]),
            helper.make_node("MatMul", [inputs, f"t{i}"], [out]),
        ]
        values.append(onnx.numpy_helper.from_array(RNG.standard_normal((k, k)).astype(np.float32), name))
        inputs = out
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 2, k])],
        values,
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


MIXED_AT_8 = {
    "all_attention": ("mlp.down_proj",),
    "attention": ("self_attn.qkv_proj",),
    "attention_down": ("self_attn.qkv_proj",),
    "q4_k_m": ("self_attn.qkv_proj", "mlp.down_proj"),
    "none": (),
}


@pytest.mark.parametrize("mix", ["all_attention", "attention_down", "attention", "q4_k_m", "none"])
@pytest.mark.parametrize(
    "form, int8_form", [("matmul_nbits", "matmul_nbits"), ("dequantize_linear", "dequantize_linear_channel")]
)
def test_a_mix_keeps_its_weights_at_8_bits_in_the_layers_more_bits_picks(mix: str, form: str, int8_form: str) -> None:
    """Eight layers: `more_bits` picks layers 0, 3, 6 and 7. `attention` keeps their packed q/k/v
    at 8 bits, `attention_down` also every layer's down projection, `q4_k_m` their down projections
    and the LM head, `all_attention` their down projections and every layer's q/k/v, `none`
    nothing; every other weight goes to 4 bits."""
    parts = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    names = [f"model.layers.{i}.{part}.weight" for i in range(8) for part in parts] + ["lm_head.weight"]
    model = layer_chain(32, names)
    quantize = QuantizeWeights(4, 32, True, form, int8_form=int8_form, mix=mix)
    quantize(model)
    wide = [f"model.layers.{i}.{part}.weight" for i in (0, 3, 6, 7) for part in MIXED_AT_8[mix]]
    if mix == "attention_down":
        wide += [f"model.layers.{i}.mlp.down_proj.weight" for i in range(8)]
    if mix == "all_attention":
        wide += [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in range(8)]
    assert sorted(quantize.wider) == sorted(wide + (["lm_head.weight"] if mix == "q4_k_m" else []))
    for name in names:
        assert f"{name}.q{8 if name in quantize.wider else 4}" in model.graph.initializers


def test_an_int4_recipe_mixes_attention_and_down_unless_told_and_records_it() -> None:
    default = WeightQuantization(4)
    assert default.mixed == "all_attention" and default.to_dict()["mix"] == "all_attention"
    assert WeightQuantization(4, mix="attention").to_dict()["mix"] == "attention"
    assert WeightQuantization(4, mix="q4_k_m").to_dict()["mix"] == "q4_k_m"
    assert "mix" not in WeightQuantization(4, mix="none").to_dict()  # a plain recipe keeps its bytes
    assert WeightQuantization(8).mixed == "none" and "mix" not in WeightQuantization(8).to_dict()
    with pytest.raises(ValueError, match="int4 build"):
        WeightQuantization(8, mix="q4_k_m")
    with pytest.raises(ValueError, match="unknown mix"):
        WeightQuantization(4, mix="q5_k_m")
    resolved = WeightQuantization(4).resolved(symmetric_only=False, calibrated=False)
    assert resolved.make_pass("matmul_nbits", int8_form="matmul_nbits").mix == "all_attention"


def test_a_recipe_takes_zero_points_at_int4_where_the_target_reads_them_unless_told() -> None:
    default = WeightQuantization(4)
    with pytest.raises(ValueError, match="resolved"):  # nothing is quantized before the choice is made
        default.make_pass("matmul_nbits")
    assert default.resolved(symmetric_only=False, calibrated=False).symmetric is False
    assert default.resolved(symmetric_only=True, calibrated=False).symmetric is True  # tensorrt
    assert default.resolved(symmetric_only=False, calibrated=True).symmetric is True  # calibrated codes
    free_min = WeightQuantization(4, free_min=True).resolved(symmetric_only=False, calibrated=False)
    assert free_min.symmetric is True and free_min.make_pass("matmul_nbits", int8_form="matmul_nbits").symmetric
    assert WeightQuantization(8).resolved(symmetric_only=False, calibrated=False).symmetric is True
    # what the recipe says is kept, and an asked-for zero point reaches the pass
    assert WeightQuantization(4, symmetric=True).resolved(symmetric_only=False, calibrated=False).symmetric is True
    asked = WeightQuantization(8, symmetric=False).resolved(symmetric_only=False, calibrated=True)
    assert asked.symmetric is False and not asked.make_pass("matmul_nbits").symmetric
    assert asked.to_dict()["symmetric"] is False


def test_the_8b_benchmarks_int4_grid_is_what_int4_reproduces_exactly() -> None:
    """`benchmarks/make_8b.py --int4-grid` makes weights whose int4 build measures the pipeline,
    not rounding: the quantizer, scale search included, must give them back with no error."""
    import torch

    from benchmarks.make_8b import on_int4_grid

    weight = on_int4_grid((64, 256), torch.Generator().manual_seed(0)).to(torch.float16).numpy()
    q = quantize_blockwise(weight, 4, 32, True)
    assert np.array_equal(q.dequantize(), weight.astype(np.float32))


def assert_product(got: np.ndarray, x: np.ndarray, *records: QuantizedWeight) -> None:
    """`got` is x @ Wᵀ to float32 rounding, W the records' dequantized weights one under the other,
    whatever order either side sums in: each element within K·ε of Σ|x|·(|code · scale| + |min|),
    twice the bound of one float32 sum of K products (a graph with a min term sums its parts apart)."""
    weight = np.concatenate([record.dequantize() for record in records])
    size = np.concatenate([_magnitudes(record) for record in records])
    bound = x.shape[-1] * np.finfo(np.float32).eps * (np.abs(x) @ size.T)
    error = np.abs(got - x @ weight.T)
    assert np.all(error <= bound), f"{float(error.max())} against a bound of {float(bound.min())} at least"


def _magnitudes(record: QuantizedWeight) -> np.ndarray:
    """|code · scale| + |min| of each weight: the sizes of the terms the graph sums."""
    size = np.abs(replace(record, mins=None).dequantize())
    if record.mins is not None:  # the mins alone: every code 0, no zero point
        size += np.abs(replace(record, codes=np.zeros_like(record.codes), zero_points=None).dequantize())
    return size


def prequantized(n: int, k: int, bits: int, block: int) -> QuantizedWeight:
    """A record as a checkpoint ships it: any codes, fp16 scales, integer zero points per block."""
    top = 2**bits - 1
    return QuantizedWeight(
        RNG.integers(0, top + 1, (n, k)).astype(np.uint8),
        (RNG.random((n, k // block)) * 0.1 + 0.01).astype(np.float16),
        RNG.integers(0, top + 1, (n, k // block)).astype(np.uint8),
        bits,
        block,
    )


@pytest.mark.parametrize("form, op", [("matmul_nbits", "MatMulNBits"), ("dequantize_linear", "DequantizeLinear")])
@pytest.mark.parametrize("bits, block", [(4, 32), (4, 16), (8, 64)])
def test_imported_weights_keep_their_codes_and_compute_x_times_the_dequantized_record(
    form: str, op: str, bits: int, block: int
) -> None:
    k, n = 64, 24
    q = prequantized(n, k, bits, block)
    model = projection_graph(k, n, q.dequantize())  # the graph holds the dequantized weight, [N, K] as exported
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    imports = ImportQuantizedWeights({"w": q}, form)
    assert not ImportQuantizedWeights({"other": q}, form)(model).modified  # a weight it does not name stays
    assert imports(model).modified and imports.counts == {"imported": 1}
    assert (
        op_count(model, op, "com.microsoft" if op == "MatMulNBits" else "") == 1 and "w" not in model.graph.initializers
    )
    assert imports.imported_forms == {
        "w": {"form": form, "bits": bits, "block_size": block, "zero_points": True, "from": ["w"]}
    }
    codes = model.graph.initializers[f"w.q{bits}"].const_value.numpy()  # type: ignore[union-attr]
    if form == "matmul_nbits" and bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1)
    elif form == "dequantize_linear":
        codes = codes.astype(np.uint8).T  # [K, N] uint4 / uint8
    assert np.array_equal(codes.reshape(n, k), q.codes)  # unchanged: no quantizer ran
    (got,) = ort_outputs(model, {"x": x})
    assert_product(got, x, q)
    assert not imports(model).modified


def test_a_packed_weight_imports_its_parts_stacked_and_mixed_parts_stay_float() -> None:
    k = 64
    parts = {name: prequantized(n, k, 4, 32) for name, n in (("q", 16), ("k", 8), ("v", 8))}

    def packed(imported: dict[str, QuantizedWeight]) -> tuple[ir.Model, ImportQuantizedWeights]:
        model = projection_graph(k, 32, np.zeros((32, k), np.float32), name="qkv")
        stacked = StackedRows([q.dequantize() for q in parts.values()], ir.DataType.FLOAT, "qkv", list(parts))
        model.graph.initializers["qkv"].const_value = stacked
        imports = ImportQuantizedWeights(imported)
        imports(model)
        return model, imports

    model, imports = packed(parts)
    assert imports.counts == {"imported": 1} and imports.imported_forms["qkv"]["from"] == ["q", "k", "v"]
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    assert_product(got, x, *parts.values())
    # one part not imported, or imported with another block size: the packed weight stays float
    assert packed({"q": parts["q"], "k": parts["k"]})[1].counts == {}
    assert packed(parts | {"v": prequantized(8, k, 4, 16)})[1].counts == {}


@pytest.mark.parametrize("form", ["matmul_nbits", "dequantize_linear"])
def test_codes_stored_in_another_input_order_read_the_activations_in_that_order(form: str) -> None:
    """GPTQ's act-order: the codes' columns are input features `input_order`; a Gather puts x in that order."""
    k, n = 64, 16
    q = replace(prequantized(n, k, 4, 32), input_order=RNG.permutation(k))
    weight = q.dequantize()  # [N, K] in the features' own order
    stored = replace(q, input_order=None).dequantize()
    assert np.array_equal(weight[:, q.input_order], stored) and not np.array_equal(weight, stored)
    model = projection_graph(k, n, weight)
    imports = ImportQuantizedWeights({"w": q}, form)
    assert imports(model).modified and op_count(model, "Gather") == 1
    assert imports.imported_forms["w"]["input_order"] is True
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    assert_product(got, x, q)  # its weight, in the features' own order


def block_sums(model: ir.Model, op: str = "ReduceSum") -> int:
    """How many nodes sum blocks of an input (`MinTerms`): a ReduceSum over the input reshaped
    into blocks, or (`op` "MatMul", for an input of unknown rank) a MatMul by the block indicator."""
    return sum(
        node.op_type == op and (node.inputs[1].name or "").startswith("kvforge.block_sum.")  # type: ignore[union-attr]
        for node in model.graph
    )


def with_mins(n: int, k: int, bits: int) -> QuantizedWeight:
    """A symmetric record with a float term per block of 32, as a GGUF free-minimum type imports."""
    top = 2 ** (bits - 1)
    return QuantizedWeight(
        RNG.integers(-top, top, (n, k)).astype(np.int8),
        (RNG.random((n, k // 32)) * 0.1 + 0.01).astype(np.float32),
        None,
        bits,
        32,
        mins=RNG.standard_normal((n, k // 32)).astype(np.float32),
    )


@pytest.mark.parametrize("form, op", [("matmul_nbits", "MatMulNBits"), ("dequantize_linear", "DequantizeLinear")])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rank_known", [True, False])
def test_a_min_per_block_is_added_through_the_block_sums_of_the_input(
    form: str, op: str, bits: int, rank_known: bool
) -> None:
    k, n = 96, 16
    q = with_mins(n, k, bits)
    weight = q.dequantize()
    blocks = (q.codes.astype(np.float32) * np.repeat(q.scales, 32, axis=1)).reshape(n, -1, 32)
    assert np.array_equal(weight.reshape(n, -1, 32), blocks + q.mins[..., None])  # type: ignore[index]
    model = projection_graph(k, n, weight)
    if not rank_known:  # the MatMul reads an input whose rank the graph does not give
        matmul = next(node for node in model.graph if node.op_type == "MatMul")
        unknown = ir.node("Identity", [matmul.inputs[0]])
        unknown.outputs[0].type = matmul.inputs[0].type
        model.graph.insert_before(matmul, unknown)
        matmul.replace_input_with(0, unknown.outputs[0])
    imports = ImportQuantizedWeights({"w": q}, form)
    assert imports(model).modified and imports.counts == {"imported": 1}
    assert op_count(model, op, "com.microsoft" if op == "MatMulNBits" else "") == 1
    summed = block_sums(model, "ReduceSum" if rank_known else "MatMul")
    assert summed == 1 and block_sums(model, "MatMul" if rank_known else "ReduceSum") == 0
    assert imports.imported_forms["w"]["mins"] is True
    assert model.graph.initializers[f"w.q{bits}.mins"].const_value.shape == (k // 32, n)  # type: ignore[union-attr]
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    want = x.astype(np.float64) @ weight.T.astype(np.float64)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-5)
    assert not imports(model).modified
    # a --weights recipe after the import leaves the min term's float MatMul as it is
    quantize = QuantizeWeights(4, form=form)
    assert not quantize(model).modified and quantize.counts == {}
    np.testing.assert_array_equal(ort_outputs(model, {"x": x})[0], got)


def test_packed_parts_stack_their_mins_zeros_for_a_part_without_and_share_one_block_sum() -> None:
    k = 64
    parts = {"gate": with_mins(16, k, 4), "up": replace(with_mins(8, k, 4), mins=None)}
    stacked = stack_rows(list(parts.values()))
    assert stacked is not None and stacked.mins is not None
    np.testing.assert_array_equal(stacked.mins[16:], 0)
    model = projection_graph(k, 24, np.zeros((24, k), np.float32), name="gate_up")
    model.graph.initializers["gate_up"].const_value = StackedRows(
        [q.dequantize() for q in parts.values()], ir.DataType.FLOAT, "gate_up", list(parts)
    )
    # a second weight reading the same input: its block sums are the first one's
    down = with_mins(8, k, 4)
    model.graph.initializers["down"] = ir.Value(name="down", const_value=ir.tensor(down.dequantize().T.copy()))
    logits = model.graph.outputs[0]
    second = ir.node("MatMul", [model.graph.inputs[0], model.graph.initializers["down"]], outputs=[ir.Value(name="y2")])
    model.graph.append(second)
    model.graph.outputs.append(second.outputs[0])
    second.outputs[0].shape, second.outputs[0].type = ir.Shape([2, 3, 8]), logits.type
    imports = ImportQuantizedWeights(parts | {"down": down})
    assert imports(model).modified and imports.counts == {"imported": 2}
    assert block_sums(model) == 1
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    got, got_down = ort_outputs(model, {"x": x})
    assert_product(got, x, stacked)
    assert_product(got_down, x, down)


def test_symmetric_parts_of_other_bits_and_blocks_stack_in_the_widest_bits_and_smallest_block() -> None:
    """A GGUF file's q in 4-bit blocks of 32 with mins beside a v in 8-bit blocks of 16 (Q6_K)."""
    k = 96
    q = with_mins(16, k, 4)
    v = QuantizedWeight(
        RNG.integers(-32, 32, (8, k)).astype(np.int8), (RNG.random((8, k // 16)) * 0.1).astype(np.float32), None, 8, 16
    )
    stacked = stack_rows([q, v])
    assert stacked is not None and (stacked.bits, stacked.block_size) == (8, 16)
    np.testing.assert_allclose(stacked.dequantize(), np.concatenate([q.dequantize(), v.dequantize()]), rtol=1e-6)
    model = projection_graph(k, 24, np.concatenate([q.dequantize(), v.dequantize()]))
    assert ImportQuantizedWeights({"w": stacked})(model).modified
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    assert_product(got, x, stacked)
    # blocks that do not split into the smallest (48 into 32) do not stack
    assert stack_rows([q, replace(v, block_size=48, scales=v.scales[:, :2])]) is None


def grid_blocks(n: int, k: int, dtype: type = np.float32, rng: np.random.Generator | None = None) -> np.ndarray:
    """A [N, K] weight whose every block of 32 is step * code + min, codes 0..15 (a dequantized GGUF
    Q4_1 block), some blocks using only part of the codes (spans 9 to 15), a few all one value;
    drawn from `rng` (default: this module's generator, whose state depends on the tests before)."""
    rng = RNG if rng is None else rng
    blocks = k // 32
    low = rng.integers(0, 7, (n, blocks, 1))
    span = rng.integers(9, 16, (n, blocks, 1))
    codes = low + np.minimum(rng.integers(0, 16, (n, blocks, 32)), span)
    codes = np.clip(codes, 0, 15)
    codes[..., 0], codes[..., 1] = low[..., 0], np.minimum(low + span, 15)[..., 0]  # the span is used
    # float16 steps, as GGUF's Q4_1 stores them (and a float32 build's MatMulNBits)
    step = (rng.random((n, blocks, 1)) * 0.02 + 0.005).astype(np.float16).astype(np.float32)
    minimum = (rng.standard_normal((n, blocks, 1)) * 0.1).astype(dtype).astype(np.float32)
    weight = codes * step + minimum
    weight[0, 0] = minimum[0, 0]  # a block of one value
    return weight.reshape(n, k).astype(dtype)


def test_a_free_min_grid_comes_back_exactly_and_other_weights_closer_than_zero_points() -> None:
    weight = grid_blocks(64, 128)
    q = quantize_free_min(weight, 32)
    assert q.zero_points is None and q.mins is not None and q.bits == 4
    assert q.codes.min() >= -8 and q.codes.max() <= 7
    np.testing.assert_allclose(q.dequantize(), weight, rtol=0, atol=2e-7)
    # symmetric codes and integer zero points both round such blocks again
    for other in (quantize_blockwise(weight, 4, 32, True), quantize_blockwise(weight, 4, 32, False)):
        assert np.abs(other.dequantize() - weight).max() > 1e-3
    # on weights that lie on no grid, the free minimum's error is below an integer zero point's
    # (0.077 against 0.081 and, symmetric, 0.090 on such a draw)
    gaussian = RNG.standard_normal((256, 256)).astype(np.float32)

    def error(w: QuantizedWeight) -> float:
        return float(np.linalg.norm(w.dequantize() - gaussian) / np.linalg.norm(gaussian))

    zero_points, symmetric = (error(quantize_blockwise(gaussian, 4, 32, kind)) for kind in (False, True))
    assert error(quantize_free_min(gaussian, 32)) < zero_points < symmetric


def test_free_min_chunks_on_threads_give_the_codes_of_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = RNG.standard_normal((70, 96)).astype(np.float16)
    results = []
    for threads in (1, 3):
        monkeypatch.setattr(quantize_module, "QUANTIZE_THREADS", threads)
        results.append(quantize_free_min(weight, 32, rows_per_chunk=8))
    one, several = results
    for field in ("codes", "scales", "mins"):
        assert np.array_equal(getattr(one, field), getattr(several, field))
    assert one.scales.dtype == np.float16


@pytest.mark.parametrize("form, op", [("matmul_nbits", "MatMulNBits"), ("dequantize_linear", "DequantizeLinear")])
def test_free_min_weights_compute_x_times_their_grid(form: str, op: str) -> None:
    k, n = 96, 40
    weight = grid_blocks(n, k)
    model = projection_graph(k, n, weight)
    quantize = QuantizeWeights(4, form=form, free_min=True)
    assert quantize(model).modified and quantize.counts == {"quantized": 1, "free_min": 1}
    assert op_count(model, op, "com.microsoft" if op == "MatMulNBits" else "") == 1 and block_sums(model) == 1
    x = RNG.standard_normal((2, 3, k)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    want = x.astype(np.float64) @ weight.T.astype(np.float64)  # the grid itself: nothing rounded again
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-5)


def test_a_free_min_weight_whose_inputs_are_not_whole_blocks_is_symmetric() -> None:
    k, n = 80, 16
    model = projection_graph(k, n, RNG.standard_normal((n, k)).astype(np.float32))
    quantize = QuantizeWeights(4, free_min=True)
    assert quantize(model).modified and quantize.counts == {"quantized": 1}
    assert block_sums(model) == 0


def test_a_free_min_recipe_is_4_bit_without_zero_points_and_recorded() -> None:
    for bad in ({"bits": 8}, {"bits": 4, "symmetric": False}):
        with pytest.raises(ValueError, match="--free-min"):
            WeightQuantization(free_min=True, **bad)  # type: ignore[arg-type]
    assert WeightQuantization(4, free_min=True).to_dict()["free_min"] is True
    assert "free_min" not in WeightQuantization(4).to_dict()  # earlier recipes keep their bytes
