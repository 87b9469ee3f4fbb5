"""MoE lowering: the gather-form experts block -> com.microsoft MoE on the ort-cpu target.

The kernel against a numpy reference on one-node models (the interleaved gate/up layout, both
routing normalizations); the rule on the canonicalized graphs of tiny qwen3_moe / mixtral /
granitemoe (fires on every layer, same outputs on onnxruntime, exact `modified`), what
`--explain` says where it does not fire; built artifacts pass the gate and decode as
transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.passes.fuse_moe import CUDA_SWIGLU, PLAIN_SWIGLU, interleave_gate_up, moe_lowering_ort, routing
from tests.passes.fusion_testing import canonical_graph, check_modified_is_exact, decoder_feeds, op_count, ort_outputs

E, H, INTER, K, T = 4, 64, 32, 2, 5
RNG = np.random.default_rng(0)
FUSED_FAMILIES = ["qwen3_moe", "mixtral", "granitemoe", "gpt_oss"]
# gpt_oss: alpha, beta and the clamp of its SwiGLU, what kvforge.passes.fuse_moe writes for it
GPT_OSS_SWIGLU = dict(activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0)


def experts(scale: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """(gate_up [E, 2I, H] with the gate's rows first, down [E, H, INTER]), transformers' layout."""
    return (
        (RNG.standard_normal((E, 2 * INTER, H)) * scale).astype(np.float32),
        (RNG.standard_normal((E, H, INTER)) * scale).astype(np.float32),
    )


def reference(x: np.ndarray, logits: np.ndarray, gate_up: np.ndarray, down: np.ndarray, normalize: bool) -> np.ndarray:
    """Softmax over the experts, top-k (renormalized or not), SiLU(gate) * up, weighted sum."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1)[:, :K]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        w = p[t, chosen[t]]
        w = w / w.sum() if normalize else w
        for j, e in enumerate(chosen[t]):
            h = gate_up[e] @ x[t]
            gate, up = h[:INTER], h[INTER:]
            out[t] += w[j] * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


def one_node(op: str, inputs: list[str], initializers: dict[str, np.ndarray], **attributes: object) -> ir.Model:
    node = helper.make_node(op, inputs, ["y"], domain="com.microsoft", **attributes)
    graph = helper.make_graph(
        [node],
        "moe",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, H]),
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, [T, E]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, H])],
        [numpy_helper.from_array(v, k) for k, v in initializers.items()],
    )
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)]
    return ir.from_proto(helper.make_model(graph, opset_imports=opsets))


def moe_attributes(normalize: int) -> dict[str, object]:
    """What kvforge.passes.fuse_moe writes."""
    return dict(
        k=K,
        activation_type="swiglu",
        swiglu_fusion=1,
        activation_alpha=1.0,
        activation_beta=0.0,
        swiglu_limit=PLAIN_SWIGLU[2],
        normalize_routing_weights=normalize,
    )


@pytest.mark.parametrize("normalize", [0, 1])
def test_moe_kernel_with_interleaved_gate_up_matches_numpy(normalize: int) -> None:
    gate_up, down = experts()
    x = RNG.standard_normal((T, H)).astype(np.float32)
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    model = one_node(
        "MoE",
        ["x", "logits", "w1", "", "w2"],
        {"w1": interleave_gate_up(gate_up), "w2": down},
        **moe_attributes(normalize),
    )
    (y,) = ort_outputs(model, {"x": x, "logits": logits})
    expected = reference(x, logits, gate_up, down, bool(normalize))
    np.testing.assert_allclose(y, expected, atol=1e-5, rtol=1e-5)
    # the gate/up layout matters: the rows as transformers stores them give another function
    model = one_node("MoE", ["x", "logits", "w1", "", "w2"], {"w1": gate_up, "w2": down}, **moe_attributes(normalize))
    (wrong,) = ort_outputs(model, {"x": x, "logits": logits})
    assert np.abs(wrong - expected).max() > 1e-2


def clamped_experts() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(gate_up [E, 2I, H] with gate and up rows interleaved, its bias [E, 2I], down [E, H, I], its
    bias [E, H]): gpt_oss's experts as MoE reads them, large enough that the clamp at 7 bites."""
    return (
        (RNG.standard_normal((E, 2 * INTER, H)) * 0.6).astype(np.float32),
        (RNG.standard_normal((E, 2 * INTER)) * 0.5).astype(np.float32),
        (RNG.standard_normal((E, H, INTER)) * 0.2).astype(np.float32),
        (RNG.standard_normal((E, H)) * 0.5).astype(np.float32),
    )


