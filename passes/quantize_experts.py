"""Routed experts' weights under `--weights int8|int4`, in the form the target reads.

`kvforge.passes.quantize` quantizes the MatMuls whose weight is a constant; routed experts' weights are
not: they are a stack [experts, out, in] read through com.microsoft MoE (passes/fuse_moe.py) or
gathered per token (the gather form). This pass quantizes both, symmetric, round to nearest,
with `kvforge.passes.quantize`'s quantizer:

- `qmoe` (ort-cpu): every com.microsoft MoE becomes com.microsoft QMoE over uint8 codes stored as
  MatMulNBits stores them (symmetric codes moved up by the middle code, low nibble first), one
  scale per output channel for int8 and per block of `block_size` inputs for int4
  (`expert_weight_bits`, `block_size`). onnxruntime 1.32's CPU kernel matches the dequantized
  weights to ~1e-5 in these forms; its block-wise int8 form (and accuracy_level 4) quantizes the
  activations too, so int8 stays per channel and no accuracy_level is set. int4 falls back to
  per channel where the hidden or expert width is not a multiple of the block. Experts left in
  the gather form (a routing MoE does not take) are quantized as below.
- `gather` (portable): the stacked weight is stored as int8 codes with one scale per output
  channel ([E, N, 1], or [E, 1, N] where the gathered slice is a MatMul's right operand), and
  each Gather / GatherND of it becomes the same gather of the codes and of the scales, then
  Cast and Mul: a token reads and dequantizes only its experts' slices. GatherND and Gather take
  no 4-bit data, so an int4 request stores these as int8 (said in `notes`).

Quantization here is always symmetric (an asymmetric request is noted): QMoE's zero points and
the gather form's dequantize would need a second gathered tensor per weight.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from kvforge.passes.fuse_moe import MS_DOMAIN
from kvforge.passes.quantize import BITS, matmul_nbits_inputs, quantize_blockwise, register_initializer, replace_node

FORMS = ("qmoe", "gather")
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
# Block sizes QMoE's CPU kernel takes (powers of two from 16 to 128)
_QMOE_BLOCKS = (16, 32, 64, 128)


class QuantizeExperts(InPlacePass):
    """Quantize routed experts' weights; `counts` says how many MoE nodes and gathered stacks were
    quantized, `notes` what differs from the request and why."""

    def __init__(self, bits: int, block_size: int = 32, form: str = "qmoe", symmetric: bool = True) -> None:
        super().__init__()
        if bits not in BITS or form not in FORMS:
            raise ValueError(f"unsupported expert quantization: bits={bits}, form={form!r}")
        self.bits = bits
        self.block_size = block_size
        self.form = form
        self.symmetric = symmetric
        self.counts: Counter[str] = Counter()
        self.notes: dict[str, str] = {}  # weight name -> how it was stored, where that differs from the request

    def call(self, model: ir.Model) -> PassResult:
        self.counts = Counter()
        self.notes = {}
        graph = model.graph
        if self.form == "qmoe":
            for node in list(graph):
                if node.op_type == "MoE" and node.domain == MS_DOMAIN:
                    self._to_qmoe(graph, node)
        for weight in list(graph.initializers.values()):
            if _gathered_stack(weight):
                self._gather_int8(graph, weight)
        modified = bool(sum(self.counts.values()))
        if modified and not self.symmetric:
            self.notes["experts"] = "quantized symmetric (no zero points): asymmetric applies to MatMul weights only"
        return PassResult(model, modified=modified)

    def _to_qmoe(self, graph: ir.Graph, node: ir.Node) -> None:
        w1, w2 = node.inputs[2], node.inputs[4] if len(node.inputs) > 4 else None
        if w1 is None or w2 is None or len(node.inputs) > 6 and node.inputs[6] is not None:
            return
        if any(w.const_value is None or w.const_value.dtype not in _FLOATS for w in (w1, w2)):
            return
        hidden = int(w1.const_value.shape.numpy()[2])  # type: ignore[union-attr]
        inter = int(w2.const_value.shape.numpy()[2])  # type: ignore[union-attr]
        block = None
        if self.bits == 4:
            if self.block_size in _QMOE_BLOCKS and hidden % self.block_size == 0 and inter % self.block_size == 0:
                block = self.block_size
            else:
                self.notes[w1.name or ""] = (
                    f"int4 per output channel: hidden {hidden} or expert width {inter} is not a multiple "
                    f"of the block size {self.block_size} QMoE takes"
                )
        q1 = self._qmoe_weight(graph, w1, block)
        q2 = self._qmoe_weight(graph, w2, block)
        attributes = {name: attr for name, attr in node.attributes.items()}
        attributes["expert_weight_bits"] = ir.AttrInt64("expert_weight_bits", self.bits)
        if block is not None:
            attributes["block_size"] = ir.AttrInt64("block_size", block)
        bias1 = node.inputs[3] if len(node.inputs) > 3 else None
        bias2 = node.inputs[5] if len(node.inputs) > 5 else None
        inputs = [node.inputs[0], node.inputs[1], *q1, bias1, q2[0], q2[1], bias2]
        while inputs and inputs[-1] is None:
            inputs.pop()
        qmoe = ir.node("QMoE", inputs, attributes=attributes, domain=MS_DOMAIN)
        graph.insert_before(node, qmoe)
        replace_node(graph, node, qmoe.outputs[0])
        for stale in (w1, w2):
            if not stale.uses() and stale.name is not None and stale.name in graph.initializers:
                del graph.initializers[stale.name]
        self.counts["qmoe"] += 1

    def _qmoe_weight(self, graph: ir.Graph, weight: ir.Value, block: int | None) -> tuple[ir.Value, ir.Value]:
        """(codes [E, N, K·bits/8] uint8, scales [E, N] or [E, N, K / block]) of a [E, N, K] stack."""
        array = weight.const_value.numpy()  # type: ignore[union-attr]
        experts, rows, k = array.shape
        codes, scales = [], []
        for e in range(experts):
            q = quantize_blockwise(array[e], self.bits, block or k, symmetric=True)
            b, s, _ = matmul_nbits_inputs(q)
            codes.append(b.reshape(rows, -1))
            scales.append(s if block else s[:, 0])
        base = f"{weight.name}.q{self.bits}"
        return (
            register_initializer(graph, base, np.stack(codes)),
            register_initializer(graph, base + ".scales", np.stack(scales)),
        )

    def _gather_int8(self, graph: ir.Graph, weight: ir.Value) -> None:
        array = weight.const_value.numpy()  # type: ignore[union-attr]
        gathers = [user for user, _ in weight.uses()]
        # the reduction axis: the last, unless every gathered slice is a MatMul's right operand
        right = all(use.op_type == "MatMul" and index == 1 for g in gathers for use, index in g.outputs[0].uses())
        axis = 1 if right else 2
        qmax = 127.0
        wide = array.astype(np.float32)
        scale = (np.abs(wide).max(axis=axis, keepdims=True) / qmax).astype(array.dtype).astype(np.float32)
        scale = np.where(scale > 0, scale, np.float32(1.0))
        codes = np.clip(np.rint(wide / scale), -qmax, qmax).astype(np.int8)
        base = f"{weight.name}.q8"
        codes_value = register_initializer(graph, base, codes)
        scales_value = register_initializer(graph, base + ".scales", scale.astype(array.dtype))
        dtype = weight.const_value.dtype  # type: ignore[union-attr]
        for gather in gathers:
            attributes = dict(gather.attributes)
            picked = ir.node(gather.op_type, [codes_value, *gather.inputs[1:]], attributes=attributes)
            picked_scales = ir.node(gather.op_type, [scales_value, *gather.inputs[1:]], attributes=attributes)
            wide_codes = ir.node("Cast", picked.outputs, {"to": dtype})
            dequantized = ir.node("Mul", [wide_codes.outputs[0], picked_scales.outputs[0]])
            for new in (picked, picked_scales, wide_codes, dequantized):
                graph.insert_before(gather, new)
            replace_node(graph, gather, dequantized.outputs[0])
        del graph.initializers[weight.name]  # type: ignore[arg-type]
        self.counts["gather_int8"] += 1
        if self.bits == 4:
            self.notes[weight.name or ""] = "int8, not int4: GatherND and Gather take no 4-bit data"


def _gathered_stack(weight: ir.Value) -> bool:
    """A constant [experts, out, in] float stack read only by Gather / GatherND over its first axis,
    the gathered slices only by MatMuls (so not a stack of scales, or of biases)."""
    tensor = weight.const_value
    if tensor is None or tensor.dtype not in _FLOATS or len(tensor.shape) != 3 or weight.is_graph_input():
        return False
    uses = weight.uses()
    if not uses:
        return False
    for user, index in uses:
        if index != 0 or user.domain != "" or user.op_type not in ("Gather", "GatherND"):
            return False
        if user.op_type == "Gather" and user.attributes.get_int("axis", 0) != 0:
            return False
        if user.op_type == "GatherND" and user.attributes.get_int("batch_dims", 0) != 0:
            return False
        readers = user.outputs[0].uses()
        if not readers or any(reader.op_type != "MatMul" or reader.domain != "" for reader, _ in readers):
            return False
    return True
