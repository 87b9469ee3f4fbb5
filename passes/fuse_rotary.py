"""Rotary position embedding, as Hugging Face writes it, -> ONNX opset-23 `RotaryEmbedding`.

The exporter leaves rotary as `q * cos + rotate_half(q) * sin` per head tensor, with cos/sin built once from
`Concat(freqs, freqs)`. `RotaryEmbedding` takes the half-width tables directly (`[batch, seq, rotary_dim / 2]`,
no position_ids input), so the replacement computes `Cos(freqs)` / `Sin(freqs)` from the existing freqs: the
same values, exactly, since both halves of the concatenated table are equal. Each match makes its own pair;
common-subexpression elimination afterwards leaves one pair shared by every layer, and removes the old table.

onnxscript's `RotaryEmbedding23Fusion` matches these graphs too, but does not check that the tables line up
with the input's batch and sequence dims (onnxruntime rejects a broadcast `[1, seq, d]` table that the
decomposed Mul accepted), needs a static head count that the 4-D form does not use, handles partial rotary
as a second rule over its own output, and matches the shared table, so it must keep matched nodes
(`remove_nodes=False`), after which onnxscript sweeps the whole graph for dead nodes whether or not the rule
fired (a pass that reports no change could still have changed the graph). This rule matches the per-head
nodes only and verifies the table in `check`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult

from kvforge.passes.rewrite import FusionPass


def rotary_fusion() -> FusionPass:
    """Full and partial rotary -> RotaryEmbedding. Partial first: its inner rotation is a full one in shape."""
    return FusionPass("rotary", {"rotary_partial": RotaryFusion.rule(partial=True), "rotary": RotaryFusion.rule()})


class RotaryFusion(pattern.RewriteRuleClassBase):
    """`x * cos + rotate_half(x) * sin` on `x [B, H, S, D]` -> `RotaryEmbedding(x, Cos(freqs), Sin(freqs))`.

    Matched, full rotary (`r = D`)::

        x ─┬──────────────────────────────────────────── Mul(x, cos) ─┐
           ├─ Slice(x, 0, r/2) ───────────────┐                       ├─ Add ─> y
           └─ Slice(x, r/2, end) ─ Neg ─ Concat(-x2, x1) ─ Mul(·, sin) ┘

    With `partial=True` (phi3, gpt_neox: only the first `r < D` channels rotate), `x` above is
    `Slice(x, 0, r)` and the result is `Concat(y, Slice(x, r, end))`.

    Checked, not matched (shared by q and k and by every layer, so it stays for CSE to clean up)::

        cos = Unsqueeze(Cos(Concat(freqs, freqs, axis=-1)), [1]),  sin = the same with Sin

    In a float16/bfloat16 model the tables are computed in float32 and cast to x's dtype
    (`Unsqueeze(Cast(Cos(...)))`); the replacement casts its tables the same way.

    Replacement::

        RotaryEmbedding(x, Cos(freqs), Sin(freqs), interleaved=0[, rotary_embedding_dim=r]) ─> y
    """

    def __init__(self, partial: bool = False) -> None:
        super().__init__(name="PartialRotaryEmbedding" if partial else "RotaryEmbedding")
        self._partial = partial

    def pattern(self, op: Any, x: Any, cos: Any, sin: Any) -> Any:
        rotated = _slice(op, x, "rot") if self._partial else x
        half_turned = op.Concat(op.Neg(_slice(op, rotated, "hi")), _slice(op, rotated, "lo"), axis=-1)
        y = op.Add(op.Mul(rotated, cos), op.Mul(half_turned, sin))
        return op.Concat(y, _slice(op, x, "pass"), axis=-1) if self._partial else y

    def check(self, context: Any, x: ir.Value, cos: ir.Value, sin: ir.Value, **bound: Any) -> MatchResult:  # type: ignore[override]
        result = MatchResult()
        shape = x.shape
        if shape is None or len(shape) != 4 or not isinstance(shape[3], int):
            return result.fail(f"{x.name} is not known to be 4-D with a static head_dim: {shape}", x)
        head_dim = rotary_dim = shape[3]
        if self._partial:
            rotated, kept = _last_axis_slice(bound, "rot"), _last_axis_slice(bound, "pass")
            if rotated is None or rotated[0] != 0 or not 0 < rotated[1] < head_dim:
                return result.fail(f"rotated part is not x[..., :r] with 0 < r < {head_dim}: {rotated}", x)
            rotary_dim = rotated[1]
            if kept is None or kept[0] != rotary_dim or kept[1] < head_dim:
                return result.fail(f"pass-through part is not x[..., {rotary_dim}:]: {kept}", x)
        half = rotary_dim // 2
        low, high = _last_axis_slice(bound, "lo"), _last_axis_slice(bound, "hi")
        if rotary_dim % 2 or low != (0, half) or high is None or high[0] != half or high[1] < rotary_dim:
            return result.fail(f"rotate_half does not split {rotary_dim} channels at {half}: {low}, {high}", x)
        freqs = _frequencies(cos, sin)
        if freqs is None:
            return result.fail("cos/sin are not Unsqueeze(Cos/Sin(Concat(freqs, freqs, axis=-1)), axes=[1])", cos)
        return _check_table(result, x, freqs, half)

    def rewrite(self, op: Any, x: ir.Value, cos: ir.Value, sin: ir.Value, **bound: Any) -> Any:
        freqs = _frequencies(cos, sin)
        assert freqs is not None  # check passed
        half_cos, half_sin = op.Cos(freqs), op.Sin(freqs)
        if x.dtype is not None and x.dtype != freqs.dtype:
            half_cos, half_sin = op.Cast(half_cos, to=x.dtype), op.Cast(half_sin, to=x.dtype)
            for table in (half_cos, half_sin):
                table.dtype, table.shape = x.dtype, freqs.shape.copy() if freqs.shape is not None else None
        if not self._partial:
            return op.RotaryEmbedding(x, half_cos, half_sin, interleaved=0)
        rotated = _last_axis_slice(bound, "rot")
        assert rotated is not None  # check passed
        return op.RotaryEmbedding(x, half_cos, half_sin, interleaved=0, rotary_embedding_dim=rotated[1])


def _slice(op: Any, x: Any, name: str) -> Any:
    """`Slice(x, starts, ends, axes, steps)`, its operands bound as `{name}_start` .. `{name}_steps` for `check`."""
    return op.Slice(x, *(pattern.Var(f"{name}_{operand}") for operand in ("start", "end", "axes", "steps")))


def _frequencies(cos: ir.Value, sin: ir.Value) -> ir.Value | None:
    """`freqs` if cos and sin are Unsqueeze([Cast](Cos / Sin(Concat(freqs, freqs, axis=-1))), [1]) of one
    Concat, the Cast (if any) to the dtype of the values the tables rotate."""
    tables = []
    for value, trig in ((cos, "Cos"), (sin, "Sin")):
        unsqueeze = _producer(value, "Unsqueeze")
        if unsqueeze is None or _ints(unsqueeze.inputs[1]) != [1]:
            return None
        table = unsqueeze.inputs[0]
        if (cast := _producer(table, "Cast")) is not None:
            table = cast.inputs[0]
        node = _producer(table, trig)
        if node is None:
            return None
        tables.append(node.inputs[0])
    concat = _producer(tables[0], "Concat")
    if tables[0] is not tables[1] or concat is None or len(concat.inputs) != 2:
        return None
    freqs = concat.inputs[0]
    if freqs is None or freqs.shape is None or concat.inputs[1] is not freqs:
        return None
    axis = concat.attributes.get_int("axis")
    return freqs if axis in (-1, len(freqs.shape) - 1) else None


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and node.domain == "" else None


def _check_table(result: MatchResult, x: ir.Value, freqs: ir.Value, half: int) -> MatchResult:
    """freqs must be `[batch, seq, rotary_dim / 2]` with x's batch and seq: RotaryEmbedding does not broadcast."""
    table, shape = freqs.shape, x.shape
    if table is None or shape is None or len(table) != 3:
        return result.fail(f"freqs {freqs.name} is not known to be 3-D [batch, seq, rotary_dim / 2]", freqs)
    if table[2] != half:
        return result.fail(f"freqs {freqs.name} has {table[2]} channels, rotate_half expects {half}", freqs)
    if not (_same_dim(table[0], shape[0]) and _same_dim(table[1], shape[2])):
        return result.fail(f"freqs {freqs.name} {table} does not match the batch and seq of {x.name} {shape}", freqs)
    return result


