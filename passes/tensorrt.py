"""The portable graph in the form TensorRT's ONNX parser builds a plain engine from.

The `tensorrt` target runs the `onnx` target's phases, then these passes, then the
checker (`kvforge.passes.tensorrt_check`). Each pass turns one construct the parser refuses or
maps badly into one it takes natively (TensorRT 10.15; sources in docs/tensorrt.md):

- `FixCapacity`: the KV cache inputs and outputs get a fixed sequence length `S_max`.
  TensorRT's KV-cache update layer (`IKVCacheUpdateLayer`, which `TensorScatter` imports to)
  needs a cache that is a network input "with a static sequence length dimension", whose
  output is a network output sharing the input's memory
  (docs.nvidia.com/deeplearning/tensorrt/latest/_static/operators/KVCacheUpdate.html).
- `ConcatCacheToScatter`: a model exported with eager attention (softcapping: gemma2) keeps
  its cache as `Concat(past, new)`; it becomes the same in-place `TensorScatter` update,
  read back through a `Slice` of the valid positions, so every architecture gets the fixed
  cache. (`Attention`'s `softcap` attribute is unsupported by the parser, so such a model
  keeps its MatMul / Tanh / Softmax attention.)
- `BoolMaskToCapacity`: the attention mask padded to `S_max` with `Pad(mask, .., False)`
  becomes `Concat(mask, Expand(False))`: the parser's `Pad` takes no BOOL tensors, `Concat`
  and `Expand` do (onnx-tensorrt docs/operators.md, TensorRT 10.15).
- `RotaryPositionIds`: `RotaryEmbedding(x, Cos(freqs), Sin(freqs))`, with the tables computed
  per token from `position_ids`, becomes `RotaryEmbedding(x, cos_cache, sin_cache,
  position_ids)` over constant `[S_max, rotary_dim / 2]` tables, the form
  `IRotaryEmbeddingLayer` takes with its position-ids input (int64, as the parser requires).
- `DropDefaultAttentionAttributes`: `Attention`'s `softcap` and `qk_matmul_output_mode`,
  which the parser lists as unsupported, are removed where they hold their default (0),
  which means the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from kvforge.passes.fuse_attention import RequireOpset

PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."


def _int_attr(node: ir.Node, name: str, default: int | None) -> int | None:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _const_ints(value: ir.Value | None) -> list[int] | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else [int(v) for v in tensor.numpy().reshape(-1)]


def _typed(dtype: ir.DataType, *nodes: ir.Node) -> None:
    """New nodes' outputs get their element type at once (shape inference runs later, in finalize)."""
    for node in nodes:
        node.outputs[0].dtype = dtype


def _constant(graph: ir.Graph, before: ir.Node, array: np.ndarray) -> ir.Value:
    node = ir.node("Constant", [], attributes={"value": ir.tensor(array)})
    graph.insert_before(before, node)
    value = node.outputs[0]
    value.dtype = ir.DataType.from_numpy(array.dtype)
    value.shape = ir.Shape(list(array.shape))
    return value


class FixCapacity(InPlacePass):
    """The sequence axis (2) of every `past_key_values.*` input and `present.*` output becomes `capacity`.

    Only a `shared` cache (each present produced by a `TensorScatter` of its past) is fixed;
    run after the cache is made a buffer (`AttentionToTensorScatter`, `ConcatCacheToScatter`).
    """

    def __init__(self, capacity: int, past_prefix: str = PAST_PREFIX, present_prefix: str = PRESENT_PREFIX) -> None:
        super().__init__()
        if capacity < 1:
            raise ValueError(f"capacity must be a positive number of positions, got {capacity}")
        self.capacity = capacity
        self.past_prefix = past_prefix
        self.present_prefix = present_prefix

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        values = [v for v in graph.inputs if (v.name or "").startswith(self.past_prefix)]
        values += [v for v in graph.outputs if (v.name or "").startswith(self.present_prefix)]
        modified = False
        for value in values:
            shape = value.shape
            if shape is None or len(shape) != 4 or shape[2] == self.capacity:
                continue
            dims = list(shape)
            dims[2] = self.capacity
            value.shape = ir.Shape(dims)
            modified = True
        return PassResult(model, modified=modified)


