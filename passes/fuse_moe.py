"""Mixture-of-experts block -> onnxruntime's `com.microsoft MoE` (the ort-cpu target's "lower-ort" phase).

transformers' `batched_mm` experts (toolchain/export.py) reach the graph in a gather form: every
token's k selected experts' weights are gathered and multiplied with its hidden state,

    logits ─ Softmax ─ TopK(k) ─┬─ values ─(routing weights)───────────────────────────────────────┐
                                └─ indices ─ Reshape ─ Unsqueeze ─> idx                           │
    x [T, H] ─ Unsqueeze(1) ─ Expand([1, k, 1]) ─ Reshape ─> x_rep [T·k, H]                       │
    h  = Squeeze(MatMul(GatherND(gate_up [E, 2I, H], idx), Unsqueeze(x_rep, -1)), -1)             │
    gate, up = Split(h, axis=1)                                                                   │
    a  = Mul(Mul(gate, Sigmoid(gate)), up)                          (SiLU-gated: SwiGLU)          │
    y  = Squeeze(MatMul(GatherND(down [E, H, I], idx), Unsqueeze(a, -1)), -1) · Unsqueeze(weights)┘
    out = ReduceSum(Reshape(y, [T, k, H]), axes=[1], keepdims=0)

    ==>   out = com.microsoft MoE(x, logits, gate_up (gate/up rows interleaved), -, down,
                                  k, activation_type="swiglu", swiglu_fusion=1, alpha 1, beta 0,
                                  normalize_routing_weights)

A decode step then reads only the selected experts' weights, without the gather form's copy of
every selected expert's weights per token (at prefill, T·k copies).

Routing forms matched (onnxruntime's MoE routes by softmax over all experts, then top-k):

- Softmax -> TopK, the top-k probabilities as weights (qwen3_moe with norm_topk_prob false):
  normalize_routing_weights=0;
- Softmax -> TopK -> values / ReduceSum(values) (mixtral, qwen3_moe with norm_topk_prob):
  normalize_routing_weights=1;
- TopK(logits) -> Softmax over the k values (granitemoe): the same as softmax, top-k and
  renormalize, so normalize_routing_weights=1.

gpt_oss's form (second rule, `ClampedMoEFusion`: experts stored [E, in, out] with gate and up
columns already interleaved, a bias after each product, SwiGLU clamped at 7 with alpha 1.702 and
`(up + 1)`) becomes the same op with its biases, the weights transposed to [E, out, in] and
activation_alpha / activation_beta / swiglu_limit set from the graph's constants. Both rules
count under one name, `moe_swiglu`.

Other routings (deepseek_v3's sigmoid scores with grouped top-k and a correction bias) and other
expert forms keep the gather form, which is correct; `--explain` names what did not match (for a
clamp other than one limit on both halves, the clamps it found).

onnxruntime 1.32's CPU kernel takes SwiGLU only with gate and up interleaved on each row
(swiglu_fusion=1), so the fused gate_up weight is stored interleaved (row 2i the gate's row i,
row 2i+1 the up projection's). The activation is G · sigmoid(alpha · G) · (L + beta), so alpha
and beta are set to 1 and 0 explicitly (the kernel's defaults are not those); no swiglu_limit
(no clamp). With swiglu_limit L the kernel computes min(G, L) and clip(L, -L, L) first, which is
gpt_oss's clamp. Checked against numpy on one-node models (tests/passes/test_fuse_moe.py): max
error ~1e-6 plain, ~1e-5 of outputs up to 25 for gpt_oss's form with the clamp exercised.

Measured (benchmarks/moe_decode.py; docs/performance.md has the table): a mixtral of 120.9M
parameters, 59.5M active (8 experts of width 832, top-2), fp32, batch 1, on the shared
2-core machine, side by side in one process: decode with MoE 0.944x a dense model of the
active size, the same checkpoint in the gather form 0.612x (median within a round of
MoE / gather form: 1.50).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult, OpsetPatternBuilder

from passes.fuse_norm import known_dims
from passes.rewrite import FusionPass

if TYPE_CHECKING:  # onnxscript exports these only from private modules: annotations only, never at run time
    from onnxscript.rewriter._basics import MatchContext
    from onnxscript.rewriter._context import TapeBuilder
    from onnxscript.rewriter._pattern_ir import ValuePattern

MS_DOMAIN = "com.microsoft"
# Element types of com.microsoft MoE.
_MOE_TYPES = frozenset([ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16])
INTERLEAVED = ".interleaved"  # suffix of the gate_up weight stored with gate and up rows interleaved
TRANSPOSED = ".transposed"  # suffix of a [experts, in, out] weight stored [experts, out, in]


def _ints(value: ir.Value | None) -> list[int] | None:
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None:
        return None
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def _is_axis(value: ir.Value | None, axis: int, rank: int | None) -> bool:
    """`value` is the constant axes [axis] (negative or counted from the front of a rank-`rank` tensor)."""
    axes = _ints(value)
    if axes is None or len(axes) != 1:
        return False
    return axes[0] == axis or (rank is not None and axes[0] % rank == axis % rank)


def _attr_int(node: ir.Node, name: str, default: int) -> int:
    attribute = node.attributes.get(name)
    return default if attribute is None else int(attribute.as_int())


def _last_axis(node: ir.Node, value: ir.Value | None) -> bool:
    """`node`'s `axis` attribute names the last axis of `value` (a rank-2 tensor in these graphs)."""
    axis = _attr_int(node, "axis", -1)
    dims = known_dims(value) if value is not None else None
    rank = len(dims) if dims is not None else (len(value.shape) if value is not None and value.shape else None)
    return axis == -1 or (rank is not None and axis == rank - 1)


