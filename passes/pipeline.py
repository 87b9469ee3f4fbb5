"""Per-target pass pipelines: literal lists of passes, grouped in phases, with a report.

Every pass is an `onnx_ir.passes` pass: `modified` is exact, and running a pipeline twice
changes nothing the second time (tests check both). Configuration lives in each pass's
constructor arguments, and those arguments are recorded in the report.
"""

from __future__ import annotations

import inspect
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassBase, PassResult, common
from onnxscript.optimizer import fold_constants_ir
from onnxscript.rewriter.rules import common as rules

from kvforge.passes.fuse_attention import (
    PastLengthFromMask,
    RequireOpset,
    RotaryInAttention,
    attention_fusion,
    attention_lowering_ort,
    attention_scatter,
)
from kvforge.passes.fuse_gelu import gelu_fusion, gelu_lowering_ort
from kvforge.passes.fuse_moe import moe_lowering_ort
from kvforge.passes.fuse_norm import norm_fusion, norm_lowering_ort
from kvforge.passes.fuse_rotary import rotary_fusion
from kvforge.passes.last_position import LastPositionLogits
from kvforge.passes.pack_matmul import pack_gate_up, pack_qkv
from kvforge.passes.quantize import (
    FormChooser,
    ImportQuantizedWeights,
    KernelForm,
    QuantizedWeight,
    QuantizeWeights,
    WeightQuantization,
)
from kvforge.passes.quantize_embedding import QuantizeEmbedding
from kvforge.passes.quantize_experts import QuantizeExperts
from kvforge.passes.rewrite import FusionPass
from kvforge.passes.targets import Target
from kvforge.passes.tensorrt import tensorrt_form
from kvforge.passes.tensorrt_check import RequireTensorRT
from kvforge.passes.weight_layout import FoldWeightTransposes

# The positions a graph returns logits for (kvforge.runners.contract's LOGITS_POSITIONS, the
# manifest's io.logits_positions): as many last ones as its `logits_to_keep` input says
# (default 1), the last one only, or every one.
LOGITS_POSITIONS = ("keep", "last", "all")

# Constant folding only touches tensors up to this many elements: shape arithmetic and
# small tables fold, weight matrices keep their checkpoint names.
FOLD_LIMIT_ELEMENTS = 1024


def _keep_weight_transposes(node: ir.Node) -> bool | None:
    """Never fold Transpose(weight): the fold would replace the checkpoint-named weight
    with an anonymous copy, and quantization wants the [out, in] layout as stored."""
    if node.op_type == "Transpose" and node.domain == "":
        source = node.inputs[0]
        if source is not None and source.is_initializer() and source.const_value is not None:
            return False if source.const_value.size > FOLD_LIMIT_ELEMENTS else None
    return None


# No-op and redundant shape/cast ops the exporter leaves around the ops fusions look for.
_SIMPLIFY_RULES = {
    "slice_noop": rules.collapse_slice_rule,
    "slice_full_range": rules.collapse_slice2_rule,
    "cast_noop": rules.no_op_cast_rule,
    "cast_cast": rules.cast_cast_rule,
    "expand_noop": rules.no_op_expand_rule,
    "transpose_noop": rules.no_op_transpose_rule,
    "transpose_transpose": rules.transpose_transpose_rule,
    "reshape_reshape": rules.reshape_reshape_rule,
    "unsqueeze_unsqueeze": rules.unsqueeze_unsqueeze_rule,
    "squeeze_reshape_1d": rules.squeeze_reshape_1d_rule,
    "mul_by_1": rules.mul_by_1_rule,
    "add_0": rules.add_0_rule,
    "sub_0": rules.sub_0_rule,
    "div_by_1": rules.div_by_1_rule,
}


class FoldConstantsPass(InPlacePass):
    """onnxscript's constant folding (`onnxscript.optimizer.fold_constants_ir`, whose pass class
    is not public) as a pass of the pipeline, with its settings as attributes for the report."""

    def __init__(
        self,
        *,
        shape_inference: bool,
        input_size_limit: int,
        output_size_limit: int,
        should_fold: Callable[[ir.Node], bool | None],
    ) -> None:
        super().__init__()
        self.shape_inference = shape_inference
        self.input_size_limit = input_size_limit
        self.output_size_limit = output_size_limit
        self.should_fold = should_fold

    def call(self, model: ir.Model) -> PassResult:
        result = fold_constants_ir(
            model,
            onnx_shape_inference=self.shape_inference,
            input_size_limit=self.input_size_limit,
            output_size_limit=self.output_size_limit,
            should_fold=self.should_fold,
        )
        return PassResult(model, result.modified)


