"""Compute a half-precision graph in float32, its weights read as they are stored.

onnxruntime's CPU provider has no bfloat16 kernels for MatMul and most other ops, so a
`--dtype bf16` graph cannot run where the verification gate runs; an fp16 graph runs, but
only because onnxruntime converts every fp16 weight to a float32 copy when it loads it
(twice the weights' bytes, resident: 6 GB for 1.5B parameters). The gate runs this pass's
copy of the graph instead: the same nodes, every narrow value type, constant and Cast
target made float32, and each narrow weight left as stored (the artifact's own bytes)
and read through a `Cast` to float32 inserted before its first reader (quantization
scales, which their ops need constant, are widened in place). Every bfloat16 or
fp16 value is exactly a float32 one, so the copy checks the graph's structure and its
weights against the eager model within the narrow dtype's tolerance; the narrow
arithmetic itself is the runtime's.

```
W (bf16 initializer) ───────────────────► MatMul ─► Cast(to=bf16) ─► y (bf16)
W (bf16 initializer) ─► Cast(to=f32) ───► MatMul ─► Cast(to=f32)  ─► y (f32)
```

Run on onnxruntime without graph optimizations (constant folding would turn the Casts back
into float32 copies of the weights) and in priority order (each Cast then runs just before
its reader, so one weight at a time is held in float32: `kvforge.runners.session.OrtSession`'s
`weights_cast_per_run`).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

# Attributes that name an element type; a node whose attribute names `narrow` produces it.
_DTYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")
# Ops whose float inputs must stay constant initializers: onnxruntime's MatMulNBits packs its
# scales with the codes when the session loads and computes garbage from scales a Cast
# produces (docs/performance.md, "Kernel choices behind the passes"); the block-quantized
# lookup and DequantizeLinear read scales the same way. Their scales are widened in place instead: a
# scale per block is a small fraction of the weights' bytes.
_READ_AS_CONSTANTS = frozenset(
    {("com.microsoft", "MatMulNBits"), ("com.microsoft", "GatherBlockQuantized"), ("", "DequantizeLinear")}
)


class WidenFloats(InPlacePass):
    """Every `narrow` value, constant and element-type attribute becomes `wide`; every `narrow`
    initializer is read through a Cast to `wide`, or, read by an op in `_READ_AS_CONSTANTS`,
    becomes a `wide` initializer itself."""

    def __init__(self, narrow: ir.DataType = ir.DataType.BFLOAT16, wide: ir.DataType = ir.DataType.FLOAT) -> None:
        super().__init__()
        self.narrow = narrow
        self.wide = wide

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        order = {node: index for index, node in enumerate(graph)}
        for value in list(graph.initializers.values()):
            modified |= self._read_through_cast(graph, value, order)
        for value in [*graph.inputs, *graph.outputs]:
            modified |= self._widen_value(value)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            modified |= self._widen_attributes(node)
            for value in node.outputs:
                modified |= self._widen_value(value)
        return PassResult(model, modified=modified)

    def _read_through_cast(self, graph: ir.Graph, value: ir.Value, order: dict[ir.Node, int]) -> bool:
        """Whether `value`, a `narrow` initializer, now reaches its readers through a new Cast (or,
        read by an op that needs it constant, is now a `wide` one itself)."""
        uses = [(node, index) for node, index in value.uses() if not self._widens(node)]
        if value.dtype != self.narrow or not uses:
            return False
        if any((node.domain, node.op_type) in _READ_AS_CONSTANTS for node, _ in uses):
            value.const_value = self._widen_tensor(value.const_value)  # type: ignore[arg-type]
            value.dtype = self.wide
            return True
        cast = ir.node("Cast", [value], {"to": self.wide})
        wide = cast.outputs[0]
        wide.name, wide.dtype, wide.shape = f"{value.name}.{self.wide.name.lower()}", self.wide, value.shape
        for node, index in uses:
            node.replace_input_with(index, wide)
        top_level = [node for node, _ in uses if node in order]
        first = min(top_level, key=order.__getitem__) if len(top_level) == len(uses) else next(iter(graph))
        graph.insert_before(first, cast)
        return True

    def _widens(self, node: ir.Node) -> bool:
        return node.op_type == "Cast" and node.domain == "" and node.attributes.get_int("to") == self.wide

    def _widen_value(self, value: ir.Value) -> bool:
        changed = False
        if value.dtype == self.narrow and not value.is_initializer():
            value.dtype = self.wide
            changed = True
        return changed

    def _widen_attributes(self, node: ir.Node) -> bool:
        changed = False
        for name, attribute in list(node.attributes.items()):
            if name in _DTYPE_ATTRIBUTES and attribute.type == ir.AttributeType.INT and attribute.value == self.narrow:
                node.attributes[name] = ir.AttrInt64(name, self.wide)
                changed = True
            elif attribute.type == ir.AttributeType.TENSOR and attribute.value.dtype == self.narrow:
                node.attributes[name] = ir.AttrTensor(name, self._widen_tensor(attribute.value))
                changed = True
        return changed

    def _widen_tensor(self, tensor: ir.TensorProtocol) -> ir.TensorProtocol:
        return ir.tensor(tensor.numpy().astype(self.wide.numpy()), name=tensor.name)
