"""Exact speculative decoding: guess a few tokens, check them all in one target step.

A verify step feeds the target model the pending token (chosen, not yet in the cache) and
up to K drafted tokens, and gets logits for every position it fed (`logits_to_keep` set to
the step's length in a default build; every position in one built with `--logits all`).
Each position's token is then chosen exactly as plain decoding chooses it, by the
request's own `Decoder` (repetition penalty, grammar mask, sampler) on that position's
logits, and the drafts are accepted while they equal the chosen token. The first position
where they differ still yields its chosen token (the target's own), so every verify step
produces 1 to K+1 tokens, and the drafts after it are dropped by shortening the cache: the
in-place `shared` buffer keeps its bytes and the next attention mask is simply shorter (the
model writes at `mask length - seq`), a `concat` cache is sliced.

Exactness. The drafter only decides which positions are computed in one call, never which
token is chosen: each token is drawn from the same distribution with the same random draw
as in plain decoding (one uniform per generated token, in the same order), so greedy and
seeded sampling give the tokens plain decoding gives, as far as the logits of a multi-token
step equal those of one-token steps (float rounding of a different kernel shape; how close
they are on the CPU targets is in docs/performance.md). This acceptance rule accepts a draft only when the sampled
token equals it: under sampling it accepts less often than rejection sampling
(Leviathan et al.) would, and it keeps plain decoding's exact tokens per seed, which
rejection sampling does not.

Drafters:

- `prompt-lookup`: the last n tokens of the prompt plus the generated text (n from 3 down
  to 1, the longest that occurs earlier) are looked up earlier in it, and the K tokens that
  followed the latest occurrence with K tokens after it (else the earliest, which has the
  most) are proposed (prompt lookup decoding; llama.cpp's and vLLM's n-gram speculation).
  No extra model; proposes nothing when nothing repeats.
- `draft:PATH`: a smaller kvforge artifact with the same tokenizer proposes K tokens
  greedily, one step each, over its own cache (rolled back like the target's).

The verify step is the engine core's (`kvforge.runners.core`): a row's step with k + 1 positions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from kvforge.runners.cache import Cache, device_of
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import GenerationError
from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.session import Session

PROMPT_LOOKUP = "prompt-lookup"
DRAFT_PREFIX = "draft:"
DEFAULT_DRAFT_TOKENS = 8
MAX_DRAFT_TOKENS = 64
# positions a step can take back (every draft of a verify step and the token fed before them):
# what a layer bounded by a sliding window keeps beyond its window while speculating
ROLLBACK = MAX_DRAFT_TOKENS + 1
# n-gram sizes prompt lookup matches, longest first: down to one token, which made more tokens
# per verify step than two at least (docs/performance.md, Speculative decoding)
NGRAM_MAX, NGRAM_MIN = 3, 1


def require_all_logits(io: DecoderIO, artifact: Path | str | None = None) -> None:
    """Refuse speculation on a graph that returns the last position's logits only, or that
    carries fixed-size layer states (a rejected draft cannot be taken back out of a state)."""
    where = f"{artifact}: " if artifact is not None else ""
    if io.state_names:
        raise GenerationError(
            f"{where}speculative decoding rolls a rejected draft back by shortening the KV cache, which the "
            f"fixed-size states of this model's {sorted({layer.kind for layer in io.layers or ()} - {'attention'})} "
            "layers (io.layers in its manifest.json) cannot do; generate without speculative"
        )
    if io.logits_positions == "last":
        raise GenerationError(
            f"{where}speculative decoding needs logits for every position of a verify step, but this artifact "
            "returns the last position's only (io.logits_positions 'last' in its manifest.json); rebuild it with "
            "`kvforge build CHECKPOINT -o OUT` (or, for a target without the logits_to_keep input, --logits all)"
        )


def parse_speculative(value: str | None, draft_tokens: int | None) -> tuple[str | None, int]:
    """Check `speculative` ("prompt-lookup", "draft:PATH" or None) and the draft count."""
    k = DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise GenerationError(f"draft_tokens must be an integer in [1, {MAX_DRAFT_TOKENS}], got {draft_tokens!r}")
    if value is None:
        if draft_tokens is not None:
            raise GenerationError("draft_tokens is set but speculative is not; pass speculative='prompt-lookup' too")
        return None, k
    if not isinstance(value, str) or not (
        value == PROMPT_LOOKUP or (value.startswith(DRAFT_PREFIX) and len(value) > len(DRAFT_PREFIX))
    ):
        raise GenerationError(
            f"speculative must be 'prompt-lookup' or 'draft:PATH' (a kvforge artifact), got {value!r}"
        )
    return value, k


def takes_turns(speculative: str | None) -> bool:
    """Whether `speculative` runs a draft model's session in turn with the target's, so that
    both are loaded with `stop_spinning` (`Engine.load`)."""
    return isinstance(speculative, str) and speculative.startswith(DRAFT_PREFIX)


@dataclass
class SpeculationStats:
    """What speculation did over one request: verify steps, tokens drafted, drafts accepted."""

    verify_steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verified_tokens: int = 0  # tokens the verify steps produced (every token after each row's first)

    @property
    def acceptance_rate(self) -> float:
        """The fraction of drafted tokens the target's own choice agreed with."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per verify step (1.0: no better than plain decoding)."""
        return self.verified_tokens / self.verify_steps if self.verify_steps else 0.0