class ConcatCacheToScatter(InPlacePass):
    """`present = Concat(past, new, axis=-2)` becomes an in-place update of a fixed buffer.

    ```
    past [B,H,past,D] ─┐
    new  [B,H,S,D]   ──┴─ Concat(axis=-2) ─► present ─► (attention reads it)
    ```
    becomes
    ```
    w = (T - S) per row                       T: attention_mask length, S: new positions
    present = TensorScatter(past, new, w, axis=-2, mode="linear")     [B,H,S_max,D], a graph output
    keys    = Slice(present, 0, T, axis=2)                             what the attention read before
    ```
    The attention after it is unchanged: it reads the same `T` positions it read from the
    `Concat`. Used for models exported with eager attention, which have no `Attention` op
    for `AttentionToTensorScatter` to rewrite.
    """

    def __init__(
        self, mask_input: str = "attention_mask", past_prefix: str = PAST_PREFIX, present_prefix: str = PRESENT_PREFIX
    ) -> None:
        super().__init__()
        self.mask_input = mask_input
        self.past_prefix = past_prefix
        self.present_prefix = present_prefix

    def _matches(self, node: ir.Node) -> bool:
        if node.op_type != "Concat" or node.domain != "" or len(node.inputs) != 2:
            return False
        past, new = node.inputs
        out = node.outputs[0]
        return (
            past is not None
            and new is not None
            and past.is_graph_input()
            and (past.name or "").startswith(self.past_prefix)
            and _int_attr(node, "axis", None) in (-2, 2)
            and out.is_graph_output()
            and (out.name or "").startswith(self.present_prefix)
        )

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        mask = next((v for v in graph.inputs if v.name == self.mask_input), None)
        if mask is None:
            return PassResult(model, modified=False)
        concats = [node for node in graph if self._matches(node)]
        for node in concats:
            past, new = node.inputs
            assert past is not None and new is not None
            present = node.outputs[0]
            total = ir.node("Shape", [mask], attributes={"start": 1, "end": 2})
            seq = ir.node("Shape", [new], attributes={"start": 2, "end": 3})
            written = ir.node("Sub", [total.outputs[0], seq.outputs[0]])
            batch = ir.node("Shape", [new], attributes={"start": 0, "end": 1})
            indices = ir.node("Expand", [written.outputs[0], batch.outputs[0]])
            scatter = ir.node(
                "TensorScatter", [past, new, indices.outputs[0]], attributes={"axis": -2, "mode": "linear"}
            )
            graph.insert_before(node, [total, seq, written, batch, indices, scatter])
            starts = _constant(graph, node, np.array([0], dtype=np.int64))
            axes = _constant(graph, node, np.array([2], dtype=np.int64))
            keys = ir.node("Slice", [scatter.outputs[0], starts, total.outputs[0], axes])
            graph.insert_before(node, keys)
            _typed(ir.DataType.INT64, total, seq, written, batch, indices)
            updated = scatter.outputs[0]
            updated.type, updated.shape = past.type, past.shape
            keys.outputs[0].type, keys.outputs[0].shape = present.type, present.shape
            index = next(i for i, v in enumerate(graph.outputs) if v is present)
            name = present.name
            graph.outputs[index] = updated  # the graph output first: the readers get the slice
            present.name = None
            updated.name = name
            present.replace_all_uses_with(keys.outputs[0])
            graph.remove(node, safe=True)
        return PassResult(model, modified=bool(concats))


