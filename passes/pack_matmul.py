"""Pack sibling projections: MatMuls that read the same input become one MatMul on concatenated weights, then Split.

Attention's q/k/v projections and the MLP's gate/up projections each read the same hidden state; packed, they
are one kernel launch instead of two or three and one wide GEMM for kernels that want one (fused attention
with packed QKV input). On onnxruntime CPU at decode shapes fp32 gains little (the weights' bytes, which
decode is bound by, do not change), quantized weights more (MatMulNBits quantizes its input once for the
packed projection); passes/pipeline.py has the figures. Checkpoints such as phi3 ship these weights packed
already; this makes the others look the
same: the packed weight is a new initializer named like phi3's (`...qkv_proj.weight`, `...gate_up_proj.weight`),
stored in the layout the projections were stored in (`[out, in]` read through `Transpose` as exported, so
weight-only quantization sees the layout it expects), and the old weights leave the graph once nothing reads them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult

from kvforge.passes.rewrite import FusionPass
from kvforge.passes.weight_layout import StackedRows


def pack_qkv() -> FusionPass:
    """Three projections of one input (attention's q, k, v) -> one MatMul + Split; with bias Adds first."""
    return FusionPass("pack_qkv", {"qkv_bias": _qkv_rule(bias=True), "qkv": _qkv_rule(bias=False)})


def pack_gate_up() -> FusionPass:
    """`act(x @ gate) * (x @ up)` -> one MatMul + Split, the activation and the product left as they were."""
    return FusionPass("pack_gate_up", {f"gate_up_{act}": PackGateUp.rule(act) for act in _ACTIVATIONS})


@dataclass(frozen=True)
class _Projection:
    """One matched `MatMul(x, W)` (+ bias): the weight initializer and how the MatMul reads it."""

    weight: ir.Value
    transposed: bool  # read as Transpose(weight): stored [out, in], as exported
    bias: ir.Value | None = None

    @property
    def kernel(self) -> np.ndarray:
        """The weight as [out, in], whatever its stored layout."""
        array = _constant(self.weight).numpy()
        return array if self.transposed else array.T

    @property
    def out_features(self) -> int:
        shape = _constant(self.weight).shape
        return shape[0] if self.transposed else shape[1]


def _weight(op: Any, w: Any, tag: str) -> Any:
    """The weight operand of a projection: Transpose(W[out, in]) as exported, or W[in, out] where it was folded."""
    return pattern.OrValue([op.Transpose(w, perm=[1, 0]), w], tag_var=tag, tag_values=[True, False])


def _projection_pattern(op: Any, x: Any, w: Any, b: Any, tag: str, bias: bool) -> Any:
    y = op.MatMul(x, _weight(op, w, tag))
    return op.Add(y, b) if bias else y


class _PackRule(pattern.RewriteRuleClassBase):
    """Drops the weights it packed as soon as nothing reads them: at each rewrite those of the
    match before (whose nodes the rewriter has removed since), the rest when the rule is done.
    So a model's originals and packed copies never all coexist: one match's worth at most."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self._packed_weights: list[ir.Value] = []

    def _replaced(self, values: Iterable[ir.Value]) -> None:
        self._packed_weights = _remove_unused_initializers(self._packed_weights)
        self._packed_weights.extend(values)

    def setup(self) -> None:
        self._packed_weights = []

    def cleanup(self) -> None:
        _remove_unused_initializers(self._packed_weights)
        self._packed_weights = []


class PackQkv(_PackRule):
    """Three MatMuls of the same `x` with constant weights -> one MatMul on the concatenated weights.

    Matched (`bias=True` adds the Adds; each weight may also be read directly, without the Transpose)::

        x ──┬─ MatMul(x, Transpose(Wq)) ─ Add(·, bq) ─> q
            ├─ MatMul(x, Transpose(Wk)) ─ Add(·, bk) ─> k
            └─ MatMul(x, Transpose(Wv)) ─ Add(·, bv) ─> v

    Replacement (Wqkv = concat(Wq, Wk, Wv) along out, a new initializer named `...qkv_proj.weight`)::

        x ─ MatMul(x, Transpose(Wqkv)) ─ Add(·, bqkv) ─ Split(axis=-1, [out_q, out_k, out_v]) ─> q, k, v
    """

    def __init__(self, bias: bool) -> None:
        super().__init__("PackQkvBias" if bias else "PackQkv")
        self._bias = bias

    def pattern(self, op: Any, x: Any, wq: Any, wk: Any, wv: Any, bq: Any, bk: Any, bv: Any) -> Any:
        return tuple(
            _projection_pattern(op, x, w, b, f"{name}_transposed", self._bias)
            for name, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv))
        )

    def check(self, context: Any, **bindings: Any) -> MatchResult:  # type: ignore[override]
        return _check_projections(_bound_projections(bindings, "qkv", self._bias))

    def rewrite(self, op: Any, x: ir.Value, **bindings: Any) -> Any:
        projections = _bound_projections(bindings, "qkv", self._bias)
        self._replaced([*(p.weight for p in projections), *(p.bias for p in projections if p.bias is not None)])
        packed = _packed_matmul(op, x, projections)
        sizes = op.Constant(value_ints=[p.out_features for p in projections])
        return op.Split(packed, sizes, axis=-1, _outputs=len(projections))


@dataclass(frozen=True)
class _Activation:
    """A gate activation as the exporter writes it; its last node's output is bound as `activated`, so the
    rewrite can rebuild it with the matched node's attributes (Gelu's `approximate`)."""

    pattern: Callable[[Any, Any], Any]
    rebuild: Callable[[Any, Any, ir.Node], Any]


_ACTIVATIONS = {
    "silu": _Activation(
        lambda op, g: op.Mul(g, op.Sigmoid(g), _outputs=["activated"]),
        lambda op, g, node: op.Mul(g, op.Sigmoid(g)),
    ),
    "gelu": _Activation(
        lambda op, g: op.Gelu(g, _outputs=["activated"]),
        lambda op, g, node: op.Gelu(g, **node.attributes),
    ),
}


class PackGateUp(_PackRule):
    """The gated MLP's two projections of `x` -> one MatMul; `activation` is "silu" or "gelu".

    Matched (for "silu", act(g) is Mul(g, Sigmoid(g)); for "gelu", Gelu(g) with its `approximate`)::

        x ──┬─ MatMul(x, Transpose(Wg)) ─ act ─┐
            └─ MatMul(x, Transpose(Wu)) ───────┴─ Mul ─> h

    Replacement (Wgu = concat(Wg, Wu) along out, a new initializer named `...gate_up_proj.weight`)::

        x ─ MatMul(x, Transpose(Wgu)) ─ Split(axis=-1, [out_g, out_u]) ─┬─ g ─ act ─┐
                                                                      └─ u ───────┴─ Mul ─> h
    """

    def __init__(self, activation: str) -> None:
        super().__init__(name=f"PackGateUp_{activation}")
        self._activation = _ACTIVATIONS[activation]

    def pattern(self, op: Any, x: Any, wg: Any, wu: Any) -> Any:
        gate = op.MatMul(x, _weight(op, wg, "g_transposed"))
        up = op.MatMul(x, _weight(op, wu, "u_transposed"))
        return op.Mul(self._activation.pattern(op, gate), up)

    def check(self, context: Any, **bindings: Any) -> MatchResult:  # type: ignore[override]
        return _check_projections(_bound_projections(bindings, "gu", bias=False))

    def rewrite(self, op: Any, x: ir.Value, activated: ir.Value, **bindings: Any) -> Any:
        projections = _bound_projections(bindings, "gu", bias=False)
        self._replaced(p.weight for p in projections)
        packed = _packed_matmul(op, x, projections)
        sizes = op.Constant(value_ints=[p.out_features for p in projections])
        gate, up = op.Split(packed, sizes, axis=-1, _outputs=2)
        activation = activated.producer()
        assert activation is not None  # bound to a pattern node's output
        return op.Mul(self._activation.rebuild(op, gate, activation), up)


def _bound_projections(bindings: dict[str, Any], names: str, bias: bool) -> list[_Projection]:
    return [
        _Projection(bindings[f"w{n}"], bool(bindings[f"{n}_transposed"]), bindings.get(f"b{n}") if bias else None)
        for n in names
    ]


def _check_projections(projections: Sequence[_Projection]) -> MatchResult:
    result = MatchResult()
    weights = [p.weight for p in projections]
    if len(set(weights)) != len(weights):
        return result.fail("two of the projections read the same weight", list[ir.Node | ir.Value](weights))
    for p in projections:
        tensor = _constant(p.weight)
        if tensor is None:
            return result.fail(f"weight {p.weight.name} is not a constant initializer", p.weight)
        if len(tensor.shape) != 2:
            return result.fail(f"weight {p.weight.name} is not 2-D: {tensor.shape}", p.weight)
        if p.bias is not None:
            bias = _constant(p.bias)
            if bias is None:
                return result.fail(f"bias {p.bias.name} is not a constant initializer", p.bias)
            if bias.shape != (p.out_features,) or bias.dtype != tensor.dtype:
                return result.fail(f"bias {p.bias.name} is not a {tensor.dtype} vector of {p.out_features}", p.bias)
    dtypes = {_constant(w).dtype for w in weights}
    if len(dtypes) != 1:
        return result.fail(f"weights differ in dtype: {', '.join(f'{w.name} {_constant(w).dtype}' for w in weights)}")
    return result


def _constant(value: ir.Value) -> Any:
    """The value's tensor if it is an initializer nothing can override at run time, else None."""
    if not value.is_initializer() or value.is_graph_input():
        return None
    return value.const_value


