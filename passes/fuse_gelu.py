"""GELU fusions: 0.5·x·(1 + erf(x/√2)) and its tanh approximation to the standard `Gelu` (opset 20).

Where the exporter sees `F.gelu` it already writes `Gelu` (gemma's gelu_pytorch_tanh -> Gelu(approximate="tanh"),
gpt_neox's gelu -> Gelu(approximate="none")). Models that spell GELU out in Python reach the graph as
elementwise ops, e.g. gpt2's gelu_new:

    Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)), √(2/π))), 1))

`gelu_fusion` ("fuse", portable) turns both spelled-out forms into one `Gelu`, which every opset-20 runtime
has. `gelu_lowering_ort` ("lower-ort") folds a bias Add into onnxruntime's `BiasGelu` (gpt_neox: Add(MatMul,
bias) -> Gelu), the one GELU contrib op that is faster than the standard op on onnxruntime CPU.

onnxruntime's contrib `Gelu` and `FastGelu` measured no faster than the standard op on its CPU kernels, so a
standard `Gelu` is not lowered; `BiasGelu` measured faster than Add + Gelu, so that fusion is made. The
spelled-out tanh form costs several `Gelu`s as written; onnxruntime's own optimizer (ORT_ENABLE_ALL) re-fuses
it at session start, but TensorRT and a runtime without that optimizer see one op only after `gelu_fusion`.
The figures: docs/performance.md, "Kernel choices behind the passes".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import onnx_ir as ir
from onnxscript.rewriter import MatchContext, pattern
from onnxscript.rewriter.ort_fusions import bias_gelu
from onnxscript.rewriter.pattern import MatchResult, OpsetPatternBuilder

from kvforge.passes.fuse_norm import is_vector_over_last_axis
from kvforge.passes.rewrite import FusionPass

if TYPE_CHECKING:  # annotations only, from private modules where onnxscript exports no public name:
    from onnxscript.rewriter._context import TapeBuilder  # the public RewriterContext declares no op methods
    from onnxscript.rewriter._pattern_ir import ValuePattern  # a pattern's values: no public name

_SQRT_2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBIC = 0.044715

# Element types of Gelu-20.
_GELU_TYPES = frozenset([ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE])


class GeluFusion(pattern.RewriteRuleClassBase):
    """(x · 0.5) · (1 + f(x)) -> Gelu(x, approximate).

        x ─┬─ Mul(·, 0.5) ────────────────┐
           └─ f(x) ─ Add(·, 1) ────────── Mul ─> y          ==>       x ─> Gelu(approximate) ─> y

        approximate="none":  f(x) = Erf(Div(x, √2))  or  Erf(Mul(x, 1/√2))
        approximate="tanh":  f(x) = Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)), √(2/π)))

    This is the graph torch.onnx writes for `0.5 * x * (1 + f)` and `x * 0.5 * (1 + f)` (HF gelu_new,
    GELUActivation's Python form): torch puts a Python scalar second (`0.5 * x` is Mul(x, 0.5)), so operand
    order is matched as is, and a wrong constant is reported by `--explain` as the value it found (constants
    match to 1e-5 relative). Other groupings of the product do not occur in the supported architectures.
    """

    def __init__(self, approximate: Literal["none", "tanh"]) -> None:
        super().__init__("gelu_erf" if approximate == "none" else "gelu_tanh")
        self._approximate = approximate

    def pattern(self, op: OpsetPatternBuilder, x: ValuePattern) -> ValuePattern:
        if self._approximate == "tanh":
            f = op.Tanh(op.Mul(op.Add(x, op.Mul(op.Pow(x, 3.0), _TANH_CUBIC)), _SQRT_2_OVER_PI))
        else:  # x / sqrt(2) in models, x * M_SQRT1_2 in torch's own decomposition
            f = op.Erf(pattern.OrValue([op.Div(x, _SQRT_2), op.Mul(x, 1.0 / _SQRT_2)]))
        return op.Mul(op.Mul(x, 0.5), op.Add(f, 1.0))

    def check(self, context: MatchContext, x: ir.Value, **_: object) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        if context.model.opset_imports.get("", 0) < 20:
            return result.fail("model opset is below 20, which has no Gelu")
        if x.dtype not in _GELU_TYPES:
            return result.fail(f"element type {x.dtype} is not one Gelu takes", x)
        return result

    def rewrite(self, op: TapeBuilder, x: ir.Value, **_: object) -> ir.Value:
        gelu: ir.Value = op.Gelu(x, approximate=self._approximate)
        return gelu


class BiasGeluFusion(bias_gelu.BiasGeluFusion):
    """onnxscript's BiasGelu rule (standard Gelu), with the bias checked against the input's last dim.

        x ──┐
            Add ─ Gelu(approximate="none") ─> y      ==>      x, bias ─> com.microsoft BiasGelu ─> y
        bias┘

    The bias is the Add's second operand, as torch writes a Linear's bias. The library rule only checks that
    it is rank 1; onnxruntime's kernel also needs its length to be the input's last dim (a [1] bias broadcast
    by the Add fails at run time), and float or float16.
    """

    def __init__(self) -> None:
        super().__init__("bias_gelu", contrib_op=False)

    def check(  # type: ignore[override]
        self, context: MatchContext, gelu: ir.Value, input: ir.Value, bias: ir.Value, **_: object
    ) -> MatchResult:
        result: MatchResult = super().check(context, gelu, input, bias)
        if not result:
            return result
        if not is_vector_over_last_axis(bias, input):
            return result.fail(f"bias has shape {bias.shape}, not [D] for input shape {input.shape}", bias)
        if input.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16) or bias.dtype != input.dtype:
            return result.fail(f"element types {input.dtype}, {bias.dtype}: BiasGelu takes float or float16", input)
        return result


def gelu_fusion() -> FusionPass:
    """Spelled-out GELU (erf or tanh form) -> Gelu (standard ONNX, opset 20)."""
    return FusionPass("gelu", {"gelu_erf": GeluFusion.rule("none"), "gelu_tanh": GeluFusion.rule("tanh")})


def gelu_lowering_ort() -> FusionPass:
    """Add(x, bias) + Gelu -> com.microsoft BiasGelu; Gelu itself stays standard (no faster as a contrib op)."""
    return FusionPass("gelu_ort", {"bias_gelu": BiasGeluFusion.rule()})