def routing(indices: ir.Value, weights: ir.Value) -> tuple[ir.Value, int, int] | str:
    """(router logits, k, normalize_routing_weights) where `indices` and `weights` are a
    softmax-then-top-k routing that onnxruntime's MoE computes itself; else why not."""
    topk = indices.producer()
    if topk is None or topk.op_type != "TopK" or topk.domain != "" or len(topk.outputs) != 2:
        return "expert indices do not come from a TopK"
    if indices is not topk.outputs[1] or not _attr_int(topk, "largest", 1):
        return "expert indices are not the largest TopK's indices"
    scores = topk.inputs[0]
    if not _last_axis(topk, scores):
        return "TopK is not over the experts (last) axis"
    k_values = _ints(topk.inputs[1])
    if k_values is None or len(k_values) != 1 or k_values[0] < 1:
        return "TopK's k is not a constant"
    k = k_values[0]
    values = topk.outputs[0]
    source = scores.producer() if scores is not None else None
    softmax_first = (
        source is not None and source.op_type == "Softmax" and source.domain == "" and _last_axis(source, scores)
    )
    if weights is values:
        if not softmax_first:
            what = source.op_type if source is not None else "a graph input"
            return f"experts are chosen by top-k over {what}, not over a softmax of the router logits"
        assert source is not None
        return source.inputs[0], k, 0  # type: ignore[return-value]
    producer = weights.producer()
    if producer is None:
        return "routing weights are not computed from the TopK values"
    if softmax_first and producer.op_type == "Div" and producer.inputs[0] is values:
        total = producer.inputs[1].producer() if producer.inputs[1] is not None else None
        if (
            total is not None
            and total.op_type == "ReduceSum"
            and total.inputs[0] is values
            and _attr_int(total, "keepdims", 1) == 1
            and _is_axis(total.inputs[1] if len(total.inputs) > 1 else None, -1, 2)
        ):
            assert source is not None
            return source.inputs[0], k, 1  # type: ignore[return-value]
        return "routing weights are the top-k values divided by something other than their sum"
    if not softmax_first and producer.op_type == "Softmax" and producer.inputs[0] is values:
        if _last_axis(producer, values) and scores is not None:
            return scores, k, 1
    kind = source.op_type if source is not None else "a graph input"
    return (
        f"routing weights come from {producer.op_type} over top-k of {kind}: onnxruntime's MoE routes "
        "by softmax over all experts then top-k (optionally renormalized) only"
    )


