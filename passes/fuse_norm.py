"""Normalization fusion: RMSNorm subgraphs to `RMSNormalization`.

`norm_fusion` ("fuse", portable): the exporter writes RMSNorm (llama, mistral, qwen2, qwen3, phi3, gemma,
gemma2) as Pow / ReduceMean / Add / Sqrt / Reciprocal / Mul / Mul(weight); this becomes one opset-23
`RMSNormalization`, which onnxruntime, TensorRT and any opset-23 runtime execute as a single kernel.
LayerNorm needs no rule: torch.onnx already emits `LayerNormalization` for `aten.layer_norm` (gpt2: 5,
gpt_neox: 5, also for a float16 checkpoint), so there is no decomposed LayerNorm to fuse.

No target lowers a norm further: onnxruntime's `SimplifiedLayerNormalization` (which `onnx.checker` also
rejects at opset 23) and its residual-fusing Skip*Normalization ops measured no faster on its CPU kernels
(docs/performance.md, "onnxruntime's contrib norms and Gelu").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import onnx_ir as ir
from onnxscript.rewriter import MatchContext
from onnxscript.rewriter.pattern import MatchResult

# onnxscript's RMSNorm rule, which RMSNormFusion extends, is exported from no public module
from onnxscript.rewriter.rules.fusion import _rms_normalization

from passes.rewrite import FusionPass

if TYPE_CHECKING:  # annotations only: the public RewriterContext declares no op methods
    from onnxscript.rewriter._context import TapeBuilder

Dims = tuple[int | str, ...]


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


def norm_fusion() -> FusionPass:
    """RMSNorm subgraphs -> RMSNormalization (standard ONNX, opset 23)."""
    return FusionPass(
        "norm",
        {
            "rms_norm_weight_first": RMSNormFusion.rule(weight_first=True),
            "rms_norm_weight_last": RMSNormFusion.rule(weight_first=False),
        },
    )
