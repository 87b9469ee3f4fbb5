"""LastPositionLogits: the LM head (and a softcap after it) runs on the last position only, or
(`to_keep`) on the last `logits_to_keep` positions, an input that defaults to 0 (every position).

Inline graphs of the head as the canonical graph has it (MatMul with a transposed constant weight, constants
with known values), heads it must leave alone, then the canonicalized graphs of tiny checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.last_position import LastPositionLogits
from kvforge.passes.targets import TARGETS
from tests.passes.fusion_testing import canonical_graph, ort_outputs
from tests.tiny import VOCAB_SIZE

HIDDEN, VOCAB = 8, 12
CAP = 3.0  # small enough that the softcap changes the logits
INT64_MAX = np.iinfo(np.int64).max
ATOL, RTOL = 1e-5, 1e-4  # float32; slicing first changes no arithmetic, so in practice they are equal


@dataclass(frozen=True)
class Head:
    """An LM head graph; each field off its default is a variant or a look-alike."""

    weight: str = "transposed"  # MatMul(h, Transpose(W [V, H])); "plain": MatMul(h, W [H, V]); "input": W is an input
    softcap: bool = False  # logits = CAP * Tanh(raw / CAP)
    constant_nodes: bool = False  # the softcap's CAP as a Constant node, not an initializer
    tail: str | None = None  # "reduce_seq": ReduceSum over axis 1; "add_input": + another [B, S, V] input
    output: str = "logits"


def make_head(head: Head = Head()) -> ir.Model:
    rng = np.random.default_rng(0)
    inputs = [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "seq", HIDDEN])]
    initializers: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    weight = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    if head.weight == "transposed":
        initializers.append(numpy_helper.from_array(weight, "lm_head.weight"))
        nodes.append(helper.make_node("Transpose", ["lm_head.weight"], ["w"], perm=[1, 0]))
    elif head.weight == "plain":
        initializers.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [HIDDEN, VOCAB]))
    nodes.append(helper.make_node("MatMul", ["hidden", "w"], ["raw"]))
    value = "raw"
    if head.softcap:
        cap = numpy_helper.from_array(np.array(CAP, np.float32), "cap")
        if head.constant_nodes:
            nodes.append(helper.make_node("Constant", [], ["cap"], value=cap))
        else:
            initializers.append(cap)
        nodes += [
            helper.make_node("Div", [value, "cap"], ["scaled"]),
            helper.make_node("Tanh", ["scaled"], ["squashed"]),
            helper.make_node("Mul", ["squashed", "cap"], ["capped"]),
        ]
        value = "capped"
    if head.tail == "reduce_seq":
        nodes.append(helper.make_node("ReduceSum", [value, "seq_axis"], ["summed"], keepdims=1))
        initializers.append(numpy_helper.from_array(np.array([1], np.int64), "seq_axis"))
        value = "summed"
    elif head.tail == "add_input":
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["batch", "seq", VOCAB]))
        nodes.append(helper.make_node("Add", [value, "bias"], ["biased"]))
        value = "biased"
    nodes[-1].output[0] = head.output
    out_seq: int | str = 1 if head.tail == "reduce_seq" else "seq"
    graph = helper.make_graph(
        nodes,
        "lm_head",
        inputs,
        [helper.make_tensor_value_info(head.output, TensorProto.FLOAT, ["batch", out_seq, VOCAB])],
        initializer=initializers,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    proto.ir_version = 10
    return ir.from_proto(proto)


def head_feeds(model: ir.Model, seq: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = {"batch": 2, "seq": seq}
    feeds = {}
    for value in model.graph.inputs:
        assert value.shape is not None and value.name is not None
        shape = [d if isinstance(d, int) else sizes[str(d.value)] for d in value.shape]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def fresh(model: ir.Model) -> ir.Model:
    return ir.from_proto(ir.to_proto(model))


def slices(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == "Slice"]


def const_ints(value: ir.Value | None) -> list[int]:
    assert value is not None and value.const_value is not None
    return [int(x) for x in value.const_value.numpy().ravel()]


@pytest.mark.parametrize(
    "head",
    [Head(), Head(softcap=True), Head(weight="plain"), Head(weight="plain", softcap=True)],
    ids=["transposed-weight", "softcap", "plain-weight", "plain-weight-softcap"],
)
def test_lm_head_runs_on_the_last_position_only(head: Head) -> None:
    model = make_head(head)
    reference = fresh(model)
    nodes_before = len(model.graph)
    assert LastPositionLogits()(model).modified

    (last,) = slices(model)
    assert last.name == "last_position" and last.inputs[0] is not None and last.inputs[0].name == "hidden"
    assert [const_ints(v) for v in last.inputs[1:]] == [[-1], [INT64_MAX], [1]]  # starts, ends, axes
    (matmul,) = [n for n in model.graph if n.op_type == "MatMul"]
    assert matmul.inputs[0] is last.outputs[0]
    assert len(model.graph) == nodes_before + 1
    (logits,) = model.graph.outputs
    assert logits.shape is not None and [str(d) for d in logits.shape] == ["batch", "1", str(VOCAB)]

    for seq in (5, 1):
        feeds = head_feeds(model, seq)
        (got,), (want,) = ort_outputs(model, feeds), ort_outputs(reference, feeds)
        assert got.shape == (2, 1, VOCAB)
        np.testing.assert_allclose(got, want[:, -1:], atol=ATOL, rtol=RTOL)
        if head.softcap:
            assert np.abs(got).max() < CAP and np.abs(want).max() > 1.0  # the cap is in the graph and acts

    again = LastPositionLogits()(model)
    assert not again.modified and len(model.graph) == nodes_before + 1 and len(slices(model)) == 1


@pytest.mark.parametrize(
    "head", [Head(), Head(softcap=True), Head(weight="plain")], ids=["transposed", "softcap", "plain"]
)
def test_logits_to_keep_input_picks_how_many_last_positions(head: Head) -> None:
    model = make_head(head)
    reference = fresh(model)
    seq = 5
    feeds = head_feeds(model, seq)  # before the pass: the hidden states (and weight) only
    (want,) = ort_outputs(reference, feeds)
    nodes_before = len(model.graph)
    assert LastPositionLogits(to_keep=True)(model).modified

    keep = model.graph.inputs[-1]
    assert keep.name == "logits_to_keep" and keep.dtype == ir.DataType.INT64 and keep.shape == ir.Shape([1])
    assert "logits_to_keep" in model.graph.initializers and const_ints(keep) == [0]  # the default: every position
    (last,) = slices(model)
    assert last.name == "last_position" and last.inputs[1] is not None
    negate = last.inputs[1].producer()
    assert negate is not None and negate.op_type == "Neg" and negate.inputs[0] is keep
    assert len(model.graph) == nodes_before + 2  # Neg and Slice
    (logits,) = model.graph.outputs
    assert logits.shape is not None and [str(d) for d in logits.shape] == ["batch", "kept", str(VOCAB)]

    (default,) = ort_outputs(model, feeds)  # not fed: the initializer's [0], every position
    assert default.shape == (2, seq, VOCAB)
    np.testing.assert_allclose(default, want, atol=ATOL, rtol=RTOL)
    for kept in (1, 3, seq):
        (got,) = ort_outputs(model, {**feeds, "logits_to_keep": np.array([kept], np.int64)})
        assert got.shape == (2, kept, VOCAB)
        np.testing.assert_allclose(got, want[:, -kept:], atol=ATOL, rtol=RTOL)

    again = LastPositionLogits(to_keep=True)(model)
    assert not again.modified and len(model.graph) == nodes_before + 2
    assert len(model.graph.inputs) == len(reference.graph.inputs) + 1


def test_logits_to_keep_survives_constant_folding() -> None:
    """The input's default is an initializer, which a fold would take for a constant: the pipeline's
    clean-up after the pass must leave Neg(logits_to_keep) to the caller's value."""
    from kvforge.passes.pipeline import canonicalize

    model = make_head(Head(softcap=True))
    feeds = head_feeds(model, 4)
    (want,) = ort_outputs(fresh(model), feeds)
    LastPositionLogits(to_keep=True)(model)
    for p in canonicalize():
        p(model)
    assert [n.op_type for n in model.graph if n.op_type in ("Neg", "Slice")] == ["Neg", "Slice"]
    (got,) = ort_outputs(model, {**feeds, "logits_to_keep": np.array([4], np.int64)})
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)


