"""GGUF's quantized tensors as records: the exact types keep the file's codes and scales (the
free-minimum ones with a float term per block), the others are rounded as chosen; checked
against the gguf package's own dequantization."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from kvforge.passes.quantize import ImportQuantizedWeights
from kvforge.toolchain.gguf_import import decode, records
from tests.passes.fusion_testing import ort_outputs
from tests.passes.test_quantize import projection_graph

RNG = np.random.default_rng(0)
N, K = 24, 256
T = GGMLQuantizationType


def random_k_blocks(qtype: GGMLQuantizationType, block_bytes: int, halves: tuple[int, ...]) -> np.ndarray:
    """[N, K / 256 * block_bytes] random k-quant blocks whose fp16 fields (at `halves`) are finite."""
    blocks = RNG.integers(0, 256, (N * K // 256, block_bytes), dtype=np.uint8)
    for at in halves:
        blocks[:, at : at + 2] = (RNG.random((len(blocks), 1)) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    return blocks.reshape(N, -1)


# type -> (bytes per block, offsets of its fp16 fields) where the package has no quantizer:
# any blocks with finite fp16 fields are valid ones
K_BLOCKS = {T.Q6_K: (210, (208,)), T.Q4_K: (144, (0, 2)), T.Q5_K: (176, (0, 2)), T.Q3_K: (110, (108,))}


def blocks_of(qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype in K_BLOCKS:
        return random_k_blocks(qtype, *K_BLOCKS[qtype])
    return quantize(RNG.standard_normal((N, K)).astype(np.float32), qtype)


@pytest.mark.parametrize(
    "qtype, bits, block, mins",
    [
        (T.Q4_0, 4, 32, False),
        (T.Q8_0, 8, 32, False),
        (T.Q5_0, 8, 32, False),
        (T.Q6_K, 8, 16, False),
        (T.Q4_1, 4, 32, True),
        (T.Q5_1, 8, 32, True),
        (T.Q4_K, 4, 32, True),
        (T.Q5_K, 8, 32, True),
    ],
)
def test_the_exact_types_keep_their_codes_and_dequantize_to_the_files_values(
    qtype: GGMLQuantizationType, bits: int, block: int, mins: bool
) -> None:
    raw = blocks_of(qtype)
    imported = decode(raw, qtype, (N, K))
    assert imported is not None and imported.exact
    q = imported.record
    assert (q.bits, q.block_size, q.zero_points, q.mins is not None) == (bits, block, None, mins)
    expected = dequantize(raw, qtype).reshape(N, K)
    if mins:  # symmetric codes of the file's own, the min and the codes' centre a float term per block
        width = 4 if qtype in (T.Q4_1, T.Q4_K) else 5
        assert q.codes.min() >= -(2 ** (width - 1)) and q.codes.max() < 2 ** (width - 1)
        np.testing.assert_allclose(q.dequantize(), expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    else:
        np.testing.assert_array_equal(q.dequantize(), expected)  # the same floats, not merely close
    # and MatMulNBits computes with them: x @ the file's weight, to float accumulation
    model = projection_graph(K, N, expected)
    ImportQuantizedWeights({"w": q})(model)
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    (got,) = ort_outputs(model, {"x": x})
    np.testing.assert_allclose(got, x @ expected.T, rtol=1e-5, atol=1e-5 * np.abs(x @ expected.T).max())


@pytest.mark.parametrize("qtype", [T.Q3_K])
def test_a_type_with_no_exact_form_is_rounded_as_chosen_and_said_so(qtype: GGMLQuantizationType) -> None:
    data = blocks_of(qtype)
    values = dequantize(data, qtype).reshape(N, K)
    errors = {}
    for form, bits in (("int4", 4), ("int8", 8)):
        imported = decode(data, qtype, (N, K), form)
        assert imported is not None and not imported.exact and "Q3_K" in imported.reason
        assert imported.record.bits == bits and imported.record.zero_points is not None
        # within half a step of its code, or clipped to the block's lowest or highest value
        record = imported.record
        step = np.repeat(record.scales.astype(np.float32), 32, axis=1)
        zero = np.repeat(record.zero_points.astype(np.float32), 32, axis=1)
        lowest, highest = -zero * step, (2**bits - 1 - zero) * step
        inside = (values >= lowest - step / 2) & (values <= highest + step / 2)
        error = np.abs(record.dequantize() - values)
        assert (error[inside] <= step[inside] / 2 * (1 + 1e-3) + 1e-7).all()
        np.testing.assert_allclose(record.dequantize()[~inside], np.where(values > 0, highest, lowest)[~inside])
        errors[form] = error.mean()
    assert errors["int8"] < errors["int4"] / 8
    assert decode(data, qtype, (N, K), "float") is None


def test_records_read_a_gguf_file_by_the_names_given(tmp_path: Path) -> None:
    """ggml's dims are (K, N): the record is the [N, K] weight, named as the caller maps it."""
    weight = RNG.standard_normal((N, K)).astype(np.float32)
    writer = GGUFWriter(tmp_path / "m.gguf", "llama")
    raw = quantize(weight, T.Q8_0)
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=T.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(K, np.float32))
    writer.add_tensor("unnamed.weight", quantize(weight, T.Q4_0), raw_dtype=T.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    names = {"blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight", "blk.0.attn_norm.weight": "norm"}
    found = records(GGUFReader(tmp_path / "m.gguf"), names)
    assert list(found) == ["model.layers.0.mlp.down_proj.weight"]  # the 1-D norm and the unnamed tensor are not
    np.testing.assert_array_equal(
        found["model.layers.0.mlp.down_proj.weight"].record.dequantize(), dequantize(raw, T.Q8_0)
    )


@pytest.mark.parametrize("qtype, mins", [(T.Q6_K, False), (T.Q4_K, True), (T.Q5_K, True)])
def test_k_quant_scales_are_stored_as_their_factors_and_multiplied_out_to_the_same_floats(
    qtype: GGMLQuantizationType, mins: bool
) -> None:
    """A k-quant's scales (d * an integer per block) and min terms are written as the file holds
    them, a float16 per super-block and the integers, and multiplied out by constant nodes:
    at load, the scales and min terms the record holds, bit for bit."""
    import onnx_ir as ir
    import onnxruntime as ort

    raw = blocks_of(qtype)
    imported = decode(raw, qtype, (N, K))
    assert imported is not None and imported.record.factors is not None
    q = imported.record
    model = projection_graph(K, N, q.dequantize())
    level = 0 if qtype == T.Q6_K else 4  # at level 4 a Q6_K is regrouped (test below)
    ImportQuantizedWeights({"w": q}, accuracy_level=level)(model)
    floats = [v for v in model.graph.initializers.values() if v.dtype == ir.DataType.FLOAT]
    stored = [v for v in floats if not (v.name or "").startswith("kvforge.block_sum")]  # the min term's ones
    assert sum(v.const_value.nbytes for v in stored) <= 4  # the min terms' offset: no float32 scales
    # the scales and min terms the graph computes are the record's floats exactly
    nodes = {node.op_type: node for node in model.graph}
    kernel = nodes["MatMulNBits"]
    scales = kernel.inputs[2]
    taps = [scales] + ([nodes["Transpose"].outputs[0]] if mins else [])
    for tap in taps:
        model.graph.outputs.append(tap)
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    proto = ir.to_proto(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got, got_scales, *got_mins = session.run(None, {"x": x})
    np.testing.assert_array_equal(got_scales, q.scales)
    if mins:
        np.testing.assert_array_equal(got_mins[0], q.mins.T)
    want = x @ q.dequantize().T
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())  # int8 activations


def test_8_bit_codes_are_regrouped_in_the_blocks_int8_activations_read_fastest_and_kept_for_float_ones() -> None:
    """At accuracy level 4, 8-bit codes in blocks of 16 (a Q6_K's) are rounded again in blocks of
    32 with a float16 scale each, the LM head's 8-bit codes in blocks of 128: every weight within
    half its new step of the file's; at level 0 (the float gate's build) the file's codes and
    blocks stay."""
    import onnx_ir as ir
    import onnxruntime as ort

    from kvforge.passes.quantize import regrouped
    from kvforge.passes.storage import regroup_block

    q = decode(blocks_of(T.Q6_K), T.Q6_K, (N, K)).record  # type: ignore[union-attr]
    q8 = decode(blocks_of(T.Q8_0), T.Q8_0, (N, K)).record  # type: ignore[union-attr]
    q4k = decode(blocks_of(T.Q4_K), T.Q4_K, (N, K)).record  # type: ignore[union-attr]
    assert (q.bits, q.block_size, q8.block_size) == (8, 16, 32)
    assert [regroup_block(r, head) for head in (False, True) for r in (q, q8, q4k)] == [32, None, None, 128, 128, None]
    assert regrouped(q8) is q8 and regrouped(q4k, head=True) is q4k  # as they are
    for record, head, block in ((q, False, 32), (q, True, 128), (q8, True, 128)):
        moved = regrouped(record, head)
        assert (moved.bits, moved.block_size, moved.factors) == (8, block, None)
        np.testing.assert_array_equal(moved.scales.astype(np.float16).astype(np.float32), moved.scales)
        step = np.repeat(moved.scales, block, axis=1)
        error = np.abs(moved.dequantize() - record.dequantize())
        assert (error <= step / 2 * (1 + 1e-6)).all() and error.max() > 0
        assert np.abs(moved.codes).max() >= 127  # each block's largest magnitude takes the widest code
    x = RNG.standard_normal((2, 3, K)).astype(np.float32)
    for level, output, block in ((4, "y", 32), (4, "logits", 128), (0, "logits", 16)):
        model = projection_graph(K, N, q.dequantize(), output=output)  # "logits": the LM head
        imports = ImportQuantizedWeights({"w": q}, accuracy_level=level)
        imports(model)
        (kernel,) = [node for node in model.graph if node.op_type == "MatMulNBits"]
        assert kernel.attributes["block_size"].as_int() == block
        assert imports.imported_forms["w"].get("regrouped") == (["w"] if level == 4 else None)
        # onnxruntime's optimizations on: they fold the scales' Cast, which MatMulNBits' int8 path
        # must see as a constant when it packs the weight
        session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
        (got,) = session.run(None, {"x": x})
        want = x @ (regrouped(q, output == "logits") if level == 4 else q).dequantize().T
        tolerance = 2e-2 if level == 4 else 1e-5  # int8 activations
        np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * np.abs(want).max())


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0, T.Q6_K, T.Q4_K])
def test_the_footprint_counts_a_record_as_the_import_writes_it(qtype: GGMLQuantizationType) -> None:
    """`record_bytes` (what `kvforge inspect` and `--device-memory` count for an imported weight) is
    the bytes of the initializers the import writes for it, but the min term's block-sum constant
    and the factors' shape and offset (a few bytes)."""
    from kvforge.toolchain.footprint import record_bytes

    imported = decode(blocks_of(qtype), qtype, (N, K))
    assert imported is not None
    q = imported.record
    for head in (False, True):  # a layer's weight, the LM head's (regrouped in other blocks)
        model = projection_graph(K, N, q.dequantize(), output="logits" if head else "y")
        ImportQuantizedWeights({"w": q}, accuracy_level=4)(model)
        constants = ("kvforge.block_sum", ".scales.shape", ".mins.offset")
        written = [v for name, v in model.graph.initializers.items() if not any(c in name for c in constants)]
        assert record_bytes(q, head=head) == sum(v.const_value.nbytes for v in written)


