"""FoldWeightTransposes: weights stored as their MatMuls read them, under the checkpoint's names."""

from __future__ import annotations

import gc
import io
import typing
import weakref

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.weight_layout import FoldWeightTransposes, StackedRows, TransposedTensor
from tests.passes.fusion_testing import op_count, ort_outputs

VOCAB, HIDDEN = 12, 8


def head_graph(tied: bool) -> ir.Model:
    """logits = MatMul(Gather(E, ids) if tied else h, Transpose(W)) with W = E when tied."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    proj = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    nodes = [
        helper.make_node("Gather", ["embed.weight", "ids"], ["h"]),
        helper.make_node("Transpose", ["proj.weight"], ["proj_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h", "proj_t"], ["h2"]),
        helper.make_node("Transpose", ["embed.weight" if tied else "head.weight"], ["head_t"], perm=[1, 0]),
        helper.make_node("MatMul", ["h2", "head_t"], ["logits"]),
    ]
    initializers = [numpy_helper.from_array(table, "embed.weight"), numpy_helper.from_array(proj, "proj.weight")]
    if not tied:
        head = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
        initializers.append(numpy_helper.from_array(head, "head.weight"))
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, VOCAB])],
        initializer=initializers,
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


FEEDS = {"ids": np.array([[1, 5, 7], [0, 11, 3]], dtype=np.int64)}


def test_weights_read_only_through_transpose_are_stored_transposed_under_their_names() -> None:
    model = head_graph(tied=False)
    (expected,) = ort_outputs(head_graph(tied=False), FEEDS)
    projection = model.graph.initializers["proj.weight"].const_value.numpy().copy()  # type: ignore[union-attr]
    assert FoldWeightTransposes()(model).modified
    assert op_count(model, "Transpose") == 0
    assert sorted(model.graph.initializers) == ["embed.weight", "head.weight", "proj.weight"]
    stored = model.graph.initializers["proj.weight"].const_value.numpy()  # type: ignore[union-attr]
    np.testing.assert_array_equal(stored, projection.T)
    assert model.graph.initializers["head.weight"].shape == ir.Shape([HIDDEN, VOCAB])
    (actual,) = ort_outputs(model, FEEDS)
    np.testing.assert_array_equal(actual, expected)
    assert not FoldWeightTransposes()(model).modified


def test_a_table_also_read_as_it_is_keeps_its_layout_and_gets_a_transposed_copy() -> None:
    model = head_graph(tied=True)
    (expected,) = ort_outputs(head_graph(tied=True), FEEDS)
    FoldWeightTransposes()(model)
    assert sorted(model.graph.initializers) == ["embed.weight", "embed.weight.transposed", "proj.weight"]
    assert model.graph.initializers["embed.weight"].shape == ir.Shape([VOCAB, HIDDEN])  # the Gather still reads it
    (actual,) = ort_outputs(model, FEEDS)
    np.testing.assert_array_equal(actual, expected)


def test_a_transpose_with_another_permutation_stays() -> None:
    model = head_graph(tied=False)
    node = next(n for n in model.graph if n.op_type == "Transpose")
    node.attributes["perm"] = ir.AttrInt64s("perm", [0, 1])
    result = FoldWeightTransposes()(model)
    assert result.modified and op_count(model, "Transpose") == 1  # only the head's was folded


def test_the_transposed_weight_is_written_in_slices_with_the_bytes_of_the_whole_transpose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = np.random.default_rng(2).standard_normal((37, 5)).astype(np.float32)
    tensor = TransposedTensor([source], ir.DataType.FLOAT, "w")
    monkeypatch.setattr(TransposedTensor, "ROW_BYTES", 3 * 37 * 4)  # three rows of the transpose per write
    writes: list[int] = []

    class Recording(io.BytesIO):
        def write(self, data: typing.Any) -> int:
            writes.append(len(data))
            return super().write(data)

    file = Recording()
    tensor.tofile(file)
    assert file.getvalue() == np.ascontiguousarray(source.T).tobytes() == tensor.tobytes()
    assert writes == [3 * 37 * 4, 2 * 37 * 4]
    assert tensor.shape == ir.Shape([5, 37])


def test_a_stacked_weight_is_written_and_transposed_from_its_parts_without_the_stacked_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(3)
    parts = [rng.standard_normal((rows, 6)).astype(np.float16) for rows in (4, 2, 3)]
    whole = np.concatenate(parts, axis=0)
    stacked = StackedRows(parts, ir.DataType.FLOAT16, "w")
    assert stacked.shape == ir.Shape([9, 6])
    file = io.BytesIO()
    stacked.tofile(file)
    assert file.getvalue() == whole.tobytes() == stacked.tobytes()

    monkeypatch.setattr(TransposedTensor, "ROW_BYTES", 4 * 9 * 2)  # four rows of the transpose per write
    transposed = TransposedTensor(stacked.parts, ir.DataType.FLOAT16, "w")
    file = io.BytesIO()
    transposed.tofile(file)
    assert transposed.shape == ir.Shape([6, 9])
    assert file.getvalue() == np.ascontiguousarray(whole.T).tobytes() == transposed.tobytes()
    with pytest.raises(ValueError, match="equal columns"):
        StackedRows([parts[0], parts[1][:, :5]], ir.DataType.FLOAT16, "w")


def test_dropping_a_lazy_weight_frees_its_parts_without_a_garbage_collection() -> None:
    """The build drops each written weight from its graph and counts on the memory coming back
    at once: a reference cycle would keep the parts until a full collection, which the build
    rarely runs (a 1.5B fp16 build held its weights twice at its gate that way)."""
    parts = [np.ones((4, 3), dtype=np.float32), np.zeros((2, 3), dtype=np.float32)]
    alive = [weakref.ref(part) for part in parts]
    stacked = StackedRows(parts, ir.DataType.FLOAT, "w")
    transposed = TransposedTensor(stacked.parts, ir.DataType.FLOAT, "w")
    assert transposed.numpy().shape == (3, 6)
    gc.disable()
    try:
        del parts, stacked, transposed
        assert [ref() for ref in alive] == [None, None]
    finally:
        gc.enable()