def clamped_reference(
    x: np.ndarray, logits: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray
) -> np.ndarray:
    """gpt_oss's experts block: top-k over the logits, softmax over the k values, biases, gate
    min(., 7), up clip(., -7, 7), (up + 1) * gate * sigmoid(1.702 * gate)."""
    chosen = np.argsort(-logits, axis=-1)[:, :K]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = logits[t, chosen[t]]
        w = np.exp(top - top.max())
        w /= w.sum()
        for j, e in enumerate(chosen[t]):
            h = w1[e] @ x[t] + b1[e]
            gate, up = np.minimum(h[0::2], 7.0), np.clip(h[1::2], -7.0, 7.0)
            out[t] += w[j] * (w2[e] @ ((up + 1) * gate / (1 + np.exp(-1.702 * gate))) + b2[e])
    return out


def test_moe_kernel_with_biases_and_a_clamped_swiglu_matches_gpt_oss_in_numpy() -> None:
    w1, b1, w2, b2 = clamped_experts()
    x = RNG.standard_normal((T, H)).astype(np.float32)
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    assert (np.abs(np.einsum("enh,th->ten", w1, x)) > 7).mean() > 0.05  # the clamp is exercised
    inputs = ["x", "logits", "w1", "b1", "w2", "b2"]
    weights = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    model = one_node("MoE", inputs, weights, **{**moe_attributes(1), **GPT_OSS_SWIGLU})
    (y,) = ort_outputs(model, {"x": x, "logits": logits})
    expected = clamped_reference(x, logits, w1, b1, w2, b2)
    np.testing.assert_allclose(y, expected, atol=5e-5, rtol=1e-5)
    # without swiglu_limit the kernel does not clamp: another function on these inputs
    unclamped = {**moe_attributes(1), **GPT_OSS_SWIGLU}
    del unclamped["swiglu_limit"]
    (wrong,) = ort_outputs(one_node("MoE", inputs, weights, **unclamped), {"x": x, "logits": logits})
    assert np.abs(wrong - expected).max() > 1e-2


def test_interleave_puts_gate_and_up_rows_in_turn() -> None:
    gate_up = np.arange(2 * 3 * 2 * 1, dtype=np.float32).reshape(2, 6, 1)  # 2 experts, INTER = 3, H = 1
    out = interleave_gate_up(gate_up)
    assert out[0, :, 0].tolist() == [0, 3, 1, 4, 2, 5]
    assert out[1, :, 0].tolist() == [6, 9, 7, 10, 8, 11]


@pytest.mark.slow  # exports each tiny checkpoint once per session (shared with the other fusion tests)
@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_moe_fusion_fires_on_every_layer_and_keeps_outputs(model_type: str, scratch: Path) -> None:
    model = canonical_graph(model_type, scratch)
    feeds = decoder_feeds(model)
    before = ort_outputs(model, feeds)
    experts_gathered = op_count(model, "GatherND")
    fusion = moe_lowering_ort()
    check_modified_is_exact(fusion, canonical_graph(model_type, scratch))
    fusion(model)
    assert fusion.counts == {"moe_swiglu": 2}  # the tiny checkpoints' two layers
    assert op_count(model, "MoE", "com.microsoft") == 2
    gathered = 4 if model_type == "gpt_oss" else 2  # two stacks a layer, and gpt_oss's two biases
    assert op_count(model, "GatherND") == experts_gathered - 2 * gathered
    # MoE reads copies: gate_up interleaved (gpt_oss's already is), gpt_oss's [experts, in, out] stacks transposed
    copied = ("gate_up_proj", "down_proj") if model_type == "gpt_oss" else ("gate_up_proj",)
    for stack in copied:
        stacks = [v for name, v in model.graph.initializers.items() if name.endswith(f"experts.{stack}")]
        assert len(stacks) == 2 and not any(v.uses() for v in stacks)
    after = ort_outputs(model, feeds)
    tolerance = 1e-5 if model_type == "gpt_oss" else 2e-5
    for a, b in zip(before, after, strict=True):
        np.testing.assert_allclose(b, a, atol=tolerance, rtol=1e-4)


@pytest.mark.slow
def test_gpt_oss_moe_carries_its_biases_and_swiglu_constants(scratch: Path) -> None:
    model = canonical_graph("gpt_oss", scratch)
    moe_lowering_ort()(model)
    for node in (n for n in model.graph if n.op_type == "MoE"):
        assert node.attributes.get_int("swiglu_fusion") == 1 and node.attributes.get_int("k") == K
        assert node.attributes.get_int("normalize_routing_weights") == 1  # top-k, then softmax over the k
        for name, value in GPT_OSS_SWIGLU.items():
            assert node.attributes.get_float(name) == pytest.approx(value)
        w1, b1, w2, b2 = (node.inputs[i] for i in (2, 3, 4, 5))
        assert all(v is not None and v.const_value is not None for v in (w1, b1, w2, b2))
        assert w1.name.endswith(".gate_up_proj.interleaved") and w2.name.endswith(".down_proj.transposed")  # type: ignore[union-attr]
        assert tuple(w1.shape) == (E, 2 * 128, 64) and tuple(b1.shape) == (E, 2 * 128)  # type: ignore[arg-type]
        assert tuple(w2.shape) == (E, 64, 128) and tuple(b2.shape) == (E, 64)  # type: ignore[arg-type]


