"""The tensorrt target's postcondition: every node is one TensorRT's ONNX parser imports.

`tensorrt_ops.json` beside this file lists, for the minimum TensorRT version kvforge
declares, each operator the parser supports with its element types and restrictions
(from onnx/onnx-tensorrt docs/operators.md and the TensorRT layer documentation), and the
target's own restrictions (an explicit boolean attention mask, RotaryEmbedding over
position_ids, symmetric weight quantization, ...). `check_graph` returns every violation,
each naming the node; the pass raises `UnsupportedByTensorRT` with them, so a build fails
before any engine is attempted instead of in the parser on a GPU machine.

Graph-wide, the checker also requires what the parser and a strongly typed network need:
the default domain only, at `opset.required`, no functions, no forbidden ops (If, Loop,
Scan), every tensor's element type known, every floating tensor in the compute dtype, and
a fixed-length KV cache whose every `present.*` output is the `TensorScatter` of its
`past_key_values.*` input.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

DATA_FILE = Path(__file__).with_name("tensorrt_ops.json")
PAST_PREFIX = "past_key_values."
PRESENT_PREFIX = "present."
_FLOATS = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE})


class UnsupportedByTensorRT(ValueError):
    """The graph has nodes or tensors TensorRT's ONNX parser (or the tensorrt target) refuses."""


@dataclass(frozen=True)
class Violation:
    where: str  # "OpType(node name)", "input NAME", "graph"
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


@cache
def support_data(path: Path = DATA_FILE) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def min_tensorrt_version() -> str:
    return str(support_data()["tensorrt"])


def _where(node: ir.Node) -> str:
    return f"{node.op_type}({node.name})"


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if index < len(node.inputs) else None


def _is_constant(value: ir.Value) -> bool:
    return ir.convenience.get_const_tensor(value) is not None


def _is_read(value: ir.Value) -> bool:
    return bool(value.uses()) or value.is_graph_output()


def _dtype_name(dtype: ir.DataType | None) -> str:
    return "unknown" if dtype is None else dtype.name


def _typed_value(node: ir.Node, entry: Mapping[str, Any]) -> ir.Value | None:
    where = entry.get("type_of", {"input": 0})
    if "output" in where:
        return node.outputs[where["output"]]
    return _input(node, where["input"])


# --- per-node rules: each yields the problems it finds ------------------------------------------------

Rule = Callable[[ir.Node, Mapping[str, Any]], Iterator[str]]


