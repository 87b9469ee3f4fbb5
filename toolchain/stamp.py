"""Lowering a decoder by tracing each distinct layer kind once and stamping out the stack.

A decoder is N copies of a few distinct layer kinds. torch.export and the torch.onnx
lowering cost time per layer, so the whole-stack path (`export_decoder` then `to_onnx`)
spends most of a build re-tracing identical layers. Here the eager model is cut down to
two layers of each kind (the first two of each, in stack order), exported and lowered;
the lowered graph is taken apart into what comes before the layers (embedding, masks,
rotary tables, the cache's shape reads), each layer, and what comes after (final norm, LM
head); and the full graph is written out again with every layer of the stack copied from
its kind's lowered layer, each copy reading that layer's weights and cache.

The two copies of a kind are what makes this sound: the second is compared with the first,
node for node (op, attributes, and where every input comes from: a weight of the same name
in its own layer, the same shared value, the previous layer's output, its own cache), which
shows the lowering of that layer does not depend on its position. The second copy, whose
inputs come from a previous layer as every later layer's do, is the template for all the
later layers of its kind; the first copy stands for the first layer of its kind. Anything
the analysis does not recognize (a layer reading a value another layer computed other than
its output, layers not in one contiguous run, subgraphs, weights not found under the
layer's name) raises `Unstampable` and the build lowers the whole stack instead; the parity
gate still checks the complete graph either way.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch
from torch.export import ExportedProgram

from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ExportError
from kvforge.toolchain import lowering_cache
from kvforge.toolchain.export import export_decoder
from kvforge.toolchain.lower import _WRAPPER_PREFIX, apply_contract, to_onnx, torch_tensor
from kvforge.toolchain.spec import DecoderSpec

log = logging.getLogger(__name__)

_SCOPES = "pkg.torch.onnx.name_scopes"
# Module attributes that number the layer: remapped in the cut-down model, not part of a kind.
_INDEX_ATTRIBUTES = ("layer_idx",)
_PLAIN = (bool, int, float, str, type(None))
_COMMUTATIVE = frozenset({"Add", "Mul", "And", "Or", "Xor", "Max", "Min", "Sum", "Equal"})


class Unstampable(Exception):
    """The lowered layers do not have a structure stamping can prove; lower the whole stack."""


@dataclass(frozen=True)
class Lowering:
    """How the graph was lowered: `stamped` from `traced` layers of `kinds` distinct kinds,
    or the whole stack (`reason` says why)."""

    stamped: bool
    layers: int
    traced: int
    kinds: int
    reason: str | None = None
    cached: bool = False  # the traced layers' lowered graph was read from the lowering cache
    entry: Path | None = field(default=None, compare=False)  # its entry there (None: the cache is off)

    def summary(self) -> str:
        if self.stamped:
            return (
                f"lowering: {self.layers} layers stamped from {self.traced} traced "
                f"({self.kinds} layer kind{'s' if self.kinds != 1 else ''}"
                f"{'; their graph from the lowering cache' if self.cached else ''})"
            )
        return f"lowering: whole stack of {self.layers} layers ({self.reason})"


def whole(spec: DecoderSpec, reason: str) -> Lowering:
    return Lowering(False, spec.num_layers, spec.num_layers, 0, reason)


@dataclass(frozen=True)
class Plan:
    """Which layers the cut-down model keeps (`selected`, full-stack indices in order) and, for
    every layer of the stack, the position in the cut-down model of its template."""

    layers_path: str  # the layer ModuleList's path in the HF model, e.g. "model.layers"
    selected: tuple[int, ...]  # cut-down position -> the full-stack layer it is
    template: tuple[int, ...]  # full-stack layer -> the cut-down position it is copied from
    copies: tuple[tuple[int, ...], ...]  # per kind: the cut-down positions of its first (and second) copy

    @property
    def kinds(self) -> int:
        return len(self.copies)

    def is_first(self, p: int) -> bool:
        return any(copies[0] == p for copies in self.copies)


def plan(model: torch.nn.Module, spec: DecoderSpec) -> Plan:
    """The cut-down model for `model`, or Unstampable when no layer kind repeats."""
    path, layers = _layer_list(model, spec.num_layers)
    types = getattr(model.config, "layer_types", None)
    kinds = [
        _kind(layer, types[i] if isinstance(types, (list, tuple)) and len(types) == len(layers) else None)
        for i, layer in enumerate(layers)
    ]
    first: dict[Hashable, int] = {}
    second: dict[Hashable, int] = {}
    for i, kind in enumerate(kinds):
        if kind not in first:
            first[kind] = i
        elif kind not in second:
            second[kind] = i
    selected = tuple(sorted([*first.values(), *second.values()]))
    if len(selected) >= len(layers):
        raise Unstampable(
            f"nothing repeats enough to stamp: {len(layers)} layers of {len(first)} kinds, {len(selected)} to trace"
        )
    position = {i: p for p, i in enumerate(selected)}
    template = tuple(
        position[first[kind]] if i == first[kind] else position[second[kind]] for i, kind in enumerate(kinds)
    )
    copies = tuple(tuple(position[i] for i in (first[k], second.get(k)) if i is not None) for k in first)
    return Plan(path, selected, template, copies)


def _layer_list(model: torch.nn.Module, num_layers: int) -> tuple[str, torch.nn.ModuleList]:
    """The model's stack of decoder layers: the outermost ModuleList of `num_layers` modules."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_layers
    ]
    outer = [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o, _ in found)]
    if len(outer) != 1:
        raise Unstampable(f"cannot tell the layer stack among {[n for n, _ in outer]}")
    return outer[0]


