"""The engine loop in process: continuous batching against each request's solo output."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvforge.runners.engine import Engine
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.scheduler import (
    BatchScheduler,
    Delta,
    Event,
    Failed,
    Finished,
    Overloaded,
    Request,
    Unavailable,
)
from tests.tiny import CORPUS

pytestmark = pytest.mark.slow
TIMEOUT_S = 60.0
PROMPTS = [
    "def",
    "class Point:\n    def __init__(self, x, y):",
    "for i in range(10):",
    CORPUS[0] + CORPUS[1],
    "import os\nimport sys\n",
    "héllo wörld",
    CORPUS[4] + CORPUS[2] + CORPUS[0],
]


class Recording:
    """A session that records the shape of every call and can be told to fail or return NaN."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.io = inner, inner.io
        self.calls: list[tuple[int, int]] = []
        self.fail_if: Callable[[dict[str, np.ndarray]], bool] = lambda feeds: False
        self.nan_if: Callable[[dict[str, np.ndarray]], bool] = lambda feeds: False

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls.append(feeds["input_ids"].shape)
        if self.fail_if(feeds):
            raise RuntimeError("injected session failure")
        outputs = self.inner.run(feeds)
        if self.nan_if(feeds):
            outputs["logits"] = np.full_like(outputs["logits"], np.nan)
        return outputs


@pytest.fixture(scope="module")
def engine(tiny_artifact: Path) -> Engine:
    return Engine.load(tiny_artifact)


def scheduler_for(engine: Engine, session: Any = None, **options: Any) -> BatchScheduler:
    settings = dict(max_num_seqs=4, max_queued=16, prefill_chunk=8) | options
    scheduler = BatchScheduler(
        session or engine.session,
        max_positions=engine.max_positions,
        eos_ids=engine.eos_ids,
        metrics=Metrics(),
        **settings,
    )
    scheduler.start()
    return scheduler


def request(
    engine: Engine, prompt: str | list[int], max_new_tokens: int, *, stop: tuple[str, ...] = (), **sampling: Any
) -> Request:
    ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    params = engine.sampling(**({"temperature": 0.0} | sampling))
    return Request(ids, params, max_new_tokens, engine.tokenizer.detokenizer(stop, context_ids=ids))


def collect(req: Request) -> tuple[str, Event]:
    """The request's text and its last event (Finished or Failed)."""
    parts: list[str] = []
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        event = req.events.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(event, Delta):
            parts.append(event.text)
        else:
            return "".join(parts), event


def wait_generating(req: Request) -> None:
    """Wait (bounded) until the request has its first token: it is in the batch."""
    deadline = time.monotonic() + TIMEOUT_S
    while req.generated < 1:
        assert time.monotonic() < deadline, "no first token in time"
        time.sleep(0.001)


def solo(engine: Engine, prompt: str | list[int], max_new_tokens: int, **sampling: Any) -> tuple[str, int]:
    """Text and token count of the prompt generated alone (one prefill, no batching)."""
    ids = engine.encode(prompt) if isinstance(prompt, str) else list(prompt)
    tokens = engine.generate_tokens([ids], max_new_tokens=max_new_tokens, **({"temperature": 0.0} | sampling))[0]
    text = tokens[:-1] if tokens and tokens[-1] in engine.eos_ids else tokens
    return engine.tokenizer.decode(text), len(tokens)


def test_batched_greedy_equals_solo_with_arrivals_mid_generation(engine: Engine) -> None:
    scheduler = scheduler_for(engine, max_num_seqs=4, prefill_chunk=8)
    try:
        budgets = [40, 12, 60, 8, 50, 30, 25]
        first = [request(engine, p, n) for p, n in zip(PROMPTS[:3], budgets[:3])]
        for req in first:
            scheduler.submit(req)
        # The rest arrive while the first ones decode: some longer, some shorter than the batch.
        wait_generating(first[0])
        later = [request(engine, p, n) for p, n in zip(PROMPTS[3:], budgets[3:])]
        for req in later:
            scheduler.submit(req)
            time.sleep(0.002)
        for index, req in enumerate(first + later):
            text, end = collect(req)
            expected_text, expected_tokens = solo(engine, PROMPTS[index], budgets[index])
            assert isinstance(end, Finished), end
            assert (text, end.completion_tokens) == (expected_text, expected_tokens), f"prompt {index}"
            assert end.reason == ("length" if expected_tokens == budgets[index] else "stop")
        assert scheduler.wait_idle(TIMEOUT_S)
        assert scheduler.in_system == 0
    finally:
        scheduler.stop()