@pytest.mark.slow
def test_gpt_oss_with_another_clamp_keeps_the_gather_form_and_explain_says_why(scratch: Path) -> None:
    model = canonical_graph("gpt_oss", scratch)
    clips = [n for n in model.graph if n.op_type == "Clip" and n.inputs[1] is not None]
    assert len(clips) == 2  # the up projection's clip(-7, 7) in each layer
    for clip in clips:  # clip(-6, 7): no single swiglu_limit says that
        low = ir.Value(name=f"{clip.name}.low", const_value=ir.tensor(np.array(-6, np.float32)))
        model.graph.register_initializer(low)
        clip.replace_input_with(1, low)
    fusion = moe_lowering_ort()
    fusion(model)
    assert fusion.counts == {"moe_swiglu": 0}
    (miss,) = fusion.explain(model)
    assert miss.rule == "moe_swiglu" and "check failed" in miss.reason and "SwiGLU clamps" in miss.reason, miss


def test_plain_swiglu_states_alpha_beta_and_a_limit_that_never_clamps() -> None:
    """Every attribute the SwiGLU reads is stated, in values that mean the same to onnxruntime's
    CPU kernel and to its CUDA kernels that read them: no kernel default is relied on (the CUDA
    kernels' defaults are gpt_oss's 1.702, 1 and a clamp at 7), and the limit is finite and
    positive (a non-positive one is "no clamp" to CUDA and "clamp to 0" to the CPU)."""
    alpha, beta, limit = PLAIN_SWIGLU
    assert (alpha, beta) == (1.0, 0.0) and 0 < limit < np.inf and np.float32(limit) == limit
    # inputs large enough that a clamp at 7 would bite: the stated limit does not clamp them
    gate_up, down = experts(scale=1.0)
    x = RNG.standard_normal((T, H)).astype(np.float32)
    logits = RNG.standard_normal((T, E)).astype(np.float32)
    assert (np.abs(np.einsum("enh,th->ten", gate_up, x)) > 7).mean() > 0.2
    inputs, weights = ["x", "logits", "w1", "", "w2"], {"w1": interleave_gate_up(gate_up), "w2": down}
    (y,) = ort_outputs(one_node("MoE", inputs, weights, **moe_attributes(1)), {"x": x, "logits": logits})
    expected = reference(x, logits, gate_up, down, True)
    np.testing.assert_allclose(y, expected, atol=1e-3 * np.abs(expected).max(), rtol=1e-4)
    # what a CUDA kernel's defaults compute (alpha 1.702, beta 1, clamp at 7) is another function
    cuda_defaults = {**moe_attributes(1), **dict(zip(GPT_OSS_SWIGLU, CUDA_SWIGLU, strict=True))}
    (other,) = ort_outputs(one_node("MoE", inputs, weights, **cuda_defaults), {"x": x, "logits": logits})
    assert np.abs(other - expected).max() > 0.1 * np.abs(expected).max()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_emitted_moe_attributes_are_the_provider_neutral_ones(model_type: str, scratch: Path) -> None:
    model = canonical_graph(model_type, scratch)
    fusion = moe_lowering_ort()
    fusion(model)
    expected = dict(zip(GPT_OSS_SWIGLU, CUDA_SWIGLU if model_type == "gpt_oss" else PLAIN_SWIGLU, strict=True))
    nodes = [n for n in model.graph if n.op_type == "MoE"]
    assert len(nodes) == 2
    for node in nodes:
        assert node.attributes.get_string("activation_type") == "swiglu"
        assert node.attributes.get_int("swiglu_fusion") == 1  # the one layout both kernels read
        for name, value in expected.items():  # stated, never left to a kernel's default
            assert name in node.attributes and node.attributes.get_float(name) == pytest.approx(value, rel=1e-6)


