"""Token samplers as pure functions over numpy logits.

Every step takes logits of shape ``[batch, vocab]`` and returns a new array, so the
generation loop can compose them, tests can check each one alone, and nothing here
depends on the session that produced the logits. The order of the steps follows
Hugging Face and vLLM (repetition penalty, temperature, top-k, top-p, min-p, draw) so
that the same settings give the same distribution as there.

Filtered-out tokens get ``-inf`` logits; the final draw turns the survivors into
probabilities. Work is done in float64: logits arrive as float16/float32 from the
session, and cumulative sums over a 100k+ vocabulary need the headroom.

The parameters, `SamplingParams`, are declared with their ranges and spellings in
`kvforge.runners.settings` (imported here too), from which every surface that takes them derives.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvforge.runners.errors import GenerationError
from kvforge.runners.settings import SamplingParams as SamplingParams  # declared there, with its settings
from kvforge.runners.settings import sampling_settings as sampling_settings

FloatArray = npt.NDArray[np.float64]
IdArray = npt.NDArray[np.int64]


class Uniforms(Protocol):
    """What a draw takes its uniforms from: numpy's Generator, or anything whose `random(n)`
    gives `n` floats in [0, 1) (a row's share of a batch's draws, `kvforge.runners.speculative`)."""

    def random(self, n: int) -> npt.NDArray[np.float64]: ...


def _check_int(field: str, value: object) -> None:
    """Reject floats and bools where a count or seed is expected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GenerationError(f"{field} must be an integer, got {value!r}")


def make_rng(seed: int | None) -> np.random.Generator:
    """The generator every draw uses: the same seed gives the same tokens."""
    if seed is not None:
        _check_int("seed", seed)
        if seed < 0:
            raise GenerationError(f"seed must be >= 0 or None, got {seed}")
    return np.random.default_rng(seed)


def apply_repetition_penalty(logits: FloatArray, seen: Sequence[npt.ArrayLike], penalty: float) -> FloatArray:
    """Make already-seen tokens less likely, dividing positive and multiplying negative logits.

    Each token counts once however often it was seen, as in Hugging Face.
    """
    result = np.array(logits, dtype=np.float64, copy=True)
    if penalty == 1.0:
        return result
    batch, vocab = result.shape
    if len(seen) != batch:
        raise GenerationError(f"seen has {len(seen)} rows but logits have batch {batch}; pass one id list per row")
    for row, ids in enumerate(seen):
        tokens = _seen_tokens(ids, vocab, row)
        picked = result[row, tokens]
        # a penalty far from 1 can take a logit past float64's range: ±inf, which sampling and
        # the argmax take as the most (least) likely token, so the overflow is not an error
        with np.errstate(over="ignore"):
            result[row, tokens] = np.where(picked > 0, picked / penalty, picked * penalty)
    return result


def _seen_tokens(ids: npt.ArrayLike, vocab: int, row: int) -> IdArray:
    """Unique, range-checked token ids of one row of ``seen``."""
    tokens = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
    if tokens.size and (tokens[0] < 0 or tokens[-1] >= vocab):
        bad = tokens[0] if tokens[0] < 0 else tokens[-1]
        raise GenerationError(f"seen[{row}] holds token id {bad}, outside the vocabulary [0, {vocab})")
    return tokens


def apply_temperature(logits: FloatArray, temperature: float) -> FloatArray:
    """Sharpen (T < 1) or flatten (T > 1) the distribution; T must be > 0 here."""
    if temperature <= 0:
        raise GenerationError(f"temperature must be > 0 to scale logits, got {temperature}; use greedy() for 0")
    return np.asarray(logits, dtype=np.float64) / temperature


def apply_top_k(logits: FloatArray, top_k: int) -> FloatArray:
    """Keep the ``top_k`` largest logits per row; ties with the k-th value are kept too.

    Keeping ties follows Hugging Face and avoids an arbitrary choice between tokens of
    equal probability.
    """
    result = np.array(logits, dtype=np.float64, copy=True)
    vocab = result.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return result
    kth_largest = np.partition(result, vocab - top_k, axis=-1)[:, vocab - top_k]
    result[result < kth_largest[:, None]] = -np.inf
    return result