def test_capacity_stays_bounded_and_padding_is_compacted(engine: Engine) -> None:
    """A long-lived batch where long prompts come and go: the buffer never outgrows its bound
    and every output still equals its solo output."""
    scheduler = scheduler_for(engine, max_num_seqs=3, prefill_chunk=32)
    long_prompt = CORPUS[0] + CORPUS[1] + CORPUS[4]
    try:
        keeper = request(engine, "for i in", 200)
        scheduler.submit(keeper)
        for round_ in range(6):
            batch = [request(engine, long_prompt, 6 + round_), request(engine, "x = ", 10 + round_)]
            for req in batch:
                scheduler.submit(req)
            for req, (prompt, budget) in zip(batch, [(long_prompt, 6 + round_), ("x = ", 10 + round_)]):
                text, end = collect(req)
                assert isinstance(end, Finished)
                assert (text, end.completion_tokens) == solo(engine, prompt, budget)
            assert scheduler._batch.mask.shape[1] <= scheduler._batch.capacity_limit
        text, end = collect(keeper)
        assert isinstance(end, Finished)
        assert (text, end.completion_tokens) == solo(engine, "for i in", 200)
        assert scheduler.compactions > 0
    finally:
        scheduler.stop()


def test_prefill_runs_in_bounded_chunks_between_decode_steps(engine: Engine) -> None:
    session = Recording(engine.session)
    scheduler = scheduler_for(engine, session, max_num_seqs=4, prefill_chunk=16)
    long_ids = (engine.encode(CORPUS[0] * 3) * 4)[:128]
    try:
        shorts = [request(engine, p, 80) for p in PROMPTS[:3]]
        for req in shorts:
            scheduler.submit(req)
        for req in shorts:  # all three are decoding
            wait_generating(req)
        session.calls.clear()
        long_req = request(engine, long_ids, 4)
        scheduler.submit(long_req)
        collect(long_req)
        chunks = [i for i, shape in enumerate(session.calls) if shape == (1, 16)]
        assert len(chunks) == 128 // 16
        assert all(seq <= 16 for _, seq in session.calls)
        for a, b in zip(chunks, chunks[1:]):
            between = session.calls[a + 1 : b]
            assert any(seq == 1 and batch >= 1 for batch, seq in between), session.calls
        for req in shorts:
            collect(req)
    finally:
        scheduler.stop()


def test_a_failing_prefill_fails_only_its_request(engine: Engine) -> None:
    session = Recording(engine.session)
    used = {t for p in PROMPTS[:2] for t in engine.encode(p)}
    marker = max(set(range(3, engine.session.io.vocab_size)) - used - {t + 1 for t in used})
    session.fail_if = lambda feeds: feeds["input_ids"].shape[1] > 1 and marker in feeds["input_ids"]
    session.nan_if = lambda feeds: feeds["input_ids"].shape[1] > 1 and marker - 1 in feeds["input_ids"]
    scheduler = scheduler_for(engine, session)
    try:
        good = [request(engine, p, 20) for p in PROMPTS[:2]]
        bad = request(engine, [5, 6, marker, 7], 20)
        nan = request(engine, [5, 6, marker - 1, 7], 20)
        for req in (good[0], bad, nan, good[1]):
            scheduler.submit(req)
        assert isinstance(collect(bad)[1], Failed)
        assert isinstance(collect(nan)[1], Failed)
        for req, prompt in zip(good, PROMPTS[:2]):
            text, end = collect(req)
            assert isinstance(end, Finished)
            assert (text, end.completion_tokens) == solo(engine, prompt, 20)
        assert scheduler.failure is None
        assert scheduler.metrics.request_failed.get() == 2
    finally:
        scheduler.stop()


