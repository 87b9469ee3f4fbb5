"""Widen every tensor of one float type to another: a bfloat16 graph computed in float32.

onnxruntime's CPU provider has no bfloat16 kernels for MatMul and most other ops, so a
`--dtype bf16` graph cannot run where the verification gate runs. The gate runs this
pass's copy of it instead: the same nodes, the same weights (every bfloat16 value is
exactly a float32 one), every bfloat16 tensor, value type and Cast target made float32.
What the copy checks is the graph's structure and its weights, against the eager model
within the bfloat16 tolerance; the bfloat16 arithmetic itself is TensorRT's or CUDA's.

```
W (bf16 initializer) ─► MatMul ─► Cast(to=bf16) ─► y (bf16)
W (f32, same values) ─► MatMul ─► Cast(to=f32)  ─► y (f32)
```
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

# Attributes that name an element type; a node whose attribute names `narrow` produces it.
_DTYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")


class WidenFloats(InPlacePass):
    """Every `narrow` tensor, value and element-type attribute becomes `wide`."""

    def __init__(self, narrow: ir.DataType = ir.DataType.BFLOAT16, wide: ir.DataType = ir.DataType.FLOAT) -> None:
        super().__init__()
        self.narrow = narrow
        self.wide = wide

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        for value in graph.initializers.values():
            modified |= self._widen_value(value)
        for value in [*graph.inputs, *graph.outputs]:
            modified |= self._widen_value(value)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            modified |= self._widen_attributes(node)
            for value in node.outputs:
                modified |= self._widen_value(value)
        return PassResult(model, modified=modified)

    def _widen_value(self, value: ir.Value) -> bool:
        changed = False
        tensor = value.const_value
        if tensor is not None and tensor.dtype == self.narrow:
            value.const_value = self._widen_tensor(tensor)
            changed = True
        if value.dtype == self.narrow:
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