def _packed_matmul(op: Any, x: ir.Value, projections: Sequence[_Projection]) -> Any:
    """MatMul(x, packed weights) (+ packed bias), the weights in the layout the projections were stored in."""
    first = projections[0]
    taken = first.weight.graph.initializers if first.weight.graph is not None else {}
    transposed = all(p.transposed for p in projections)
    name = _packed_name([p.weight.name or "" for p in projections], taken)
    dtype = _constant(first.weight).dtype
    if transposed:  # [sum(out), in], stacked as written: the parts are not copied
        sources = [p.weight.name or "" for p in projections]
        weight = op.initializer(StackedRows([p.kernel for p in projections], dtype, name, sources))
    else:
        kernel = np.concatenate([p.kernel for p in projections], axis=0)
        weight = op.initializer(ir.tensor(kernel.T, dtype=dtype, name=name))
    y = op.MatMul(x, op.Transpose(weight, perm=[1, 0]) if transposed else weight)
    biases = [p.bias for p in projections if p.bias is not None]
    if not biases:
        return y
    values = np.concatenate([_constant(b).numpy() for b in biases])
    name = _packed_name([b.name or "" for b in biases], taken)
    return op.Add(y, op.initializer(ir.tensor(values, dtype=biases[0].dtype, name=name)))


