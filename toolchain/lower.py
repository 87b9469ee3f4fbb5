"""Lowering an ExportedProgram to an `onnx_ir.Model` whose I/O follows the contract."""

from __future__ import annotations

import logging

import onnx_ir as ir
import torch
from torch.export import ExportedProgram

from kvforge.runners.contract import DecoderIO, TensorSpec
from kvforge.runners.errors import ExportError

log = logging.getLogger(__name__)

# 23: the first opset with Attention, RMSNormalization and RotaryEmbedding.
OPSET = 23
# Node metadata kept from the exporter: module scopes help explain a graph; stack traces
# and FX dumps carry machine paths, which would make artifacts differ between machines.
_KEPT_NODE_METADATA = ("pkg.torch.onnx.name_scopes",)
_WRAPPER_PREFIX = "model."


def to_onnx(program: ExportedProgram, io: DecoderIO) -> ir.Model:
    """torch.onnx (dynamo) lowering; graph I/O renamed and shaped per the contract."""
    # It warns once per torchvision op that torchvision is missing; decoders use none of them.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    try:
        # optimize=False: the exporter's optimizer folds Transpose(weight) into anonymous
        # constants, losing the checkpoint's tensor names that later passes and reports use.
        onnx_program = torch.onnx.export(program, dynamo=True, optimize=False, opset_version=OPSET, verbose=False)
    except Exception as e:  # the exporter raises many unrelated types; all mean the same to the user
        raise ExportError(f"ONNX lowering failed: {type(e).__name__}: {e}; please report it") from e
    if onnx_program is None:  # only when exporting to a file, which we do not
        raise ExportError("ONNX lowering returned no program; please report it")
    model = onnx_program.model
    apply_contract(model.graph, io)
    _strip_machine_metadata(model)
    _name_initializers_as_checkpoint(model.graph)
    _forget_former_io(model.graph)
    return model


def _forget_former_io(graph: ir.Graph) -> None:
    """Drop the references onnx-ir's graph input and output lists keep to values that left them.

    The lists count how often each value appears, in a Counter that keeps a key at count 0
    (onnx-ir 1.1). The exporter lists every parameter as a graph input before it makes it an
    initializer, so every weight's Value, and the weight with it, stayed referenced for the
    graph's lifetime: a weight that packing or quantization replaced was never freed.
    """
    for values in (graph.inputs, graph.outputs):
        counter = getattr(values, "_ref_counter", None)
        if counter is None:  # a later onnx-ir without the counter
            continue
        for value in [v for v, count in counter.items() if count <= 0]:
            del counter[value]


def apply_contract(graph: ir.Graph, io: DecoderIO) -> None:
    for values, specs, kind in ((graph.inputs, io.inputs, "inputs"), (graph.outputs, io.outputs, "outputs")):
        if len(values) != len(specs):
            raise ExportError(f"lowered graph has {len(values)} {kind}, the contract expects {len(specs)}")
        for value, spec in zip(values, specs):
            _check_dtype(value, spec)
            value.name = spec.name
            value.shape = ir.Shape(list(spec.dims))


def _check_dtype(value: ir.Value, spec: TensorSpec) -> None:
    if value.dtype is None or value.dtype.numpy() != spec.dtype:
        raise ExportError(
            f"graph value {value.name} has dtype {value.dtype}, the contract says {spec.name} is {spec.dtype}"
        )


def _strip_machine_metadata(model: ir.Model) -> None:
    model.graph.metadata_props.clear()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for key in [k for k in node.metadata_props if k not in _KEPT_NODE_METADATA]:
            del node.metadata_props[key]


def _name_initializers_as_checkpoint(graph: ir.Graph) -> None:
    """`model.model.layers.0...` (wrapper attribute + HF name) becomes the checkpoint's own name."""
    for value in list(graph.initializers.values()):
        if value.name is not None and value.name.startswith(_WRAPPER_PREFIX):
            value.name = value.name[len(_WRAPPER_PREFIX) :]  # onnx_ir re-keys graph.initializers


def torch_tensor(tensor: torch.Tensor, name: str) -> ir.TensorProtocol:
    """A weight as the exporter holds one (shared memory with the eager model)."""
    from torch.onnx._internal.exporter._core import TorchTensor

    return TorchTensor(tensor.detach(), name=name)
