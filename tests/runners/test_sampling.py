"""Samplers: each step on hand-computed examples, and the full draw against its distribution.

Statistical checks use a fixed seed, so they are deterministic; their bounds are loose
enough for any seed yet tight enough that a wrong distribution fails them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvforge.runners.decoding import Decoder, make_sampler
from kvforge.runners.errors import GenerationError
from kvforge.runners.sampling import (
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    draw,
    greedy,
    make_rng,
    softmax,
)

# Chi-square critical values at p = 0.001, by degrees of freedom.
CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 9: 27.88}


def _counts(tokens: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(tokens, minlength=vocab).astype(np.float64)


def _chi_square(observed: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the tokens with mass, and its degrees of freedom."""
    support = probs > 0
    assert observed[~support].sum() == 0, "a token with zero probability was sampled"
    expected = probs[support] * observed.sum()
    statistic = float((((observed[support] - expected) ** 2) / expected).sum())
    return statistic, int(support.sum()) - 1


def sample(logits: Any, params: SamplingParams, rng: np.random.Generator, seen: list[Any] | None = None) -> np.ndarray:
    """The decoders' sampling chain (`make_sampler`) over a batch of rows, after the repetition
    penalty as a decoder applies it: many draws in one call for the statistical checks."""
    params.validate()
    scores = np.asarray(logits, dtype=np.float64)
    if params.repetition_penalty != 1.0:
        assert seen is not None
        scores = apply_repetition_penalty(scores, seen, params.repetition_penalty)
    return make_sampler(params)(scores, rng)


def _draws(row: np.ndarray, params: SamplingParams, n: int, seed: int = 0) -> np.ndarray:
    """Sample ``n`` tokens from one row by repeating it as a batch."""
    batch = np.tile(row, (n, 1))
    return sample(batch, params, make_rng(seed))


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"seed": -3}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_validate_names_the_bad_field(changes: dict[str, object], field: str) -> None:
    params = SamplingParams(**changes)  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match=rf"^{field} must be"):
        params.validate()


def test_validate_message_shows_the_range_and_value() -> None:
    with pytest.raises(GenerationError, match=r"top_p must be in \(0, 1\].*got 1\.5"):
        SamplingParams(top_p=1.5).validate()


def test_defaults_and_boundary_values_are_valid() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=1.0, seed=0).validate()
    SamplingParams(top_p=1e-9, min_p=0.0, repetition_penalty=0.5, top_k=np.int64(3)).validate()  # type: ignore[arg-type]


def test_sample_validates_params() -> None:
    with pytest.raises(GenerationError, match="top_k"):
        sample(np.zeros((1, 4), np.float32), SamplingParams(top_k=-2), make_rng(0))


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, top_k=5).greedy
    assert not SamplingParams(temperature=0.7).greedy


# --- greedy ------------------------------------------------------------------------------


def test_greedy_picks_argmax_and_lowest_index_on_ties() -> None:
    logits = np.array([[0.1, 3.0, 3.0, -1.0], [5.0, 5.0, 5.0, 5.0], [-2.0, -1.0, -3.0, -1.5]])
    tokens = greedy(logits)
    assert tokens.dtype == np.int64
    assert tokens.tolist() == [1, 0, 1]


def test_greedy_sampling_ignores_filters_and_rng() -> None:
    logits = np.array([[0.1, 2.0, 1.9, -1.0]], np.float32)
    params = SamplingParams(temperature=0, top_k=1, top_p=0.1, min_p=0.9)
    assert sample(logits, params, make_rng(1)).tolist() == [1]
    assert sample(logits, SamplingParams(temperature=0), make_rng(2)).tolist() == [1]


def test_greedy_applies_repetition_penalty_first() -> None:
    logits = np.array([[0.1, 2.0, 1.9, -1.0]])
    params = SamplingParams(temperature=0, repetition_penalty=1.2)
    # 2.0 / 1.2 = 1.667 < 1.9, so the seen argmax loses to token 2.
    assert sample(logits, params, make_rng(0), seen=[np.array([1])]).tolist() == [2]