def apply_top_p(logits: FloatArray, top_p: float) -> FloatArray:
    """Keep the smallest set of most likely tokens whose probability mass reaches ``top_p``.

    A token is kept when the mass of the tokens ranked above it is still below
    ``top_p``, so the most likely token always survives. Equal logits are ranked by
    lower token id first, which makes the cut deterministic.

    Only the head of the distribution is sorted: candidates are the tokens at or above
    the m-th largest logit (ties included), m doubling until their mass reaches
    ``top_p``. Every token outside has a smaller logit than every candidate, so it ranks
    below all of them and its mass above is at least ``top_p``: it is dropped, exactly as
    a full sort would drop it.
    """
    result = np.array(logits, dtype=np.float64, copy=True)
    if top_p >= 1.0:
        return result
    probs = softmax(result)
    for row in range(result.shape[0]):
        result[row, _top_p_dropped(result[row], probs[row], top_p)] = -np.inf
    return result


_TOP_P_FIRST_CANDIDATES = 64


def _top_p_dropped(logits: FloatArray, probs: FloatArray, top_p: float) -> npt.NDArray[np.bool_]:
    vocab = logits.shape[0]
    m = min(_TOP_P_FIRST_CANDIDATES, vocab)
    while True:
        kth = np.partition(logits, vocab - m)[vocab - m]
        candidates = np.flatnonzero(logits >= kth)  # ascending ids: the stable sort ranks ties by id
        if m == vocab or probs[candidates].sum() >= top_p:
            break
        m = min(2 * m, vocab)
    order = candidates[np.argsort(-logits[candidates], kind="stable")]
    sorted_probs = probs[order]
    mass_above = np.cumsum(sorted_probs) - sorted_probs
    dropped = np.ones(vocab, dtype=bool)
    dropped[order[mass_above < top_p]] = False
    return dropped


def apply_min_p(logits: FloatArray, min_p: float) -> FloatArray:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's.

    Compared in log space (logit >= max + log(min_p)), which needs no softmax and
    always keeps the maximum.
    """
    result = np.array(logits, dtype=np.float64, copy=True)
    if min_p <= 0.0:
        return result
    threshold = result.max(axis=-1, keepdims=True) + math.log(min_p)
    result[result < threshold] = -np.inf
    return result


def greedy(logits: npt.ArrayLike) -> IdArray:
    """The most likely token per row; ties go to the lowest id."""
    tokens: IdArray = np.argmax(np.asarray(logits), axis=-1).astype(np.int64)
    return tokens


def softmax(logits: FloatArray) -> FloatArray:
    """Row-wise probabilities; ``-inf`` logits get exactly zero probability, and a row with
    ``+inf`` logits (a penalty that overflowed) shares all of it among them, the limit of a
    logit growing without bound."""
    top = logits.max(axis=-1, keepdims=True)
    if np.isposinf(top).any():
        logits = np.where(np.isposinf(top), np.where(np.isposinf(logits), 0.0, -np.inf), logits)
        top = logits.max(axis=-1, keepdims=True)
    shifted = logits - top
    weights = np.exp(shifted)
    probs: FloatArray = weights / weights.sum(axis=-1, keepdims=True)
    return probs


def draw(logits: FloatArray, rng: Uniforms) -> IdArray:
    """Sample one token per row by inverting the CDF with one uniform per row.

    One uniform per row (rather than Gumbel noise per vocabulary entry) keeps a step
    cheap for large vocabularies. Tokens with zero probability can never be chosen: the
    CDF does not rise at them, and the index is clamped to the last token with mass in
    case rounding puts the uniform at the very top.
    """
    probs = softmax(logits)
    cdf = np.cumsum(probs, axis=-1)
    uniforms = rng.random(probs.shape[0]) * cdf[:, -1]
    chosen = (cdf <= uniforms[:, None]).sum(axis=-1)
    last_with_mass = probs.shape[-1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=-1)
    tokens: IdArray = np.minimum(chosen, last_with_mass).astype(np.int64)
    return tokens