def test_a_failing_decode_step_fails_the_engine_and_its_requests(engine: Engine) -> None:
    session = Recording(engine.session)
    session.fail_if = lambda feeds: feeds["input_ids"].shape[1] == 1 and len(session.calls) > 6
    scheduler = scheduler_for(engine, session)
    try:
        reqs = [request(engine, p, 50) for p in PROMPTS[:2]]
        for req in reqs:
            scheduler.submit(req)
        for req in reqs:
            assert isinstance(collect(req)[1], Failed)
        assert scheduler.failure is not None and "injected" in scheduler.failure
        with pytest.raises(Unavailable):
            scheduler.submit(request(engine, "def", 4))
    finally:
        scheduler.stop()


def test_cancel_frees_running_and_queued_slots(engine: Engine) -> None:
    scheduler = scheduler_for(engine, max_num_seqs=1, max_queued=1)
    try:
        running, waiting = request(engine, "def", 200), request(engine, "class", 200)
        scheduler.submit(running)
        scheduler.submit(waiting)
        with pytest.raises(Overloaded):
            scheduler.submit(request(engine, "for", 5))
        wait_generating(running)
        scheduler.cancel(waiting)
        assert scheduler.in_system == 1  # a queued request leaves at once
        scheduler.cancel(running)
        assert scheduler.wait_idle(TIMEOUT_S)
        assert scheduler.metrics.request_aborted.get() == 2
        after = request(engine, "for i in", 6)
        scheduler.submit(after)
        text, end = collect(after)
        assert isinstance(end, Finished) and (text, end.completion_tokens) == solo(engine, "for i in", 6)
    finally:
        scheduler.stop()


def test_seeded_sampling_and_penalty_in_a_batch_equal_solo(engine: Engine) -> None:
    scheduler = scheduler_for(engine)
    cases: list[tuple[str, dict[str, Any]]] = [
        ("def", dict(temperature=0.9, top_p=0.95, seed=3)),
        ("class Point:", dict(temperature=1.2, top_k=20, seed=7)),
        ("for i in", dict(temperature=0.0, repetition_penalty=1.3)),
        ("import", dict(temperature=0.7, min_p=0.1, seed=11)),
    ]
    try:
        reqs = [request(engine, prompt, 30, **sampling) for prompt, sampling in cases]
        for req in reqs:
            scheduler.submit(req)
        for req, (prompt, sampling) in zip(reqs, cases):
            text, end = collect(req)
            assert isinstance(end, Finished)
            assert (text, end.completion_tokens) == solo(engine, prompt, 30, **sampling), sampling
    finally:
        scheduler.stop()


def test_stop_string_ends_the_request(engine: Engine) -> None:
    scheduler = scheduler_for(engine)
    try:
        full, _ = solo(engine, "def", 30)
        assert len(full) >= 8, full
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        req = request(engine, "def", 30, stop=(stop,))
        scheduler.submit(req)
        text, end = collect(req)
        assert isinstance(end, Finished) and end.reason == "stop"
        assert text == full[: full.find(stop)]
    finally:
        scheduler.stop()


def test_concat_cache_artifacts_batch_too(built_artifact: Callable[..., Path]) -> None:
    """gemma2 keeps eager attention and the `concat` cache (and a sliding window of 8): rows
    still join, leave and compact, and each equals its solo output."""
    engine = Engine.load(built_artifact("gemma2"))
    assert not engine.session.io.shared_kv
    scheduler = scheduler_for(engine, max_num_seqs=3, prefill_chunk=8)
    budgets = [30, 10, 25, 12, 20]
    try:
        reqs = [request(engine, p, n) for p, n in zip(PROMPTS, budgets)]
        scheduler.submit(reqs[0])
        wait_generating(reqs[0])
        for req in reqs[1:]:
            scheduler.submit(req)
        for req, prompt, budget in zip(reqs, PROMPTS, budgets):
            text, end = collect(req)
            assert isinstance(end, Finished)
            assert (text, end.completion_tokens) == solo(engine, prompt, budget)
    finally:
        scheduler.stop()
