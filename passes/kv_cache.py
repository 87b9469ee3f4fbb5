"""An int8 KV cache: onnxruntime's `GroupQueryAttention` keeps its past and present as int8 codes.

The kernel takes the cache as int8 with static scales (`k_quant_type` / `v_quant_type`
PER_CHANNEL, `kv_cache_bit_width` 8, `k_scale` / `v_scale` inputs of one float per key/value
head and channel): it writes each new position's keys and values as codes and reads the past
back through the scales itself, so a decode step reads a quarter of a float32 cache's bytes.
`QuantizeKVCache` turns every `GroupQueryAttention` of a lowered graph into that form, with
the scales a build calibrated (`kvforge.toolchain.kv_scales`), and retypes the graph's cache inputs
and outputs to int8. A cache input that reaches anything but a `GroupQueryAttention` (a layer
lowered otherwise, a recurrent state) cannot be int8, and the pass refuses the graph, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

KV_DTYPES = ("int8",)
_K_SCALE, _V_SCALE = (
    12,
    13,
)  # GroupQueryAttention's inputs: q k v past_k past_v seqlens total cos sin pos bias sink k_scale v_scale
_PAST_KEY, _PAST_VALUE = 3, 4


class KVCacheRefused(ValueError):
    """The graph has a cache tensor that an int8 cache cannot hold; the message names it."""


class QuantizeKVCache(InPlacePass):
    """`GroupQueryAttention(q, k, v, past_k, past_v, ...)` with a float cache becomes the same with an
    int8 cache, PER_CHANNEL scales (`scales[past key name]`, one float per kv head × channel, as
    initializers) and `kv_cache_bit_width` 8; the past inputs and present outputs it reads and
    writes become int8 in the graph's I/O."""

    def __init__(self, scales: Mapping[str, np.ndarray]) -> None:
        super().__init__()
        self._scales = scales

    def call(self, model: ir.Model) -> PassResult:
        graph = model.graph
        pasts = {v.name: v for v in graph.inputs if v.name and v.name.startswith("past_key_values.")}
        quantized: set[str] = set()
        for node in list(graph):
            if (node.domain, node.op_type) != ("com.microsoft", "GroupQueryAttention"):
                continue
            past_k, past_v = node.inputs[_PAST_KEY], node.inputs[_PAST_VALUE]
            if past_k is None or past_v is None or past_k.name not in pasts or past_v.name not in pasts:
                continue
            k_scale = self._scale(graph, past_k.name, node)
            v_scale = self._scale(graph, past_v.name, node)
            if len(node.inputs) <= _V_SCALE:
                node.resize_inputs(_V_SCALE + 1)
            node.replace_input_with(_K_SCALE, k_scale)
            node.replace_input_with(_V_SCALE, v_scale)
            node.attributes["k_quant_type"] = ir.AttrString("k_quant_type", "PER_CHANNEL")
            node.attributes["v_quant_type"] = ir.AttrString("v_quant_type", "PER_CHANNEL")
            node.attributes["kv_cache_bit_width"] = ir.AttrInt64("kv_cache_bit_width", 8)
            for present in node.outputs[1:3]:
                present.dtype = ir.DataType.INT8
            quantized.update((past_k.name, past_v.name))
        missing = sorted(set(pasts) - quantized)
        if missing:
            raise KVCacheRefused(
                f"{missing[0]} is not read by onnxruntime's GroupQueryAttention, whose int8 cache is the only one "
                f"kvforge writes ({len(missing)} cache inputs in all); build without --kv-dtype"
            )
        for name in quantized:
            pasts[name].dtype = ir.DataType.INT8
        return PassResult(model, modified=bool(quantized))

    def _scale(self, graph: ir.Graph, past: str, node: ir.Node) -> ir.Value:
        if past not in self._scales:
            raise KVCacheRefused(f"{past}: no calibrated scale for it (node {node.name})")
        scale = np.ascontiguousarray(self._scales[past], dtype=np.float32).reshape(-1)
        value = ir.val(f"{past}.scale", const_value=ir.tensor(scale, name=f"{past}.scale"))
        graph.register_initializer(value)
        return value