class BoolMaskToCapacity(InPlacePass):
    """`Pad(mask, [0,0,0,0, 0,0,0,free], False)` of a 4-D boolean mask becomes
    `Concat(mask, Expand(False, [B, 1, S, free]), axis=-1)`: the same values, in ops whose
    TensorRT importers take BOOL (its `Pad` does not)."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        pads = [node for node in graph if self._free_positions(node) is not None]
        for node in pads:
            mask = node.inputs[0]
            free = self._free_positions(node)
            assert mask is not None and free is not None
            leading = ir.node("Shape", [mask], attributes={"start": 0, "end": 3})
            shape = ir.node("Concat", [leading.outputs[0], free], attributes={"axis": 0})
            graph.insert_before(node, [leading, shape])
            false = _constant(graph, node, np.array(False))
            block = ir.node("Expand", [false, shape.outputs[0]])
            full = ir.node("Concat", [mask, block.outputs[0]], attributes={"axis": -1})
            graph.insert_before(node, [block, full])
            out = node.outputs[0]
            _typed(ir.DataType.INT64, leading, shape)
            _typed(ir.DataType.BOOL, block)
            full.outputs[0].dtype, full.outputs[0].shape = ir.DataType.BOOL, out.shape
            out.replace_all_uses_with(full.outputs[0], replace_graph_outputs=True)
            graph.remove(node, safe=True)
        return PassResult(model, modified=bool(pads))

    @staticmethod
    def _free_positions(node: ir.Node) -> ir.Value | None:
        """The 1-element end padding of the last axis, if this Pad pads only there with False."""
        if node.op_type != "Pad" or node.domain != "" or len(node.inputs) < 3:
            return None
        mask, pads, value = node.inputs[0], node.inputs[1], node.inputs[2]
        if mask is None or mask.dtype != ir.DataType.BOOL or mask.shape is None or len(mask.shape) != 4:
            return None
        if len(node.inputs) > 3 or (node.attributes.get("mode") and node.attributes["mode"].value != "constant"):
            return None
        fill = ir.convenience.get_const_tensor(value) if value is not None else None
        if fill is None or bool(fill.numpy().reshape(-1)[0]):
            return None
        concat = pads.producer() if pads is not None else None
        if concat is None or concat.op_type != "Concat" or concat.domain != "" or len(concat.inputs) != 2:
            return None
        zeros, free = concat.inputs
        if _const_ints(zeros) != [0] * 7 or free is None or (free.shape is not None and list(free.shape) != [1]):
            return None
        return free


# The ops the per-position rotary angle computation may use, evaluated with numpy.
_EVALUATORS: dict[str, Callable[[ir.Node, list[np.ndarray]], np.ndarray]] = {
    "Unsqueeze": lambda n, a: np.expand_dims(a[0], tuple(int(x) for x in a[1].reshape(-1))),
    "Cast": lambda n, a: a[0].astype(ir.DataType(_int_attr(n, "to", 1) or 1).numpy()),
    "Mul": lambda n, a: np.multiply(a[0], a[1]),
    "Div": lambda n, a: np.divide(a[0], a[1]),
    "MatMul": lambda n, a: np.matmul(a[0], a[1]),
    "Transpose": lambda n, a: np.transpose(a[0], n.attributes["perm"].value if "perm" in n.attributes else None),
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


class RotaryPositionIds(InPlacePass):
    """`RotaryEmbedding(x, Cos(freqs), Sin(freqs))` with `freqs` computed from `position_ids`
    becomes `RotaryEmbedding(x, cos_cache, sin_cache, position_ids)`.

    ```
    position_ids ─ Unsqueeze ─ Cast ─ Mul(inv_freq) ─► freqs [B,S,R/2] ─┬─ Cos ─ (Cast)? ─┐
                                                                       └─ Sin ─ (Cast)? ─┴─ RotaryEmbedding(x, cos, sin)
    ```
    becomes `RotaryEmbedding(x, cos_cache, sin_cache, position_ids)` with
    `cos_cache = Cos(freqs at positions 0..S_max-1)` as a constant `[S_max, R/2]` table (and
    `sin_cache` likewise). `freqs` is evaluated with numpy in its own dtype, op for op, so
    the table holds the values the graph computed per token. `S_max` is the KV buffer's
    fixed length (run `FixCapacity` first): no position reaches it.
    """

    def __init__(self, position_input: str = "position_ids", past_prefix: str = PAST_PREFIX) -> None:
        super().__init__()
        self.position_input = position_input
        self.past_prefix = past_prefix

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        positions = next((v for v in graph.inputs if v.name == self.position_input), None)
        capacity = self._capacity(graph)
        if positions is None or capacity is None:
            return PassResult(model, modified=False)
        feed = np.arange(capacity, dtype=np.int64)[None, :]
        tables: dict[tuple[int, ir.DataType | None], tuple[ir.Value, ir.Value]] = {}
        modified = False
        for node in list(graph):
            freqs = self._frequencies(node)
            if freqs is None:
                continue
            x = node.inputs[0]
            key = (id(freqs), x.dtype if x is not None else None)
            if key not in tables:
                angles = _evaluate(freqs, positions, feed)
                if angles is None or angles.ndim != 3 or angles.shape[:2] != (1, capacity):
                    continue
                dtype = key[1].numpy() if key[1] is not None else angles.dtype
                tables[key] = self._tables(graph, angles[0], dtype, len(tables))
            cos_cache, sin_cache = tables[key]
            node.replace_input_with(1, cos_cache)
            node.replace_input_with(2, sin_cache)
            node.resize_inputs(4)
            node.replace_input_with(3, positions)
            modified = True
        return PassResult(model, modified=modified)

    def _capacity(self, graph: ir.Graph) -> int | None:
        lengths = {
            v.shape[2]
            for v in graph.inputs
            if (v.name or "").startswith(self.past_prefix) and v.shape is not None and len(v.shape) == 4
        }
        length = lengths.pop() if len(lengths) == 1 else None
        return length if isinstance(length, int) else None

    @staticmethod
    def _frequencies(node: ir.Node) -> ir.Value | None:
        if node.op_type != "RotaryEmbedding" or node.domain != "" or len(node.inputs) != 3:
            return None
        cos, sin = node.inputs[1], node.inputs[2]
        cos_node, sin_node = _through_cast(cos), _through_cast(sin)
        if cos_node is None or sin_node is None or (cos_node.op_type, sin_node.op_type) != ("Cos", "Sin"):
            return None
        if cos_node.domain or sin_node.domain or cos_node.inputs[0] is not sin_node.inputs[0]:
            return None
        return cos_node.inputs[0]

    @staticmethod
    def _tables(graph: ir.Graph, angles: np.ndarray, dtype: np.dtype, index: int) -> tuple[ir.Value, ir.Value]:
        """Cos and sin of the angles in their own dtype, as the graph computed them, then in
        `dtype`, the rotated values' (float32 tables cast for a float16 model)."""
        suffix = "" if index == 0 else f"_{index}"
        made = []
        for name, function in (("cos", np.cos), ("sin", np.sin)):
            table = function(angles).astype(angles.dtype).astype(dtype)
            value = ir.Value(
                name=f"rotary.{name}_cache{suffix}",
                type=ir.TensorType(ir.DataType.from_numpy(table.dtype)),
                shape=ir.Shape(list(table.shape)),
                const_value=ir.tensor(table),
            )
            graph.register_initializer(value)
            made.append(value)
        return made[0], made[1]