@pytest.mark.slow
def test_for_cuda_plain_swiglu_keeps_the_gather_form_and_gpt_oss_fuses(scratch: Path) -> None:
    """onnxruntime's CUDA kernels compute gpt_oss's SwiGLU in every release and plain SwiGLU
    not in all: for a target naming the CUDA provider only the former fuses."""
    plain = canonical_graph("qwen3_moe", scratch)
    fusion = moe_lowering_ort(cuda=True)
    fusion(plain)
    assert fusion.counts == {"moe_swiglu": 0} and op_count(plain, "MoE", "com.microsoft") == 0
    (miss,) = fusion.explain(plain)
    assert "CUDA" in miss.reason and "alpha 1.0" in miss.reason, miss
    clamped = canonical_graph("gpt_oss", scratch)
    fusion = moe_lowering_ort(cuda=True)
    fusion(clamped)
    assert fusion.counts == {"moe_swiglu": 2}


def _topk_graph(first: str, after: str) -> ir.Graph:
    """logits -> (Softmax ->) TopK -> (Softmax | Div-by-sum | Sigmoid-first) routing weights."""
    logits = ir.Value(name="logits", shape=ir.Shape([T, E]), type=ir.TensorType(ir.DataType.FLOAT))
    nodes: list[ir.Node] = []
    scores = logits
    if first != "none":
        nodes.append(ir.node(first, [logits], {"axis": -1} if first == "Softmax" else {}))
        scores = nodes[-1].outputs[0]
    k = ir.Value(name="k", const_value=ir.tensor(np.array([K], np.int64)))
    topk = ir.node("TopK", [scores, k], {"axis": -1}, num_outputs=2)
    nodes.append(topk)
    values = topk.outputs[0]
    if after == "softmax":
        nodes.append(ir.node("Softmax", [values], {"axis": -1}))
    elif after == "div_sum":
        axes = ir.Value(name="axes", const_value=ir.tensor(np.array([-1], np.int64)))
        total = ir.node("ReduceSum", [values, axes], {"keepdims": 1})
        nodes += [total, ir.node("Div", [values, total.outputs[0]])]
    graph = ir.Graph([logits], [nodes[-1].outputs[-1]], nodes=nodes)
    return graph


@pytest.mark.parametrize(
    ("first", "after", "normalize"),
    [("Softmax", "values", 0), ("Softmax", "div_sum", 1), ("none", "softmax", 1)],
)
def test_routing_forms_onnxruntime_computes(first: str, after: str, normalize: int) -> None:
    graph = _topk_graph(first, after)
    topk = next(n for n in graph if n.op_type == "TopK")
    weights = topk.outputs[0] if after == "values" else list(graph)[-1].outputs[0]
    found = routing(topk.outputs[1], weights)
    assert not isinstance(found, str), found
    logits, k, normalized = found
    assert logits is graph.inputs[0] and k == K and normalized == normalize


@pytest.mark.parametrize(("first", "after"), [("Sigmoid", "values"), ("none", "values"), ("Sigmoid", "div_sum")])
def test_other_routings_are_refused_with_a_reason(first: str, after: str) -> None:
    graph = _topk_graph(first, after)
    topk = next(n for n in graph if n.op_type == "TopK")
    weights = topk.outputs[0] if after == "values" else list(graph)[-1].outputs[0]
    found = routing(topk.outputs[1], weights)
    assert isinstance(found, str) and ("softmax" in found or "sum" in found), found


@pytest.mark.slow  # builds (export, gate) the tiny checkpoints, shared with tests/toolchain
@pytest.mark.parametrize("model_type", FUSED_FAMILIES)
def test_built_moe_artifact_fuses_every_layer_and_decodes_as_transformers(
    model_type: str, tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    from kvforge.runners.engine import Engine
    from tests.toolchain.test_pipeline import PROMPTS, eager_greedy

    artifact = built_artifact(model_type)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    fired = {r["name"]: r["fusions"] for r in manifest["passes"]["passes"]}
    assert fired["moe_ort"] == {"moe_swiglu": 2}
    assert "moe_ort" not in manifest["passes"]["missed"]
    assert manifest["passes"]["histogram_after"]["com.microsoft::MoE"] == 2
    engine = Engine.load(artifact)
    engine.eos_ids = ()
    ids = engine.encode(PROMPTS[0])
    ours = engine.generate_tokens([ids], max_new_tokens=16, temperature=0.0)[0]
    assert ours == eager_greedy(tiny_checkpoint(model_type), ids, 16)


@pytest.mark.slow
def test_deepseek_routing_keeps_the_gather_form_and_the_report_says_why(built_artifact: Callable[..., Path]) -> None:
    manifest = json.loads((built_artifact("deepseek_v3") / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    assert "com.microsoft::MoE" not in manifest["passes"]["histogram_after"]
    (reason,) = manifest["passes"]["missed"]["moe_ort"]
    assert reason.startswith("moe_swiglu")
