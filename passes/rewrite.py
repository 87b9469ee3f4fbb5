"""Fusion passes: named sets of onnxscript rewrite rules, counted per rule, explained when missed.

onnxscript's rewriter is the rule engine (pattern / check / rewrite); this module makes a
rule set an `onnx_ir` pass with an exact `modified`, and records for every rule how often
it fired. When a rule fires fewer times than the pipeline expected, `explain` replays it
with onnxscript's matching tracer (which changes nothing) and reports the node where the
best partial match stopped and the constraint that failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult
from onnxscript.rewriter import MatchingTracer, MatchStatus, RewriteRule, RewriteRuleSet


@dataclass(frozen=True)
class Miss:
    """Why a rule did not fire: the closest match in the graph and what stopped it."""

    rule: str
    node: str  # "OpType(name)" of the node the best partial match started from, or ""
    reason: str

    def __str__(self) -> str:
        where = f" at {self.node}" if self.node else ""
        return f"{self.rule}{where}: {self.reason}"


class FusionPass(InPlacePass):
    """Apply `rules` in order to the model; `counts` says how often each one fired.

    Rules are keyed by the name the pass report and `--explain` use for them; one name may
    stand for several rules (forms of one fusion), counted together and explained by the
    closest match of any of them.
    """

    def __init__(self, name: str, rules: Mapping[str, RewriteRule | Sequence[RewriteRule]]) -> None:
        super().__init__()
        self.name = name
        self._rules = {key: [rule] if isinstance(rule, RewriteRule) else list(rule) for key, rule in rules.items()}
        self.counts: dict[str, int] = {}

    def call(self, model: ir.Model) -> PassResult:
        before = _node_ids(model)
        self.counts = {name: RewriteRuleSet(rules).apply_to_model(model) for name, rules in self._rules.items()}
        _release_matched_graphs(self._all_rules())
        # The rewriter also drops nodes left without uses, so a rule count of 0 is not "unchanged".
        return PassResult(model, modified=any(self.counts.values()) or _node_ids(model) != before)

    def explain(self, model: ir.Model) -> list[Miss]:
        """For every rule, why its best partial match in `model` failed (the model is not changed)."""
        misses = []
        for name, rules in self._rules.items():
            tracer = MatchingTracer()
            RewriteRuleSet(rules).apply_to_model(model, tracer=tracer)
            misses.append(_closest_miss(name, tracer))
        _release_matched_graphs(self._all_rules())
        _detach_unplaced_users(model)
        return misses

    def _all_rules(self) -> list[RewriteRule]:
        return [rule for rules in self._rules.values() for rule in rules]


def _release_matched_graphs(rules: Iterable[RewriteRule]) -> None:
    """Forget the graph each rule's matcher last looked at. onnxscript's matchers keep a
    reference to it (and to the node and match), and many rules are module-level objects
    shared by every build in the process: without this, the last graph a rule saw, with all
    its weights, stays in memory until the process ends."""
    for rule in rules:
        matcher = getattr(rule, "_matcher", None)
        for attribute in ("_graph", "_current_node", "_match"):
            if matcher is not None and hasattr(matcher, attribute):
                setattr(matcher, attribute, None)


def _detach_unplaced_users(model: ir.Model) -> None:
    """The tracer still builds each rule's replacement without inserting it; those nodes
    remain users of graph values and would keep later rewrites from removing them."""
    graph = model.graph
    values = [*graph.inputs, *graph.initializers.values()]
    values += [out for node in ir.traversal.RecursiveGraphIterator(graph) for out in node.outputs]
    for value in values:
        for user, index in list(value.uses()):
            if user.graph is None:
                user.replace_input_with(index, None)


def _node_ids(model: ir.Model) -> set[int]:
    return {id(node) for node in ir.traversal.RecursiveGraphIterator(model.graph)}


def _closest_miss(rule: str, tracer: MatchingTracer) -> Miss:
    candidates = [m for matches in tracer.best_matches_map.values() for m in matches]
    failed = [m for m in candidates if m.status != MatchStatus.SUCCESS]
    if not failed:
        return Miss(rule, "", "no node in the graph starts this pattern")
    best = max(failed, key=lambda m: m.score())
    node = best.root_node
    kind = "check failed" if best.status == MatchStatus.CONDITION_FAILED else "pattern mismatch"
    matched = len(best.match_result.nodes)
    reason = best.match_result.reason or "no reason given"
    return Miss(rule, f"{node.op_type}({node.name})", f"{kind} after matching {matched} node(s): {reason}")
