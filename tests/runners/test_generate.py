"""The engine core's generation over a scripted `Session`: invalid logits are refused, naming the step.

The core needs only ``session.io`` and ``session.run(feeds)``, so a session that returns
crafted arrays shows exactly what it does with them, without a model.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvforge.runners.contract import DecoderIO
from kvforge.runners.core import logit_steps
from kvforge.runners.decoding import batch_decoders
from kvforge.runners.errors import GenerationError
from kvforge.runners.generate import check_length
from kvforge.runners.sampling import SamplingParams

IO = DecoderIO(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=8)
LogitsFor = Callable[[int, np.ndarray], np.ndarray]  # (call index, input_ids) -> logits [batch, seq, vocab]


class ScriptedSession:
    """Returns the logits a script gives for each call, and a correctly shaped cache."""

    def __init__(self, logits_for: LogitsFor, io: DecoderIO = IO) -> None:
        self.io = io
        self.logits_for = logits_for
        self.calls = 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = feeds["input_ids"]
        batch, total = feeds["attention_mask"].shape
        outputs = {"logits": self.logits_for(self.calls, ids)}
        shape = (batch, self.io.num_kv_heads, total, self.io.head_dim)
        outputs.update({name: np.zeros(shape, np.float32) for name in self.io.present_names})
        self.calls += 1
        return outputs


def favour(token: int, poison_call: int | None = None, poison: float = np.nan, row: int = 0) -> LogitsFor:
    """Logits preferring ``token``; on call ``poison_call`` one entry of ``row`` is ``poison``."""

    def logits_for(call: int, ids: np.ndarray) -> np.ndarray:
        logits = np.zeros((ids.shape[0], ids.shape[1], IO.vocab_size), np.float32)
        logits[:, :, token] = 5.0
        if call == poison_call:
            logits[row, -1, 3] = poison
        return logits

    return logits_for


def run_loop(session: ScriptedSession, prompts: list[list[int]], max_new_tokens: int = 6, **kwargs: object) -> list:
    return list(
        logit_steps(
            session,
            prompts,
            max_new_tokens=max_new_tokens,
            max_positions=64,
            decoders=batch_decoders(SamplingParams(temperature=0.0), prompts),
            **kwargs,  # type: ignore[arg-type]
        )
    )


def test_clean_logits_generate_the_favoured_token() -> None:
    session = ScriptedSession(favour(5))
    steps = run_loop(session, [[1, 2, 3]])
    assert [int(s.tokens[0]) for s in steps] == [5] * 6 and session.calls == 6


@pytest.mark.parametrize(("poison", "problem"), [(np.nan, "contain NaN"), (np.inf, r"contain \+inf"), (-np.inf, None)])
@pytest.mark.parametrize(("call", "where"), [(0, r"prefill \(step 0\)"), (3, "decode step 3")])
def test_nan_or_inf_logits_raise_naming_the_step(poison: float, problem: str | None, call: int, where: str) -> None:
    session = ScriptedSession(favour(5, poison_call=call, poison=poison))
    if problem is None:  # one -inf entry is a masked token, not an error
        assert [int(s.tokens[0]) for s in run_loop(session, [[1, 2]])] == [5] * 6
        return
    produced = []
    with pytest.raises(GenerationError, match=rf"^{where}: logits {problem}; .*kvforge verify"):
        for step in logit_steps(
            session,
            [[1, 2]],
            max_new_tokens=6,
            max_positions=64,
            decoders=batch_decoders(SamplingParams(temperature=0.0), [[1, 2]]),
        ):
            produced.append(int(step.tokens[0]))
    assert produced == [5] * call  # every step before the bad one, nothing sampled from it


def test_all_minus_inf_row_is_refused() -> None:
    def logits_for(call: int, ids: np.ndarray) -> np.ndarray:
        logits = np.zeros((ids.shape[0], ids.shape[1], IO.vocab_size), np.float32)
        if call == 3:  # each prompt prefilled alone (calls 0 and 1), then the batch's second decode step
            logits[1, -1, :] = -np.inf
        return logits

    with pytest.raises(GenerationError, match=r"^prompts\[1\]: decode step 2: logits are all -inf; "):
        run_loop(ScriptedSession(logits_for), [[1], [2, 3]])


def test_sampling_is_refused_too_not_only_greedy() -> None:
    session = ScriptedSession(favour(5, poison_call=1))
    with pytest.raises(GenerationError, match="decode step 1: logits contain NaN"):
        list(
            logit_steps(
                session,
                [[1, 2]],
                max_new_tokens=4,
                max_positions=64,
                decoders=batch_decoders(SamplingParams(temperature=0.8, top_p=0.9), [[1, 2]]),
            )
        )


def test_a_finished_row_leaves_the_batch_and_the_others_go_on() -> None:
    """Row 0 samples eos from its prefill; it is never computed again and row 1 carries on alone;
    the steps mark row 0 inactive from then on."""
    batches = []

    def logits_for(call: int, ids: np.ndarray) -> np.ndarray:
        batches.append(ids.shape[0])
        logits = np.zeros((ids.shape[0], ids.shape[1], IO.vocab_size), np.float32)
        logits[:, :, 7 if call == 0 else 4] = 5.0  # call 0: row 0's prefill, which chooses eos
        return logits

    steps = run_loop(ScriptedSession(logits_for), [[1, 2], [3]], max_new_tokens=4, eos_ids=[7])
    assert [s.tokens.tolist() for s in steps] == [[7, 4], [0, 4], [0, 4], [0, 4]]
    assert [s.active.tolist() for s in steps] == [[True, True]] + [[False, True]] * 3
    assert batches == [1, 1, 1, 1, 1]  # two prefills, then three decode steps of row 1 alone


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((1, 8), np.float32),  # 2-D, not [batch, seq, vocab]
        np.zeros((1, 1, 9), np.float32),  # vocabulary of the wrong size
        np.zeros((2, 1, 8), np.float32),  # wrong batch
        np.zeros((1, 1, 8), np.int64),  # not floats
    ],
)
def test_malformed_logits_are_refused_naming_the_step(bad: np.ndarray) -> None:
    session = ScriptedSession(lambda call, ids: bad)
    with pytest.raises(GenerationError, match=r"^prefill failed: the session returned logits of shape"):
        run_loop(session, [[1, 2]])


@pytest.mark.parametrize(
    ("prompts", "budget", "message"),
    [
        ([[1] * 64], 1, "prompt of 64 tokens exceeds the model's context of 64 positions"),
        ([[1] * 80], 1, "prompt of 80 tokens exceeds the model's context of 64"),
        ([[1] * 60, [1]], 5, r"60 tokens \+ max_new_tokens 5 = 65 exceeds the model's context of 64 positions"),
        ([[1], []], 1, "prompt 1 is empty"),
        ([], 1, "no prompts given"),
        ([[1]], 0, "max_new_tokens must be at least 1, got 0"),
        ([[1]], -3, "max_new_tokens must be at least 1, got -3"),
        ([[1]], 2.0, "max_new_tokens must be an integer, got 2.0"),
        ([[1]], True, "max_new_tokens must be an integer, got True"),
    ],
)
def test_check_length_refuses_requests_that_cannot_fit(prompts: list[list[int]], budget: int, message: str) -> None:
    with pytest.raises(GenerationError, match=message):
        check_length(prompts, budget, 64)
    session = ScriptedSession(favour(5))
    with pytest.raises(GenerationError, match=message):
        run_loop(session, prompts, max_new_tokens=budget)
    assert session.calls == 0


def test_a_prompt_that_exactly_fills_the_context_with_its_budget_is_accepted() -> None:
    check_length([[1] * 60], 4, 64)
    assert len(run_loop(ScriptedSession(favour(5)), [[1] * 60], max_new_tokens=4)) == 4
