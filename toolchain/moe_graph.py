"""A mixture of experts as the exported graph holds it: its stacked expert weights, the layers
that route to them, and the manifest's `experts` entry."""

from __future__ import annotations

import onnx_ir as ir

from kvforge.toolchain.spec import EXPERTS, DecoderSpec


def expert_stacks(model: ir.Model, spec: DecoderSpec) -> dict[str, ir.TensorProtocol]:
    """Initializers under `experts` stacked over the routed experts (first dimension), by name."""
    if not spec.num_experts:
        return {}
    return {
        name: value.const_value
        for name, value in model.graph.initializers.items()
        if EXPERTS in name
        and value.const_value is not None
        and len(value.const_value.shape) >= 2
        and value.const_value.shape[0] == spec.num_experts
    }


def moe_layers(model: ir.Model, spec: DecoderSpec) -> int:
    """How many layers route to experts: the distinct modules (`model.layers.3.mlp`) whose
    `experts` hold stacked weights, as exported (layers that stay dense hold none)."""
    return len({name.split(EXPERTS, 1)[0] for name in expert_stacks(model, spec)})


def experts(model: ir.Model, spec: DecoderSpec) -> dict[str, int] | None:
    """A mixture of experts' routed experts, how many a token uses, and the bytes of their
    weights in the graph (initializers under `experts` stacked over the experts), so that
    `kvforge bench` counts only the experts a decode step reads. None for a dense model."""
    if not spec.num_experts:
        return None
    nbytes = sum(tensor.nbytes for tensor in expert_stacks(model, spec).values())
    return {"routed": spec.num_experts, "per_token": spec.experts_per_token, "weight_bytes": nbytes}
