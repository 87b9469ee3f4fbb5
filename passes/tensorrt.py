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

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from kvforge.passes.fuse_attention import RequireOpset
from kvforge.passes.fuse_rotary import PositionTables, table_frequencies

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
        tables = PositionTables(graph, positions, capacity)
        modified = False
        for node in list(graph):
            freqs = table_frequencies(node)
            made = None if freqs is None or node.inputs[0] is None else tables.of(freqs, node.inputs[0].dtype)
            if made is None:
                continue
            cos_cache, sin_cache = made
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
