"""Normalization fusions: RMSNorm subgraphs to `RMSNormalization`, residual Add + norm to onnxruntime's Skip ops.

Two levels, one per pipeline phase:

* `norm_fusion` ("fuse", portable): the exporter writes RMSNorm (llama, mistral, qwen2, qwen3, phi3, gemma,
  gemma2) as Pow / ReduceMean / Add / Sqrt / Reciprocal / Mul / Mul(weight); this becomes one opset-23
  `RMSNormalization`, which onnxruntime, TensorRT and any opset-23 runtime execute as a single kernel.
  LayerNorm needs no rule: torch.onnx already emits `LayerNormalization` for `aten.layer_norm` (gpt2: 5,
  gpt_neox: 5, also for a float16 checkpoint), so there is no decomposed LayerNorm to fuse.
* `norm_lowering_ort` ("lower-ort"): residual `Add` + `RMSNormalization` -> com.microsoft
  `SkipSimplifiedLayerNormalization`, residual `Add` + `LayerNormalization` -> com.microsoft
  `SkipLayerNormalization`; when the sum is also read elsewhere (the residual stream) it becomes the Skip op's
  fourth output (`input_skip_bias_sum`), otherwise the Skip op has one output.

A standalone `RMSNormalization` stays as it is: onnxruntime's `SimplifiedLayerNormalization` is no faster
(docs/performance.md), and it sits in the ONNX domain without an opset-23 schema, so `onnx.checker` rejects it.

On onnxruntime's CPU kernels the Skip ops measured no faster than Add + the standard norm, and
`SimplifiedLayerNormalization` no faster than `RMSNormalization` (docs/performance.md, "Kernel choices
behind the passes"): only the `ort-cuda` target, whose CUDA provider has fused kernels for them, runs
`norm_lowering_ort`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import onnx_ir as ir
from onnxscript.rewriter import MatchContext, pattern
from onnxscript.rewriter.pattern import MatchResult, OpsetPatternBuilder

# onnxscript's RMSNorm rule, which RMSNormFusion extends, is exported from no public module
from onnxscript.rewriter.rules.fusion import _rms_normalization

from kvforge.passes.rewrite import FusionPass

if TYPE_CHECKING:  # annotations only: onnxscript names these in no public module
    from onnxscript.rewriter._context import TapeBuilder
    from onnxscript.rewriter._pattern_ir import ValuePattern

Dims = tuple[int | str, ...]

# Element types onnxruntime's CPU Skip*Normalization kernels are registered for and compute in float.
_SKIP_NORM_TYPES = frozenset([ir.DataType.FLOAT, ir.DataType.FLOAT16])


def known_dims(value: ir.Value | None) -> Dims | None:
    """The shape of `value` as ints and symbol names, or None where the rank or any dim is unknown."""
    if value is None or value.shape is None:
        return None
    dims: list[int | str] = []
    for dim in value.shape:
        if isinstance(dim, int):
            dims.append(dim)
        elif dim.value is None:
            return None
        else:
            dims.append(dim.value)
    return tuple(dims)


def is_vector_over_last_axis(vector: ir.Value | None, x: ir.Value) -> bool:
    """`vector` has shape [D] where D is the last dim of `x` (both known)."""
    x_dims, v_dims = known_dims(x), known_dims(vector)
    return x_dims is not None and len(x_dims) > 0 and v_dims == (x_dims[-1],)


class RMSNormFusion(_rms_normalization.RmsNormFusion):
    """onnxscript's RMSNorm rule, with `scale` checked to be one weight per channel.

        x ─(Cast f32)?─┬─ Pow(·, 2) ─ ReduceMean(axes=[-1], keepdims=1) ─ Add(eps) ─ Sqrt ─ Reciprocal ─┐
                       └──────────────────────────────────────────────────────────────────────────── Mul
                                                                                   (Cast back)? ─ Mul(scale) ─> y
        ==>
        x, scale ─> RMSNormalization(axis=-1, epsilon=eps, stash_type=f32) ─> y

    `weight_first` is the operand order of the last Mul: Mul(weight, normalized) in llama, mistral, qwen2,
    qwen3, phi3; Mul(normalized, weight) in gemma and gemma2. gemma's weight is (1 + weight): constant folding
    makes it one initializer in the tiny checkpoints, and at real sizes the Add(weight, 1) stays in the graph and
    its output is the scale, so it needs no variant. The library rule accepts any `scale`; a scale that is not
    a [D] vector (a gate, a per-token factor) would turn into an invalid RMSNormalization, so it is refused.
    """

    def __init__(self, *, weight_first: bool) -> None:
        super().__init__("rms_norm_weight_first" if weight_first else "rms_norm_weight_last", not weight_first)

    def check(  # type: ignore[override]
        self,
        context: MatchContext,
        x: ir.Value,
        scale: ir.Value,
        epsilon: ir.Value,
        compute_dtype: ir.Attr | None,
        target_dtype: ir.Attr | None,
        **_: object,
    ) -> MatchResult:
        result: MatchResult = super().check(context, x, scale, epsilon, compute_dtype, target_dtype)
        if not result:
            return result
        if context.model.opset_imports.get("", 0) < 23:
            return result.fail("model opset is below 23, which has no RMSNormalization")
        if not is_vector_over_last_axis(scale, x):
            return result.fail(f"scale has shape {scale.shape}, not [D] for input shape {x.shape}", scale)
        return result

    def rewrite(self, op: TapeBuilder, x: ir.Value, scale: ir.Value, epsilon: ir.Value, **rest: object) -> ir.Value:
        """RMSNormalization's result has x's type, so a scale of another type (gemma in float16 scales in
        float32 and casts afterwards) takes x cast to the scale's type, as the matched graph computed it."""
        if scale.dtype is not None and x.dtype != scale.dtype:
            widened = op.Cast(x, to=scale.dtype)
            widened.dtype, widened.shape = scale.dtype, x.shape.copy() if x.shape is not None else None
            x = widened
        fused: ir.Value = super().rewrite(op, x, scale, epsilon, **rest)
        return fused