def _kind(layer: torch.nn.Module, layer_type: Any) -> Hashable:
    """What makes two layers lower alike: the config's layer type, and for every submodule its
    class, plain attributes (but the layer's index) and the shapes and dtypes of its tensors."""
    parts: list[Hashable] = [repr(layer_type)]
    for name, module in layer.named_modules():
        attributes = tuple(
            sorted(
                (k, repr(v))
                for k, v in vars(module).items()
                if not k.startswith("_") and k not in _INDEX_ATTRIBUTES and k != "training" and isinstance(v, _PLAIN)
            )
        )
        tensors = tuple(
            (n, tuple(t.shape), str(t.dtype))
            for n, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        )
        parts.append((name, type(module).__module__, type(module).__qualname__, attributes, tensors))
    return tuple(parts)


@contextmanager
def cut_down(model: torch.nn.Module, chosen: Plan) -> Iterator[None]:
    """`model` with only the chosen layers, numbered 0.., and its config's per-layer lists and
    layer count to match; everything restored on exit."""
    config: Any = model.config
    parent_path, _, attribute = chosen.layers_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    layers: torch.nn.ModuleList = getattr(parent, attribute)
    full = len(layers)
    saved_config = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == full}
    saved_count = getattr(config, "num_hidden_layers", None)
    if saved_count != full:
        raise Unstampable(f"the config's num_hidden_layers ({saved_count}) is not the stack's {full} layers")
    saved_indices: list[tuple[torch.nn.Module, str, Any]] = []
    try:
        for p, i in enumerate(chosen.selected):
            for module in layers[i].modules():
                for name in _INDEX_ATTRIBUTES:
                    if isinstance(getattr(module, name, None), int):
                        saved_indices.append((module, name, getattr(module, name)))
                        setattr(module, name, p)
        setattr(parent, attribute, torch.nn.ModuleList([layers[i] for i in chosen.selected]))
        for k, v in saved_config.items():
            setattr(config, k, type(v)(v[i] for i in chosen.selected))
        config.num_hidden_layers = len(chosen.selected)
        yield
    finally:
        setattr(parent, attribute, layers)
        for k, v in saved_config.items():
            setattr(config, k, v)
        config.num_hidden_layers = saved_count
        for module, name, value in saved_indices:
            setattr(module, name, value)