def test_float16_and_float32_logits_are_accepted() -> None:
    for dtype in (np.float16, np.float32, np.float64):
        logits = np.array([[0.0, 4.0, 1.0]], dtype=dtype)
        tokens = sample(logits, SamplingParams(temperature=0), make_rng(0))
        assert tokens.dtype == np.int64 and tokens.tolist() == [1]


# --- repetition penalty ------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = np.array([[2.0, -1.0, 0.5, 3.0, 0.0], [2.0, -1.0, 0.5, 3.0, 0.0]])
    seen: list[Any] = [np.array([0, 1, 1, 4]), [3]]
    result = apply_repetition_penalty(logits, seen, 2.0)
    np.testing.assert_allclose(result[0], [1.0, -2.0, 0.5, 3.0, 0.0])
    np.testing.assert_allclose(result[1], [2.0, -1.0, 0.5, 1.5, 0.0])
    np.testing.assert_allclose(logits[0], [2.0, -1.0, 0.5, 3.0, 0.0])  # input untouched


def test_repetition_penalty_below_one_encourages_repeats() -> None:
    result = apply_repetition_penalty(np.array([[2.0, -1.0]]), [[0, 1]], 0.5)
    np.testing.assert_allclose(result, [[4.0, -0.5]])


def test_repetition_penalty_counts_each_token_once() -> None:
    once = apply_repetition_penalty(np.array([[4.0]]), [[0]], 2.0)
    thrice = apply_repetition_penalty(np.array([[4.0]]), [[0, 0, 0]], 2.0)
    np.testing.assert_allclose(once, thrice)


def test_repetition_penalty_checks_rows_and_ids() -> None:
    logits = np.zeros((2, 4))
    with pytest.raises(GenerationError, match="seen has 1 rows"):
        apply_repetition_penalty(logits, [[0]], 1.5)
    with pytest.raises(GenerationError, match=r"seen\[1\] holds token id 4"):
        apply_repetition_penalty(logits, [[0], [4]], 1.5)
    with pytest.raises(GenerationError, match=r"seen\[0\] holds token id -1"):
        apply_repetition_penalty(logits, [[-1], []], 1.5)


def test_a_decoder_penalizes_its_prompt_and_what_it_chose() -> None:
    logits = np.array([0.1, 2.0, 1.9, 1.8])
    decoder = Decoder(SamplingParams(temperature=0, repetition_penalty=1.2), prompt=[1])
    assert decoder.choose(logits)[0] == 2  # 2.0 / 1.2 = 1.667 < 1.9: the prompt's token loses
    decoder.accept(2)
    assert decoder.choose(logits)[0] == 3  # 1.9 / 1.2 = 1.583 < 1.8: and so does the one chosen


def test_sample_applies_penalty_before_temperature() -> None:
    # Penalty 4 on token 0 (logit 2 -> 0.5), then T = 0.5: softmax([1.0, 1.0]) is uniform.
    # Penalty after temperature would give softmax([1.0, 2.0]) instead.
    logits = np.array([2.0, 0.5])
    params = SamplingParams(temperature=0.5, repetition_penalty=4.0)
    n = 20_000
    tokens = sample(np.tile(logits, (n, 1)), params, make_rng(5), seen=[[0]] * n)
    statistic, dof = _chi_square(_counts(tokens, 2), np.array([0.5, 0.5]))
    assert statistic < CHI2_CRITICAL_0_001[dof]


# --- temperature -------------------------------------------------------------------------


def test_temperature_scales_logits() -> None:
    np.testing.assert_allclose(apply_temperature(np.array([[1.0, -2.0]]), 0.5), [[2.0, -4.0]])
    with pytest.raises(GenerationError, match="temperature must be > 0"):
        apply_temperature(np.array([[1.0]]), 0.0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draw_frequencies_match_softmax_of_logits_over_temperature(temperature: float) -> None:
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -3.0], np.float32)
    tokens = _draws(logits, SamplingParams(temperature=temperature), 30_000, seed=11)
    probs = softmax(logits[None].astype(np.float64) / temperature)[0]
    statistic, dof = _chi_square(_counts(tokens, 6), probs)
    assert statistic < CHI2_CRITICAL_0_001[dof]


