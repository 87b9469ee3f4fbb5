"""Per-target pass pipelines: literal lists of passes, grouped in phases, with a report.

Every pass is an `onnx_ir.passes` pass: `modified` is exact, and running a pipeline twice
changes nothing the second time (tests check both). Configuration lives in each pass's
constructor arguments, and those arguments are recorded in the report.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx_ir as ir
from onnx_ir.passes import PassBase, common
from onnxscript.optimizer._constant_folding import FoldConstantsPass

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


def canonicalize() -> list[PassBase]:
    return [
        FoldConstantsPass(
            shape_inference=False,
            input_size_limit=FOLD_LIMIT_ELEMENTS,
            output_size_limit=FOLD_LIMIT_ELEMENTS,
            should_fold=_keep_weight_transposes,
        ),
        common.CommonSubexpressionEliminationPass(),
        common.IdentityEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
    ]


# target -> phases, in order. A phase is a name and the passes it runs.
PIPELINES: dict[str, list[tuple[str, Callable[[], list[PassBase]]]]] = {
    "onnx": [("canonicalize", canonicalize)],
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


@dataclass
class PassReport:
    target: str
    histogram_before: dict[str, int] = field(default_factory=dict)
    histogram_after: dict[str, int] = field(default_factory=dict)
    passes: list[PassRecord] = field(default_factory=list)

    def to_dict(self, timings: bool = True) -> dict[str, Any]:
        """JSON-able; without timings it is the same for the same graph (for reproducible manifests)."""
        data = asdict(self)
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
        top = sorted(self.histogram_after.items(), key=lambda kv: (-kv[1], kv[0]))[:12]
        lines.append("  ops after: " + ", ".join(f"{op} {n}" for op, n in top))
        return "\n".join(lines)


def histogram(model: ir.Model) -> dict[str, int]:
    counts = Counter(
        f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in ir.traversal.RecursiveGraphIterator(model.graph)
    )
    return dict(sorted(counts.items()))


def run(model: ir.Model, target: str) -> PassReport:
    """Run the target's pipeline on `model` in place and report what each pass did."""
    if target not in PIPELINES:
        raise KeyError(f"no pass pipeline for target {target!r}; known: {', '.join(PIPELINES)}")
    report = PassReport(target, histogram_before=histogram(model))
    for phase, make_passes in PIPELINES[target]:
        for p in make_passes():
            before = len(model.graph)
            start = time.perf_counter()
            result = p(model)
            seconds = time.perf_counter() - start
            model = result.model
            report.passes.append(
                PassRecord(phase, type(p).__name__, _config(p), result.modified, before, len(model.graph), seconds)
            )
    report.histogram_after = histogram(model)
    return report


def _config(p: PassBase) -> dict[str, Any]:
    return {k: v for k, v in vars(p).items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}


def _count(hist: dict[str, int]) -> int:
    return sum(hist.values())