@dataclass
class CutProgram:
    """The cut-down model's ExportedProgram (None where its lowered graph came from the lowering
    cache: `lowered`), with the plan that made it."""

    program: ExportedProgram | None
    plan: Plan
    io: DecoderIO
    lowered: ir.Model | None = None
    entry: Path | None = None  # the lowering cache's entry for this trace (None: the cache is off)


def export(model: torch.nn.Module, spec: DecoderSpec, io: DecoderIO, cache: Path | None = None) -> CutProgram:
    """torch.export of the cut-down model, or its lowered graph from the lowering cache in
    directory `cache` (Unstampable when no layer kind repeats; `model` is left as it was)."""
    chosen = plan(model, spec)

    def cut(per_layer: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
        return None if per_layer is None else tuple(per_layer[i] for i in chosen.selected)

    # what the contract and the spec say per layer (windows, kinds and states) follows the layers kept
    cut_spec = replace(spec, num_layers=len(chosen.selected), layers=cut(spec.layers))
    cut_io = replace(io, num_layers=len(chosen.selected), layer_windows=cut(io.layer_windows), layers=cut(io.layers))
    entry = None if cache is None else cache_entry(cache, model, chosen, cut_spec, cut_io)
    with cut_down(model, chosen):
        if entry is not None and (lowered := lowering_cache.load(entry, model)) is not None:
            return CutProgram(None, chosen, cut_io, lowered, entry)
        try:
            program = export_decoder(model, cut_spec, cut_io)
        except ExportError as e:  # the whole stack may still export: let the build try it
            raise Unstampable(f"the cut-down model does not export ({e})") from e
    return CutProgram(program, chosen, cut_io, entry=entry)


def cache_entry(cache: Path, model: torch.nn.Module, chosen: Plan, spec: DecoderSpec, io: DecoderIO) -> Path:
    """The lowering cache's entry in directory `cache` for the cut-down model of `model` that
    `chosen`, `spec` and `io` describe: keyed by the whole model's structure as `_kind` reads a
    layer's (classes, plain attributes, tensor shapes and dtypes) and by the rest of the trace's
    inputs (`lowering_cache.key`)."""
    return lowering_cache.entry(cache, model, (_kind(model, None), chosen, spec, io))


def lower(cut: CutProgram, model: torch.nn.Module, io: DecoderIO) -> tuple[ir.Model, Lowering]:
    """The full stack's graph from the cut-down program: lowered (or read from the lowering
    cache), proven and stamped out (Unstampable when the lowered layers' structure cannot be
    proven). A graph lowered here is kept in the cache once stamping has proven it."""
    entry, lowered, kept = cut.entry, cut.lowered, None
    if lowered is None:
        assert cut.program is not None
        try:
            lowered = to_onnx(cut.program, cut.io)
        except ExportError as e:
            raise Unstampable(f"the cut-down model does not lower ({e})") from e
        if entry is not None:
            with cut_down(model, cut.plan):  # its weights by the names the cut-down model gives them
                kept = lowering_cache.dump(lowered, model)
    try:
        stamped = _Stamper(lowered, cut.plan, model).stamp()
    except (KeyError, StopIteration, Unstampable) as e:
        if entry is not None and cut.lowered is not None:
            lowering_cache.forget(entry)
        if isinstance(e, Unstampable):
            raise
        # another torch/onnxscript release can lower the cut-down layers into a shape this
        # proof does not follow: the whole stack is lowered instead, never a crash
        raise Unstampable(f"the lowered layers do not have the structure stamping expects ({type(e).__name__})") from e
    if entry is not None and kept is not None:
        lowering_cache.store(entry, kept)
    apply_contract(stamped.graph, io)
    full = len(cut.plan.template)
    return stamped, Lowering(
        True, full, len(cut.plan.selected), cut.plan.kinds, cached=cut.lowered is not None, entry=entry
    )


# ---------------------------------------------------------------------------------------
# The lowered cut-down graph, taken apart and written out for the full stack.

Role = tuple[Any, ...]


@dataclass
class _Layer:
    nodes: list[ir.Node] = field(default_factory=list)
    prologue: list[ir.Node] = field(default_factory=list)  # its own nodes before the layers (cache reads)
    output: ir.Value | None = None


class _Stamper:
    def __init__(self, cut: ir.Model, chosen: Plan, model: torch.nn.Module) -> None:
        self.cut, self.plan = cut, chosen
        self.graph = cut.graph
        self.m = len(chosen.selected)
        self.scope = re.compile(r"'" + re.escape(_WRAPPER_PREFIX + chosen.layers_path) + r"\.(\d+)'")
        self.weight = re.compile(re.escape(chosen.layers_path) + r"\.(\d+)\.(.+)")
        self.tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(
            model.named_buffers(remove_duplicate=False)
        )
        self.past = {f"past_key_values.{p}.{k}": (p, k) for p in range(self.m) for k in ("key", "value")}

    # -- taking the cut-down graph apart ------------------------------------------------

    def _layer_of(self, node: ir.Node) -> int | None:
        found = {int(x) for x in self.scope.findall(node.metadata_props.get(_SCOPES, ""))}
        if len(found) > 1:
            raise Unstampable(f"node {node.name} is scoped in several layers {sorted(found)}")
        return found.pop() if found else None

    def _analyse(self) -> None:
        nodes = list(self.graph)
        for node in nodes:
            for attr in node.attributes.values():
                if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
                    raise Unstampable(f"node {node.name} ({node.op_type}) holds a subgraph")
        labels = [self._layer_of(n) for n in nodes]
        layer_positions = [k for k, label in enumerate(labels) if label is not None]
        if not layer_positions:
            raise Unstampable("no node is scoped in a layer")
        start, end = layer_positions[0], layer_positions[-1] + 1
        inside = labels[start:end]
        numbered = [label for label in inside if label is not None]
        if len(numbered) != len(inside) or numbered != sorted(numbered) or sorted(set(numbered)) != list(range(self.m)):
            raise Unstampable("the layers' nodes are not one run per layer, in order")
        self.before, self.after = nodes[:start], nodes[end:]
        self.layers = [_Layer() for _ in range(self.m)]
        self.home: dict[int, int] = {}  # id(node) -> layer
        for node, label in zip(nodes[start:end], inside):
            assert label is not None
            self.layers[label].nodes.append(node)
            self.home[id(node)] = label
        self._split_prologue()
        self._find_outputs()

    def _split_prologue(self) -> None:
        """Nodes before the layers that read one layer's cache only for that layer (the
        exporter's copies of each past tensor, its length) belong to that layer."""
        depends: dict[int, set[int]] = {}
        for node in self.before:
            deps: set[int] = set()
            for value in node.inputs:
                if value is None:
                    continue
                if value.name in self.past and value.is_graph_input():
                    deps.add(self.past[value.name][0])
                elif (producer := value.producer()) is not None and id(producer) in depends:
                    deps |= depends[id(producer)]
            depends[id(node)] = deps
        own: dict[int, int] = {}
        for node in reversed(self.before):
            deps = depends[id(node)]
            if len(deps) != 1:
                continue
            (p,) = deps
            users = [user for value in node.outputs for user, _ in value.uses()]
            if any(value.is_graph_output() for value in node.outputs):
                continue
            if users and all(self.home.get(id(u)) == p or own.get(id(u)) == p for u in users):
                own[id(node)] = p
        self.own_prologue = own
        for node in self.before:
            if (owner := own.get(id(node))) is not None:
                self.layers[owner].prologue.append(node)

    def _find_outputs(self) -> None:
        for p, layer in enumerate(self.layers):
            consumed = {
                id(value): value
                for node in layer.nodes
                for value in node.outputs
                if not _is_constant(node)
                for user, _ in value.uses()
                if self.home.get(id(user)) != p
            }
            if len(consumed) != 1:
                raise Unstampable(f"layer {p} passes {len(consumed)} values to later nodes, not one hidden state")
            layer.output = next(iter(consumed.values()))

    # -- proving the copies alike ----------------------------------------------------------

    def _role(self, value: ir.Value | None, p: int, local: dict[int, tuple[int, int]]) -> Role:
        """Where an input of layer p comes from, independent of p."""
        if value is None:
            return ("none",)
        if id(value) in local:
            return ("local", *local[id(value)])
        producer = value.producer()
        if producer is not None and _is_constant(producer):
            return ("constant", _constant_key(producer))
        if producer is None:
            if value.name in self.past:
                q, kind = self.past[value.name]
                if q != p:
                    raise Unstampable(f"layer {p} reads the cache of layer {q}")
                return ("past", kind)
            if value.name is not None and (match := self.weight.fullmatch(value.name)):
                if int(match.group(1)) != p:
                    raise Unstampable(f"layer {p} reads {value.name}, a weight of another layer")
                return ("weight", match.group(2))
            return ("shared", value.name)
        layer = self.home.get(id(producer))
        if layer is None:
            owner = self.own_prologue.get(id(producer))
            if owner is not None and owner != p:
                raise Unstampable(f"layer {p} reads {value.name}, computed for layer {owner}")
            return ("shared", value.name)
        if layer == p - 1 and value is self.layers[layer].output:
            return ("input",)
        raise Unstampable(f"layer {p} reads {value.name}, computed in layer {layer} (not its output)")

    def _signature(self, p: int, embedding: ir.Value | None = None) -> list[Role]:
        layer = self.layers[p]
        local: dict[int, tuple[int, int]] = {}
        signature: list[Role] = []
        k = 0
        for part, nodes in (("prologue", layer.prologue), ("layer", layer.nodes)):
            for node in nodes:
                if _is_constant(node):
                    continue
                inputs = tuple(
                    ("input",) if v is not None and v is embedding else self._role(v, p, local) for v in node.inputs
                )
                if node.domain in ("", "ai.onnx") and node.op_type in _COMMUTATIVE:
                    # symbolic sizes come in the order of their symbols' names, which differ per layer
                    inputs = tuple(sorted(inputs, key=repr))
                outputs = tuple(
                    (
                        "present" if v.is_graph_output() else "",
                        v is layer.output,
                        None if v.dtype is None else v.dtype.name,
                        None if v.shape is None else v.shape.rank(),
                    )
                    for v in node.outputs
                )
                signature.append(
                    (part, node.domain, node.op_type, node.overload, _attributes_key(node), inputs, outputs)
                )
                for j, v in enumerate(node.outputs):
                    local[id(v)] = (k, j)
                k += 1
        return signature

    def _prove(self) -> None:
        """Each kind's second copy against its first: alike but for the layer they are."""
        for copies in self.plan.copies:
            if len(copies) < 2:
                continue
            a, b = copies
            first, second = self._signature(a), self._signature(b)
            if a == 0:  # the stack's first layer reads the embedding where later ones read the previous layer
                first = self._signature(a, self._embedding(first, second))
            if len(first) != len(second):
                raise Unstampable(f"the lowered layers {a} and {b} of one kind differ in length")
            for x, y in zip(first, second):
                if x != y:
                    raise Unstampable(f"the lowered layers {a} and {b} of one kind differ at a {x[2]} node")

    def _embedding(self, first: list[Role], second: list[Role]) -> ir.Value | None:
        """The shared value the first layer reads where its kind's second copy reads its input."""

        def shared(signature: list[Role]) -> set[str]:
            return {role[1] for node in signature for role in node[5] if role[0] == "shared"}

        only = shared(first) - shared(second)
        if len(only) != 1:
            return None
        (name,) = only
        return next((v for node in self.layers[0].nodes for v in node.inputs if v is not None and v.name == name), None)

    # -- writing the full graph ----------------------------------------------------------

    def stamp(self) -> ir.Model:
        self._analyse()
        self._prove()
        full_layers = len(self.plan.template)
        mapping: dict[int, ir.Value] = {}  # id(cut value) -> full value, for shared values
        instances: list[dict[int, ir.Value]] = [{} for _ in range(full_layers)]  # per full layer
        inputs: list[ir.Value] = []
        for value in self.graph.inputs:
            if value.name in self.past:
                continue
            inputs.append(mapping.setdefault(id(value), _fresh(value, value.name)))
        for i in range(full_layers):
            p = self.plan.template[i]
            for kind in ("key", "value"):
                template = self.graph.inputs[[v.name for v in self.graph.inputs].index(f"past_key_values.{p}.{kind}")]
                fresh = _fresh(template, f"past_key_values.{i}.{kind}")
                instances[i][id(template)] = fresh
                inputs.append(fresh)
        # shared reads of a cut-down layer's cache read the cache of the layer it stands for
        for value in self.graph.inputs:
            if value.name in self.past:
                p, _ = self.past[value.name]
                mapping[id(value)] = instances[self.plan.selected[p]][id(value)]

        initializers: list[ir.Value] = []
        layer_weights: dict[int, list[ir.Value]] = {p: [] for p in range(self.m)}
        for value in self.graph.initializers.values():
            match = self.weight.fullmatch(value.name or "")
            if match is not None:
                layer_weights[int(match.group(1))].append(value)
            else:
                fresh = _fresh(value, value.name)
                fresh.const_value = value.const_value
                mapping[id(value)] = fresh
                initializers.append(fresh)
        for i in range(full_layers):
            p = self.plan.template[i]
            for value in layer_weights[p]:
                suffix = self.weight.fullmatch(value.name or "").group(2)  # type: ignore[union-attr]
                name = f"{self.plan.layers_path}.{i}.{suffix}"
                tensor = self.tensors.get(name)
                traced = value.const_value
                if tensor is None or traced is None or tuple(tensor.shape) != tuple(traced.shape):
                    raise Unstampable(f"no weight {name} like the traced {value.name}")
                fresh = _fresh(value, name)
                fresh.const_value = torch_tensor(tensor, _WRAPPER_PREFIX + name)
                instances[i][id(value)] = fresh
                initializers.append(fresh)

        nodes: list[ir.Node] = []
        for node in self.before:
            owner = self.own_prologue.get(id(node))
            if owner is None:
                nodes.append(self._copy(node, mapping, _At(instances)))
            else:
                nodes.extend(
                    self._copy(node, mapping, _At(instances, i))
                    for i in range(full_layers)
                    if self.plan.template[i] == owner
                )
        for i in range(full_layers):
            nodes.extend(
                self._copy(node, mapping, _At(instances, i)) for node in self.layers[self.plan.template[i]].nodes
            )
        for node in self.after:
            nodes.append(self._copy(node, mapping, _At(instances)))

        outputs: list[ir.Value] = []
        for value in self.graph.outputs:
            if value.name == "logits":
                outputs.append(self._lookup(value, mapping, _At(instances)))  # type: ignore[arg-type]
        for i in range(full_layers):
            p = self.plan.template[i]
            for kind in ("key", "value"):
                template = next(v for v in self.graph.outputs if v.name == f"present.{p}.{kind}")
                value = instances[i][id(template)]
                outputs.append(value)
        graph = ir.Graph(
            inputs,
            outputs,
            nodes=nodes,
            initializers=initializers,
            opset_imports=dict(self.graph.opset_imports),
            name=self.graph.name,
        )
        return ir.Model(
            graph,
            ir_version=self.cut.ir_version,
            producer_name=self.cut.producer_name,
            producer_version=self.cut.producer_version,
            functions=list(self.cut.functions.values()),
        )

    def _lookup(self, value: ir.Value | None, mapping: dict[int, ir.Value], at: _At) -> ir.Value | None:
        """The full graph's counterpart of cut-down `value`, read by a node copied at `at`."""
        if value is None:
            return None
        if at.layer is not None and id(value) in at.instances[at.layer]:
            return at.instances[at.layer][id(value)]
        if id(value) in mapping:
            return mapping[id(value)]
        producer = value.producer()
        q = None if producer is None else self.home.get(id(producer))
        if q is None or producer is None:
            raise Unstampable(f"{value.name} is read before it is computed")
        full = len(self.plan.template)
        if value is self.layers[q].output:
            if at.layer is None and q == self.m - 1:  # the last layer's output, read by the final norm
                return self._output(full - 1, at.instances)
            if at.layer is not None and q == self.plan.template[at.layer] - 1:
                return self._output(at.layer - 1, at.instances)
        if _is_constant(producer) and self.plan.is_first(q):  # the exporter made it once, for every later use
            return at.instances[self.plan.selected[q]][id(value)]
        raise Unstampable(f"{value.name}, computed in layer {q}, is read outside it")

    def _output(self, i: int, instances: list[dict[int, ir.Value]]) -> ir.Value:
        output = self.layers[self.plan.template[i]].output
        assert output is not None
        return instances[i][id(output)]

    def _copy(self, node: ir.Node, mapping: dict[int, ir.Value], at: _At) -> ir.Node:
        """`node` copied at `at`: a node of full layer `at.layer`, or a shared one."""
        inputs = [self._lookup(v, mapping, at) for v in node.inputs]
        metadata = dict(node.metadata_props)
        prefix = "" if at.layer is None else f"l{at.layer}/"
        if at.layer is not None and _SCOPES in metadata:
            old = f"'{_WRAPPER_PREFIX}{self.plan.layers_path}.{self.plan.template[at.layer]}"
            new = f"'{_WRAPPER_PREFIX}{self.plan.layers_path}.{at.layer}"
            metadata[_SCOPES] = re.sub(re.escape(old) + r"(?=[.'])", new, metadata[_SCOPES])
        copy = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            [
                ir.Attr(a.name, a.type, a.value, a.ref_attr_name, doc_string=a.doc_string)
                for a in node.attributes.values()
            ],
            overload=node.overload,
            num_outputs=len(node.outputs),
            version=node.version,
            name=None if node.name is None else prefix + node.name,
            doc_string=node.doc_string,
            metadata_props=metadata,
        )
        for old_value, new_value in zip(node.outputs, copy.outputs):
            new_value.name = None if old_value.name is None else prefix + old_value.name
            new_value.type = old_value.type
            new_value.shape = None if old_value.shape is None else old_value.shape.copy()
            (mapping if at.layer is None else at.instances[at.layer])[id(old_value)] = new_value
        return copy


@dataclass
class _At:
    instances: list[dict[int, ir.Value]]  # per full layer: id(cut value) -> its copy there
    layer: int | None = None


def _fresh(value: ir.Value, name: str | None) -> ir.Value:
    return ir.Value(name=name, type=value.type, shape=None if value.shape is None else value.shape.copy())


def _is_constant(node: ir.Node) -> bool:
    return node.op_type == "Constant" and node.domain in ("", "ai.onnx")


def _constant_key(node: ir.Node) -> Hashable:
    return _attributes_key(node)


def _attributes_key(node: ir.Node) -> Hashable:
    items = []
    for name, attr in sorted(node.attributes.items()):
        value = attr.value
        if attr.type == ir.AttributeType.TENSOR:
            value = (value.dtype.name, tuple(value.shape), value.tobytes())
        elif attr.type == ir.AttributeType.TENSORS:
            value = tuple((t.dtype.name, tuple(t.shape), t.tobytes()) for t in value)
        elif isinstance(value, Sequence) and not isinstance(value, str):
            value = tuple(value)
        items.append((name, attr.type.name, value))
    return tuple(items)