def _weights_failure(
    x: ir.Value, stacks: tuple[tuple[ir.Value, str, int], ...], layout: str
) -> tuple[str, ir.Value] | None:
    """Why x or the experts' (weight, what, rank) constants are not what MoE takes, else None."""
    if x.dtype not in _MOE_TYPES:
        return f"element type {x.dtype} is not one MoE takes", x
    if x.shape is None or len(x.shape) != 2:
        return f"hidden states have shape {x.shape}, not [tokens, hidden]", x
    for value, what, rank in stacks:
        if not value.is_initializer() or value.is_graph_input() or value.const_value is None:
            return f"the experts' {what} are not a constant initializer", value
        if len(value.const_value.shape) != rank or value.const_value.dtype != x.dtype:
            return f"the experts' {what} are not a stack {layout} of x's type", value
    return None


def _block_failure(
    x: ir.Value,
    indices: ir.Value,
    weights: ir.Value,
    repeat: ir.Value,
    x_axes: ir.Value,
    sum_axes: ir.Value,
    experts: int,
    hidden: int,
) -> tuple[str, ir.Value] | None:
    """Why the routing, the repeated hidden states or the sum over the selected experts are
    not what MoE computes for `experts` experts of input size `hidden`, else None."""
    found = routing(indices, weights)
    if isinstance(found, str):
        return found, indices
    logits, k, _normalize = found
    x_dims, logit_dims = known_dims(x), known_dims(logits)
    if x_dims is not None and x_dims[-1] != hidden:
        return f"hidden size {x_dims[-1]} is not the experts' input size {hidden}", x
    if logits.shape is None or len(logits.shape) != 2 or (logit_dims is not None and logit_dims[-1] != experts):
        return f"router logits have shape {logits.shape}, not [tokens, {experts}]", logits
    if not 1 <= k <= experts:
        return f"top-k {k} is not within the {experts} experts", indices
    if _ints(repeat) != [1, k, 1] or not _is_axis(x_axes, 1, 3):
        return f"hidden states are not repeated once per selected expert (k={k})", repeat
    if not _is_axis(sum_axes, 1, 3):
        return "the experts' outputs are not summed over the selected experts", sum_axes
    return None


