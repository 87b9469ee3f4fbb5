"""One request's token choice: logits processors, a sampler built once, logprobs, the end rule.

Everything that generates (`Engine`, the server's scheduler, the Triton backend) builds one
`Decoder` per request (per choice, with n > 1) and asks it for each token:

    scores = logits (float64) -> each processor in turn (repetition penalty, grammar mask)
           -> the sampler (temperature, top-k, top-p, min-p, seeded draw), as mlx-lm's make_sampler

Logprobs are the model's own log-softmax over the whole vocabulary, taken from the raw logits
before any processor or sampling step: finite, and comparable across sampling settings (what
OpenAI and vLLM return by default).

`end_of_row` is the one rule that says whether a row has finished, and why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvforge.runners.errors import GenerationError
from kvforge.runners.sampling import (
    FloatArray,
    IdArray,
    SamplingParams,
    Uniforms,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    draw,
    greedy,
    make_rng,
)

# OpenAI's bound on top_logprobs; vLLM allows more, but a 20-entry dict per token is plenty.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability and the `top` most likely tokens, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: npt.ArrayLike) -> FloatArray:
    """Log-probabilities of one row of logits, in float64."""
    row = np.asarray(logits, dtype=np.float64)
    shifted = row - row.max(axis=-1, keepdims=True)
    result: FloatArray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return result


def token_logprob(logits: npt.ArrayLike, token: int, top: int) -> TokenLogprob:
    """The entry for `token` under the model's distribution `logits` ([vocab]); ties rank lower ids first."""
    logprobs = log_softmax(logits)
    entries: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, logprobs.shape[-1])
        head = np.argpartition(-logprobs, k - 1)[:k]
        order = head[np.lexsort((head, -logprobs[head]))]
        entries = tuple((int(i), float(logprobs[i])) for i in order)
    return TokenLogprob(int(token), float(logprobs[token]), entries)


class LogitsProcessor(Protocol):
    """A step before the sampler that keeps the history it needs."""

    def __call__(self, scores: FloatArray) -> FloatArray:
        """Scores [1, vocab] (float64) in, scores out; a token set to -inf cannot be chosen."""
        ...

    def accept(self, token: int) -> None:
        """The token chosen after this step."""
        ...

    @property
    def finished(self) -> bool:
        """True when nothing more may be generated (a grammar that has reached its end)."""
        ...


class RepetitionPenalty:
    """Hugging Face's repetition penalty over the prompt and every token generated since."""

    def __init__(self, prompt: Sequence[int], penalty: float) -> None:
        self.seen = np.asarray(prompt, dtype=np.int64)
        self.penalty = penalty

    def __call__(self, scores: FloatArray) -> FloatArray:
        return apply_repetition_penalty(scores, [self.seen], self.penalty)

    def accept(self, token: int) -> None:
        self.seen = np.append(self.seen, token)

    @property
    def finished(self) -> bool:
        return False


Sampler = Callable[[FloatArray, Uniforms], IdArray]


def make_sampler(params: SamplingParams) -> Sampler:
    """The sampling chain for `params`, built once: only the steps that do something are in it."""
    if params.greedy:
        return lambda scores, rng: greedy(scores)
    steps: list[Callable[[FloatArray], FloatArray]] = [lambda s: apply_temperature(s, params.temperature)]
    if params.top_k > 0:
        steps.append(lambda s: apply_top_k(s, params.top_k))
    if params.top_p < 1.0:
        steps.append(lambda s: apply_top_p(s, params.top_p))
    if params.min_p > 0.0:
        steps.append(lambda s: apply_min_p(s, params.min_p))

    def sample(scores: FloatArray, rng: Uniforms) -> IdArray:
        for step in steps:
            scores = step(scores)
        return draw(scores, rng)

    return sample