def _through_cast(value: ir.Value | None) -> ir.Node | None:
    """The producer of `value`, or of the Cast's input when `value` is a Cast's output."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Cast" and not node.domain:
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node


class DropDefaultAttentionAttributes(InPlacePass):
    """`Attention` attributes TensorRT's importer refuses are removed where they hold the
    default, which means the same: `softcap=0` (no capping), `qk_matmul_output_mode=0`."""

    DEFAULTS = {"softcap": 0.0, "qk_matmul_output_mode": 0}

    def call(self, model: ir.Model) -> PassResult:
        modified = False
        for node in model.graph:
            if node.op_type != "Attention" or node.domain != "":
                continue
            for name, default in self.DEFAULTS.items():
                attr = node.attributes.get(name)
                if attr is not None and attr.value == default:
                    del node.attributes[name]
                    modified = True
        return PassResult(model, modified=modified)


def tensorrt_form(capacity: int) -> list[InPlacePass]:
    """The passes between the portable fixed cache and the TensorRT checker, in order."""
    return [
        ConcatCacheToScatter(),
        RequireOpset(24, ("TensorScatter",)),
        FixCapacity(capacity),
        BoolMaskToCapacity(),
        RotaryPositionIds(),
        DropDefaultAttentionAttributes(),
    ]