# Standard norm -> the onnxruntime op that adds the residual first; the name stem of its rules.
_SKIP_OPS = {
    "RMSNormalization": ("SkipSimplifiedLayerNormalization", "skip_rms_norm"),
    "LayerNormalization": ("SkipLayerNormalization", "skip_layer_norm"),
}


class SkipNormFusion(pattern.RewriteRuleClassBase):
    """Residual Add + norm -> onnxruntime's Skip*Normalization (domain com.microsoft).

        x ──┐                                      x ──┐
            Add ──> sum ──> (other readers)            Skip{Simplified}LayerNormalization(epsilon)
        skip┘  │                              ==>  skip┤      ├─ output[0] ─> y
               RMSNormalization(gamma)       gamma ────┤      └─ output[3] ─> sum ──> (other readers)
               / LayerNormalization(gamma, beta?)  beta┘  (LayerNormalization's bias, when it has one)
               │
               y

    `norm_op` picks RMSNormalization -> SkipSimplifiedLayerNormalization or LayerNormalization ->
    SkipLayerNormalization. With `keep_sum` the pattern also returns the sum and fires only where the sum has
    readers besides the norm (the residual stream); without it, it fires only where the norm is the sum's
    sole reader (the matcher will not drop an Add that is read elsewhere), and the fused node has one output.
    """

    def __init__(self, norm_op: Literal["RMSNormalization", "LayerNormalization"], *, keep_sum: bool) -> None:
        self._skip_op, stem = _SKIP_OPS[norm_op]
        super().__init__(f"{stem}_residual" if keep_sum else stem)
        self._norm_op = norm_op
        self._keep_sum = keep_sum

    def pattern(
        self, op: OpsetPatternBuilder, x: ValuePattern, skip: ValuePattern, gamma: ValuePattern
    ) -> ValuePattern | tuple[ValuePattern, ValuePattern]:
        total = op.Add(x, skip, _outputs=["total"])
        norm = getattr(op, self._norm_op)  # LayerNormalization's optional bias is read in check / rewrite
        normalized = norm(total, gamma, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["normalized"])
        return (normalized, total) if self._keep_sum else normalized

    def check(  # type: ignore[override]
        self,
        context: MatchContext,
        x: ir.Value,
        skip: ir.Value,
        gamma: ir.Value,
        total: ir.Value,
        normalized: ir.Value,
        **_: object,
    ) -> MatchResult:
        result = MatchResult()
        norm = normalized.producer()
        assert norm is not None
        beta = _bias(norm)
        dims = known_dims(x)
        if dims is None:
            return result.fail(f"input shape {x.shape} is not fully known", x)
        if known_dims(skip) != dims:
            return result.fail(f"the Add broadcasts: input {x.shape}, skip {skip.shape}", skip)
        if len(dims) not in (2, 3):
            return result.fail(f"onnxruntime's Skip ops take rank 2 or 3, this input has rank {len(dims)}", x)
        axis = norm.attributes.get_int("axis", -1)
        if axis not in (-1, len(dims) - 1):
            return result.fail(f"{norm.op_type} normalizes from axis {axis}, not over the last axis only", norm)
        if norm.attributes.get_int("stash_type", 1) != ir.DataType.FLOAT:
            return result.fail(f"{norm.op_type} computes in a type other than float (stash_type)", norm)
        if x.dtype not in _SKIP_NORM_TYPES:
            return result.fail(f"element type {x.dtype} has no onnxruntime CPU Skip kernel", x)
        if any(v.dtype != x.dtype for v in (skip, gamma, beta, normalized) if v is not None):
            return result.fail("input, skip, weights and output differ in element type", norm)
        for weight in (gamma, beta):
            if weight is not None and not is_vector_over_last_axis(weight, x):
                return result.fail(f"{weight.name} has shape {weight.shape}, not [{dims[-1]}]", weight)
        if self._keep_sum and len(total.uses()) == 1 and not total.is_graph_output():
            return result.fail("the sum has no reader besides the norm (the single-output rule applies)", total)
        return result

    def rewrite(
        self, op: TapeBuilder, x: ir.Value, skip: ir.Value, gamma: ir.Value, normalized: ir.Value, **_: object
    ) -> ir.Value | tuple[ir.Value, ir.Value]:
        norm = normalized.producer()
        assert norm is not None
        beta = _bias(norm)
        inputs = [x, skip, gamma] if beta is None else [x, skip, gamma, beta]
        epsilon = norm.attributes.get_float("epsilon", 1e-5)
        # Outputs 1 and 2 (mean, inv_std_var) are for training; onnxruntime's CPU kernel never writes them.
        outputs = 4 if self._keep_sum else 1
        fused = op.op(self._skip_op, *inputs, epsilon=epsilon, _domain="com.microsoft", _outputs=outputs)
        if isinstance(fused, ir.Value):
            return fused
        return fused[0], fused[3]


def _bias(norm: ir.Node) -> ir.Value | None:
    """LayerNormalization's optional third input (RMSNormalization has none)."""
    return norm.inputs[2] if len(norm.inputs) > 2 else None


def norm_fusion() -> FusionPass:
    """RMSNorm subgraphs -> RMSNormalization (standard ONNX, opset 23)."""
    return FusionPass(
        "norm",
        {
            "rms_norm_weight_first": RMSNormFusion.rule(weight_first=True),
            "rms_norm_weight_last": RMSNormFusion.rule(weight_first=False),
        },
    )


def norm_lowering_ort() -> FusionPass:
    """Residual Add + RMSNormalization / LayerNormalization -> onnxruntime's Skip*Normalization."""
    return FusionPass(
        "norm_ort",
        {
            "skip_rms_norm_residual": SkipNormFusion.rule("RMSNormalization", keep_sum=True),
            "skip_rms_norm": SkipNormFusion.rule("RMSNormalization", keep_sum=False),
            "skip_layer_norm_residual": SkipNormFusion.rule("LayerNormalization", keep_sum=True),
            "skip_layer_norm": SkipNormFusion.rule("LayerNormalization", keep_sum=False),
        },
    )