def test_infinite_logits_share_all_the_probability() -> None:
    """A logit a penalty took past float64's range is the limit of one growing without bound:
    the +inf tokens share the mass, every finite one gets none (not the NaNs of inf − inf)."""
    logits = np.array([[1.0, np.inf, 2.0, np.inf, -np.inf], [1.0, 0.0, -1.0, 0.5, -np.inf]])
    probs = softmax(logits)
    np.testing.assert_array_equal(probs[0], [0.0, 0.5, 0.0, 0.5, 0.0])
    np.testing.assert_allclose(probs[1], softmax(logits[1:, :4])[0].tolist() + [0.0])  # a finite row as before
    tokens = _draws(logits[0], SamplingParams(temperature=0.7), 200, seed=3)
    assert set(tokens.tolist()) == {1, 3}


def test_chi_square_check_detects_the_wrong_temperature() -> None:
    """Guards the statistical tests above: a distribution off by T=1 vs 1.3 must fail."""
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    tokens = _draws(logits, SamplingParams(temperature=1.3), 30_000, seed=11)
    statistic, dof = _chi_square(_counts(tokens, 6), softmax(logits[None])[0])
    assert statistic > CHI2_CRITICAL_0_001[dof]


# --- top-k -------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest() -> None:
    logits = np.array([[0.5, 3.0, -1.0, 2.0, 1.0]])
    result = apply_top_k(logits, 2)
    assert np.isfinite(result[0]).tolist() == [False, True, False, True, False]
    np.testing.assert_allclose(result[0, [1, 3]], [3.0, 2.0])
    np.testing.assert_array_equal(apply_top_k(logits, 0), logits)
    np.testing.assert_array_equal(apply_top_k(logits, 5), logits)
    np.testing.assert_array_equal(apply_top_k(logits, 50), logits)


def test_top_k_keeps_ties_at_the_boundary() -> None:
    result = apply_top_k(np.array([[1.0, 2.0, 2.0, 0.0]]), 2)
    assert np.isfinite(result[0]).tolist() == [False, True, True, False]
    result = apply_top_k(np.array([[1.0, 2.0, 1.0, 0.0]]), 2)
    assert np.isfinite(result[0]).tolist() == [True, True, True, False]