def canonicalize() -> list[PassBase]:
    return [
        FoldConstantsPass(
            shape_inference=True,
            input_size_limit=FOLD_LIMIT_ELEMENTS,
            output_size_limit=FOLD_LIMIT_ELEMENTS,
            should_fold=_keep_weight_transposes,
        ),
        FusionPass("simplify", _SIMPLIFY_RULES),
        common.CommonSubexpressionEliminationPass(),
        common.IdentityEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
    ]


def fuse(logits: str = "keep") -> list[PassBase]:
    """Patterns of many small ops become the standard ONNX ops that name them; with `logits`
    "keep" (the default) the LM head runs on the last `logits_to_keep` positions (an input,
    default 1: a prefill computes one row, a speculative verify step every row it feeds), with
    "last" on the last position only, with "all" on every one."""
    fusions: list[PassBase] = [norm_fusion(), gelu_fusion(), rotary_fusion(), attention_fusion()]
    if logits == "all":
        return fusions
    return [*fusions, LastPositionLogits(to_keep=logits == "keep")]


def pack() -> list[PassBase]:
    """Projections that read the same input become one MatMul over concatenated weights.

    Every target: GPU runtimes save a kernel launch per packed projection, and on
    onnxruntime's CPU kernels the reference decodes faster packed (MatMulNBits quantizes its
    input once for q/k/v instead of three times; docs/performance.md has the figures).
    """
    return [pack_qkv(), pack_gate_up()]


def lower_ort(moe: bool, rotary_positions: int | None = None) -> list[PassBase]:
    """Standard ops become onnxruntime's contrib ops where those are faster on its CPU kernels;
    in a mixture of experts (`moe`), the gather-form experts block becomes com.microsoft MoE
    (passes/fuse_moe.py), which reads each token's selected experts' weights in place. With
    `rotary_positions` (the model's context; given where the onnxruntime that runs the graph
    has GroupQueryAttention's `query_seqlens`, 1.32 on), q and k are rotated inside
    GroupQueryAttention over tables of that many positions (`RotaryInAttention`).

    Not here: residual Add + norm as SkipSimplifiedLayerNormalization / SkipLayerNormalization.
    onnxruntime's CPU Skip kernels measured slower than the standard Add + RMSNormalization /
    LayerNormalization they would replace (docs/performance.md, "Kernel choices behind the passes").
    """
    moe_passes: list[PassBase] = [moe_lowering_ort()] if moe else []
    rotary: list[PassBase] = [RotaryInAttention(rotary_positions)] if rotary_positions else []
    return [PastLengthFromMask(), attention_lowering_ort(), *rotary, gelu_lowering_ort(), *moe_passes]


def lower_ort_cuda(moe: bool) -> list[PassBase]:
    """`lower_ort` for onnxruntime's CUDA provider: its contrib ops (GroupQueryAttention with
    the in-place cache, BiasGelu), residual Add + norm as SkipSimplifiedLayerNormalization /
    SkipLayerNormalization (fused kernels there), and com.microsoft MoE only in the forms its
    CUDA kernels compute as the CPU kernel does (passes/fuse_moe.py; the graph is verified on
    the CPU where no GPU is at hand)."""
    moe_passes: list[PassBase] = [moe_lowering_ort(cuda=True)] if moe else []
    return [PastLengthFromMask(), attention_lowering_ort(), gelu_lowering_ort(), norm_lowering_ort(), *moe_passes]


def fixed_cache() -> list[PassBase]:
    """The KV cache becomes a fixed-size buffer updated by TensorScatter (opset 24), read
    whole by Attention under a mask: standard ops only, past and present one buffer."""
    return [PastLengthFromMask(), attention_scatter(), RequireOpset(24, ("TensorScatter",))]