def test_the_manifest_lists_a_regrouped_part_of_a_packed_weight_as_not_exact_and_the_others_as_exact() -> None:
    """A Q4_K_M file's q (Q4_K) and v (Q6_K) packed into one weight, imported at level 4: the
    pass lists v as regrouped, and the manifest marks v not exact and q exact."""
    import onnx_ir as ir

    from kvforge.passes.weight_layout import StackedRows
    from kvforge.toolchain.prequantized import manifest_entry

    found = {"q": decode(blocks_of(T.Q4_K), T.Q4_K, (N, K)), "v": decode(blocks_of(T.Q6_K), T.Q6_K, (N, K))}
    assert all(imported is not None and imported.exact for imported in found.values())
    q, v = (found[name].record for name in ("q", "v"))  # type: ignore[union-attr]
    model = projection_graph(K, 2 * N, np.concatenate([q.dequantize(), v.dequantize()]), name="qv", output="y")
    model.graph.initializers["qv"].const_value = StackedRows(
        [q.dequantize(), v.dequantize()], ir.DataType.FLOAT, "qv", ["q", "v"]
    )
    imports = ImportQuantizedWeights({"q": q, "v": v}, accuracy_level=4)
    assert imports(model).modified
    form = imports.imported_forms["qv"]
    assert (form["bits"], form["block_size"], form["regrouped"], form["mins"]) == (8, 32, ["v"], True)
    weights = manifest_entry({"method": "gguf"}, found, imports.imported_forms, requantized=True)["weights"]  # type: ignore[arg-type]
    assert (weights["q"]["exact"], weights["v"]["exact"]) == (True, False)
    assert weights["v"]["regrouped"] == ["v"]