def _same_dim(a: int | ir.SymbolicDim, b: int | ir.SymbolicDim) -> bool:
    """Provably equal: the same static size, or the same named symbolic dim (an unnamed one proves nothing)."""
    if isinstance(a, ir.SymbolicDim):
        return isinstance(b, ir.SymbolicDim) and a.value is not None and a.value == b.value
    return a == b


def _last_axis_slice(bound: dict[str, Any], prefix: str) -> tuple[int, int] | None:
    """(start, end) of the bound `Slice(_, start, end, axes, steps)` if on the last of 4 axes with step 1."""
    start, end = _ints(bound[f"{prefix}_start"]), _ints(bound[f"{prefix}_end"])
    axes, steps = _ints(bound[f"{prefix}_axes"]), _ints(bound[f"{prefix}_steps"])
    if axes not in ([3], [-1]) or steps != [1] or start is None or end is None or len(start) != 1 or len(end) != 1:
        return None
    return start[0], end[0]


def _ints(value: ir.Value | None) -> list[int] | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    return [int(v) for v in tensor.numpy().reshape(-1)]


# ---------------------------------------------------------------------------------------
# The per-token tables as constant tables over positions, for the runtimes whose rotary op
# reads `cos_cache[position]` (TensorRT's RotaryEmbedding with position ids, onnxruntime's
# GroupQueryAttention with do_rotary).