class MoEFusion(pattern.RewriteRuleClassBase):
    """The gather-form SwiGLU experts block with softmax top-k routing -> com.microsoft MoE (module docstring)."""

    def __init__(self) -> None:
        super().__init__("moe_swiglu")

    def pattern(  # type: ignore[override]
        self,
        op: OpsetPatternBuilder,
        x: ValuePattern,
        x_axes: ValuePattern,
        repeat: ValuePattern,
        rows: ValuePattern,
        indices: ValuePattern,
        flat: ValuePattern,
        index_axes: ValuePattern,
        gate_up: ValuePattern,
        in_axes: ValuePattern,
        out_axes: ValuePattern,
        down: ValuePattern,
        in_axes_2: ValuePattern,
        out_axes_2: ValuePattern,
        weights: ValuePattern,
        flat_weights: ValuePattern,
        weight_axes: ValuePattern,
        per_token: ValuePattern,
        sum_axes: ValuePattern,
    ) -> ValuePattern:
        x_rep = op.Reshape(op.Expand(op.Unsqueeze(x, x_axes), repeat), rows)
        idx = op.Unsqueeze(op.Reshape(indices, flat), index_axes)
        h = op.Squeeze(op.MatMul(op.GatherND(gate_up, idx, batch_dims=0), op.Unsqueeze(x_rep, in_axes)), out_axes)
        gate, up = op.Split(h, axis=1, num_outputs=2, _outputs=2)
        act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
        y = op.Squeeze(op.MatMul(op.GatherND(down, idx, batch_dims=0), op.Unsqueeze(act, in_axes_2)), out_axes_2)
        y = op.Mul(y, op.Unsqueeze(op.Reshape(weights, flat_weights), weight_axes))
        return op.ReduceSum(op.Reshape(y, per_token), sum_axes, keepdims=0)

    def check(  # type: ignore[override]
        self,
        context: MatchContext,
        x: ir.Value,
        x_axes: ir.Value,
        repeat: ir.Value,
        indices: ir.Value,
        index_axes: ir.Value,
        gate_up: ir.Value,
        in_axes: ir.Value,
        out_axes: ir.Value,
        down: ir.Value,
        in_axes_2: ir.Value,
        out_axes_2: ir.Value,
        weights: ir.Value,
        weight_axes: ir.Value,
        sum_axes: ir.Value,
        **_: object,
    ) -> MatchResult:
        result = MatchResult()
        stacks = ((gate_up, "gate_up weights", 3), (down, "down weights", 3))
        failure = _weights_failure(x, stacks, "[experts, out, in]")
        if failure is not None:
            return result.fail(*failure)
        experts, fused, hidden = gate_up.const_value.shape.numpy()  # type: ignore[union-attr]
        if fused % 2 or tuple(down.const_value.shape.numpy()) != (experts, hidden, fused // 2):  # type: ignore[union-attr]
            return result.fail(f"down weights {down.shape} do not match gate_up {gate_up.shape}", down)
        failure = _block_failure(x, indices, weights, repeat, x_axes, sum_axes, experts, hidden)
        if failure is not None:
            return result.fail(*failure)
        last_axes = ((index_axes, 2), (in_axes, 3), (out_axes, 3), (in_axes_2, 3), (out_axes_2, 3), (weight_axes, 2))
        for axes, rank in last_axes:
            if not _is_axis(axes, -1, rank):
                return result.fail("a matrix-vector product is not over the last axis", axes)
        return result

    def rewrite(  # type: ignore[override]
        self,
        op: TapeBuilder,
        x: ir.Value,
        indices: ir.Value,
        gate_up: ir.Value,
        down: ir.Value,
        weights: ir.Value,
        **_: object,
    ) -> ir.Value:
        found = routing(indices, weights)
        assert not isinstance(found, str)
        logits, k, normalize = found
        name = f"{gate_up.name}{INTERLEAVED}"
        w1 = op.initializer(ir.tensor(interleave_gate_up(gate_up.const_value.numpy()), name=name), name=name)  # type: ignore[union-attr]
        moe: ir.Value = op.MoE(
            x,
            logits,
            w1,
            None,
            down,
            k=k,
            activation_type="swiglu",
            swiglu_fusion=1,
            activation_alpha=1.0,
            activation_beta=0.0,
            normalize_routing_weights=normalize,
            _domain=MS_DOMAIN,
        )
        return moe


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant, else None."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(np.asarray(tensor.numpy()).reshape(-1)[0])


class ClampedMoEFusion(pattern.RewriteRuleClassBase):
    """gpt_oss's gather-form experts -> com.microsoft MoE with biases and a clamped SwiGLU.

    Its experts are stored [experts, in, out] (gate_up [E, H, 2I] with the gate's and the up
    projection's columns already interleaved, down [E, I, H]), with a bias after each product:

        h    = x_rep · GatherND(gate_up) + GatherND(gate_up_bias)
        gate = min(h[:, 0::2], limit);  up = clip(h[:, 1::2], -limit, limit)
        a    = (up + beta) · gate · sigmoid(alpha · gate)            (gpt_oss: alpha 1.702, beta 1, limit 7)
        y    = a · GatherND(down) + GatherND(down_bias), weighted and summed as in the plain form

    which is MoE's swiglu with swiglu_fusion=1, activation_alpha, activation_beta and swiglu_limit
    (onnxruntime clamps the gate from above and the linear half on both sides, as gpt_oss does).
    The weights are stored transposed to MoE's [experts, out, in]; gate and up rows stay
    interleaved. gpt_oss routes by top-k over the router logits, then softmax over the k values:
    the same as softmax over all experts, top-k and renormalize (the ratios of the selected
    exponentials do not depend on the normalizer), so normalize_routing_weights=1, as granitemoe.
    """

    def __init__(self) -> None:
        super().__init__("moe_swiglu_clamped")

    def pattern(  # type: ignore[override]
        self,
        op: OpsetPatternBuilder,
        x: ValuePattern,
        x_axes: ValuePattern,
        repeat: ValuePattern,
        rows: ValuePattern,
        indices: ValuePattern,
        flat: ValuePattern,
        index_axes: ValuePattern,
        gate_up: ValuePattern,
        gate_up_bias: ValuePattern,
        in_axes: ValuePattern,
        out_axes: ValuePattern,
        noop_in: ValuePattern,
        noop_out: ValuePattern,
        gate_start: ValuePattern,
        gate_end: ValuePattern,
        gate_axis: ValuePattern,
        gate_step: ValuePattern,
        gate_limit: ValuePattern,
        up_start: ValuePattern,
        up_end: ValuePattern,
        up_axis: ValuePattern,
        up_step: ValuePattern,
        up_low: ValuePattern,
        up_limit: ValuePattern,
        alpha: ValuePattern,
        beta: ValuePattern,
        down: ValuePattern,
        down_bias: ValuePattern,
        in_axes_2: ValuePattern,
        out_axes_2: ValuePattern,
        noop_in_2: ValuePattern,
        noop_out_2: ValuePattern,
        weights: ValuePattern,
        flat_weights: ValuePattern,
        weight_axes: ValuePattern,
        per_token: ValuePattern,
        sum_axes: ValuePattern,
    ) -> ValuePattern:
        x_rep = op.Reshape(op.Expand(op.Unsqueeze(x, x_axes), repeat), rows)
        idx = op.Unsqueeze(op.Reshape(indices, flat), index_axes)
        h = op.Squeeze(op.MatMul(op.Unsqueeze(x_rep, in_axes), op.GatherND(gate_up, idx, batch_dims=0)), out_axes)
        h = op.Squeeze(op.Unsqueeze(op.Add(h, op.GatherND(gate_up_bias, idx, batch_dims=0)), noop_in), noop_out)
        gate = op.Clip(op.Slice(h, gate_start, gate_end, gate_axis, gate_step), None, gate_limit)
        up = op.Clip(op.Slice(h, up_start, up_end, up_axis, up_step), up_low, up_limit)
        act = op.Mul(op.Add(up, beta), op.Mul(gate, op.Sigmoid(op.Mul(gate, alpha))))
        y = op.Squeeze(op.MatMul(op.Unsqueeze(act, in_axes_2), op.GatherND(down, idx, batch_dims=0)), out_axes_2)
        y = op.Squeeze(op.Unsqueeze(op.Add(y, op.GatherND(down_bias, idx, batch_dims=0)), noop_in_2), noop_out_2)
        y = op.Mul(y, op.Unsqueeze(op.Reshape(weights, flat_weights), weight_axes))
        return op.ReduceSum(op.Reshape(y, per_token), sum_axes, keepdims=0)

    def check(  # type: ignore[override]
        self,
        context: MatchContext,
        x: ir.Value,
        x_axes: ir.Value,
        repeat: ir.Value,
        indices: ir.Value,
        index_axes: ir.Value,
        gate_up: ir.Value,
        gate_up_bias: ir.Value,
        down: ir.Value,
        down_bias: ir.Value,
        weights: ir.Value,
        weight_axes: ir.Value,
        sum_axes: ir.Value,
        **values: ir.Value,
    ) -> MatchResult:
        result = MatchResult()
        stacks = (
            (gate_up, "gate_up weights", 3),
            (down, "down weights", 3),
            (gate_up_bias, "gate_up biases", 2),
            (down_bias, "down biases", 2),
        )
        failure = _weights_failure(x, stacks, "[experts, in, out] ([experts, out] for biases)")
        if failure is not None:
            return result.fail(*failure)
        experts, hidden, fused = gate_up.const_value.shape.numpy()  # type: ignore[union-attr]
        if fused % 2 or tuple(down.const_value.shape.numpy()) != (experts, fused // 2, hidden):  # type: ignore[union-attr]
            why = f"down weights {down.shape} (experts, in, out) do not match gate_up {gate_up.shape}"
            return result.fail(why, down)
        for bias, size in ((gate_up_bias, fused), (down_bias, hidden)):
            if tuple(bias.const_value.shape.numpy()) != (experts, size):  # type: ignore[union-attr]
                return result.fail(f"expert biases {bias.shape} are not [{experts}, {size}]", bias)
        failure = _block_failure(x, indices, weights, repeat, x_axes, sum_axes, experts, hidden)
        if failure is not None:
            return result.fail(*failure)
        for start, what in ((0, "gate"), (1, "up")):
            starts, ends, axes, steps = (_ints(values[f"{what}_{part}"]) for part in ("start", "end", "axis", "step"))
            if starts != [start] or steps != [2] or axes not in ([1], [-1]) or not ends or ends[0] < fused:
                return result.fail(
                    f"the {what} half is not every other column of gate_up from column {start} "
                    "(the interleaved layout MoE's swiglu_fusion=1 reads)",
                    values[f"{what}_start"],
                )
        limit, up_low, up_limit = (_scalar(values[name]) for name in ("gate_limit", "up_low", "up_limit"))
        if limit is None or up_limit != limit or up_low != -limit or limit <= 0:
            return result.fail(
                f"the SwiGLU clamps (gate <= {limit}, up in [{up_low}, {up_limit}]) are not one limit L with "
                "gate <= L and -L <= up <= L, the only clamp MoE's swiglu_limit applies",
                values["gate_limit"],
            )
        if _scalar(values["alpha"]) is None or _scalar(values["beta"]) is None:
            return result.fail("the SwiGLU's alpha or beta is not a constant", values["alpha"])
        expected_axes = (
            (index_axes, -1, 2),
            (values["in_axes"], 1, 3),
            (values["out_axes"], 1, 3),
            (values["in_axes_2"], 1, 3),
            (values["out_axes_2"], 1, 3),
            (weight_axes, -1, 2),
        )
        for value, axis, rank in expected_axes:
            if not _is_axis(value, axis, rank):
                return result.fail("an expert index, product or routing weight is not over the axis MoE uses", value)
        for into, out in (("noop_in", "noop_out"), ("noop_in_2", "noop_out_2")):
            if _ints(values[into]) is None or _ints(values[into]) != _ints(values[out]):
                return result.fail("an Unsqueeze/Squeeze pair after a bias is not over one axis", values[into])
        return result

    def rewrite(  # type: ignore[override]
        self,
        op: TapeBuilder,
        x: ir.Value,
        indices: ir.Value,
        gate_up: ir.Value,
        gate_up_bias: ir.Value,
        down: ir.Value,
        down_bias: ir.Value,
        weights: ir.Value,
        gate_limit: ir.Value,
        alpha: ir.Value,
        beta: ir.Value,
        **_: object,
    ) -> ir.Value:
        found = routing(indices, weights)
        assert not isinstance(found, str)
        logits, k, normalize = found
        stacks = []
        for value, suffix in ((gate_up, INTERLEAVED), (down, TRANSPOSED)):
            name = f"{value.name}{suffix}"
            array = np.ascontiguousarray(value.const_value.numpy().transpose(0, 2, 1))  # type: ignore[union-attr]
            stacks.append(op.initializer(ir.tensor(array, name=name), name=name))
        moe: ir.Value = op.MoE(
            x,
            logits,
            stacks[0],
            gate_up_bias,
            stacks[1],
            down_bias,
            k=k,
            activation_type="swiglu",
            swiglu_fusion=1,
            activation_alpha=_scalar(alpha),
            activation_beta=_scalar(beta),
            swiglu_limit=_scalar(gate_limit),
            normalize_routing_weights=normalize,
            _domain=MS_DOMAIN,
        )
        return moe


def interleave_gate_up(weight: np.ndarray) -> np.ndarray:
    """[E, 2I, H] with the gate's rows then the up projection's -> the same rows interleaved
    (gate row i at 2i, up row i at 2i + 1), the layout MoE's swiglu_fusion=1 reads."""
    experts, fused, hidden = weight.shape
    half = fused // 2
    return np.ascontiguousarray(np.stack([weight[:, :half], weight[:, half:]], axis=2).reshape(experts, fused, hidden))


def moe_lowering_ort() -> FusionPass:
    """The gather-form experts block with softmax top-k routing -> com.microsoft MoE: the plain
    SwiGLU form and gpt_oss's (biases, clamped SwiGLU), one fusion."""
    return FusionPass("moe_ort", {"moe_swiglu": [MoEFusion.rule(), ClampedMoEFusion.rule()]})