def _packed_name(names: Sequence[str], taken: Container[str]) -> str:
    """`a.q_proj.weight`, `a.k_proj.weight`, `a.v_proj.weight` -> `a.qkv_proj.weight`; `gate_proj`, `up_proj`
    -> `gate_up_proj` (phi3's names for the same packed weights); made unique against `taken`."""
    parts = [name.split(".") for name in names]
    differing = [i for i, column in enumerate(zip(*parts)) if len(set(column)) > 1]
    if len({len(p) for p in parts}) == 1 and len(differing) == 1:
        i = differing[0]
        words = [p[i].split("_") for p in parts]
        shared = 0
        while shared < min(len(w) for w in words) - 1 and len({tuple(w[-shared - 1 :]) for w in words}) == 1:
            shared += 1
        stems = ["_".join(w[: len(w) - shared]) for w in words]
        joined = ("" if all(len(s) == 1 for s in stems) else "_").join(stems)
        base = ".".join([*parts[0][:i], "_".join([joined, *words[0][len(words[0]) - shared :]]), *parts[0][i + 1 :]])
    else:
        base = "+".join(names) + ".packed"
    return next(name for name in _numbered(base) if name not in taken)


def _numbered(base: str) -> Iterator[str]:
    yield base
    n = 1
    while True:
        yield f"{base}.{n}"
        n += 1