def test_top_k_is_per_row() -> None:
    logits = np.array([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    assert np.isfinite(apply_top_k(logits, 1)).tolist() == [[False, False, True], [True, False, False]]


def test_top_k_never_samples_outside_the_top_k() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=50)
    top5 = set(np.argsort(-logits)[:5].tolist())
    tokens = _draws(logits, SamplingParams(temperature=2.0, top_k=5), 10_000, seed=4)
    assert set(tokens.tolist()) == top5  # never outside, and every one of them is reachable


def test_top_k_frequencies_match_renormalized_distribution() -> None:
    logits = np.array([0.3, 1.0, -0.2, 0.8, 0.0, 1.5])
    tokens = _draws(logits, SamplingParams(top_k=3), 30_000, seed=8)
    probs = np.zeros(6)
    probs[[1, 3, 5]] = softmax(logits[None, [1, 3, 5]])[0]
    statistic, dof = _chi_square(_counts(tokens, 6), probs)
    assert statistic < CHI2_CRITICAL_0_001[dof]


# --- top-p -------------------------------------------------------------------------------

# Probabilities 0.1, 0.4, 0.05, 0.3, 0.15 -> ranked: token 1 (0.4), 3 (0.3), 4 (0.15),
# 0 (0.1), 2 (0.05); cumulative 0.4, 0.7, 0.85, 0.95, 1.0.
NUCLEUS_PROBS = np.array([0.1, 0.4, 0.05, 0.3, 0.15])
NUCLEUS_LOGITS = np.log(NUCLEUS_PROBS)[None]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (1e-6, {1}),
        (0.35, {1}),
        (0.45, {1, 3}),
        (0.65, {1, 3}),
        (0.75, {1, 3, 4}),
        (0.9, {1, 3, 4, 0}),
        (0.99, {0, 1, 2, 3, 4}),
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_exactly_the_minimal_nucleus(top_p: float, kept: set[int]) -> None:
    result = apply_top_p(NUCLEUS_LOGITS, top_p)
    assert set(np.flatnonzero(np.isfinite(result[0])).tolist()) == kept
    finite = np.isfinite(result)
    np.testing.assert_allclose(result[finite], NUCLEUS_LOGITS[finite])  # survivors unchanged


def test_top_p_is_per_row_and_breaks_ties_by_lower_id() -> None:
    logits = np.vstack([NUCLEUS_LOGITS, np.zeros((1, 5))])
    result = apply_top_p(logits, 0.45)
    assert np.isfinite(result).tolist() == [
        [False, True, False, True, False],
        [True, True, True, False, False],  # uniform 0.2 each: mass 0.4 < 0.45 needs a third
    ]


def test_top_p_ignores_already_filtered_tokens() -> None:
    logits = NUCLEUS_LOGITS.copy()
    logits[0, 1] = -np.inf  # remaining mass renormalizes: 0.5, 0.25, ~0.167, ~0.083 ranked 3,4,0,2
    result = apply_top_p(logits, 0.7)
    assert set(np.flatnonzero(np.isfinite(result[0])).tolist()) == {3, 4}


def test_top_p_sampling_stays_in_nucleus_with_renormalized_frequencies() -> None:
    tokens = _draws(NUCLEUS_LOGITS[0], SamplingParams(top_p=0.75), 30_000, seed=21)
    probs = np.zeros(5)
    probs[[1, 3, 4]] = NUCLEUS_PROBS[[1, 3, 4]] / NUCLEUS_PROBS[[1, 3, 4]].sum()
    statistic, dof = _chi_square(_counts(tokens, 5), probs)
    assert statistic < CHI2_CRITICAL_0_001[dof]


# --- min-p -------------------------------------------------------------------------------


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    probs = np.array([0.5, 0.25, 0.1, 0.15])
    logits = np.log(probs)[None]
    # min_p 0.25 -> threshold 0.125: token 2 (0.1) goes, token 3 (0.15) stays.
    assert np.isfinite(apply_min_p(logits, 0.25)).tolist() == [[True, True, False, True]]
    assert np.isfinite(apply_min_p(logits, 0.6)).tolist() == [[True, False, False, False]]
    assert np.isfinite(apply_min_p(logits, 1.0)).tolist() == [[True, False, False, False]]
    np.testing.assert_array_equal(apply_min_p(logits, 0.0), logits)


def test_min_p_does_not_depend_on_absolute_probability() -> None:
    flat = np.log(np.full((1, 8), 1 / 8))
    assert np.isfinite(apply_min_p(flat, 0.9)).all()  # every token is as likely as the max


def test_min_p_uses_the_tempered_distribution() -> None:
    # After T=0.5 the probs are [0.8, 0.2] (ratio 0.25 < 0.3: token 1 goes); at T=1 the
    # ratio is 0.5 and token 1 stays.
    logits = np.log(np.array([[2 / 3, 1 / 3]]))
    cold = SamplingParams(temperature=0.5, min_p=0.3)
    tokens = sample(np.tile(logits, (2_000, 1)), cold, make_rng(0))
    assert set(tokens.tolist()) == {0}
    warm = SamplingParams(temperature=1.0, min_p=0.3)
    assert set(sample(np.tile(logits, (2_000, 1)), warm, make_rng(0)).tolist()) == {0, 1}


# --- the draw ----------------------------------------------------------------------------


class _FixedUniforms:
    """Stands in for a Generator whose uniforms sit at a chosen value."""

    def __init__(self, value: float) -> None:
        self.value = value

    def random(self, size: int) -> np.ndarray:
        return np.full(size, self.value)


def test_draw_never_returns_a_zero_probability_token_at_the_cdf_edges() -> None:
    logits = np.array([[-np.inf, 0.0, 1.0, -np.inf, -np.inf]])
    top = math.nextafter(1.0, 0.0)
    assert draw(logits, _FixedUniforms(top)).tolist() == [2]  # type: ignore[arg-type]
    assert draw(logits, _FixedUniforms(0.0)).tolist() == [1]  # type: ignore[arg-type]


def test_same_seed_same_tokens_and_different_seeds_differ() -> None:
    logits = np.zeros((500, 100), np.float32)
    params = SamplingParams(top_k=50, top_p=0.9)
    first = sample(logits, params, make_rng(1234))
    again = sample(logits, params, make_rng(1234))
    other = sample(logits, params, make_rng(1235))
    np.testing.assert_array_equal(first, again)
    assert (first != other).mean() > 0.5


def test_a_generator_advances_between_steps() -> None:
    logits = np.zeros((200, 100))
    rng = make_rng(9)
    assert (sample(logits, SamplingParams(), rng) != sample(logits, SamplingParams(), rng)).any()


def test_unseeded_rngs_differ() -> None:
    logits = np.zeros((200, 1000))
    first = sample(logits, SamplingParams(), make_rng(None))
    second = sample(logits, SamplingParams(), make_rng(None))
    assert (first != second).any()


def test_make_rng_rejects_bad_seeds() -> None:
    with pytest.raises(GenerationError, match="seed"):
        make_rng(-1)


def test_batch_rows_are_independent() -> None:
    onehot = np.full(6, -1e9)
    onehot[4] = 0.0
    flat = np.zeros(6)
    logits = np.vstack([flat, onehot, flat, onehot])
    tokens = sample(logits, SamplingParams(top_k=3), make_rng(0))
    assert tokens[1] == 4 and tokens[3] == 4
    # A row's token does not depend on the logits of the other rows.
    alone = sample(flat[None], SamplingParams(top_k=3), make_rng(0))
    with_others = sample(np.vstack([flat, onehot * 0.5]), SamplingParams(top_k=3), make_rng(0))
    assert alone[0] == with_others[0]


def test_repetition_penalty_is_per_row() -> None:
    logits = np.log(np.array([[0.5, 0.5], [0.5, 0.5]]))
    logits = logits + 1.0  # positive logits, so the penalty divides
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, params, make_rng(0), seen=[[0], [1]]).tolist() == [1, 0]