def quantize(
    target: Target,
    weights: WeightQuantization,
    moe: bool = False,
    choose: FormChooser | None = None,
    imported: dict[str, QuantizedWeight] | None = None,
    scales: Mapping[str, np.ndarray] | None = None,
) -> list[PassBase]:
    """Weight-only quantization in the form the target's runtime reads (its record's
    `quantization_forms`: onnxruntime's MatMulNBits for its own targets, standard block-wise
    DequantizeLinear + MatMul otherwise, per channel for TensorRT's int8). A mixture of experts'
    routed experts (`moe`) in the target's `expert_quantization` (passes/quantize_experts.py).
    Then the token-embedding table in the target's `embedding_form`, after the LM head so that a
    tied table shares the head's quantized initializers. `choose` picks each MatMulNBits
    weight's block size and accuracy level (`kvforge.toolchain.tune`); other forms ignore it. `scales`:
    calibrated weights' scales by name (`kvforge.toolchain.calibration`), which their codes are rounded against."""
    passes: list[PassBase] = [
        weights.make_pass(
            target.quantization_form(weights.bits),
            choose,
            target.quantization_form(8),
            scales,
            tied_lookup=target.tied_lookup,
        )
    ]
    if moe and target.expert_quantization is not None:
        passes.append(
            QuantizeExperts(weights.bits, weights.block_size, target.expert_quantization, weights.without_zero_points)
        )
    if target.embedding_form is not None:
        passes.append(QuantizeEmbedding.from_weights(weights, target.embedding_form, imported))
    return passes


def tensorrt(capacity: int) -> list[PassBase]:
    """The portable graph restricted to what TensorRT's ONNX parser imports natively: a
    fixed-length cache of `capacity` positions, a boolean mask built with BOOL-capable ops,
    RotaryEmbedding over position_ids (passes/tensorrt.py has each constraint's source)."""
    return list(tensorrt_form(capacity))


def finalize() -> list[PassBase]:
    """Weights stored as their MatMuls read them, then the canonical clean-up: fusions leave
    shape ops and transposes that now cancel."""
    return [FoldWeightTransposes(), *canonicalize()]


def finalize_tensorrt(dtype: str) -> list[PassBase]:
    """`finalize`, then the postcondition: every node one the parser imports, every float
    in the compute `dtype` (or float32, where the model computes in float32)."""
    return [*finalize(), RequireTensorRT(dtype)]


# A phase by the name a target's record gives it (passes/targets.py): the name the pass report
# shows, and the factory of its passes. A factory may take the build's settings by keyword
# (`capacity`, `dtype`); `phases` passes those it names.
PHASES: dict[str, tuple[str, Callable[..., list[PassBase]]]] = {
    "canonicalize": ("canonicalize", canonicalize),
    "fuse": ("fuse", fuse),
    "pack": ("pack", pack),
    "lower-ort": ("lower-ort", lower_ort),
    "lower-ort-cuda": ("lower-ort", lower_ort_cuda),
    "fixed-cache": ("fixed-cache", fixed_cache),
    "tensorrt": ("tensorrt", tensorrt),
    "finalize": ("finalize", finalize),
    "finalize-tensorrt": ("finalize", finalize_tensorrt),
}


@dataclass(frozen=True)
class PassRecord:
    phase: str
    name: str
    config: dict[str, Any]
    modified: bool
    nodes_before: int
    nodes_after: int
    seconds: float
    fusions: dict[str, int] = field(default_factory=dict)  # rule -> times it fired (fusion passes)


@dataclass
class PassReport:
    target: str
    histogram_before: dict[str, int] = field(default_factory=dict)
    histogram_after: dict[str, int] = field(default_factory=dict)
    passes: list[PassRecord] = field(default_factory=list)
    # fusion -> [rule: why it fell short], for fusions that fired fewer times than expected
    missed: dict[str, list[str]] = field(default_factory=dict)
    # quantized weight (its codes' initializer) -> (MatMulNBits form, (N, K)), where a form was
    # chosen per weight (`quantize`'s `choose`); recorded in the manifest as `kernels`, not here
    kernel_forms: dict[str, tuple[KernelForm, tuple[int, int]]] = field(default_factory=dict)
    # graph weight -> the form a pre-quantized checkpoint's weight was imported in (`imported_weights`
    # in the manifest), not here
    imported: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self, timings: bool = True) -> dict[str, Any]:
        """JSON-able; without timings it is the same for the same graph (for reproducible manifests)."""
        data = asdict(self)
        del data["kernel_forms"], data["imported"]
        if not timings:
            for record in data["passes"]:
                del record["seconds"]
        return data

    def summary(self) -> str:
        lines = [
            f"passes for target {self.target}: {_count(self.histogram_before)} -> {_count(self.histogram_after)} nodes"
        ]
        for r in self.passes:
            change = f"{r.nodes_before} -> {r.nodes_after} nodes" if r.modified else "no change"
            lines.append(f"  {r.phase:<13} {r.name:<38} {change:<22} {r.seconds * 1000:8.1f} ms")
            fired = {rule: n for rule, n in r.fusions.items() if n}
            if fired and r.phase != "canonicalize" and r.phase != "finalize":
                lines.append("  " + " " * 13 + "  fused: " + ", ".join(f"{rule} x{n}" for rule, n in fired.items()))
        top = sorted(self.histogram_after.items(), key=lambda kv: (-kv[1], kv[0]))[:12]
        lines.append("  ops after: " + ", ".join(f"{op} {n}" for op, n in top))
        return "\n".join(lines)

    def explanation(self) -> str:
        if not self.missed:
            return "every expected fusion fired"
        lines = []
        for fusion, reasons in self.missed.items():
            if fusion in (QuantizeWeights.__name__, QuantizeEmbedding.__name__):
                lines.append("weights left at full precision:")
            elif fusion == QuantizeExperts.__name__:
                lines.append("expert weights stored otherwise than asked:")
            else:
                lines.append(f"fusion {fusion} fired fewer times than expected:")
            lines.extend(f"  {reason}" for reason in reasons)
        return "\n".join(lines)