def _rank(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for index in rule["inputs"]:
        value = _input(node, index)
        if value is None:
            continue
        if value.shape is None:
            yield f"input {index} ({value.name}) has unknown rank; {rule['why']}"
        elif len(value.shape) != rule["rank"]:
            yield f"input {index} ({value.name}) has rank {len(value.shape)}; {rule['why']}"


def _absent_inputs(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for index in rule["inputs"]:
        value = _input(node, index)
        if value is not None:
            yield f"input {index} ({value.name}) is set; {rule['why']}"


def _absent_outputs(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for index in rule["outputs"]:
        if index < len(node.outputs) and _is_read(node.outputs[index]):
            yield f"output {index} ({node.outputs[index].name}) is used; {rule['why']}"


def _absent_attributes(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for name in rule["names"]:
        if name in node.attributes:
            yield f"attribute {name} is set; {rule['why']}"


def _attribute(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    attr = node.attributes.get(rule["name"])
    value = rule.get("default") if attr is None else attr.value
    if value != rule["equals"]:
        yield f"attribute {rule['name']}={value!r}, must be {rule['equals']!r}; {rule['why']}"


def _required_inputs(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for index in rule["inputs"]:
        if _input(node, index) is None:
            yield f"input {index} is missing; {rule['why']}"


def _input_types(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    value = _input(node, rule["input"])
    if value is not None and _dtype_name(value.dtype) not in rule["types"]:
        yield f"input {rule['input']} ({value.name}) is {_dtype_name(value.dtype)}; {rule['why']}"


def _constant_inputs(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for index in rule["inputs"]:
        value = _input(node, index)
        if value is not None and not _is_constant(value):
            yield f"input {index} ({value.name}) is not a constant; {rule['why']}"


def _absent_or_zero_inputs(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for index in rule["inputs"]:
        value = _input(node, index)
        if value is None:
            continue
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is None or np.any(tensor.numpy().astype(np.float64) != 0):
            yield f"input {index} ({value.name}) is not all zero; {rule['why']}"


def _positive_scale(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    value = _input(node, rule["input"])
    tensor = ir.convenience.get_const_tensor(value) if value is not None else None
    if tensor is not None and not np.all(tensor.numpy().astype(np.float64) > 0):
        yield f"input {rule['input']} ({value.name if value else ''}) has a scale <= 0; {rule['why']}"


def _consumers(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    out = node.outputs[0]
    readers = sorted({user.op_type for user, _ in out.uses()})
    if out.is_graph_output() or any(op not in rule["ops"] for op in readers):
        yield f"output read by {', '.join(readers) or 'the graph output'}; {rule['why']}"


def _quantized_weight(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    weight, scale = _input(node, 0), _input(node, 1)
    if weight is None or scale is None:
        return
    form = rule["forms"].get(_dtype_name(weight.dtype))
    if form is None:
        accepted = ", ".join(rule["forms"])
        yield f"weight {weight.name} is {_dtype_name(weight.dtype)}; only {accepted} weights are accepted"
        return
    block = node.attributes.get("block_size")
    block_size = 0 if block is None else int(block.value)
    axis_attr = node.attributes.get("axis")
    axis = 1 if axis_attr is None else int(axis_attr.value)
    if form.get("block_size") == "required" and block_size <= 0:
        yield f"no block_size; {form['why']}"
    if form.get("block_size") == "absent" and block_size > 0:
        yield f"block_size={block_size}; {form['why']}"
    if "axis" in form and axis != form["axis"]:
        yield f"axis={axis}; {form['why']}"
    if "scale_rank" in form and (scale.shape is None or len(scale.shape) != form["scale_rank"]):
        yield f"scale {scale.name} has shape {scale.shape}; {form['why']}"


def _cast_to(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    attr = node.attributes.get("to")
    name = _dtype_name(ir.DataType(int(attr.value))) if attr is not None else "unknown"
    if name not in rule["types"]:
        yield f"casts to {name}; {rule['why']}"


def _cache_update(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    past, out = _input(node, 0), node.outputs[0]
    if past is None or not past.is_graph_input() or not (past.name or "").startswith(PAST_PREFIX):
        yield f"the cache {past.name if past else None} is not a {PAST_PREFIX}* graph input; {rule['why']}"
    elif past.shape is None or len(past.shape) != 4 or not isinstance(past.shape[2], int):
        yield f"the cache {past.name} has no fixed sequence length ({past.shape}); {rule['why']}"
    if not out.is_graph_output() or not (out.name or "").startswith(PRESENT_PREFIX):
        yield f"the output {out.name} is not a {PRESENT_PREFIX}* graph output; {rule['why']}"
    elif past is not None and (past.name or "")[len(PAST_PREFIX) :] != (out.name or "")[len(PRESENT_PREFIX) :]:
        yield f"the output {out.name} is not the update of {past.name}; {rule['why']}"


def _reads_cache(node: ir.Node, rule: Mapping[str, Any]) -> Iterator[str]:
    for index in rule["inputs"]:
        value = _input(node, index)
        producer = value.producer() if value is not None else None
        if producer is None or (producer.domain, producer.op_type) != ("", "TensorScatter"):
            yield f"input {index} ({value.name if value else None}) is not a TensorScatter output; {rule['why']}"


RULES: dict[str, Rule] = {
    "rank": _rank,
    "absent_inputs": _absent_inputs,
    "absent_outputs": _absent_outputs,
    "absent_attributes": _absent_attributes,
    "attribute": _attribute,
    "required_inputs": _required_inputs,
    "input_types": _input_types,
    "constant_inputs": _constant_inputs,
    "absent_or_zero_inputs": _absent_or_zero_inputs,
    "positive_scale": _positive_scale,
    "consumers": _consumers,
    "quantized_weight": _quantized_weight,
    "cast_to": _cast_to,
    "cache_update": _cache_update,
    "reads_cache": _reads_cache,
}


def check_node(node: ir.Node, data: Mapping[str, Any]) -> list[Violation]:
    where = _where(node)
    if node.domain not in ("", "ai.onnx"):
        return [Violation(where, f"domain {node.domain!r}: only the standard ONNX domain is imported (no plugins)")]
    if node.op_type in data["forbidden"]:
        return [
            Violation(where, f"{node.op_type} is not allowed in the tensorrt target: {data['forbidden'][node.op_type]}")
        ]
    entry = data["ops"].get(node.op_type)
    if entry is None:
        return [Violation(where, f"{node.op_type} is not supported by the TensorRT {data['tensorrt']} ONNX parser")]
    problems = []
    typed = _typed_value(node, entry)
    if typed is not None and _dtype_name(typed.dtype) not in entry["types"]:
        problems.append(
            f"element type {_dtype_name(typed.dtype)} of {typed.name}; the parser takes {', '.join(entry['types'])}"
        )
    for rule in entry.get("rules", ()):
        problems.extend(RULES[rule["rule"]](node, rule))
    return [Violation(where, problem) for problem in problems]


def check_graph(
    model: ir.Model, compute_dtype: str = "float32", data: Mapping[str, Any] | None = None
) -> list[Violation]:
    """Every reason TensorRT's parser or the tensorrt target would refuse `model`; empty when none."""
    data = data if data is not None else support_data()
    graph = model.graph
    violations = []
    opset = model.opset_imports.get("", 0)
    if opset != data["opset"]["required"]:
        violations.append(
            Violation("graph", f"default-domain opset {opset}, the target requires {data['opset']['required']}")
        )
    for domain in sorted(d for d in model.opset_imports if d not in ("", "ai.onnx")):
        violations.append(Violation("graph", f"imports domain {domain!r}: only the standard ONNX domain is imported"))
    for key in model.functions:
        violations.append(Violation("graph", f"defines function {key}: functions are not imported; inline them"))
    dtype = ir.DataType.from_numpy(np.dtype(compute_dtype))
    violations.extend(_cache_io(graph))
    for node in ir.traversal.RecursiveGraphIterator(graph):
        violations.extend(check_node(node, data))
        for value in node.outputs:
            if _is_read(value):
                violations.extend(_typed(value, dtype, _where(node)))
    for value in [*graph.inputs, *graph.initializers.values()]:
        violations.extend(_typed(value, dtype, f"{'input' if value.is_graph_input() else 'initializer'} {value.name}"))
    return violations


def _typed(value: ir.Value, dtype: ir.DataType, where: str) -> list[Violation]:
    """Strongly typed: every element type known, every floating tensor in the compute dtype or
    in float32 (the islands a half-precision model computes in float32: rotary tables, some
    norms, the logits), each crossing an explicit Cast, which a strongly typed network keeps."""
    if value.dtype is None:
        return [Violation(where, f"{value.name} has no known element type; the network is strongly typed")]
    if value.dtype in _FLOATS and value.dtype not in (dtype, ir.DataType.FLOAT):
        return [Violation(where, f"{value.name} is {value.dtype.name}, not the compute dtype {dtype.name} or FLOAT")]
    return []


def _cache_io(graph: ir.Graph) -> list[Violation]:
    pasts = [v for v in graph.inputs if (v.name or "").startswith(PAST_PREFIX)]
    presents = {v.name: v for v in graph.outputs if (v.name or "").startswith(PRESENT_PREFIX)}
    violations = []
    lengths = set()
    for past in pasts:
        shape = past.shape
        if shape is None or len(shape) != 4 or not isinstance(shape[2], int):
            violations.append(Violation(f"input {past.name}", f"shape {shape}: the cache needs a fixed length S_max"))
        else:
            lengths.add(shape[2])
        present = presents.get(PRESENT_PREFIX + (past.name or "")[len(PAST_PREFIX) :])
        producer = present.producer() if present is not None else None
        if (
            producer is None
            or (producer.domain, producer.op_type) != ("", "TensorScatter")
            or producer.inputs[0] is not past
        ):
            violations.append(
                Violation(f"input {past.name}", "its present output is not TensorScatter(past, ...) wired directly")
            )
    if len(lengths) > 1:
        violations.append(Violation("graph", f"KV cache inputs differ in length: {sorted(lengths)}"))
    return violations


class RequireTensorRT(InPlacePass):
    """Fails (`UnsupportedByTensorRT`) unless every node passes `check_graph`; never changes the graph."""

    def __init__(self, compute_dtype: str = "float32") -> None:
        super().__init__()
        self.compute_dtype = compute_dtype
        self.tensorrt = min_tensorrt_version()

    def call(self, model: ir.Model) -> PassResult:
        violations = check_graph(model, self.compute_dtype)
        if violations:
            shown = "; ".join(str(v) for v in violations[:8])
            more = f" (and {len(violations) - 8} more)" if len(violations) > 8 else ""
            raise UnsupportedByTensorRT(
                f"the graph is not one TensorRT {self.tensorrt}'s ONNX parser builds: {shown}{more}; "
                "see docs/tensorrt.md for what the target accepts"
            )
        return PassResult(model, modified=False)