def test_logits_to_keep_is_not_added_twice_under_one_name() -> None:
    """A graph that already has an input named logits_to_keep is not one this pass made: left alone."""
    model = make_head()
    model.graph.inputs.append(ir.val("logits_to_keep", ir.DataType.INT64, ir.Shape([1])))
    assert not LastPositionLogits(to_keep=True)(model).modified and not slices(model)


def test_logits_output_is_chosen_by_name() -> None:
    model = make_head(Head(output="scores"))
    assert not LastPositionLogits()(model).modified and not slices(model)  # no output named "logits"
    assert LastPositionLogits(output="scores")(model).modified
    assert len(slices(model)) == 1
    assert not LastPositionLogits(output="scores")(model).modified


@pytest.mark.parametrize(
    "head",
    [
        Head(tail="reduce_seq"),  # mixes positions: the last position alone is not the same sum
        Head(tail="add_input", softcap=True),  # a second varying operand: not known to be position-wise
        Head(weight="input"),  # not a constant weight, so not known to be the LM head
    ],
    ids=["reduce-over-seq", "add-of-two-inputs", "weight-is-an-input"],
)
def test_heads_that_are_not_position_wise_are_left_alone(head: Head) -> None:
    model = make_head(head)
    reference = fresh(model)
    nodes_before = len(model.graph)
    assert not LastPositionLogits()(model).modified
    assert len(model.graph) == nodes_before and not slices(model)
    feeds = head_feeds(model, 5)
    for got, want in zip(ort_outputs(model, feeds), ort_outputs(reference, feeds)):
        np.testing.assert_array_equal(got, want)