def table_frequencies(node: ir.Node) -> ir.Value | None:
    """`freqs` when `node` is `RotaryEmbedding(x, Cos(freqs), Sin(freqs))` (each table maybe Cast
    to x's dtype), the form `RotaryFusion` writes; None otherwise."""
    if node.op_type != "RotaryEmbedding" or node.domain != "" or len(node.inputs) != 3:
        return None
    cos_node, sin_node = _through_cast(node.inputs[1]), _through_cast(node.inputs[2])
    if cos_node is None or sin_node is None or (cos_node.op_type, sin_node.op_type) != ("Cos", "Sin"):
        return None
    if cos_node.domain or sin_node.domain or cos_node.inputs[0] is not sin_node.inputs[0]:
        return None
    return cos_node.inputs[0]


class PositionTables:
    """Constant `[count, rotary_dim / 2]` cos and sin tables over positions 0 .. count - 1, one
    pair per distinct `freqs` and dtype, registered in `graph` as `rotary.cos_cache`, ...

    `freqs` is evaluated with numpy in its own dtype, op for op (`_evaluate`), from `positions`
    (the graph input the per-token angles are computed from) fed 0 .. count - 1, so a table
    row holds the values the graph computed for that position; cos and sin are taken in that
    dtype too, then cast to the dtype of the values the tables rotate."""

    def __init__(self, graph: ir.Graph, positions: ir.Value, count: int) -> None:
        self.graph, self.positions, self.count = graph, positions, count
        self._feed = np.arange(count, dtype=np.int64)[None, :]
        self._made: dict[tuple[int, ir.DataType | None], tuple[ir.Value, ir.Value] | None] = {}

    def of(self, freqs: ir.Value, dtype: ir.DataType | None) -> tuple[ir.Value, ir.Value] | None:
        """(cos_cache, sin_cache) for `freqs` in `dtype` (None: freqs' own), or None where freqs is
        not computed from the positions by the elementwise ops `_evaluate` knows."""
        key = (id(freqs), dtype)
        if key not in self._made:
            angles = _evaluate(freqs, self.positions, self._feed)
            if angles is None or angles.ndim != 3 or angles.shape[:2] != (1, self.count):
                self._made[key] = None
            else:
                made = sum(pair is not None for pair in self._made.values())
                stored = dtype.numpy() if dtype is not None else angles.dtype
                self._made[key] = self._tables(angles[0], stored, "" if made == 0 else f"_{made}")
        return self._made[key]

    def _tables(self, angles: np.ndarray, dtype: np.dtype, suffix: str) -> tuple[ir.Value, ir.Value]:
        made = []
        for name, function in (("cos", np.cos), ("sin", np.sin)):
            table = function(angles).astype(angles.dtype).astype(dtype)
            value = ir.Value(
                name=f"rotary.{name}_cache{suffix}",
                type=ir.TensorType(ir.DataType.from_numpy(table.dtype)),
                shape=ir.Shape(list(table.shape)),
                const_value=ir.tensor(table),
            )
            self.graph.register_initializer(value)
            made.append(value)
        return made[0], made[1]


def _through_cast(value: ir.Value | None) -> ir.Node | None:
    """The producer of `value`, or of the Cast's input when `value` is a Cast's output."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Cast" and not node.domain:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node


def _cast_to(node: ir.Node) -> np.dtype:
    attr = node.attributes.get("to")
    return ir.DataType(int(attr.value) if attr is not None else 1).numpy()


def _unsqueeze(node: ir.Node, args: list[np.ndarray]) -> np.ndarray:
    return np.expand_dims(args[0], tuple(int(x) for x in args[1].reshape(-1)))


def _transpose(node: ir.Node, args: list[np.ndarray]) -> np.ndarray:
    perm = node.attributes.get("perm")
    return np.transpose(args[0], None if perm is None else perm.value)


# The ops the per-position rotary angle computation may use, evaluated with numpy.
_EVALUATORS: dict[str, Callable[[ir.Node, list[np.ndarray]], np.ndarray]] = {
    "Unsqueeze": _unsqueeze,
    "Cast": lambda n, a: a[0].astype(_cast_to(n)),
    "Mul": lambda n, a: np.multiply(a[0], a[1]),
    "Div": lambda n, a: np.divide(a[0], a[1]),
    "MatMul": lambda n, a: np.matmul(a[0], a[1]),
    "Transpose": _transpose,
}


def _evaluate(value: ir.Value, positions: ir.Value, feed: np.ndarray, depth: int = 0) -> np.ndarray | None:
    """The value of `value` when `positions` holds `feed`, if it is computed from it and constants by
    the elementwise ops above; None otherwise."""
    if value is positions:
        return feed
    constant = ir.convenience.get_const_tensor(value)
    if constant is not None:
        return constant.numpy()
    node = value.producer()
    if node is None or node.domain != "" or node.op_type not in _EVALUATORS or depth > 16:
        return None
    args = []
    for operand in node.inputs:
        result = _evaluate(operand, positions, feed, depth + 1) if operand is not None else None
        if result is None:
            return None
        args.append(result)
    return _EVALUATORS[node.op_type](node, args)
