"""Run the LM head only on the last position, the only one generation samples from.

A prefill of S tokens otherwise multiplies S hidden states by the [hidden, vocab]
matrix, by far the largest matmul of a small model (for a 32000-word vocabulary and a
1024-token prompt, more work than all layers' projections together), and throws all but
the last row away.

With `to_keep`, the graph takes how many last positions to return as an input,
`logits_to_keep` (int64 [1]), as transformers' `logits_to_keep` argument does: one graph
serves a prefill (1: the last position only) and a speculative verify step (k + 1: every
position it fed). The input has an initializer of the same name holding [0], which ONNX
makes a default the caller may override: 0 keeps every position (Slice from -0), so a
runtime that does not know the input gets logits [batch, seq, vocab], the shape it
expects of a graph whose positions dim is not 1 (onnxruntime-genai allocates the logits so).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

# Position-wise ops the walk from the logits back to the LM head may pass through: each
# computes every position from that position alone, so slicing before them is exact.
_POSITION_WISE = {"Cast", "Div", "Mul", "Add", "Sub", "Tanh", "Softcap"}
# The graph input saying how many last positions get logits (kvforge.runners.contract's KEEP_INPUT),
# and its default: 0, every position
KEEP_INPUT = "logits_to_keep"
KEEP_DEFAULT = 0
# The logits' positions dim under `to_keep` (kvforge.runners.contract's KEPT_DIM)
KEPT_DIM = "kept"


class LastPositionLogits(InPlacePass):
    """`logits = MatMul(h, W_vocab) [position-wise ops]` becomes the same on
    `Slice(h, starts=-1, ends=MAX, axes=1)`: logits [batch, 1, vocab].

    ```
    h [B,S,H] ─► MatMul(W) ─► (Mul/Tanh/... softcap) ─► logits [B,S,V]
    h [B,S,H] ─► Slice(axis 1, last) ─► MatMul(W) ─► ... ─► logits [B,1,V]
    ```
    The LM head is the MatMul with a constant weight found by walking back from the
    output through position-wise ops; anything else leaves the graph unchanged.

    `to_keep`: the slice starts at `-logits_to_keep`, a new graph input defaulting to [0], every
    position (an initializer of the same name): logits [batch, kept, vocab].
    ```
    h [B,S,H] ─► Slice(axis 1, starts=Neg(logits_to_keep)) ─► MatMul(W) ─► ... ─► logits [B,kept,V]
    ```
    """

    def __init__(self, output: str = "logits", to_keep: bool = False) -> None:
        super().__init__()
        self.output = output
        self.to_keep = to_keep

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        logits = next((v for v in graph.outputs if v.name == self.output), None)
        head = _lm_head(logits) if logits is not None else None
        if head is None or logits is None:
            return PassResult(model, modified=False)
        hidden = head.inputs[0]
        assert hidden is not None
        if self.to_keep and any(v.name == KEEP_INPUT for v in graph.inputs):
            return PassResult(model, modified=False)  # the name is taken: not a graph this pass knows
        ends = ir.val("last_position_ends", const_value=ir.tensor(np.array([np.iinfo(np.int64).max], dtype=np.int64)))
        axes = ir.val("last_position_axes", const_value=ir.tensor(np.array([1], dtype=np.int64)))
        for value in (ends, axes):
            graph.register_initializer(value)
        if self.to_keep:
            starts = self._keep_input(graph, head)
            positions: int | ir.SymbolicDim = ir.SymbolicDim(KEPT_DIM)
        else:
            starts = ir.val("last_position_starts", const_value=ir.tensor(np.array([-1], dtype=np.int64)))
            graph.register_initializer(starts)
            positions = 1
        last = ir.node("Slice", [hidden, starts, ends, axes], name="last_position")
        graph.insert_before(head, last)
        head.replace_input_with(0, last.outputs[0])
        if logits.shape is not None and len(logits.shape) == 3:
            logits.shape = ir.Shape([logits.shape[0], positions, logits.shape[2]])
        return PassResult(model, modified=True)

    @staticmethod
    def _keep_input(graph: ir.Graph, head: ir.Node) -> ir.Value:
        """The `logits_to_keep` input (with its default) and `Neg` of it, the slice's start."""
        default = ir.tensor(np.array([KEEP_DEFAULT], np.int64))
        keep = ir.val(KEEP_INPUT, ir.DataType.INT64, ir.Shape([1]), const_value=default)
        graph.inputs.append(keep)
        graph.register_initializer(keep)
        negate = ir.node("Neg", [keep], name="last_position_starts")
        graph.insert_before(head, negate)
        return negate.outputs[0]


def _lm_head(logits: ir.Value) -> ir.Node | None:
    """The MatMul with a constant right operand that `logits` derives from position-wise."""
    node = logits.producer()
    while node is not None and node.domain == "":
        if node.op_type == "MatMul":
            hidden, weight = node.inputs[0], node.inputs[1]
            constant = weight is not None and (_is_constant(weight) or _is_transposed_constant(weight))
            already_sliced = hidden is not None and _is_last_position(hidden)
            return node if constant and not already_sliced else None
        if node.op_type not in _POSITION_WISE:
            return None
        varying = [v for v in node.inputs if v is not None and not _is_constant(v)]
        if len(varying) != 1:
            return None
        node = varying[0].producer()
    return None


def _is_last_position(value: ir.Value) -> bool:
    producer = value.producer()
    return producer is not None and producer.op_type == "Slice" and producer.name == "last_position"


def _is_transposed_constant(value: ir.Value) -> bool:
    producer = value.producer()
    return (
        producer is not None
        and producer.op_type == "Transpose"
        and producer.inputs[0] is not None
        and _is_constant(producer.inputs[0])
    )


def _is_constant(value: ir.Value) -> bool:
    """An initializer or a Constant node's output, folded in this process or not."""
    return ir.convenience.get_const_tensor(value) is not None