def test_steps_return_new_arrays_and_leave_input_alone() -> None:
    logits = np.array([[0.3, 1.0, -0.2, 0.8]])
    before = logits.copy()
    for result in (
        apply_repetition_penalty(logits, [[1]], 1.0),
        apply_temperature(logits, 1.0),
        apply_top_k(logits, 0),
        apply_top_p(logits, 1.0),
        apply_min_p(logits, 0.0),
    ):
        assert result is not logits
        result[0, 0] = 99.0
    np.testing.assert_array_equal(logits, before)
    apply_top_k(logits, 1)
    apply_top_p(logits, 0.1)
    apply_min_p(logits, 0.9)
    apply_repetition_penalty(logits, [[1]], 3.0)
    np.testing.assert_array_equal(logits, before)


def test_sample_returns_int64_of_batch_length() -> None:
    tokens = sample(np.zeros((3, 7), np.float16), SamplingParams(temperature=0.8), make_rng(0))
    assert tokens.dtype == np.int64 and tokens.shape == (3,)
    assert ((tokens >= 0) & (tokens < 7)).all()


# --- properties (hypothesis): whatever the logits and settings ------------------------------

PROPERTY = settings(max_examples=300, deadline=None)


@st.composite
def logits_rows(draw_: st.DrawFn) -> np.ndarray:
    """[batch, vocab] logits with ties, wide ranges and masked (-inf) tokens, never a masked row."""
    batch, vocab = draw_(st.integers(1, 3)), draw_(st.integers(1, 24))
    values = st.one_of(st.floats(-30, 30, width=32), st.sampled_from([0.0, 1.0, -np.inf]))
    logits = np.array(draw_(st.lists(values, min_size=batch * vocab, max_size=batch * vocab)), np.float32)
    logits = logits.reshape(batch, vocab)
    for row in range(batch):
        if np.isneginf(logits[row]).all():
            logits[row, draw_(st.integers(0, vocab - 1))] = draw_(st.floats(-30, 30, width=32))
    return logits


