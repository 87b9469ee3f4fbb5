"""Rotary fusion: inline graphs for each form (full, partial, misses), then every tiny architecture."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_ir.passes import common

from kvforge.passes.fuse_rotary import rotary_fusion
from tests.passes.fusion_testing import canonical_graph, check_modified_is_exact, decoder_feeds, op_count, ort_outputs

FP32 = dict(rtol=1e-4, atol=1e-5)
INT64_MAX = 2**63 - 1
BATCH, HEADS, SEQ = 2, 2, 3


def rotary_graph(
    head_dim: int = 8, rotary_dim: int = 8, split: int | None = None, table_batch: str = "batch"
) -> ir.Model:
    """y = rotate(x) and z = rotate(k), sharing one cos/sin table, as the exporter writes them.

    `rotary_dim < head_dim` rotates only x[..., :rotary_dim] (phi3, gpt_neox); `split` moves the
    rotate_half boundary off the middle (not rotary any more); `table_batch="one"` gives freqs
    a batch of 1 that the decomposed Mul broadcasts and RotaryEmbedding would not.
    """
    half = split if split is not None else rotary_dim // 2
    ints = {
        "zero": [0],
        "half": [half],
        "rot": [rotary_dim],
        "end": [INT64_MAX],
        "last": [3],
        "one": [1],
    }
    nodes = [
        helper.make_node("Concat", ["freqs", "freqs"], ["table"], axis=-1),
        helper.make_node("Cos", ["table"], ["cos"]),
        helper.make_node("Sin", ["table"], ["sin"]),
        helper.make_node("Unsqueeze", ["cos", "one"], ["cos4"]),
        helper.make_node("Unsqueeze", ["sin", "one"], ["sin4"]),
    ]
    for name, out in (("x", "y"), ("k", "z")):
        rotated = name
        if rotary_dim < head_dim:
            rotated = f"{name}_rot"
            nodes.append(helper.make_node("Slice", [name, "zero", "rot", "last", "one"], [rotated]))
        nodes += [
            helper.make_node("Mul", [rotated, "cos4"], [f"{name}_cos"]),
            helper.make_node("Slice", [rotated, "zero", "half", "last", "one"], [f"{name}_lo"]),
            helper.make_node("Slice", [rotated, "half", "end", "last", "one"], [f"{name}_hi"]),
            helper.make_node("Neg", [f"{name}_hi"], [f"{name}_neg"]),
            helper.make_node("Concat", [f"{name}_neg", f"{name}_lo"], [f"{name}_turned"], axis=-1),
            helper.make_node("Mul", [f"{name}_turned", "sin4"], [f"{name}_sin"]),
            helper.make_node("Add", [f"{name}_cos", f"{name}_sin"], [out if rotary_dim == head_dim else f"{name}_y"]),
        ]
        if rotary_dim < head_dim:
            nodes += [
                helper.make_node("Slice", [name, "rot", "end", "last", "one"], [f"{name}_pass"]),
                helper.make_node("Concat", [f"{name}_y", f"{name}_pass"], [out], axis=-1),
            ]
    head = ["batch", HEADS, "seq", head_dim]
    graph = helper.make_graph(
        nodes,
        "rotary",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, head),
            helper.make_tensor_value_info("k", TensorProto.FLOAT, head),
            helper.make_tensor_value_info("freqs", TensorProto.FLOAT, [table_batch, "seq", rotary_dim // 2]),
        ],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, head) for o in ("y", "z")],
        initializer=[numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def rotary_feeds(head_dim: int = 8, rotary_dim: int = 8, table_batch: int = BATCH) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    positions = np.arange(SEQ, dtype=np.float32)[None, :, None] + rng.integers(0, 9, (table_batch, 1, 1))
    inv_freq = 1.0 / 10000 ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)
    return {
        "x": rng.standard_normal((BATCH, HEADS, SEQ, head_dim)).astype(np.float32),
        "k": rng.standard_normal((BATCH, HEADS, SEQ, head_dim)).astype(np.float32),
        "freqs": (positions * inv_freq).astype(np.float32),
    }


@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "rule"),
    [(8, 8, "rotary"), (8, 4, "rotary_partial"), (16, 8, "rotary_partial")],
    ids=["full", "partial-half", "partial-16-8"],
)
def test_rotary_becomes_rotary_embedding_with_the_same_outputs(head_dim: int, rotary_dim: int, rule: str) -> None:
    model = rotary_graph(head_dim, rotary_dim)
    feeds = rotary_feeds(head_dim, rotary_dim)
    expected = ort_outputs(model, feeds)
    fusion = rotary_fusion()
    check_modified_is_exact(fusion, model)
    fused = rotary_graph(head_dim, rotary_dim)
    fusion(fused)
    assert fusion.counts == {"rotary_partial": 0, "rotary": 0, rule: 2}
    nodes = [n for n in fused.graph if n.op_type == "RotaryEmbedding"]
    assert len(nodes) == 2 and op_count(fused, "Neg") == 0 and op_count(fused, "Slice") == 0
    attributes = {"interleaved": 0} | ({"rotary_embedding_dim": rotary_dim} if rotary_dim < head_dim else {})
    assert all({k: a.value for k, a in n.attributes.items()} == attributes for n in nodes)
    for actual, reference in zip(ort_outputs(fused, feeds), expected):
        np.testing.assert_allclose(actual, reference, **FP32)
    common.CommonSubexpressionEliminationPass()(fused)
    common.RemoveUnusedNodesPass()(fused)
    assert op_count(fused, "Cos") == op_count(fused, "Sin") == 1  # one half-width table for q and k


@pytest.mark.parametrize(
    ("graph", "feeds", "reason"),
    [
        (lambda: rotary_graph(split=3), lambda: rotary_feeds(), "rotate_half does not split 8 channels at 4"),
        (
            lambda: rotary_graph(table_batch="one"),
            lambda: rotary_feeds(table_batch=1),
            "does not match the batch and seq",
        ),
    ],
    ids=["off-centre-split", "broadcast-table"],
)
def test_near_misses_are_left_alone_and_explained(
    graph: Callable[[], ir.Model], feeds: Callable[[], dict[str, np.ndarray]], reason: str
) -> None:
    model = graph()
    expected = ort_outputs(model, feeds())
    misses = rotary_fusion().explain(graph())
    assert any(m.rule == "rotary" and reason in m.reason for m in misses), misses
    model.graph.append(ir.node("Neg", [model.graph.inputs[0]]))  # dead code: a pass that fires nowhere keeps it
    before = len(model.graph)
    fusion = rotary_fusion()
    check_modified_is_exact(fusion, model)
    assert op_count(model, "RotaryEmbedding") == 0 and len(model.graph) == before
    for actual, reference in zip(ort_outputs(model, feeds()), expected):
        np.testing.assert_array_equal(actual, reference)


# Rotations per layer (q and k) by rule; gpt2 has learned positions.
ROTARY_PER_LAYER = {
    "llama": {"rotary": 2},
    "mistral": {"rotary": 2},
    "qwen2": {"rotary": 2},
    "qwen3": {"rotary": 2},
    "phi3": {"rotary_partial": 2},
    "gemma": {"rotary": 2},
    "gemma2": {"rotary": 2},
    "gpt_neox": {"rotary_partial": 2},
    "gpt2": {},
}


@pytest.mark.slow  # exports each tiny checkpoint once per session (shared with other fusion tests)
@pytest.mark.parametrize("model_type", list(ROTARY_PER_LAYER))
def test_every_rotation_of_a_tiny_decoder_fuses_without_changing_it(model_type: str, scratch: Path) -> None:
    model = canonical_graph(model_type, scratch)
    feeds = decoder_feeds(model)
    expected = ort_outputs(model, feeds)
    layers = sum(1 for v in model.graph.inputs if (v.name or "").endswith(".key"))
    fusion = rotary_fusion()
    fusion(model)
    per_layer = ROTARY_PER_LAYER[model_type]
    assert fusion.counts == {rule: per_layer.get(rule, 0) * layers for rule in ("rotary_partial", "rotary")}
    assert op_count(model, "RotaryEmbedding") == sum(fusion.counts.values())
    for actual, reference in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(actual, reference, **FP32)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "phi3", "gemma"])
def test_a_float16_decoder_fuses_its_rotations_with_tables_cast_from_float32(model_type: str, scratch: Path) -> None:
    """In float16, transformers computes cos/sin in float32 and casts them: Unsqueeze(Cast(Cos(...)))."""
    model = canonical_graph(model_type, scratch, "float16")
    feeds = decoder_feeds(model)
    expected = ort_outputs(model, feeds)
    layers = sum(1 for v in model.graph.inputs if (v.name or "").endswith(".key"))
    fusion = rotary_fusion()
    fusion(model)
    assert sum(fusion.counts.values()) == 2 * layers  # q and k of every layer
    for node in (n for n in model.graph if n.op_type == "RotaryEmbedding"):
        x, cos, sin = node.inputs
        assert x is not None and x.dtype == ir.DataType.FLOAT16
        casts = [t.producer() if t is not None else None for t in (cos, sin)]
        assert all(c is not None and c.op_type == "Cast" and c.attributes.get_int("to") == x.dtype for c in casts)
    for actual, reference in zip(ort_outputs(model, feeds), expected):
        np.testing.assert_allclose(actual, reference, rtol=2e-2, atol=2e-2)
