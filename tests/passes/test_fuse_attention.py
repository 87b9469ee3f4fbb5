"""Attention with its KV cache: the portable fusion, onnxruntime's GroupQueryAttention, the past length.

Inline graphs in the form torch.onnx writes (cache Concat, grouped-query repeat, explicit bool mask built
from `attention_mask` and the past length), then the canonicalized graphs of tiny checkpoints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.fuse_attention import PastLengthFromMask, attention_fusion, attention_lowering_ort
from kvforge.passes.rewrite import FusionPass
from kvforge.passes.targets import TARGETS
from tests.passes.fusion_testing import canonical_graph, check_modified_is_exact, op_count, ort_outputs
from tests.tiny import VOCAB_SIZE

B, H, HKV, D = 2, 4, 2, 16
SCALE = 0.3  # not 1/sqrt(D): the attribute must survive every rewrite
# float32, fused against unfused.
ATOL, RTOL = 1e-5, 1e-4
MS = "com.microsoft"
PAST_K, PAST_V = "past_key_values.0.key", "past_key_values.0.value"
PRESENT_K, PRESENT_V = "present.0.key", "present.0.value"


@dataclass(frozen=True)
class Layout:
    """One attention layer's shape and spelling; each field off its default makes a look-alike."""

    heads: int = H
    kv_heads: int = HKV
    query_head_dim: int = D
    repeat: str | None = "interleave"  # HF's repeat_kv (Unsqueeze at 2); "tile" unsqueezes at 1; None: MHA
    repeated_heads: int | None = None  # what the repeat's Reshape gives; None: `heads`
    concat_axis: int = -2
    is_causal: int = 0
    float_mask: bool = False  # an additive float mask instead of the bool one
    softcap: float = 0.0


def ints(name: str, values: Sequence[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64), name))


def scalar(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64), name))


def mask_nodes() -> list[onnx.NodeProto]:
    """bool mask [batch, 1, seq, total]: causal from the past length, padding from `attention_mask`.

    The past length is read as the exporter reads it, `Shape(past, start=2, end=3)`."""
    return [
        helper.make_node("Shape", [PAST_K], ["past_len"], start=2, end=3),
        helper.make_node("Shape", ["input_ids"], ["seq_len"], start=1, end=2),
        helper.make_node("Add", ["past_len", "seq_len"], ["total_len"]),
        helper.make_node("Squeeze", ["past_len"], ["past_s"]),
        helper.make_node("Squeeze", ["total_len"], ["total_s"]),
        scalar("zero", 0),
        scalar("one", 1),
        helper.make_node("Range", ["zero", "total_s", "one"], ["key_pos"]),
        helper.make_node("Range", ["past_s", "total_s", "one"], ["query_pos"]),
        ints("axis0", [0]),
        ints("axis1", [1]),
        ints("axes12", [1, 2]),
        helper.make_node("Unsqueeze", ["key_pos", "axis0"], ["key_row"]),
        helper.make_node("Unsqueeze", ["query_pos", "axis1"], ["query_col"]),
        helper.make_node("LessOrEqual", ["key_row", "query_col"], ["causal"]),
        helper.make_node("Cast", ["attention_mask"], ["valid"], to=TensorProto.BOOL),
        helper.make_node("Unsqueeze", ["valid", "axes12"], ["valid4"]),
        helper.make_node("And", ["valid4", "causal"], ["mask"]),
    ]


