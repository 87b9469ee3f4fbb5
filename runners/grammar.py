"""Structured output: a JSON schema, a regular expression or a Lark grammar as a token mask.

llguidance compiles the constraint against the artifact's tokenizer.json (no torch, no
transformers) and gives, at each step, the set of tokens that keep the output inside the
language as a bitmask; `GrammarMask` is the logits processor that applies it. JSON is
compiled with compact separators and no free whitespace, so a small schema's reply is
short and ends: once the grammar can take nothing more, the row ends (`finished`), and
where it could go on or stop, the end-of-text token is among the allowed ones.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from kvforge.runners.errors import GenerationError
from kvforge.runners.sampling import FloatArray
from kvforge.runners.tokenizer import TokenizerBundle

# No whitespace between JSON tokens, "," and ":" as separators: the reply is as short as it can be.
_JSON_OPTIONS: Any = {"whitespace_flexible": False}


class GrammarError(GenerationError):
    """A JSON schema, regex or grammar that cannot be compiled, or a reply that left it."""


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint: llguidance's grammar text, and what it was made from (for messages)."""

    kind: str  # "json_schema", "regex" or "grammar"
    text: str


class GrammarCompiler:
    """The artifact's tokenizer as llguidance sees it, built once per engine."""

    def __init__(self, tokenizer: TokenizerBundle, vocab_size: int, eos_ids: Sequence[int]) -> None:
        try:
            self.tokenizer = llguidance.LLTokenizer(
                tokenizer.tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids) or None
            )
        except (ValueError, RuntimeError) as error:
            raise GrammarError(f"tokenizer.json cannot be used for structured output: {error}") from error
        self.vocab_size = vocab_size

    def compile(
        self,
        *,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
    ) -> Grammar | None:
        """At most one of the three; None when none is given. GrammarError names the one that fails."""
        given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v]
        if not given:
            return None
        if len(given) > 1:
            raise GrammarError(f"give one of json_schema, regex and grammar, not {' and '.join(given)}")
        kind = given[0]
        try:
            if json_schema is not None:
                schema = json.loads(json_schema) if isinstance(json_schema, str) else dict(json_schema)
                if not isinstance(schema, dict):
                    raise GrammarError(f"json_schema must be a JSON object, got {type(schema).__name__}")
                text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
            elif regex is not None:
                text = llguidance.LLMatcher.grammar_from_regex(_string("regex", regex))
            else:
                text = llguidance.LLMatcher.grammar_from_lark(_string("grammar", grammar))
        except (ValueError, TypeError) as error:
            raise GrammarError(f"{kind} is not valid: {_one_line(str(error))}") from error
        problem = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(f"{kind} cannot be compiled: {_one_line(problem)}")
        compiled = Grammar(kind, text)
        # A grammar can compile and still admit no text (a schema whose $ref refers only to itself):
        # the first mask says so, here rather than as an empty reply
        probe = self.mask(compiled)
        probe.allowed()
        if probe.matcher.is_error():
            reason = (probe.matcher.get_error().strip().splitlines() or ["no reason given"])[0]
            raise GrammarError(f"{kind} admits no text ({reason}); check it for a $ref that only refers to itself")
        return compiled

    def mask(self, grammar: Grammar) -> GrammarMask:
        return GrammarMask(llguidance.LLMatcher(self.tokenizer, grammar.text, log_level=0), self.vocab_size, grammar)


class GrammarMask:
    """Logits processor: tokens the grammar does not allow next get -inf."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, grammar: Grammar) -> None:
        if matcher.is_error():
            raise GrammarError(f"{grammar.kind} cannot be compiled: {_one_line(matcher.get_error())}")
        self.matcher, self.vocab_size, self.grammar = matcher, vocab_size, grammar
        self._bits = np.zeros(((vocab_size + 31) // 32,), dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def __call__(self, scores: FloatArray) -> FloatArray:
        result: FloatArray = np.where(self.allowed()[None, :], scores, -np.inf)
        return result

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} leaves the {self.grammar.kind}: {_one_line(self.matcher.get_error())}")

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole sentence of the grammar (it may end here)."""
        return bool(self.matcher.is_accepting())


def _string(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise GrammarError(f"{kind} must be a string, got {type(value).__name__}")
    return value


def _one_line(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines() if line.strip())