def histogram(model: ir.Model) -> dict[str, int]:
    counts = Counter(
        f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph)
    )
    return dict(sorted(counts.items()))


def phases(
    target: Target,
    weights: WeightQuantization | None = None,
    capacity: int | None = None,
    dtype: str = "float32",
    logits: str | None = None,
    moe: bool = False,
    choose: FormChooser | None = None,
    imported: dict[str, QuantizedWeight] | None = None,
    scales: Mapping[str, np.ndarray] | None = None,
    rotary_positions: int | None = None,
) -> list[tuple[str, list[PassBase]]]:
    """The target's phases with their passes; quantization, when asked for, runs just before
    `finalize`, after the fusions and packing whose MatMuls it quantizes. `logits` is "keep"
    (the LM head on the last `logits_to_keep` positions, an input), "last" (the last position
    only) or "all" (every position); None: the target's default (`Target.default_logits`). `moe`: the model has
    routed experts (the passes for them are left out of a dense model's pipeline). `choose`:
    each MatMulNBits weight's form (`quantize`). `imported`: weights the checkpoint ships
    quantized, by name, written with their own codes (`import_quantized`) before any other
    weight is quantized. `rotary_positions`: see `lower_ort`."""
    logits = target.default_logits if logits is None else logits
    if logits not in LOGITS_POSITIONS:
        raise ValueError(f"logits must be one of {', '.join(LOGITS_POSITIONS)}, got {logits!r}")
    if logits == "keep" and not target.logits_to_keep:
        raise ValueError(f"target {target.name} takes no logits_to_keep input; pass logits 'last' or 'all'")
    settings = {
        "capacity": capacity,
        "dtype": dtype,
        "logits": logits,
        "moe": moe,
        "rotary_positions": rotary_positions,
    }
    result = [(phase, _make(make_passes, settings)) for phase, make_passes in (PHASES[p] for p in target.phases)]
    quantizing = import_quantized(target, imported, weights) if imported else []
    if weights is not None:
        quantizing += quantize(target, weights, moe, choose, imported, scales)
    if quantizing:
        result.insert(len(result) - 1, ("quantize", quantizing))
    return result


def imports_codes(target: Target) -> bool:
    """Whether `target` reads a pre-quantized checkpoint's weights with their own codes
    (`import_quantized`), rather than keeping them float."""
    return target.quantization_form(4) in ("matmul_nbits", "dequantize_linear") and not target.symmetric_only


def import_quantized(
    target: Target, imported: dict[str, QuantizedWeight], weights: WeightQuantization | None
) -> list[PassBase]:
    """A pre-quantized checkpoint's weights with their own codes, in the form the target reads
    4-bit weights in. With no `--weights` recipe, MatMulNBits takes float activations (accuracy
    level 0), so the graph computes what the dequantized checkpoint does to float rounding and
    the build is judged by the float gate; with one, the recipe's accuracy level. A target whose
    weights are per-channel (TensorRT's int8) or symmetric only keeps them float."""
    if not imports_codes(target):
        return []
    form = target.quantization_form(4)
    passes: list[PassBase] = [ImportQuantizedWeights(imported, form, 0 if weights is None else weights.accuracy_level)]
    if weights is None and target.embedding_form is not None:  # the table too, where it ships quantized
        passes.append(QuantizeEmbedding(8, form=target.embedding_form, imported=imported, only_imported=True))
    return passes


