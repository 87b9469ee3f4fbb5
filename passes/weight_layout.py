"""Store each weight the way its MatMul reads it: `Transpose(W)` of an initializer becomes W transposed.

The exporter writes `Linear` as `MatMul(x, Transpose(W [out, in]))`, and the passes keep that
form (the checkpoint's names and layout are what packing and quantization read). Left in the
artifact, every runtime transposes each weight again at load: onnxruntime folds the Transpose
into a copy of the weight, which raises its peak and resident memory at load (docs/performance.md,
"Kernel choices behind the passes"). Stored as read, the weight is loaded as is.

```
W [out, in] ─ Transpose(perm=[1, 0]) ─ MatMul(x, ·)      ==>      Wᵀ [in, out] ─ MatMul(x, ·)
```

The stored tensor keeps the checkpoint's name when nothing else reads W; when something does
(a tied embedding table, which Gather reads as is), the transposed copy is named `{W}.transposed`.
The transposed tensor is written to the artifact a few rows at a time, never copied whole; a
packed weight (`StackedRows`, passes/pack_matmul.py) is transposed from its parts, so the
packed copy is never made either.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult


class FoldWeightTransposes(InPlacePass):
    """`Transpose(W)` of a 2-D initializer -> the transposed initializer."""

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        modified = False
        for node in list(graph):
            weight = self._weight(node)
            if weight is None:
                continue
            tensor = weight.const_value
            assert tensor is not None and weight.name is not None
            only_reader = len(weight.uses()) == 1
            name = weight.name if only_reader else f"{weight.name}.transposed"
            if only_reader:  # the name passes to the transposed tensor, which holds the original's data
                del graph.initializers[weight.name]
            parts = tensor.parts if isinstance(tensor, StackedRows) else [tensor.numpy()]
            stored = TransposedTensor(parts, tensor.dtype, name)
            transposed = ir.Value(name=name, shape=stored.shape, type=ir.TensorType(tensor.dtype), const_value=stored)
            graph.register_initializer(transposed)
            ir.convenience.replace_all_uses_with(node.outputs[0], transposed, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            modified = True
        return PassResult(model, modified=modified)

    @staticmethod
    def _weight(node: ir.Node) -> ir.Value | None:
        """The initializer `node` transposes, if it is a plain 2-D transpose of one."""
        if node.op_type != "Transpose" or node.domain != "" or len(node.inputs) != 1:
            return None
        perm = node.attributes.get_ints("perm", None)
        weight = node.inputs[0]
        if (perm is not None and list(perm) != [1, 0]) or weight is None or weight.const_value is None:
            return None
        if not weight.is_initializer() or weight.is_graph_input() or weight.is_graph_output():
            return None
        return weight if len(weight.const_value.shape) == 2 else None


class StackedRows(ir.LazyTensor):
    """`np.concatenate(parts)` of 2-D arrays with the same columns, without the copy: packed
    projections (passes/pack_matmul.py) are their parts, which the graph already holds. Written
    part by part; materialized only when something asks for its values (quantization does,
    one weight at a time), and never kept materialized. `sources`: the names of the weights the
    parts were (a pre-quantized checkpoint's records are keyed by them)."""

    def __init__(self, parts: Sequence[np.ndarray], dtype: ir.DataType, name: str, sources: Sequence[str] = ()) -> None:
        columns = {part.shape[1] for part in parts}
        if len(parts) == 0 or any(part.ndim != 2 for part in parts) or len(columns) != 1:
            raise ValueError(f"{name}: stacked parts must be 2-D with equal columns, got {[p.shape for p in parts]}")
        rows = sum(part.shape[0] for part in parts)
        parts = list(parts)  # the closure holds the parts, not `self`: no cycle, freed when dropped
        super().__init__(
            lambda: ir.tensor(_stacked(parts)),
            dtype=dtype,
            shape=ir.Shape([rows, columns.pop()]),
            name=name,
        )
        self.parts = parts
        self.sources = tuple(sources)

    def tofile(self, file: typing.BinaryIO) -> None:  # type: ignore[override]
        for part in self.parts:
            file.write(np.ascontiguousarray(part).reshape(-1).view(np.uint8).data)


class TransposedTensor(ir.LazyTensor):
    """The transpose of the rows `sources` stack (one array, or a packed weight's parts),
    without a transposed copy in memory: written to a file a few rows at a time (the writer
    calls `tofile`), materialized only if something asks for its values. A copy of the LM
    head alone is a fifth of the 125M reference's weights, and more with a large vocabulary;
    this way the build never holds it twice."""

    ROW_BYTES = 8 << 20  # the most one write copies

    def __init__(self, sources: Sequence[np.ndarray], dtype: ir.DataType, name: str) -> None:
        columns = sum(source.shape[0] for source in sources)
        rows = sources[0].shape[1]
        sources = list(sources)
        super().__init__(
            lambda: ir.tensor(np.ascontiguousarray(_stacked(sources).T)),
            dtype=dtype,
            shape=ir.Shape([rows, columns]),
            name=name,
        )
        self._sources = sources

    def tofile(self, file: typing.BinaryIO) -> None:  # type: ignore[override]
        rows, columns = self.shape.numpy()
        itemsize = self._sources[0].itemsize
        step = max(1, min(rows, self.ROW_BYTES // max(1, columns * itemsize)))
        # one buffer for every slice, written as it is (no `tobytes` copy): each weight's
        # bytes are copied once, into memory already mapped
        buffer = np.empty((step, columns), dtype=self._sources[0].dtype)
        for start in range(0, rows, step):
            block = buffer[: min(step, rows - start)]
            column = 0
            for source in self._sources:  # each part's transposed rows side by side
                width = source.shape[0]
                np.copyto(block[:, column : column + width], source.T[start : start + len(block)])
                column += width
            file.write(block.reshape(-1).view(np.uint8).data)  # its bytes, whatever the dtype (bfloat16 too)


def _stacked(parts: Sequence[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
