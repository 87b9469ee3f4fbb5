"""Token-embedding quantization: what is matched, both forms on onnxruntime, a table tied to the LM head."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kvforge.passes.storage as storage
from kvforge.passes.quantize import LM_HEAD, QuantizedWeight, QuantizeWeights, quantize_blockwise
from kvforge.passes.quantize_embedding import EMBEDDINGS, QuantizeEmbedding
from tests.passes.fusion_testing import op_count, ort_outputs


@pytest.fixture(autouse=True)
def _half_scales_of_small_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """These weights are so small that a build keeps their scales in float32 (its constant
    folding would widen their Cast anyway: `HALF_SCALES_FOLDED`); here they take the float16
    path of larger weights."""
    monkeypatch.setattr(storage, "HALF_SCALES_FOLDED", 0)


RNG = np.random.default_rng(0)
VOCAB = 40
IDS = np.array([[0, 5, 39], [7, 7, 1]], np.int64)
FORMS = [("gather_block_quantized", bits, symmetric) for bits in (4, 8) for symmetric in (True, False)] + [
    ("gather_dequantize_linear", 8, symmetric) for symmetric in (True, False)
]
_ONNX_TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16}


def lookup_graph(table: np.ndarray, tied_head: bool = False, ids: str = "input_ids", axis: int = 0) -> ir.Model:
    """hidden = table[input_ids] (and, tied, logits = -hidden @ table^T, the head reading the table
    through Transpose as exported, and hidden through an op, as the layers between them)."""
    vocab, hidden = table.shape
    elem = _ONNX_TYPES[table.dtype]
    nodes = [helper.make_node("Gather", ["embed.weight", ids], ["hidden"], axis=axis)]
    outputs = [helper.make_tensor_value_info("hidden", elem, [2, 3, hidden])]
    if tied_head:
        nodes += [
            helper.make_node("Transpose", ["embed.weight"], ["head_t"], perm=[1, 0]),
            helper.make_node("Neg", ["hidden"], ["layers"]),
            helper.make_node("MatMul", ["layers", "head_t"], ["logits"]),
        ]
        outputs = [helper.make_tensor_value_info("logits", elem, [2, 3, vocab]), *outputs]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(ids, TensorProto.INT64, [2, 3])],
        outputs,
        [onnx.numpy_helper.from_array(table, "embed.weight")],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)]))


def table(hidden: int = 64, dtype: type = np.float32) -> np.ndarray:
    return RNG.standard_normal((VOCAB, hidden)).astype(dtype)


def nodes_reading(model: ir.Model, name: str) -> list[str]:
    return sorted(node.op_type for node, _ in model.graph.initializers[name].uses())


@pytest.mark.parametrize("form, bits, symmetric", FORMS)
@pytest.mark.parametrize("hidden, block", [(64, 32), (64, 64), (96, 64), (128, 128)])  # 96 / 64: a padded last block
def test_the_lookup_reads_the_dequantized_table(form: str, bits: int, symmetric: bool, hidden: int, block: int) -> None:
    """onnxruntime, its optimizations off, returns exactly the dequantized rows; the float table leaves."""
    weights = table(hidden)
    model = lookup_graph(weights)
    quantize = QuantizeEmbedding(bits, block, symmetric, form)
    assert quantize(model).modified and quantize.counts == {"quantized": 1}
    assert "embed.weight" not in model.graph.initializers and op_count(model, "Gather") == (
        0 if form == "gather_block_quantized" else (2 if symmetric else 3)
    )
    if form == "gather_block_quantized":
        assert op_count(model, "GatherBlockQuantized", "com.microsoft") == 1
        assert op_count(model, "Slice") == (1 if hidden % block else 0)
    else:
        assert op_count(model, "DequantizeLinear") == 1
    # float16 scales (a float32 table's, read through a Cast), chosen as float16 values
    assert model.graph.initializers[f"embed.weight.q{bits}.scales"].dtype == ir.DataType.FLOAT16
    (got,) = ort_outputs(model, {"input_ids": IDS})
    want = quantize_blockwise(weights, bits, block, symmetric, scale_dtype=np.float16).dequantize()[IDS]
    assert got.shape == (2, 3, hidden) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    assert np.abs(got - weights[IDS]).max() > 1e-4  # and it is not the float table
    assert not quantize(model).modified and quantize.counts == {}  # nothing left to quantize


@pytest.mark.parametrize("form, bits", [("gather_block_quantized", 4), ("gather_dequantize_linear", 8)])
def test_a_half_precision_table_keeps_its_dtype(form: str, bits: int) -> None:
    """Scales are stored in the table's dtype, so the lookup returns that dtype, the same values."""
    weights = table(64, np.float16)
    model = lookup_graph(weights)
    QuantizeEmbedding(bits, 32, True, form)(model)
    scales = [v for n, v in model.graph.initializers.items() if n.endswith(".scales")]
    assert [v.dtype for v in scales] == [ir.DataType.FLOAT16]
    (got,) = ort_outputs(model, {"input_ids": IDS})
    want = quantize_blockwise(weights, bits, 32, True).dequantize()[IDS]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("bits, symmetric", [(4, True), (8, False)])
