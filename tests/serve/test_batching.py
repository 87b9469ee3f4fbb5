"""Continuous batching over HTTP: concurrent requests, some arriving mid-generation, each
equal to its solo greedy output; and a long prompt does not stall the streams decoding."""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from kvforge.runners.engine import Engine
from tests.serve.conftest import Server
from tests.tiny import CORPUS

pytestmark = pytest.mark.slow
TIMEOUT_S = 60.0
PROMPTS = [
    "def",
    "class Point:\n    def __init__(self, x, y):",
    CORPUS[0] + CORPUS[1],
    "for i in range(10):",
    "héllo wörld",
    CORPUS[4] + CORPUS[2],
]
BUDGETS = [80, 30, 40, 60, 20, 50]


def test_concurrent_requests_equal_their_solo_greedy_output(launch: Callable[..., Server], tiny_artifact: Path) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "4", "--prefill-chunk", "16")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    engine = Engine.load(tiny_artifact)
    started = threading.Event()

    def run(index: int) -> str:
        if index >= 2:  # these arrive while the first two are generating
            assert started.wait(TIMEOUT_S)
            time.sleep(0.005 * index)
        stream = client.completions.create(
            model="out", prompt=PROMPTS[index], max_tokens=BUDGETS[index], temperature=0, stream=True
        )
        parts = []
        for chunk in stream:
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if index == 0 and len(parts) == 3:
                started.set()
        return "".join(parts)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(run, range(len(PROMPTS))))
    expected = [engine.generate(p, max_new_tokens=n, temperature=0) for p, n in zip(PROMPTS, BUDGETS)]
    assert texts == expected


def test_a_long_prompt_keeps_the_token_gaps_of_running_streams_bounded(
    launch: Callable[..., Server], tiny_artifact: Path
) -> None:
    """While a long prompt is prefilled, the three streams keep receiving tokens: their largest
    gap stays within a small factor of one prefill chunk plus one decode step."""
    chunk = 16
    server = launch(tiny_artifact, "--max-num-seqs", "4", "--prefill-chunk", str(chunk))
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    engine = Engine.load(tiny_artifact)
    long_ids = (engine.encode(CORPUS[0] + CORPUS[1] + CORPUS[4]) * 4)[:224]
    chunk_ids = long_ids[:chunk]

    def prefill_seconds(ids: list[int]) -> float:
        began = time.perf_counter()
        client.completions.create(model="out", prompt=ids, max_tokens=1, temperature=0)
        return time.perf_counter() - began

    one_chunk = min(prefill_seconds(chunk_ids) for _ in range(5))
    arrivals: list[list[float]] = [[], [], []]
    ready = threading.Barrier(4)

    def stream(index: int) -> None:
        chunks = client.completions.create(
            model="out", prompt=["def", "class Point:", "for i in"][index], max_tokens=200, temperature=0, stream=True
        )
        for _ in chunks:
            arrivals[index].append(time.perf_counter())
            if len(arrivals[index]) == 20:
                ready.wait(TIMEOUT_S)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream, i) for i in range(3)]
        ready.wait(TIMEOUT_S)
        began = time.perf_counter()
        client.completions.create(model="out", prompt=long_ids, max_tokens=1, temperature=0)
        ended = time.perf_counter()
        for future in futures:
            future.result(TIMEOUT_S)
    during = [b - a for times in arrivals for a, b in zip(times, times[1:]) if b >= began and a <= ended]
    # Events reach the client in bursts, so a step is the mean gap of a stream before the long prompt.
    before = [[t for t in times if t < began] for times in arrivals]
    decode_step = statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in before)
    assert during, "the streams must decode while the long prompt is prefilled"
    # One chunk plus one step, times a factor for a shared 2-core machine, plus scheduling noise.
    bound = 4 * (one_chunk + decode_step) + 0.25
    assert max(during) <= bound, (max(during), one_chunk, decode_step, ended - began)