def run(
    model: ir.Model,
    target: Target,
    expected: Mapping[str, int] | None = None,
    weights: WeightQuantization | None = None,
    capacity: int | None = None,
    dtype: str = "float32",
    on_pass: Callable[[int, int, str], None] | None = None,
    logits: str | None = None,
    moe: bool = False,
    choose: FormChooser | None = None,
    imported: dict[str, QuantizedWeight] | None = None,
    scales: Mapping[str, np.ndarray] | None = None,
    rotary_positions: int | None = None,
) -> PassReport:
    """Run the pipeline of `target` (its record, `kvforge.passes.targets`) on `model` in place and report
    what each pass did.

    `expected` maps fusion pass names to how often they should fire for this model; a
    fusion that falls short is explained (closest match, failed constraint) in `missed`.
    `weights` adds the weight-only quantization phase. `capacity` is the fixed KV-cache
    length of a target that needs one (`tensorrt`); `dtype` the graph's compute dtype; `logits`
    "keep", "last" or "all" (the positions the graph returns logits for, `phases`).
    `on_pass(done, total, name)` is called after each pass (progress). `moe`: the model has
    routed experts, which get the mixture-of-experts lowering and expert quantization.
    `choose` picks each MatMulNBits weight's block size and accuracy level (`report.kernel_forms`).
    `scales`: calibrated weights' scales by name (`kvforge.toolchain.calibration`).
    `rotary_positions`: the model's context, where q and k may be rotated inside
    GroupQueryAttention (`lower_ort`).
    """
    expected = dict(expected or {})
    report = PassReport(target.name, histogram_before=histogram(model))
    pipeline = phases(target, weights, capacity, dtype, logits, moe, choose, imported, scales, rotary_positions)
    total = sum(len(passes) for _, passes in pipeline)
    for phase, passes in pipeline:
        for p in passes:
            before = len(model.graph)
            start = time.perf_counter()
            result = p(model)
            seconds = time.perf_counter() - start
            model = result.model
            name = pass_name(p)
            fusions = (
                dict(p.counts)
                if isinstance(p, (FusionPass, QuantizeWeights, QuantizeExperts, ImportQuantizedWeights))
                else {}
            )
            report.passes.append(
                PassRecord(phase, name, _config(p), result.modified, before, len(model.graph), seconds, fusions)
            )
            if isinstance(p, FusionPass) and name in expected and sum(fusions.values()) < expected[name]:
                report.missed[name] = [str(miss) for miss in p.explain(model)]
            if isinstance(p, QuantizeWeights):
                report.kernel_forms.update(p.forms)
            if isinstance(p, (ImportQuantizedWeights, QuantizeEmbedding)):
                report.imported.update(p.imported_forms)
            if isinstance(p, QuantizeWeights) and p.counts["skipped"]:
                report.missed[name] = [f"{w}: {why}" for w, why in p.skipped.items() if not why.startswith("kept")]
            if isinstance(p, QuantizeExperts) and p.notes:
                report.missed[name] = [f"{w}: {why}" for w, why in p.notes.items()]
            if on_pass is not None:
                on_pass(len(report.passes), total, name)
    report.histogram_after = histogram(model)
    return report


def _make(make_passes: Callable[..., list[PassBase]], settings: Mapping[str, Any]) -> list[PassBase]:
    """Call a phase factory with the settings its signature names; a required one (no default)
    left unset is an error."""
    wanted = inspect.signature(make_passes).parameters
    missing = [name for name, p in wanted.items() if settings.get(name) is None and p.default is p.empty]
    if missing:
        raise ValueError(f"pass phase {make_passes.__name__} needs {', '.join(missing)}; pass it to pipeline.run")
    return make_passes(**{name: settings[name] for name in wanted})


def pass_name(p: PassBase) -> str:
    """A fusion pass is named by what it fuses; any other pass by its class."""
    return p.name if isinstance(p, FusionPass) else type(p).__name__


def _config(p: PassBase) -> dict[str, Any]:
    config = {k: v for k, v in vars(p).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}
    config.pop("name", None)
    return config


def _count(hist: dict[str, int]) -> int:
    return sum(hist.values())