def test_a_tied_table_gets_codes_of_its_own_beside_the_heads(bits: int, symmetric: bool) -> None:
    """After the head's quantization, GatherBlockQuantized reads codes of its own (the head's
    MatMulNBits bytes, row for row: the same quantization), and the float table is gone."""
    weights = table(80)  # a padded last block on both sides
    model = lookup_graph(weights, tied_head=True)
    QuantizeWeights(bits, 32, symmetric, "matmul_nbits")(model)
    quantize = QuantizeEmbedding(bits, 32, symmetric, "gather_block_quantized")
    assert quantize(model).modified and quantize.counts == {"quantized": 1}
    head, own = f"embed.weight.q{bits}", f"embed.weight.q{bits}.gather"
    suffixes = ["", ".scales"] + ([] if symmetric else [".zero_points"])
    assert "embed.weight" not in model.graph.initializers
    for suffix in suffixes:
        # float16 scales, each read through a Cast of its own (folded when onnxruntime loads the model)
        scales = suffix == ".scales"
        assert nodes_reading(model, head + suffix) == ["Cast" if scales else "MatMulNBits"]
        assert nodes_reading(model, own + suffix) == ["Cast" if scales else "GatherBlockQuantized"]
        head_bytes = model.graph.initializers[head + suffix].const_value.numpy()
        own_bytes = model.graph.initializers[own + suffix].const_value.numpy()
        np.testing.assert_array_equal(own_bytes, head_bytes.reshape(own_bytes.shape))
    logits, hidden = ort_outputs(model, {"input_ids": IDS})
    dequantized = quantize_blockwise(weights, bits, 32, symmetric, scale_dtype=np.float16).dequantize()
    np.testing.assert_allclose(hidden, dequantized[IDS], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(logits, -hidden @ dequantized.T, atol=1e-3, rtol=1e-3)
    assert not quantize(model).modified


@pytest.mark.parametrize("hidden", [64, 80])
def test_the_default_mix_keeps_a_tied_head_at_8_bits_and_the_lookup_reads_its_codes(hidden: int) -> None:
    """Where the lookup reads MatMulNBits' codes (`tied_lookup`), the default mix keeps an LM head
    tied to the table at 8 bits, symmetric, and the table is looked up in those codes: one
    matrix, its rows the head's dequantized ones. Without it, a 4-bit head and a table of its own."""
    weights = table(hidden)  # 80: a padded last block
    settings = dict(bits=4, block_size=32, symmetric=False, form="matmul_nbits", int8_form="matmul_nbits")
    model = lookup_graph(weights, tied_head=True)
    head = QuantizeWeights(**settings, mix="all_attention", tied_lookup=True)  # type: ignore[arg-type]
    assert head(model).modified and head.wider == ["embed.weight"]
    lookup = QuantizeEmbedding(4, 16, False, "gather_block_quantized")
    assert lookup(model).modified and lookup.counts == {"shared": 1}
    codes = [v.name for v in model.graph.initializers.values() if v.dtype == ir.DataType.UINT8]
    assert codes == ["embed.weight.q8"]  # no zero points, no codes of the table's own
    assert nodes_reading(model, "embed.weight.q8") == ["GatherBlockQuantized", "MatMulNBits"]
    assert "embed.weight" not in model.graph.initializers
    logits, rows = ort_outputs(model, {"input_ids": IDS})
    dequantized = quantize_blockwise(weights, 8, 32, True, scale_dtype=np.float16).dequantize()
    np.testing.assert_allclose(rows, dequantized[IDS], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(logits, -rows @ dequantized.T, atol=1e-3, rtol=1e-3)
    model = lookup_graph(weights, tied_head=True)
    head = QuantizeWeights(**settings, mix="all_attention")  # type: ignore[arg-type]
    assert head(model).modified and head.wider == []
    lookup = QuantizeEmbedding(4, 16, False, "gather_block_quantized")
    assert lookup(model).modified and lookup.counts == {"quantized": 1}


def test_an_8_bit_build_looks_a_tied_table_up_in_the_heads_codes() -> None:
    """Every weight of an 8-bit build is at 8 bits, the tied head too: where the lookup reads
    MatMulNBits' codes, the table is the head's codes, in the build's blocks, and has none of its
    own; without that lookup, codes of its own."""
    weights = table(80)  # a padded last block
    model = lookup_graph(weights, tied_head=True)
    head = QuantizeWeights(8, 32, True, "matmul_nbits", tied_lookup=True)
    assert head(model).modified and head.wider == []  # `wider`: 8-bit weights of a 4-bit build
    lookup = QuantizeEmbedding(8, 32, True, "gather_block_quantized")
    assert lookup(model).modified and lookup.counts == {"shared": 1}
    codes = [v.name for v in model.graph.initializers.values() if v.dtype == ir.DataType.UINT8]
    assert codes == ["embed.weight.q8"]
    assert nodes_reading(model, "embed.weight.q8") == ["GatherBlockQuantized", "MatMulNBits"]
    logits, rows = ort_outputs(model, {"input_ids": IDS})
    dequantized = quantize_blockwise(weights, 8, 32, True, scale_dtype=np.float16).dequantize()
    np.testing.assert_allclose(rows, dequantized[IDS], atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(logits, -rows @ dequantized.T, atol=1e-3, rtol=1e-3)
    model = lookup_graph(weights, tied_head=True)
    QuantizeWeights(8, 32, True, "matmul_nbits")(model)
    lookup = QuantizeEmbedding(8, 32, True, "gather_block_quantized")
    assert lookup(model).modified and lookup.counts == {"quantized": 1}


def test_the_portable_lookup_leaves_a_tied_heads_initializers_to_it(tmp_path: Path) -> None:
    """onnxruntime fuses the head's DequantizeLinear + MatMul into MatMulNBits only when nothing
    else reads their initializers, so the 8-bit lookup has codes of its own, even for an int8 head."""
    model = lookup_graph(table(64), tied_head=True)
    QuantizeWeights(8, 32, True, "dequantize_linear")(model)
    quantize = QuantizeEmbedding(8, 32, True, "gather_dequantize_linear")
    quantize(model)
    assert quantize.counts == {"quantized": 1}
    assert "embed.weight" not in model.graph.initializers
    assert nodes_reading(model, "embed.weight.q8") == ["DequantizeLinear"]
    assert nodes_reading(model, "embed.weight.q8.gather") == ["Gather"]
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(tmp_path / "optimized.onnx")
    ops = {node.op_type for node in optimized.graph.node}
    assert "MatMulNBits" in ops and "MatMul" not in ops  # the head; the lookup keeps its DequantizeLinear


@pytest.mark.parametrize("keep", [(LM_HEAD,), ("embed.*",), (EMBEDDINGS,)])
def test_keep_leaves_the_table_at_full_precision(keep: tuple[str, ...]) -> None:
    """By name or `embeddings`; `lm_head` keeps a tied table too, as the kept head reads it at full precision."""
    model = lookup_graph(table(64), tied_head=True)
    QuantizeWeights(4, 32, True, "matmul_nbits", keep=keep)(model)
    quantize = QuantizeEmbedding(4, 32, True, "gather_block_quantized", keep=keep)
    assert not quantize(model).modified and op_count(model, "Gather") == 1
    assert quantize.counts == {"kept": 1} and "full precision" in quantize.skipped["embed.weight"]
    # the name pattern keeps the head too (it reads the same initializer); `embeddings` only the lookup
    assert op_count(model, "MatMul") == (0 if keep == (EMBEDDINGS,) else 1)


def test_a_table_also_read_by_something_else_is_skipped_with_the_reason() -> None:
    """A tied head left at full precision for another reason than --keep (not quantized at all here)."""
    model = lookup_graph(table(64), tied_head=True)
    quantize = QuantizeEmbedding(4, 32, True, "gather_block_quantized")
    assert not quantize(model).modified
    assert quantize.counts == {"skipped": 1}
    assert quantize.skipped["embed.weight"].startswith("also read at full precision by Transpose")


def test_only_token_id_lookups_are_embeddings() -> None:
    """A table gathered by position ids (learned positions, rotary caches) is not touched, nor reported."""
    model = lookup_graph(table(64), ids="position_ids")
    quantize = QuantizeEmbedding(4, 32, True, "gather_block_quantized")
    assert not quantize(model).modified and quantize.counts == {} and quantize.skipped == {}


def test_token_ids_reshaped_first_still_name_the_embedding() -> None:
    """gpt2 reshapes input_ids before the lookup."""
    model = lookup_graph(table(64))
    graph = model.graph
    gather = next(iter(graph))
    shape = ir.Value(name="ids_shape", const_value=ir.tensor(np.array([2, 3], np.int64), name="ids_shape"))
    graph.register_initializer(shape)
    ids = gather.inputs[1]
    assert ids is not None
    view = ir.node("Reshape", [ids, shape])
    graph.insert_before(gather, view)
    view.outputs[0].shape, view.outputs[0].type = ids.shape, ids.type
    gather.replace_input_with(1, view.outputs[0])
    quantize = QuantizeEmbedding(8, 32, True, "gather_dequantize_linear")
    assert quantize(model).modified and quantize.counts == {"quantized": 1}
    (got,) = ort_outputs(model, {"input_ids": IDS})
    assert got.shape == (2, 3, 64)


def test_a_table_gathered_along_its_columns_is_skipped_with_the_reason() -> None:
    model = lookup_graph(RNG.standard_normal((64, 8)).astype(np.float32), axis=1)
    model.graph.outputs[0].shape = ir.Shape([64, 2, 3])
    quantize = QuantizeEmbedding(4, 32, True, "gather_block_quantized")
    assert not quantize(model).modified
    assert quantize.counts == {"skipped": 1} and "axis 1" in quantize.skipped["embed.weight"]


def test_a_table_that_is_not_a_constant_is_skipped_with_the_reason() -> None:
    model = lookup_graph(table(64))
    graph = model.graph
    weights = graph.initializers.pop("embed.weight")
    weights.const_value = None
    graph.inputs.append(weights)
    quantize = QuantizeEmbedding(4, 32, True, "gather_block_quantized")
    assert not quantize(model).modified
    assert quantize.counts == {"skipped": 1} and "not a constant" in quantize.skipped["embed.weight"]


def test_unsupported_settings_are_refused() -> None:
    for bits, block, form in ((3, 32, "gather_block_quantized"), (4, 48, "gather_block_quantized"), (4, 32, "gguf")):
        with pytest.raises(ValueError, match="unsupported embedding quantization"):
            QuantizeEmbedding(bits, block, True, form)
    with pytest.raises(ValueError, match="no 4-bit type"):
        QuantizeEmbedding(4, 32, True, "gather_dequantize_linear")


@pytest.mark.parametrize("form", ["gather_block_quantized", "gather_dequantize_linear"])
@pytest.mark.parametrize("block", [32, 16])  # Q8_0's blocks, Q6_K's
@pytest.mark.parametrize("half", [False, True])  # scales that are float16 values: stored so, read through a Cast
def test_a_table_the_checkpoint_ships_quantized_is_looked_up_with_its_own_codes(
    form: str, block: int, half: bool
) -> None:
    hidden = 64
    scales = (RNG.random((VOCAB, hidden // block)) * 0.01).astype(np.float16 if half else np.float32)
    record = QuantizedWeight(
        RNG.integers(-128, 128, (VOCAB, hidden)).astype(np.int8), scales.astype(np.float32), None, 8, block
    )
    model = lookup_graph(record.dequantize())
    imports = QuantizeEmbedding(8, form=form, imported={"embed.weight": record, "alias": record}, only_imported=True)
    assert imports(model).modified and imports.counts == {"imported": 1}
    (forms,) = imports.imported_forms.values()
    assert forms == {
        "form": form,
        "bits": 8,
        "block_size": block,
        "zero_points": False,
        "from": ["alias", "embed.weight"],
    }
    stored = [v.dtype for name, v in model.graph.initializers.items() if name.endswith(".scales")]
    assert stored == [ir.DataType.FLOAT16 if half else ir.DataType.FLOAT]
    (got,) = ort_outputs(model, {"input_ids": IDS})
    np.testing.assert_allclose(got, record.dequantize()[IDS], atol=1e-6, rtol=1e-6)
    # a table it was not given, or one with a float term per block the lookup cannot add, stays
    for imported in ({}, {"embed.weight": replace(record, mins=np.ones((VOCAB, hidden // block), np.float32))}):
        kept = lookup_graph(record.dequantize())
        only = QuantizeEmbedding(8, form=form, imported=imported, only_imported=True)
        assert not only(kept).modified and only.counts == {"kept": 1}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_free_min_table_looks_up_each_row_with_its_block_minimums(dtype: type) -> None:
    """GatherBlockQuantized's symmetric rows plus the rows' block minimums, looked up beside them:
    the table's free-minimum grid itself (the tied head, `QuantizeWeights`, reads it through its
    own min term)."""
    from tests.passes.test_quantize import grid_blocks

    weights = grid_blocks(VOCAB, 64, dtype)
    model = lookup_graph(weights, tied_head=True)
    head = QuantizeWeights(4, free_min=True)  # the head first, as the pipeline runs them
    assert head(model).modified and head.counts == {"quantized": 1, "free_min": 1}
    quantize = QuantizeEmbedding(4, 32, True, "gather_block_quantized", free_min=True)
    assert quantize(model).modified and quantize.counts == {"quantized": 1}
    assert op_count(model, "GatherBlockQuantized", "com.microsoft") == 1 and op_count(model, "Gather") == 1
    logits, hidden = ort_outputs(model, {"input_ids": IDS})
    rows = weights[IDS].astype(np.float32)
    # exact to the dtype's rounding of min + 8 * step and of the products (a few of its ulps in fp16)
    ulp = float(np.spacing(np.abs(weights).max().astype(dtype)))
    np.testing.assert_allclose(hidden, rows, rtol=0, atol=4 * ulp)
    want = -rows @ weights.T.astype(np.float32)
    np.testing.assert_allclose(logits, want, rtol=2e-2 if dtype == np.float16 else 1e-4, atol=1e-2 * np.abs(want).max())
    # a symmetric table rounds such rows again
    plain = lookup_graph(weights)
    QuantizeEmbedding(4, 32, True, "gather_block_quantized")(plain)
    (symmetric,) = ort_outputs(plain, {"input_ids": IDS})
    assert np.abs(symmetric - rows).max() > 1e-3


def optimized_outputs(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """All graph outputs, computed by onnxruntime as a kvforge session loads a model (its graph
    optimizations on: a Cast of an initializer is folded at load)."""
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, feeds)]


@pytest.mark.parametrize(
    "hidden, block",
    # whole blocks (a GGUF file's), a padded last one; a Q6_K's 16; a head regrouped in blocks of 128
    [(64, 32), (80, 32), (64, 16), (80, 16), (128, 32)],
)
def test_an_imported_table_tied_to_the_head_is_looked_up_in_the_heads_codes(hidden: int, block: int) -> None:
    """A checkpoint's table that the LM head reads too (a GGUF file without an output matrix) is
    written once: the lookup reads the head's MatMulNBits codes and scales as they are, the scales
    float16 in the file (the file's own: each a float16 value) and float32 where the kernels
    read them; the rows are the record's floats exactly, or, where the head's import `regrouped`
    the record in larger blocks (int8 activations), the regrouped record's."""
    from kvforge.passes.quantize import ImportQuantizedWeights, regrouped

    blocks = -(-hidden // block)
    scales = (RNG.random((VOCAB, blocks)) * 0.01 + 1e-3).astype(np.float16).astype(np.float32)
    record = QuantizedWeight(RNG.integers(-127, 128, (VOCAB, hidden)).astype(np.int8), scales, None, 8, block)
    held = regrouped(record, head=True)
    assert held.block_size == {(64, 16): 32, (128, 32): 128}.get((hidden, block), block)
    weights = held.dequantize()
    model = lookup_graph(weights, tied_head=True)
    imported = {"embed.weight": record, LM_HEAD: record}
    head = ImportQuantizedWeights(imported, accuracy_level=4)
    assert head(model).modified and head.counts == {"imported": 1}
    lookup = QuantizeEmbedding(8, form="gather_block_quantized", imported=imported, only_imported=True)
    assert lookup(model).modified and lookup.counts == {"imported": 1}
    (forms,) = lookup.imported_forms.values()
    assert forms["codes_of"] == "embed.weight.q8" and forms["from"] == sorted(imported)
    assert forms["block_size"] == held.block_size
    assert forms.get("regrouped") == (None if held is record else sorted(imported))
    codes = [v for v in model.graph.initializers.values() if v.dtype == ir.DataType.UINT8]
    assert [v.name for v in codes] == ["embed.weight.q8"]
    assert nodes_reading(model, "embed.weight.q8") == ["GatherBlockQuantized", "MatMulNBits"]
    assert model.graph.initializers["embed.weight.q8.scales"].dtype == ir.DataType.FLOAT16
    assert "embed.weight" not in model.graph.initializers
    logits, rows = optimized_outputs(model, {"input_ids": IDS})
    np.testing.assert_array_equal(rows, weights[IDS])
    want = -rows @ weights.T
    np.testing.assert_allclose(logits, want, rtol=0, atol=2e-2 * np.abs(want).max())  # int8 activations
    assert not lookup(model).modified


def test_imported_scales_that_are_not_float16_values_stay_float32() -> None:
    """Only a float16 value is stored as one: a scale of more precision (a k-quant's d * sc) keeps
    the graph's float32, read directly."""
    from kvforge.passes.quantize import ImportQuantizedWeights

    scales = (RNG.random((VOCAB, 2)) * 0.01 + 1e-3).astype(np.float32)  # float32 values
    record = QuantizedWeight(RNG.integers(-127, 128, (VOCAB, 64)).astype(np.int8), scales, None, 8, 32)
    model = lookup_graph(record.dequantize(), tied_head=True)
    ImportQuantizedWeights({"embed.weight": record}, accuracy_level=4)(model)
    assert model.graph.initializers["embed.weight.q8.scales"].dtype == ir.DataType.FLOAT
    assert op_count(model, "Cast") == 0