def repeat_nodes(layout: Layout, present: str, out: str) -> list[onnx.NodeProto]:
    """HF's repeat_kv as torch.onnx writes it: [B, Hkv, T, D] -> Unsqueeze -> Expand -> Reshape [B, H, T, D]."""
    heads = layout.repeated_heads if layout.repeated_heads is not None else layout.heads
    group = max(heads // layout.kv_heads, 1)
    axis = 2 if layout.repeat == "interleave" else 1
    expand = [1, 1, group, 1, 1] if axis == 2 else [1, group, 1, 1, 1]
    return [
        ints(f"{out}_axis", [axis]),
        ints(f"{out}_expand", expand),
        ints(f"{out}_shape", [0, heads, -1, D]),
        helper.make_node("Unsqueeze", [present, f"{out}_axis"], [f"{out}_5d"]),
        helper.make_node("Expand", [f"{out}_5d", f"{out}_expand"], [f"{out}_grouped"]),
        helper.make_node("Reshape", [f"{out}_grouped", f"{out}_shape"], [out], allowzero=0),
    ]


def tensor(name: str, shape: Sequence[int | str], dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(shape))


def cached_attention_graph(layout: Layout = Layout()) -> ir.Model:
    """One layer: present = Concat(past, new), y = Attention(q, repeat(present_k), repeat(present_v), mask).

    q, k, v are graph inputs, so the graph is the attention of a decoder layer and nothing else."""
    heads, kv_heads = layout.heads, layout.kv_heads
    kv: list[int | str] = ["batch", kv_heads, "seq", D]
    nodes = mask_nodes()
    value_info = [tensor("mask", ["batch", 1, "seq", "total"], TensorProto.BOOL)]
    mask = "mask"
    if layout.float_mask:
        nodes += [
            helper.make_node("Constant", [], ["f_zero"], value=numpy_helper.from_array(np.array(0.0, np.float32))),
            helper.make_node("Constant", [], ["f_min"], value=numpy_helper.from_array(np.array(-1e9, np.float32))),
            helper.make_node("Where", ["mask", "f_zero", "f_min"], ["bias"]),
        ]
        value_info.append(tensor("bias", ["batch", 1, "seq", "total"]))
        mask = "bias"
    nodes += [
        helper.make_node("Concat", [PAST_K, "k"], [PRESENT_K], axis=layout.concat_axis),
        helper.make_node("Concat", [PAST_V, "v"], [PRESENT_V], axis=layout.concat_axis),
    ]
    keys, values = PRESENT_K, PRESENT_V
    if layout.repeat is not None:
        nodes += repeat_nodes(layout, PRESENT_K, "k_all") + repeat_nodes(layout, PRESENT_V, "v_all")
        repeated = layout.repeated_heads if layout.repeated_heads is not None else heads
        value_info += [tensor(name, ["batch", repeated, "total", D]) for name in ("k_all", "v_all")]
        keys, values = "k_all", "v_all"
    nodes.append(
        helper.make_node(
            "Attention",
            ["q", keys, values, mask],
            ["y"],
            scale=SCALE,
            is_causal=layout.is_causal,
            softcap=layout.softcap,
        )
    )
    outputs = [
        tensor("y", ["batch", heads, "seq", D]),
        tensor(PRESENT_K, ["batch", kv_heads, "total", D]),
        tensor(PRESENT_V, ["batch", kv_heads, "total", D]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [
            tensor("input_ids", ["batch", "seq"], TensorProto.INT64),
            tensor("attention_mask", ["batch", "total"], TensorProto.INT64),
            tensor("q", ["batch", heads, "seq", layout.query_head_dim]),
            tensor("k", kv),
            tensor("v", kv),
            tensor(PAST_K, ["batch", kv_heads, "past", D]),
            tensor(PAST_V, ["batch", kv_heads, "past", D]),
        ],
        outputs,
        value_info=value_info,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    proto.ir_version = 10
    return ir.from_proto(proto)


def with_nodes(model: ir.Model, nodes: Sequence[onnx.NodeProto], outputs: Sequence[onnx.ValueInfoProto]) -> ir.Model:
    """A copy of `model` with `nodes` appended and `outputs` added to the graph outputs."""
    proto = ir.to_proto(model)
    proto.graph.node.extend(nodes)
    proto.graph.output.extend(outputs)
    return ir.from_proto(proto)


def with_qk_output(model: ir.Model, read_by_node: bool) -> ir.Model:
    """A copy of `model` whose one Attention also yields its QK product (output 3), read by a node
    (whose result is a graph output) or itself a graph output."""
    proto = ir.to_proto(model)
    (attention,) = [n for n in proto.graph.node if n.op_type == "Attention"]
    attention.output.extend([""] * (3 - len(attention.output)) + ["qk"])
    if read_by_node:
        proto.graph.node.append(helper.make_node("ReduceMax", ["qk"], ["qk_max"], keepdims=0))
        proto.graph.output.append(tensor("qk_max", []))
    else:
        proto.graph.output.append(tensor("qk", ["batch", "heads", "seq", "total"]))
    return ir.from_proto(proto)


def fresh(model: ir.Model) -> ir.Model:
    """An independent copy, so a pass can run on one and the reference on the other."""
    return ir.from_proto(ir.to_proto(model))


def attention_feeds(
    seq: int, past: int, padding: Sequence[int] = (0, 2), layout: Layout = Layout(), seed: int = 0
) -> dict[str, np.ndarray]:
    """Random q/k/v/cache for batch len(padding); row i's first padding[i] positions are left padding."""
    rng = np.random.default_rng(seed)
    batch = len(padding)
    mask = np.ones((batch, past + seq), np.int64)
    for row, pad in enumerate(padding):
        mask[row, :pad] = 0

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    return {
        "input_ids": rng.integers(3, 100, (batch, seq), dtype=np.int64),
        "attention_mask": mask,
        "q": normal(batch, layout.heads, seq, layout.query_head_dim),
        "k": normal(batch, layout.kv_heads, seq, D),
        "v": normal(batch, layout.kv_heads, seq, D),
        PAST_K: normal(batch, layout.kv_heads, past, D),
        PAST_V: normal(batch, layout.kv_heads, past, D),
    }


PREFILL: dict[str, Any] = dict(seq=4, past=0)  # batch 2, row 1 left-padded by 2
DECODE: dict[str, Any] = dict(seq=1, past=5)
CONTINUE: dict[str, Any] = dict(seq=3, past=4, padding=(2,))  # batch 1: 3 more prompt tokens after a cached prefix


def assert_same_attention(got: Sequence[np.ndarray], want: Sequence[np.ndarray], feeds: dict[str, np.ndarray]) -> None:
    """y, present_k, present_v equal, except y at left-padding query positions.

    A padded query sees no key at all; what a kernel writes there is its own choice (the standard op
    writes zeros, GroupQueryAttention may not) and nothing reads it: it is never sampled, and later
    queries mask it out as a key. It must still be finite, or masking it out would give NaN."""
    seq = feeds["q"].shape[2]
    padded = feeds["attention_mask"][:, -seq:] == 0  # [batch, seq]
    y, want_y = (np.where(padded[:, None, :, None], 0.0, a) for a in (got[0], want[0]))
    assert np.isfinite(got[0]).all()
    np.testing.assert_allclose(y, want_y, atol=ATOL, rtol=RTOL)
    assert len(got) == len(want)
    for actual, reference in zip(got[1:], want[1:]):
        np.testing.assert_allclose(actual, reference, atol=ATOL, rtol=RTOL)


def attention_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type in ("Attention", "GroupQueryAttention")]


def input_names(node: ir.Node) -> list[str | None]:
    return [v.name if v is not None else None for v in node.inputs]


# --- AttentionWithCache: Concat + repeat + Attention -> Attention with past/present ----------------------------


@pytest.mark.parametrize(
    ("layout", "rule"),
    [(Layout(), "attention_gqa_cache"), (Layout(heads=HKV, repeat=None), "attention_mha_cache")],
    ids=["gqa", "mha"],
)
def test_cache_update_and_repeat_move_into_attention(layout: Layout, rule: str) -> None:
    model = cached_attention_graph(layout)
    reference = fresh(model)
    fusion = attention_fusion()
    assert fusion(model).modified
    assert fusion.counts == {"attention_gqa_cache": 0, "attention_mha_cache": 0} | {rule: 1}

    (node,) = attention_nodes(model)
    assert (node.domain, node.op_type) == ("", "Attention")
    assert input_names(node) == ["q", "k", "v", "mask", PAST_K, PAST_V]
    assert list(node.outputs) == list(model.graph.outputs)  # y, present.0.key, present.0.value
    assert node.attributes.get_float("scale") == pytest.approx(SCALE)
    assert node.attributes.get_int("is_causal") == 0
    assert op_count(model, "Concat") == op_count(model, "Expand") == op_count(model, "Reshape") == 0

    for case in (PREFILL, DECODE, CONTINUE):
        feeds = attention_feeds(**case, layout=layout)
        assert_same_attention(ort_outputs(model, feeds), ort_outputs(reference, feeds), feeds)
    check_modified_is_exact(attention_fusion(), cached_attention_graph(layout))


def test_grouped_heads_follow_repeat_kv_order() -> None:
    """Query head h reads KV head h // (H / Hkv), as HF's repeat_kv lays them out, before and after."""
    model = cached_attention_graph()
    attention_fusion()(model)
    feeds = attention_feeds(**DECODE, padding=(0, 0))
    keys = np.repeat(np.concatenate([feeds[PAST_K], feeds["k"]], axis=2), H // HKV, axis=1)
    values = np.repeat(np.concatenate([feeds[PAST_V], feeds["v"]], axis=2), H // HKV, axis=1)
    scores = SCALE * feeds["q"] @ keys.transpose(0, 1, 3, 2)  # one query: every cached key is visible
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = (weights / weights.sum(axis=-1, keepdims=True)) @ values
    np.testing.assert_allclose(ort_outputs(model, feeds)[0], expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    ("model", "rule", "reason"),
    [
        (cached_attention_graph(Layout(is_causal=1)), "attention_gqa_cache", "is_causal=1"),
        (
            cached_attention_graph(Layout(query_head_dim=8)),
            "attention_gqa_cache",
            "query head size 8 differs from key head size 16",
        ),
        (
            cached_attention_graph(Layout(heads=3)),
            "attention_gqa_cache",
            "3 query heads are not a multiple of 2 KV heads",
        ),
        (cached_attention_graph(Layout(repeated_heads=2)), "attention_gqa_cache", "does not have 4 heads of size 16"),
        (cached_attention_graph(Layout(repeat="tile")), "attention_gqa_cache", "expected [2], got [1]"),
        (cached_attention_graph(Layout(concat_axis=1)), "attention_gqa_cache", "axis mismatch: expected -2, got 1"),
        (
            cached_attention_graph(Layout(repeat=None)),
            "attention_mha_cache",
            "4 query heads over 2 KV heads without a repeat",
        ),
        (
            with_qk_output(cached_attention_graph(), read_by_node=True),
            "attention_gqa_cache",
            "already has cache outputs in use",
        ),
    ],
    ids=[
        "is-causal",
        "head-size-mismatch",
        "heads-not-a-multiple",
        "repeat-gives-kv-heads",
        "tiled-repeat",
        "concat-on-heads",
        "mha-rule-on-gqa",
        "qk-output-read",
    ],
)
def test_attention_lookalikes_are_left_alone(model: ir.Model, rule: str, reason: str) -> None:
    nodes_before = len(model.graph)
    fusion = attention_fusion()
    check_modified_is_exact(fusion, model)
    assert sum(fusion.counts.values()) == 0
    assert len(model.graph) == nodes_before
    assert [len(n.inputs) for n in attention_nodes(model)] == [4]
    misses = fusion.explain(model)
    assert any(m.rule == rule and reason in m.reason for m in misses), misses


def test_attention_whose_qk_product_is_a_graph_output_is_left_alone() -> None:
    model = with_qk_output(cached_attention_graph(), read_by_node=False)
    fusion = attention_fusion()
    fusion(model)
    assert sum(fusion.counts.values()) == 0


# --- AttentionToGroupQueryAttention: Attention with cache -> com.microsoft.GroupQueryAttention -----------------


def lowered(layout: Layout = Layout()) -> tuple[ir.Model, ir.Model, FusionPass]:
    """(the original graph, the same graph fused and lowered, the lowering pass that ran)."""
    model = cached_attention_graph(layout)
    reference = fresh(model)
    attention_fusion()(model)
    lowering = attention_lowering_ort()
    lowering(model)
    return reference, model, lowering


@pytest.mark.parametrize(
    "layout",
    [Layout(), Layout(heads=HKV, repeat=None), Layout(float_mask=True), Layout(softcap=2.0)],
    ids=["gqa", "mha", "float-mask", "softcap"],
)
def test_attention_becomes_group_query_attention(layout: Layout) -> None:
    reference, model, lowering = lowered(layout)
    assert lowering.counts["group_query_attention"] == 1
    assert op_count(model, "Attention") == 0 and op_count(model, "GroupQueryAttention", MS) == 1
    (node,) = attention_nodes(model)
    assert node.attributes.get_int("num_heads") == layout.heads
    assert node.attributes.get_int("kv_num_heads") == layout.kv_heads
    assert node.attributes.get_float("scale") == pytest.approx(SCALE)
    assert node.attributes.get_float("softcap", 0.0) == pytest.approx(layout.softcap)
    assert input_names(node)[3:5] == [PAST_K, PAST_V]
    assert list(node.outputs[1:]) == list(model.graph.outputs[1:])
    bias = node.inputs[10]
    assert bias is not None
    if layout.float_mask:  # an additive mask is the bias as it is
        assert bias.name == "bias"
    else:  # a bool mask becomes 0 where attended and the lowest float elsewhere
        producer = bias.producer()
        assert producer is not None and producer.op_type == "Where" and input_names(producer)[0] == "mask"
    for case in (PREFILL, DECODE, CONTINUE):
        feeds = attention_feeds(**case, layout=layout)
        feeds["q"] *= 3.0  # scores of a few units, so that a softcap changes them
        assert_same_attention(ort_outputs(model, feeds), ort_outputs(reference, feeds), feeds)
    check_modified_is_exact(attention_lowering_ort(), model)


@pytest.mark.xfail(
    strict=True,
    raises=ort.capi.onnxruntime_pybind11_state.InvalidArgument,
    reason="LIMITATION: onnxruntime's GroupQueryAttention refuses batch > 1 with seq > 1 and a non-empty past "
    "('batch_size must be 1 when sequence_length > 1 and past context is given'), which the contract and "
    "the standard Attention graph allow; the lowering does not (cannot statically) exclude it",
)
def test_lowered_attention_continues_a_cached_batch() -> None:
    reference, model, _ = lowered()
    feeds = attention_feeds(seq=3, past=4)
    assert_same_attention(ort_outputs(model, feeds), ort_outputs(reference, feeds), feeds)


def test_causal_attention_is_not_lowered() -> None:
    """GroupQueryAttention takes the mask as a bias here; an is_causal Attention has nothing to give it."""
    model = cached_attention_graph()
    attention_fusion()(model)
    (node,) = attention_nodes(model)
    node.attributes["is_causal"] = ir.AttrInt64("is_causal", 1)
    lowering = attention_lowering_ort()
    check_modified_is_exact(lowering, model)
    assert lowering.counts["group_query_attention"] == 0 and op_count(model, "Attention") == 1
    assert any("is_causal=1" in m.reason for m in lowering.explain(model))


def test_attention_whose_qk_product_is_read_is_not_lowered() -> None:
    fused = cached_attention_graph()
    attention_fusion()(fused)
    model = with_qk_output(fused, read_by_node=True)
    feeds = attention_feeds(**DECODE)
    expected = ort_outputs(model, feeds)
    lowering = attention_lowering_ort()
    check_modified_is_exact(lowering, model)
    assert lowering.counts["group_query_attention"] == 0 and op_count(model, "GroupQueryAttention", MS) == 0
    assert any("the QK product output is used" in m.reason for m in lowering.explain(model))
    for got, want in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_array_equal(got, want)


def test_attention_whose_qk_product_is_a_graph_output_is_not_lowered() -> None:
    fused = cached_attention_graph()
    attention_fusion()(fused)
    model = with_qk_output(fused, read_by_node=False)
    lowering = attention_lowering_ort()
    lowering(model)
    assert lowering.counts["group_query_attention"] == 0


# --- the shared KV buffer: past and present are one preallocated array -----------------------------------------

CAPACITY = 16  # positions in the shared buffer, more than the 7 the four steps below fill


def session(model: ir.Model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_in_place(
    sess: ort.InferenceSession, feeds: dict[str, np.ndarray], first_output: str, cache: dict[str, str]
) -> np.ndarray:
    """Run with each past input (key of `cache`) bound as its present output (value) too, as
    `kvforge.runners.session.OrtSession` does; returns `first_output`, the cache arrays are written in place."""
    binding = sess.io_binding()
    for name, array in feeds.items():
        binding.bind_cpu_input(name, array)
    binding.bind_output(first_output, "cpu")
    for past, present in cache.items():
        buffer = feeds[past]
        binding.bind_output(present, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
    sess.run_with_iobinding(binding)
    return np.asarray(binding.get_outputs()[0].numpy())


def shared_mode_graph() -> tuple[ir.Model, ir.Model]:
    """(the original graph, the graph for the shared KV mode: fused, past length from the mask, lowered)."""
    model = cached_attention_graph()
    reference = fresh(model)
    attention_fusion()(model)
    assert PastLengthFromMask()(model).modified
    assert attention_lowering_ort()(model).modified
    return reference, model


def test_shared_buffer_decode_equals_concat_decode() -> None:
    """A prefill of 4 then 3 one-token steps, batch 2 with row 1 left-padded: the output of every step and
    the filled part of the buffer equal what the original graph gives with a growing, concatenated cache."""
    reference, model = shared_mode_graph()
    sess = session(model)
    buffers = {name: np.zeros((B, HKV, CAPACITY, D), np.float32) for name in (PAST_K, PAST_V)}
    cache = {PAST_K: PRESENT_K, PAST_V: PRESENT_V}
    past = 0
    concat = {name: np.zeros((B, HKV, 0, D), np.float32) for name in (PAST_K, PAST_V)}
    for step, seq in enumerate((4, 1, 1, 1)):
        feeds = attention_feeds(seq, past, seed=step)  # the mask grows by a 1 per step; row 1 keeps its padding
        want = ort_outputs(reference, feeds | concat)
        y = run_in_place(sess, feeds | buffers, "y", cache)
        total = past + seq
        assert_same_attention([y, buffers[PAST_K][:, :, :total], buffers[PAST_V][:, :, :total]], want, feeds)
        assert not any(buffer[:, :, total:].any() for buffer in buffers.values()), "wrote past the filled positions"
        concat = {PAST_K: want[1], PAST_V: want[2]}
        past = total


def test_shared_buffer_needs_the_past_length_from_the_mask() -> None:
    """Without PastLengthFromMask the graph takes the buffer's capacity for the past length."""
    model = cached_attention_graph()
    attention_fusion()(model)
    attention_lowering_ort()(model)
    feeds = attention_feeds(**PREFILL)
    buffers = {name: np.zeros((B, HKV, CAPACITY, D), np.float32) for name in (PAST_K, PAST_V)}
    with pytest.raises(RuntimeError, match="broadcast"):  # a [.., 4, 20] causal mask against 4 mask positions
        run_in_place(session(model), feeds | buffers, "y", {PAST_K: PRESENT_K, PAST_V: PRESENT_V})


# --- PastLengthFromMask ------------------------------------------------------------------------------------------


def shape_reads_graph() -> ir.Model:
    """The GQA graph with more reads of the inputs' shapes, each feeding an output: the past length of the
    value cache (rewritten), the batch (kept), and `start=2, end=3` reads of the 2-D `attention_mask` and
    `input_ids`, which are empty and must stay so (kept)."""
    reads = [
        helper.make_node("Shape", [PAST_V], ["value_past"], start=2, end=3),
        helper.make_node("Shape", [PAST_K], ["batch_read"], start=0, end=1),
        helper.make_node("Shape", ["attention_mask"], ["mask_tail"], start=2, end=3),
        helper.make_node("Shape", ["input_ids"], ["ids_tail"], start=2, end=3),
        helper.make_node("Concat", ["value_past", "batch_read", "mask_tail", "ids_tail"], ["shape_reads"], axis=0),
    ]
    return with_nodes(cached_attention_graph(), reads, [tensor("shape_reads", [2], TensorProto.INT64)])


ShapeRead = tuple[str, int, int | None]  # (input, start, end)


def shape_reads(model: ir.Model) -> list[ShapeRead]:
    """(input, start, end) of every Shape node."""
    return [
        (input_names(n)[0] or "", n.attributes.get_int("start", 0), n.attributes.get_int("end", None))
        for n in model.graph
        if n.op_type == "Shape"
    ]


def test_past_length_reads_come_from_the_mask() -> None:
    model = shape_reads_graph()
    reference = fresh(model)
    before = Counter(shape_reads(model))
    rewritten = Counter[ShapeRead]([(PAST_K, 2, 3), (PAST_V, 2, 3)])
    assert before & rewritten == rewritten

    assert PastLengthFromMask()(model).modified
    inserted = Counter[ShapeRead]({("attention_mask", 1, 2): 2, ("input_ids", 1, 2): 2})  # total - seq, once per read
    assert Counter(shape_reads(model)) == before - rewritten + inserted
    assert op_count(model, "Sub") == 2
    for case in (PREFILL, DECODE):
        feeds = attention_feeds(**case)
        got, want = ort_outputs(model, feeds), ort_outputs(reference, feeds)
        np.testing.assert_array_equal(got[3], [case["past"], B])
        np.testing.assert_array_equal(got[3], want[3])
        assert_same_attention(got[:3], want[:3], feeds)
    assert not PastLengthFromMask()(model).modified


def test_past_length_pass_with_nothing_to_rewrite_reports_false() -> None:
    model = cached_attention_graph()
    nodes = len(model.graph)
    assert not PastLengthFromMask(mask_input="padding_mask")(model).modified  # no such input: nothing to read
    assert len(model.graph) == nodes and (PAST_K, 2, 3) in shape_reads(model)
    batch_read = helper.make_node("Shape", [PAST_V], ["batch_read"], start=0, end=1)
    model = with_nodes(model, [batch_read], [tensor("batch_read", [1], TensorProto.INT64)])
    assert PastLengthFromMask()(model).modified
    nodes = len(model.graph)
    assert not PastLengthFromMask()(model).modified  # only the batch read of a past input is left
    assert len(model.graph) == nodes and (PAST_V, 0, 1) in shape_reads(model)


def test_past_length_pass_leaves_other_4d_inputs_alone() -> None:
    model = with_nodes(
        cached_attention_graph(),
        [
            helper.make_node("Shape", ["q"], ["query_seq"], start=2, end=3),
            helper.make_node("Identity", ["query_seq"], ["query_len"]),
        ],
        [tensor("query_len", [1], TensorProto.INT64)],
    )
    PastLengthFromMask()(model)
    feeds = attention_feeds(**DECODE)
    np.testing.assert_array_equal(ort_outputs(model, feeds)[3], [1])


def test_past_length_read_that_is_a_graph_output() -> None:
    model = with_nodes(
        cached_attention_graph(),
        [helper.make_node("Shape", [PAST_V], ["past_length"], start=2, end=3)],
        [tensor("past_length", [1], TensorProto.INT64)],
    )
    assert PastLengthFromMask()(model).modified
    feeds = attention_feeds(**DECODE)
    np.testing.assert_array_equal(ort_outputs(model, feeds)[3], [DECODE["past"]])


# --- the canonicalized graphs of tiny checkpoints -------------------------------------------------------------

LAYERS = 2  # every tiny checkpoint (tests.tiny): 4 query heads over 2 KV heads, except gpt2's 4 over 4
FUSED_BY = {
    "llama": "attention_gqa_cache",
    "qwen3": "attention_gqa_cache",
    "phi3": "attention_gqa_cache",
    "gpt2": "attention_mha_cache",
}


def cache_names(model: ir.Model) -> dict[str, str]:
    """past input -> present output, by the contract's names."""
    pasts = [v.name for v in model.graph.inputs if v.name and v.name.startswith("past_key_values.")]
    return {past: past.replace("past_key_values.", "present.") for past in pasts}


def kv_dims(model: ir.Model) -> dict[str, tuple[int, int]]:
    """past input -> (kv heads, head size), static in every canonical graph."""
    dims = {}
    for value in model.graph.inputs:
        if value.name in cache_names(model):
            assert value.shape is not None
            heads, head_dim = value.shape[1], value.shape[3]
            assert isinstance(heads, int) and isinstance(head_dim, int)
            dims[value.name] = (heads, head_dim)
    return dims


def decoder_feeds(
    model: ir.Model, mask: np.ndarray, seq: int, cache: dict[str, np.ndarray] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds for the last `seq` positions of `mask` [batch, total]; positions count only attended slots,
    as HF's generate numbers a left-padded row. Without `cache`, a random past of total - seq positions."""
    rng = np.random.default_rng(seed)
    batch, total = mask.shape
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -seq:]
    feeds = {
        "input_ids": rng.integers(3, VOCAB_SIZE, (batch, seq), dtype=np.int64),
        "attention_mask": mask,
        "position_ids": positions,
    }
    if cache is None:
        for name, (heads, head_dim) in kv_dims(model).items():
            feeds[name] = rng.standard_normal((batch, heads, total - seq, head_dim)).astype(np.float32)
    else:
        feeds |= cache
    return {v.name: feeds[v.name] for v in model.graph.inputs if v.name}


def left_padded_mask(total: int, padding: int = 2) -> np.ndarray:
    mask = np.ones((B, total), np.int64)
    mask[1, :padding] = 0
    return mask


def assert_all_close(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> None:
    assert len(got) == len(want)
    for actual, reference in zip(got, want):
        np.testing.assert_allclose(actual, reference, atol=ATOL, rtol=RTOL)


# (mask, seq): a left-padded prefill, a decode step, and batch 1 continuing a cached prompt by 3 tokens
DECODER_CASES = [(left_padded_mask(4), 4), (left_padded_mask(6), 1), (np.ones((1, 7), np.int64), 3)]


@pytest.mark.slow  # exports each tiny checkpoint once per session (shared with the other fusion tests)
@pytest.mark.parametrize("arch", list(FUSED_BY))
def test_tiny_decoders_fuse_and_lower_every_layer(arch: str, scratch: Path) -> None:
    model = canonical_graph(arch, scratch)
    cases = [decoder_feeds(model, mask, seq) for mask, seq in DECODER_CASES]
    expected = [ort_outputs(model, feeds) for feeds in cases]

    fusion = attention_fusion()
    assert fusion(model).modified
    assert fusion.counts == {"attention_gqa_cache": 0, "attention_mha_cache": 0} | {FUSED_BY[arch]: LAYERS}
    assert [(len(n.inputs), len(n.outputs)) for n in attention_nodes(model)] == [(6, 3)] * LAYERS
    past_inputs = set(cache_names(model))
    assert not any(n.op_type == "Concat" and set(input_names(n)) & past_inputs for n in model.graph)
    for feeds, want in zip(cases, expected):
        assert_all_close(ort_outputs(model, feeds), want)
    check_modified_is_exact(attention_fusion(), model)

    lowering = attention_lowering_ort()
    assert lowering(model).modified
    assert lowering.counts["group_query_attention"] == LAYERS
    assert op_count(model, "GroupQueryAttention", MS) == LAYERS and op_count(model, "Attention") == 0
    for feeds, want in zip(cases, expected):
        assert_all_close(ort_outputs(model, feeds), want)
    check_modified_is_exact(attention_lowering_ort(), model)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "phi3", "qwen3", "gemma3_text"])
def test_ort_cpu_pipeline_leaves_no_activation_transpose(arch: str, scratch: Path) -> None:
    """Rotary on [B,S,H*D] feeding GroupQueryAttention, and its output taken without the heads round trip:
    no Transpose is left (weights are stored as their MatMuls read them), and the outputs are unchanged.
    qwen3 normalizes each query and key head before the heads move ahead of the positions, gemma3 after:
    the norm is taken on [B,S,H,D] either way."""
    from kvforge.passes.pipeline import run

    model = canonical_graph(arch, scratch)
    cases = [decoder_feeds(model, mask, seq) for mask, seq in DECODER_CASES]
    expected = [ort_outputs(model, feeds) for feeds in cases]
    report = run(model, TARGETS["ort-cpu"], logits="last")
    lowering = next(r for r in report.passes if r.name == "attention_ort")
    assert lowering.fusions == {"group_query_attention": LAYERS, "group_query_attention_output": LAYERS}
    assert op_count(model, "Transpose") == 0
    assert op_count(model, "RotaryEmbedding") == 2 * LAYERS
    assert all(len(n.inputs[0].shape or ()) == 3 for n in model.graph if n.op_type == "RotaryEmbedding")
    head_norms = [n for n in model.graph if n.op_type == "RMSNormalization" and len(n.inputs[0].shape or ()) == 4]
    assert len(head_norms) == (2 * LAYERS if arch in ("qwen3", "gemma3_text") else 0)
    assert all(n.inputs[0].producer().op_type == "Reshape" for n in head_norms)  # [B,S,H,D], the heads in place
    for feeds, want in zip(cases, expected):
        got = ort_outputs(model, feeds)
        np.testing.assert_allclose(got[0], want[0][:, -1:], atol=ATOL, rtol=RTOL)  # logits: last position
        assert_all_close(got[1:], want[1:])


@pytest.mark.slow
def test_eager_attention_has_nothing_to_fuse_and_says_why(scratch: Path) -> None:
    """gemma2 (softcapped scores) is exported with eager attention: MatMul / Softmax, no Attention op."""
    model = canonical_graph("gemma2", scratch)
    assert op_count(model, "Attention") == 0 and op_count(model, "Softmax") == LAYERS
    for make in (attention_fusion, attention_lowering_ort):
        fusion = make()
        check_modified_is_exact(fusion, model)
        assert sum(fusion.counts.values()) == 0
        misses = fusion.explain(model)
        assert [m.rule for m in misses] == list(fusion.counts)
        starts = [m for m in misses if m.rule != "group_query_attention_output"]  # that one starts at any Reshape
        assert all(m.reason == "no node in the graph starts this pattern" for m in starts), misses


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_decoder_in_a_shared_buffer_equals_concat(arch: str, scratch: Path) -> None:
    """The ort-cpu attention passes, then a prefill of 4 and 3 decode steps writing into one buffer per
    past/present pair: logits and the filled buffer equal the canonical graph's with a concatenated cache."""
    reference = canonical_graph(arch, scratch)
    model = canonical_graph(arch, scratch)
    attention_fusion()(model)
    assert PastLengthFromMask()(model).modified
    assert attention_lowering_ort()(model).modified
    sess = session(model)
    names = cache_names(model)
    dims = kv_dims(model)
    buffers = {name: np.zeros((B, heads, CAPACITY, size), np.float32) for name, (heads, size) in dims.items()}
    concat = {name: np.zeros((B, heads, 0, size), np.float32) for name, (heads, size) in dims.items()}
    total = 0
    for step, seq in enumerate((4, 1, 1, 1)):
        total += seq
        mask = left_padded_mask(total)
        feeds = decoder_feeds(reference, mask, seq, cache=concat, seed=step)
        logits, *presents = ort_outputs(reference, feeds)
        got = run_in_place(sess, feeds | buffers, "logits", names)
        assert_all_close([got], [logits])
        assert_all_close([buffers[past][:, :, :total] for past in names], presents)
        concat = dict(zip(names, presents))