class Decoder:
    """Chooses one request's tokens: its processors, then its sampler, with its own seeded generator.

    `logprobs` = k asks for each chosen token's logprob and the k most likely (0: the chosen
    one only; None: none). Logits given to `choose` must already be checked finite.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int] = (),
        *,
        processors: Sequence[LogitsProcessor] = (),
        logprobs: int | None = None,
        rng: Uniforms | None = None,
    ) -> None:
        """`rng`: where the sampler's uniforms come from (default: a generator seeded with
        `params.seed`); anything with numpy's `random(n)`."""
        params.validate()
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (or None), got {logprobs!r}")
        self.params = params
        self.rng: Uniforms = make_rng(params.seed) if rng is None else rng
        self.sampler = make_sampler(params)
        penalty = [RepetitionPenalty(prompt, params.repetition_penalty)] if params.repetition_penalty != 1.0 else []
        self.processors: list[LogitsProcessor] = [*penalty, *processors]
        self.logprobs = logprobs

    @property
    def plain_greedy(self) -> bool:
        """The token is the raw argmax and nothing else is asked: a batch can take them all at once."""
        return self.params.greedy and not self.processors and self.logprobs is None

    @property
    def finished(self) -> bool:
        return any(p.finished for p in self.processors)

    @property
    def incomplete(self) -> bool:
        """A grammar constrains the text, and the tokens taken are not yet a whole sentence of it
        (`GrammarMask.complete`): a row cut here, by its budget, does not match it."""
        return any(not getattr(p, "complete", True) for p in self.processors)

    def choose(self, logits: npt.NDArray[np.floating]) -> tuple[int, TokenLogprob | None]:
        """The next token for one row of logits ([vocab]), and its logprob entry when asked for."""
        if self.plain_greedy:  # the raw argmax: no float64 copy of the row
            return int(np.argmax(logits)), None
        scores = np.asarray(logits, dtype=np.float64)[None, :]
        for processor in self.processors:
            scores = processor(scores)
        if scores.max() == -np.inf:
            raise GenerationError(
                "every token is excluded at this step (the grammar allows none); no token can be chosen"
            )
        token = int(self.sampler(scores, self.rng)[0])
        entry = None if self.logprobs is None else token_logprob(logits, token, self.logprobs)
        return token, entry

    def accept(self, token: int) -> None:
        for processor in self.processors:
            processor.accept(token)

    def take(self, logits: npt.NDArray[np.floating]) -> tuple[int, TokenLogprob | None]:
        """`choose` the next token and `accept` it: the row's history moves on."""
        token, entry = self.choose(logits)
        self.accept(token)
        return token, entry


class BatchDraws:
    """The uniforms plain batch sampling draws from one generator: `batch` per step, row r of
    step t taking number t * batch + r. Row r's `RowDraws` hands them out in order, so each row
    of a batch samples from the one seeded generator, and a row generated alone (speculative
    decoding runs rows one after another) samples with the draws it would get in the batch."""

    def __init__(self, rng: np.random.Generator, batch: int) -> None:
        self.rng, self.batch = rng, batch
        self.drawn = np.empty(0)

    def get(self, row: int, index: int) -> float:
        position = index * self.batch + row
        if position >= self.drawn.size:
            more = max(position + 1 - self.drawn.size, 64 * self.batch)
            self.drawn = np.concatenate([self.drawn, self.rng.random(more)])
        return float(self.drawn[position])


@dataclass
class RowDraws:
    """A stand-in for a row's generator: `random(1)` gives the row's next uniform."""

    draws: BatchDraws
    row: int
    count: int = 0

    def random(self, n: int) -> np.ndarray:
        values = [self.draws.get(self.row, self.count + i) for i in range(n)]
        self.count += n
        return np.asarray(values)


def batch_decoders(params: SamplingParams, prompts: Sequence[Sequence[int]]) -> list[Decoder]:
    """One decoder per row of a batch sampled under one `params` from one generator seeded with
    `params.seed`: the same seed gives the same tokens, whatever the rows are then run as."""
    draws = BatchDraws(make_rng(params.seed), len(prompts))
    return [Decoder(params, prompt, rng=RowDraws(draws, row)) for row, prompt in enumerate(prompts)]


def end_of_row(*, eos: bool, stopped: bool, finished: bool, generated: int, budget: int) -> str | None:
    """Why a row ends after its latest token, or None while it goes on.

    `eos`: the token is an end-of-text id (and eos is not ignored); `stopped`: a stop string
    was reached; `finished`: a grammar has reached its end; `generated` of `budget` tokens.
    """
    if eos or stopped or finished:
        return "stop"
    if generated >= budget:
        return "length"
    return None