def _remove_unused_initializers(values: Sequence[ir.Value]) -> list[ir.Value]:
    """Unregister the initializers among `values` that nothing reads; returns the others."""
    kept = []
    for value in values:
        graph = value.graph
        if graph is None or value.uses() or value.is_graph_output() or value.is_graph_input():
            kept.append(value)
            continue
        if value.name is not None and graph.initializers.get(value.name) is value:
            del graph.initializers[value.name]
    return kept


class _NearbyMatcher(pattern.SimplePatternMatcher):
    """Multi-output matching restricted to the root's neighbourhood, each graph node used once.

    onnxscript's own loop tries the root against every combination of same-typed nodes in the whole graph
    (cubic in model size for three outputs: minutes on a 32-layer model), and returns the first structural
    match even when it binds one node to two outputs (q, q, q), which then fails `check` and hides (q, k, v).
    The outputs of a packing pattern all read one input within `depth` nodes of the root, so only nodes that
    close are candidates. Built on SimplePatternMatcher's `_init_match` / `_match_node` / `_multi_match`
    (onnxscript 0.7); the tests exercise it.
    """

    def __init__(self, graph_pattern: Any, depth: int) -> None:
        super().__init__(graph_pattern)
        self._depth = depth

    def match(
        self,
        model: ir.Model,
        graph_or_function: ir.Graph | ir.Function,
        node: ir.Node,
        *,
        verbose: int = 0,
        remove_nodes: bool = True,
        tracer: Any = None,
    ) -> Any:
        root, *others = self.pattern.output_nodes
        if node.op_identifier() != root.op_identifier():
            return MatchResult().fail(f"{node.op_type} cannot start this pattern")
        self._tracer = tracer
        self._graph = graph_or_function if isinstance(graph_or_function, ir.Graph) else graph_or_function.graph
        self._init_match(verbose)
        if not self._match_node(root, node):  # the root alone, so a miss names the first node that differs
            return self._match
        where = node.name or node.outputs[0].name
        result = self._match.fail(f"no {len(others)} other nodes near {where} complete the pattern")
        near = _downstream(_upstream(node, self._depth), self._depth) - {node}
        nearby = [n for n in graph_or_function if n in near]  # graph order: the first match is deterministic
        candidates = [[n for n in nearby if n.op_identifier() == other.op_identifier()] for other in others]
        for combination in itertools.product(*candidates):
            if len(set(combination)) < len(combination):
                continue
            self._init_match(verbose)
            result = self._multi_match((node, *combination), check_removable=remove_nodes)
            if result:
                return result
        return result


def _upstream(node: ir.Node, depth: int) -> set[ir.Value]:
    values: set[ir.Value] = set()
    frontier = [node]
    for _ in range(depth):
        inputs = {v for n in frontier for v in n.inputs if v is not None} - values
        values |= inputs
        frontier = [p for v in inputs if (p := v.producer()) is not None]
    return values


def _downstream(values: set[ir.Value], depth: int) -> set[ir.Node]:
    nodes: set[ir.Node] = set()
    frontier = values
    for _ in range(depth):
        consumers = {use.node for v in frontier for use in v.uses()} - nodes
        nodes |= consumers
        frontier = {out for n in consumers for out in n.outputs}
    return nodes


def _qkv_rule(bias: bool) -> pattern.RewriteRule:
    rule = PackQkv(bias)
    return pattern.RewriteRule(
        rule.pattern,
        rule.rewrite,
        rule.check,
        name=rule.name,
        matcher=lambda graph_pattern: _NearbyMatcher(graph_pattern, depth=3),
        graph_pre_visitor=rule.setup,
        graph_post_visitor=rule.cleanup,
    )