def test_softcap_with_constant_nodes_is_sliced() -> None:
    model = make_head(Head(softcap=True, constant_nodes=True))
    assert LastPositionLogits()(model).modified


# --- the canonicalized graphs of tiny checkpoints ------------------------------------------------------------


def decoder_feeds(model: ir.Model, batch: int = 2, seq: int = 4, past: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(3, VOCAB_SIZE, (batch, seq), dtype=np.int64),
        "attention_mask": np.ones((batch, past + seq), np.int64),
        "position_ids": np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1)),
    }
    for value in model.graph.inputs:
        if value.name and value.name.startswith("past_key_values."):
            assert value.shape is not None
            heads, head_dim = value.shape[1], value.shape[3]
            assert isinstance(heads, int) and isinstance(head_dim, int)
            feeds[value.name] = rng.standard_normal((batch, heads, past, head_dim)).astype(np.float32)
    return feeds


@pytest.mark.slow  # exports each tiny checkpoint once per session (shared with the other fusion tests)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # an untied and a tied (Transpose of the embeddings) head
@pytest.mark.parametrize("to_keep", [False, True], ids=["last", "keep"])
def test_tiny_decoder_logits_are_the_last_position(arch: str, to_keep: bool, scratch: Path) -> None:
    model = canonical_graph(arch, scratch)
    feeds = decoder_feeds(model)
    logits, *presents = ort_outputs(model, feeds)
    assert LastPositionLogits(to_keep=to_keep)(model).modified
    assert [n.name for n in slices(model)].count("last_position") == 1
    if to_keep:  # as the runner feeds a prefill
        feeds["logits_to_keep"] = np.array([1], np.int64)
    got_logits, *got_presents = ort_outputs(model, feeds)
    assert got_logits.shape == (2, 1, VOCAB_SIZE)
    np.testing.assert_allclose(got_logits, logits[:, -1:], atol=ATOL, rtol=RTOL)
    for got, want in zip(got_presents, presents, strict=True):
        np.testing.assert_array_equal(got, want)
    if to_keep:  # a verify step's every position: the same logits as without the pass
        seq = feeds["input_ids"].shape[1]
        every, *_ = ort_outputs(model, {**feeds, "logits_to_keep": np.array([seq], np.int64)})
        np.testing.assert_allclose(every, logits, atol=ATOL, rtol=RTOL)
    assert not LastPositionLogits(to_keep=to_keep)(model).modified


@pytest.mark.parametrize("target", ["ort-cpu", "ort-cuda", "onnx", "tensorrt"])
def test_logits_all_leaves_the_pass_out_of_every_target(target: str) -> None:
    from kvforge.passes.pipeline import phases

    def heads(logits: str) -> list[bool]:
        """`to_keep` of each LastPositionLogits in the target's pipeline."""
        made = phases(TARGETS[target], capacity=64, logits=logits)
        return [p.to_keep for _, passes in made for p in passes if isinstance(p, LastPositionLogits)]

    def names(logits: str) -> list[str]:
        made = phases(TARGETS[target], capacity=64, logits=logits)
        return [type(p).__name__ for _, passes in made for p in passes]

    assert heads("last") == [False]
    assert names("all") == [n for n in names("last") if n != "LastPositionLogits"]
    if TARGETS[target].logits_to_keep:
        assert heads("keep") == [True] and names("keep") == names("last")
    else:  # tensorrt: its parser would read the input's default as a constant
        with pytest.raises(ValueError, match="no logits_to_keep input"):
            phases(TARGETS[target], capacity=64, logits="keep")
    with pytest.raises(ValueError, match="logits must be one of"):
        phases(TARGETS[target], capacity=64, logits="first")
