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
                                  k, activation_type="swiglu", swiglu_fusion=1,
                                  activation_alpha, activation_beta, swiglu_limit,
                                  normalize_routing_weights)

A decode step then reads only the selected experts' weights, without the gather form's copy of
every selected expert's weights per token (at prefill, T·k copies); docs/performance.md has the
measured decode speed.

Routing forms matched (onnxruntime's MoE routes by softmax over all experts, then top-k):

- Softmax -> TopK, the top-k probabilities as weights (qwen3_moe with norm_topk_prob false):
  normalize_routing_weights=0;
- Softmax -> TopK -> values / ReduceSum(values) (mixtral, qwen3_moe with norm_topk_prob):
  normalize_routing_weights=1;
- TopK(logits) -> Softmax over the k values (granitemoe): the same as softmax, top-k and
  renormalize, so normalize_routing_weights=1.

gpt_oss's form (`MoEFusion(clamped=True)`: experts stored [E, in, out] with gate and up columns
already interleaved, a bias after each product, SwiGLU clamped at 7 with alpha 1.702 and
`(up + 1)`) becomes the same op with its biases, the weights transposed to [E, out, in] and
activation_alpha / activation_beta / swiglu_limit set from the graph's constants. Both forms
count under one name, `moe_swiglu`.

Other routings (deepseek_v3's sigmoid scores with grouped top-k and a correction bias) and other
expert forms keep the gather form, which is correct; `--explain` names what did not match (for a
clamp other than one limit on both halves, the clamps it found).

What the attributes mean to each kernel (onnxruntime's contrib_ops/cpu/moe and contrib_ops/cuda/moe):

- CPU: SwiGLU only with gate and up interleaved on each row (swiglu_fusion=1; row 2i the gate's
  row i, row 2i+1 the up projection's); G · sigmoid(alpha · G) · (L + beta), defaults alpha 1,
  beta 0 and no clamp; a swiglu_limit L clamps min(G, L) and clip(L, -L, L) first (gpt_oss's
  clamp), a limit of 0 clamps everything to 0.
- CUDA: the same interleaving (gate at even, up at odd columns) and formula, but its releases
  differ in which attributes they read: the CUTLASS SwiGLU epilogue hard-codes alpha 1.702 and
  (L + 1); `moe_fused_swiglu.cu` reads alpha and the limit and keeps (L + 1); the newest
  `moe_base.h` reads all three with gpt_oss's values as defaults (a missing swiglu_limit clamps
  at 7) and takes a non-positive limit as "no clamp". On an H200, onnxruntime-gpu 1.31.1
  computed gpt_oss's form as the CPU does and plain SwiGLU (alpha 1, beta 0, no limit) otherwise.

So every node states alpha, beta and the limit (plain SwiGLU: PLAIN_SWIGLU, a limit no float
exceeds), which every kernel that reads them computes alike; and for a target that names the
CUDA provider (`cuda=True`), only gpt_oss's SwiGLU (CUDA_SWIGLU), which every CUDA release
computes, is fused: plain SwiGLU keeps the gather form there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import MatchContext, pattern
from onnxscript.rewriter.pattern import MatchResult, OpsetPatternBuilder

from kvforge.passes.fuse_norm import known_dims
from kvforge.passes.rewrite import FusionPass

if TYPE_CHECKING:  # annotations only: onnxscript names these in no public module
    from onnxscript.rewriter._context import TapeBuilder
    from onnxscript.rewriter._pattern_ir import ValuePattern

MS_DOMAIN = "com.microsoft"
# Element types of com.microsoft MoE.
_MOE_TYPES = frozenset([ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16])
INTERLEAVED = ".interleaved"  # suffix of the gate_up weight stored with gate and up rows interleaved
TRANSPOSED = ".transposed"  # suffix of a [experts, in, out] weight stored [experts, out, in]
# (activation_alpha, activation_beta, swiglu_limit) of plain SwiGLU, SiLU(gate) · up, stated in
# full: the kernels' defaults differ, and a non-positive limit means "no clamp" to some CUDA
# kernels and "clamp at 0" to the CPU's; a finite limit no float exceeds means "no clamp" to all
PLAIN_SWIGLU = (1.0, 0.0, float(np.finfo(np.float32).max))
# The SwiGLU every release of onnxruntime's CUDA MoE computes: some hard-code it (gpt_oss's)
CUDA_SWIGLU = (1.702, 1.0, 7.0)


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


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant, else None."""
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is None or tensor.size != 1:
        return None
    return float(np.asarray(tensor.numpy()).reshape(-1)[0])


def _cuda_differs(alpha: float, beta: float, limit: float | None) -> str:
    clamp = "no clamp" if limit is None else f"limit {limit}"
    return (
        f"SwiGLU alpha {alpha}, beta {beta}, {clamp}: onnxruntime's CUDA MoE kernels compute alpha, beta, "
        f"limit = {CUDA_SWIGLU} in some releases whatever the attributes say (the gather form stays)"
    )


class MoEFusion(pattern.RewriteRuleClassBase):
    """A gather-form SwiGLU experts block with softmax top-k routing -> com.microsoft MoE, in
    one of its two forms (module docstring):

    - `clamped=False`: transformers' experts, stored [experts, out, in] with the gate's rows
      before the up projection's, no biases, SiLU(gate) · up;
    - `clamped=True`: gpt_oss's, stored [experts, in, out] with gate and up columns already
      interleaved, a bias after each product, the SwiGLU clamped (gate <= L, -L <= up <= L),
      alpha and beta from the graph's constants.

    `cuda`: the node must also mean the same to onnxruntime's CUDA kernels, which read only
    gpt_oss's SwiGLU the same way in every release (CUDA_SWIGLU); other forms keep the
    gather form, and `--explain` says why.
    """

    def __init__(self, clamped: bool = False, cuda: bool = False) -> None:
        super().__init__("moe_swiglu_clamped" if clamped else "moe_swiglu")
        self.clamped = clamped
        self.cuda = cuda

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
        h = self._expert_product(op, x_rep, gate_up, gate_up_bias, idx, (in_axes, out_axes, noop_in, noop_out))
        if self.clamped:
            gate = op.Clip(op.Slice(h, gate_start, gate_end, gate_axis, gate_step), None, gate_limit)
            up = op.Clip(op.Slice(h, up_start, up_end, up_axis, up_step), up_low, up_limit)
            act = op.Mul(op.Add(up, beta), op.Mul(gate, op.Sigmoid(op.Mul(gate, alpha))))
        else:
            gate, up = op.Split(h, axis=1, num_outputs=2, _outputs=2)
            act = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
        y = self._expert_product(op, act, down, down_bias, idx, (in_axes_2, out_axes_2, noop_in_2, noop_out_2))
        y = op.Mul(y, op.Unsqueeze(op.Reshape(weights, flat_weights), weight_axes))
        return op.ReduceSum(op.Reshape(y, per_token), sum_axes, keepdims=0)

    def _expert_product(
        self,
        op: OpsetPatternBuilder,
        v: ValuePattern,
        stack: ValuePattern,
        bias: ValuePattern,
        idx: ValuePattern,
        axes: tuple[ValuePattern, ValuePattern, ValuePattern, ValuePattern],
    ) -> ValuePattern:
        """Each row of `v` times its selected expert's matrix of `stack` ([E, out, in] · v, or
        v · [E, in, out] plus the expert's bias)."""
        in_axes, out_axes, noop_in, noop_out = axes
        if not self.clamped:
            return op.Squeeze(op.MatMul(op.GatherND(stack, idx, batch_dims=0), op.Unsqueeze(v, in_axes)), out_axes)
        h = op.Squeeze(op.MatMul(op.Unsqueeze(v, in_axes), op.GatherND(stack, idx, batch_dims=0)), out_axes)
        return op.Squeeze(op.Unsqueeze(op.Add(h, op.GatherND(bias, idx, batch_dims=0)), noop_in), noop_out)

    def check(  # type: ignore[override]
        self,
        context: MatchContext,
        x: ir.Value,
        x_axes: ir.Value,
        repeat: ir.Value,
        indices: ir.Value,
        index_axes: ir.Value,
        gate_up: ir.Value,
        down: ir.Value,
        weights: ir.Value,
        weight_axes: ir.Value,
        sum_axes: ir.Value,
        **values: ir.Value,
    ) -> MatchResult:
        result = MatchResult()
        failure = self._experts_failure(x, gate_up, down, values)
        if failure is None:
            experts = int(gate_up.const_value.shape.numpy()[0])  # type: ignore[union-attr]
            hidden = int(down.const_value.shape.numpy()[2 if self.clamped else 1])  # type: ignore[union-attr]
            failure = _block_failure(x, indices, weights, repeat, x_axes, sum_axes, experts, hidden)
        if failure is None:
            # [E, out, in]: products over the last axis; [E, in, out]: v as a row, over axis 1
            axis = 1 if self.clamped else -1
            products = ("in_axes", "out_axes", "in_axes_2", "out_axes_2")
            expected = ((index_axes, -1, 2), *((values[name], axis, 3) for name in products), (weight_axes, -1, 2))
            for value, want, rank in expected:
                if not _is_axis(value, want, rank):
                    failure = ("an expert index, product or routing weight is not over the axis MoE uses", value)
                    break
        if failure is None and self.clamped:
            failure = self._swiglu_failure(gate_up, values)
        elif failure is None and self.cuda:
            failure = (_cuda_differs(*PLAIN_SWIGLU[:2], None), x)
        return result.fail(*failure) if failure is not None else result

    def _experts_failure(
        self, x: ir.Value, gate_up: ir.Value, down: ir.Value, values: dict[str, ir.Value]
    ) -> tuple[str, ir.Value] | None:
        """Why the experts' constants are not a stack MoE takes, else None."""
        if not self.clamped:
            stacks: tuple[tuple[ir.Value, str, int], ...] = ((gate_up, "gate_up weights", 3), (down, "down weights", 3))
            failure = _weights_failure(x, stacks, "[experts, out, in]")
            if failure is not None:
                return failure
            experts, fused, hidden = gate_up.const_value.shape.numpy()  # type: ignore[union-attr]
            if fused % 2 or tuple(down.const_value.shape.numpy()) != (experts, hidden, fused // 2):  # type: ignore[union-attr]
                return f"down weights {down.shape} do not match gate_up {gate_up.shape}", down
            return None
        gate_up_bias, down_bias = values["gate_up_bias"], values["down_bias"]
        stacks = (
            (gate_up, "gate_up weights", 3),
            (down, "down weights", 3),
            (gate_up_bias, "gate_up biases", 2),
            (down_bias, "down biases", 2),
        )
        failure = _weights_failure(x, stacks, "[experts, in, out] ([experts, out] for biases)")
        if failure is not None:
            return failure
        experts, hidden, fused = gate_up.const_value.shape.numpy()  # type: ignore[union-attr]
        if fused % 2 or tuple(down.const_value.shape.numpy()) != (experts, fused // 2, hidden):  # type: ignore[union-attr]
            return f"down weights {down.shape} (experts, in, out) do not match gate_up {gate_up.shape}", down
        for bias, size in ((gate_up_bias, fused), (down_bias, hidden)):
            if tuple(bias.const_value.shape.numpy()) != (experts, size):  # type: ignore[union-attr]
                return f"expert biases {bias.shape} are not [{experts}, {size}]", bias
        return None

    def _swiglu_failure(self, gate_up: ir.Value, values: dict[str, ir.Value]) -> tuple[str, ir.Value] | None:
        """Why the clamped form's halves, clamps and constants are not what MoE computes (or,
        with `cuda`, not what every CUDA kernel computes), else None."""
        fused = int(gate_up.const_value.shape.numpy()[2])  # type: ignore[union-attr]
        for start, what in ((0, "gate"), (1, "up")):
            starts, ends, axes, steps = (_ints(values[f"{what}_{part}"]) for part in ("start", "end", "axis", "step"))
            if starts != [start] or steps != [2] or axes not in ([1], [-1]) or not ends or ends[0] < fused:
                why = (
                    f"the {what} half is not every other column of gate_up from column {start} "
                    "(the interleaved layout MoE's swiglu_fusion=1 reads)"
                )
                return why, values[f"{what}_start"]
        limit, up_low, up_limit = (_scalar(values[name]) for name in ("gate_limit", "up_low", "up_limit"))
        if limit is None or up_limit != limit or up_low != -limit or limit <= 0:
            why = (
                f"the SwiGLU clamps (gate <= {limit}, up in [{up_low}, {up_limit}]) are not one limit L with "
                "gate <= L and -L <= up <= L, the only clamp MoE's swiglu_limit applies"
            )
            return why, values["gate_limit"]
        alpha, beta = _scalar(values["alpha"]), _scalar(values["beta"])
        if alpha is None or beta is None:
            return "the SwiGLU's alpha or beta is not a constant", values["alpha"]
        if self.cuda and not np.allclose((alpha, beta, limit), CUDA_SWIGLU, rtol=1e-6, atol=0):
            return _cuda_differs(alpha, beta, limit), values["alpha"]
        for into, out in (("noop_in", "noop_out"), ("noop_in_2", "noop_out_2")):
            if _ints(values[into]) is None or _ints(values[into]) != _ints(values[out]):
                return "an Unsqueeze/Squeeze pair after a bias is not over one axis", values[into]
        return None

    def rewrite(  # type: ignore[override]
        self,
        op: TapeBuilder,
        x: ir.Value,
        indices: ir.Value,
        gate_up: ir.Value,
        down: ir.Value,
        weights: ir.Value,
        **values: ir.Value,
    ) -> ir.Value:
        found = routing(indices, weights)
        assert not isinstance(found, str)
        logits, k, normalize = found
        if self.clamped:  # [E, in, out] -> MoE's [E, out, in]; gate and up columns already interleaved
            w1 = _stored(op, gate_up, INTERLEAVED, gate_up.const_value.numpy().transpose(0, 2, 1))  # type: ignore[union-attr]
            w2 = _stored(op, down, TRANSPOSED, down.const_value.numpy().transpose(0, 2, 1))  # type: ignore[union-attr]
            biases: tuple[ir.Value | None, ir.Value | None] = (values["gate_up_bias"], values["down_bias"])
            alpha, beta, limit = (_scalar(values[name]) for name in ("alpha", "beta", "gate_limit"))
        else:
            w1, w2 = _stored(op, gate_up, INTERLEAVED, interleave_gate_up(gate_up.const_value.numpy())), down  # type: ignore[union-attr]
            biases = (None, None)
            alpha, beta, limit = PLAIN_SWIGLU
        moe: ir.Value = op.MoE(
            x,
            logits,
            w1,
            biases[0],
            w2,
            biases[1],
            k=k,
            activation_type="swiglu",
            swiglu_fusion=1,
            activation_alpha=alpha,
            activation_beta=beta,
            swiglu_limit=limit,
            normalize_routing_weights=normalize,
            _domain=MS_DOMAIN,
        )
        return moe


def _stored(op: TapeBuilder, source: ir.Value, suffix: str, array: np.ndarray) -> ir.Value:
    """A new initializer holding `array`, named after `source` with `suffix`."""
    name = f"{source.name}{suffix}"
    return op.initializer(ir.tensor(np.ascontiguousarray(array), name=name), name=name)


def interleave_gate_up(weight: np.ndarray) -> np.ndarray:
    """[E, 2I, H] with the gate's rows then the up projection's -> the same rows interleaved
    (gate row i at 2i, up row i at 2i + 1), the layout MoE's swiglu_fusion=1 reads."""
    experts, fused, hidden = weight.shape
    half = fused // 2
    return np.ascontiguousarray(np.stack([weight[:, :half], weight[:, half:]], axis=2).reshape(experts, fused, hidden))


def moe_lowering_ort(cuda: bool = False) -> FusionPass:
    """The gather-form experts block with softmax top-k routing -> com.microsoft MoE: the plain
    SwiGLU form and gpt_oss's (biases, clamped SwiGLU), one fusion. `cuda`: only what
    onnxruntime's CUDA kernels read as its CPU kernel does (`MoEFusion`)."""
    forms = [MoEFusion.rule(clamped=clamped, cuda=cuda) for clamped in (False, True)]
    return FusionPass("moe_ort", {"moe_swiglu": forms})