class Drafter(Protocol):
    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """At most `k` guesses of the tokens after `history` (prompt and generated ids)."""
        ...


class PromptLookup:
    """Propose what followed an earlier occurrence of the history's last n-gram: the latest
    one with `k` tokens after it, else the earliest (the longest continuation)."""

    def __init__(self, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        ids = np.asarray(history, dtype=np.int64)
        for n in range(min(self.ngram_max, len(ids) - 1), self.ngram_min - 1, -1):
            # windows that end before the last token: each has at least one token after it
            hits = np.flatnonzero((sliding_window_view(ids[:-1], n) == ids[-n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= len(ids)]
                start = int(full[-1] if full.size else hits[0]) + n
                return [int(t) for t in ids[start : start + k]]
        return []


def run_row(
    session: Session, cache: Cache, length: int, ids: Sequence[int], every_position: bool = False
) -> tuple[np.ndarray, Cache]:
    """Feed `ids` to one sequence's cache (a batch of one) after its `length` valid positions;
    the logits [1, positions, vocab] (the last position's, or with `every_position` each fed
    position's: `generate.forward`) and the cache after. A layer bounded by a sliding window
    keeps ROLLBACK positions beyond it, so that taking back a rejected draft leaves it its
    whole window."""
    feed = np.asarray([ids], dtype=np.int64)
    mask = np.ones((1, length + len(ids)), dtype=np.int64)
    return forward(session, feed, mask, cache, ROLLBACK, every_position)


def take_back(cache: Cache, length: int, kept: int) -> tuple[Cache, int]:
    """One sequence's cache of `length` positions without every position from `kept` on, and
    the positions it then holds (a shared buffer keeps the bytes; the next mask does not reach
    them, and the next step overwrites them)."""
    drop = length - kept
    if drop <= 0:
        return cache, length
    if drop > ROLLBACK:
        raise ValueError(f"cannot take back {drop} positions: a bounded layer keeps {ROLLBACK} beyond its window")
    return cache.drop_last(drop, kept), kept


@dataclass(frozen=True)
class Speculation:
    """A request's speculative decoding: drafts per verify step, and the draft model (None: prompt lookup)."""

    draft_tokens: int
    draft: DraftModel | None = None

    def drafter(self, capacity: int) -> Drafter:
        """A fresh drafter for one sequence of at most `capacity` positions (raises GenerationError
        when the draft model holds fewer)."""
        return PromptLookup() if self.draft is None else self.draft.row(capacity)


class DraftModel:
    """A smaller artifact's session proposing greedily; one `DraftRow` per sequence."""

    def __init__(self, session: Session, max_positions: int, source: str) -> None:
        self.session, self.max_positions, self.source = session, max_positions, source

    def row(self, capacity: int) -> DraftRow:
        if capacity > self.max_positions:
            raise GenerationError(
                f"prompt plus max_new_tokens need {capacity} positions, but the draft model {self.source} holds "
                f"{self.max_positions}; shorten the request or use a draft model with a longer context"
            )
        return DraftRow(self.session, empty_cache(self.session.io, 1, capacity, device_of(self.session)))


@dataclass
class DraftRow:
    session: Session
    cache: Cache
    length: int = 0  # positions the cache holds
    ids: list[int] = field(default_factory=list)  # the tokens whose KV the cache holds

    def run(self, ids: Sequence[int]) -> np.ndarray:
        logits, self.cache = run_row(self.session, self.cache, self.length, ids)
        self.length += len(ids)
        return logits

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        common = 0
        limit = min(len(self.ids), len(history) - 1)  # at least one token is fed
        while common < limit and self.ids[common] == history[common]:
            common += 1
        self.cache, self.length = take_back(self.cache, self.length, common)
        logits = self.run(history[common:])
        drafts = [int(np.argmax(logits[0, -1]))]
        while len(drafts) < k:
            drafts.append(int(np.argmax(self.run(drafts[-1:])[0, -1])))
        self.ids = [*history, *drafts[:-1]]
        return drafts


def accept_drafts(drafts: Sequence[int], choose: Callable[[int], int]) -> Iterator[tuple[int, bool]]:
    """The tokens of a verify step, in order: `choose(j)` is the token chosen from position j's
    logits (the position fed draft j - 1, or the pending token for j = 0), paired with whether it
    equals draft j; it ends after the first that does not (every later position was fed a rejected
    draft). The caller stops sooner when its sequence ends."""
    for j in range(len(drafts) + 1):
        token = choose(j)
        matched = j < len(drafts) and token == drafts[j]
        yield token, matched
        if not matched:
            return


def check_same_vocabulary(target_vocab: dict[str, int], draft_vocab: dict[str, int], draft: Path | str) -> None:
    if target_vocab != draft_vocab:
        raise GenerationError(
            f"draft model {draft}: its tokenizer differs from the target's (vocabularies of {len(draft_vocab)} and "
            f"{len(target_vocab)} tokens, or the same size with different ids); use a draft artifact built from a "
            "checkpoint with the same tokenizer"
        )