def sampling_params(vocab: int) -> st.SearchStrategy[SamplingParams]:
    return st.builds(
        SamplingParams,
        temperature=st.one_of(st.just(0.0), st.floats(0.05, 5.0)),
        top_k=st.integers(0, vocab + 2),
        top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
        min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
        seed=st.integers(0, 2**32),
    )


def allowed(row: np.ndarray, params: SamplingParams) -> set[int]:
    """Tokens each filter allows, computed independently of the implementation's order of work."""
    scores = row.astype(np.float64)
    if params.greedy:
        return {int(np.argmax(scores))}
    scores = scores / params.temperature
    finite = set(np.flatnonzero(np.isfinite(scores)).tolist())
    top_k = finite
    if 0 < params.top_k < len(row):
        kth = np.sort(scores)[::-1][params.top_k - 1]
        top_k = {t for t in finite if scores[t] >= kth}
    # the nucleus over the top-k survivors: tokens ranked above a kept one hold < top_p of the mass
    ranked = sorted(top_k, key=lambda t: (-scores[t], t))
    weights = np.exp(np.array([scores[t] for t in ranked]) - max(scores[t] for t in ranked))
    probs = weights / weights.sum()
    above = np.cumsum(probs) - probs
    nucleus = {t for t, mass in zip(ranked, above) if mass < params.top_p + 1e-9}
    best = max(scores[t] for t in finite)
    floor = best + math.log(params.min_p) - 1e-9 if params.min_p > 0 else -np.inf
    return {t for t in nucleus if scores[t] >= floor}


@PROPERTY
@given(data=st.data())
def test_the_sampled_token_is_always_one_the_filters_allow(data: st.DataObject) -> None:
    logits = data.draw(logits_rows())
    params = data.draw(sampling_params(logits.shape[1]))
    tokens = sample(logits, params, make_rng(params.seed))
    assert tokens.shape == (logits.shape[0],) and tokens.dtype == np.int64
    for row, token in enumerate(tokens):
        assert int(token) in allowed(logits[row], params), (logits[row], params, token)


@PROPERTY
@given(data=st.data())
def test_greedy_is_the_argmax_whatever_else_is_set(data: st.DataObject) -> None:
    logits = data.draw(logits_rows())
    params = data.draw(sampling_params(logits.shape[1]).map(lambda p: replace(p, temperature=0.0)))
    expected = [int(np.flatnonzero(row == row.max())[0]) for row in logits]  # lowest id among ties
    assert sample(logits, params, make_rng(params.seed)).tolist() == expected
    assert sample(logits, params, make_rng(None)).tolist() == expected  # the generator plays no part


@PROPERTY
@given(data=st.data())
def test_the_same_seed_gives_the_same_tokens(data: st.DataObject) -> None:
    logits = data.draw(logits_rows())
    params = data.draw(sampling_params(logits.shape[1]))
    first, second = make_rng(params.seed), make_rng(params.seed)
    for _ in range(3):  # over several steps, as the generation loop draws them
        assert sample(logits, params, first).tolist() == sample(logits, params, second).tolist()


def _top_p_by_full_sort(logits: np.ndarray, top_p: float) -> np.ndarray:
    """The definition, over a stable sort of the whole vocabulary."""
    result = logits.astype(np.float64).copy()
    for row in range(result.shape[0]):
        order = np.argsort(-result[row], kind="stable")
        probs = np.exp(result[row] - result[row].max())
        probs /= probs.sum()
        mass_above = np.cumsum(probs[order]) - probs[order]
        result[row, order[mass_above >= top_p]] = -np.inf
    return result


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_on_a_partial_sort_equals_the_full_sort_with_ties_and_flat_tails(top_p: float) -> None:
    """The nucleus grows its candidate set until it covers top_p; the cut is the full sort's, ties included."""
    rng = np.random.default_rng(3)
    peaked = rng.standard_normal((2, 5000)) * 4
    flat = np.round(rng.standard_normal((2, 5000)), 1)  # many exact ties, mass spread over thousands of tokens
    logits = np.concatenate([peaked, flat])
    np.testing.assert_array_equal(apply_top_p(logits, top_p), _top_p_by_full_sort(logits, top_p))
