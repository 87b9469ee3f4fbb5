"""The server's prefix cache: shared prefixes hit, outputs equal the uncached server and a solo
generation, the byte budget holds under distinct prompts, and bad budgets are refused."""

from __future__ import annotations

import http.client
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.prefix_cache import BLOCK, PrefixCache, unsupported
from kvforge.runners.serve.scheduler import BatchScheduler, Finished
from kvforge.runners.serve.server import prefix_cache_for
from tests.serve.conftest import KVFORGE, Server
from tests.serve.test_scheduler import collect, request, solo
from tests.tiny import CORPUS


@pytest.fixture(scope="module")
def engine(tiny_artifact: Path) -> Engine:
    return Engine.load(tiny_artifact)


def cached_scheduler(engine: Engine, budget: int | None, **options: Any) -> BatchScheduler:
    """A scheduler with a prefix cache of `budget` bytes (None: no cache)."""
    metrics = Metrics()
    io = engine.session.io
    cache = None
    if budget is not None:
        names = [name for name in io.past_names if io.window_of(name) is None]
        cache = PrefixCache(budget, b"tiny llama", names, metrics)
    settings = dict(max_num_seqs=4, max_queued=16, prefill_chunk=8) | options
    scheduler = BatchScheduler(
        engine.session,
        max_positions=engine.max_positions,
        eos_ids=engine.eos_ids,
        metrics=metrics,
        prefix_cache=cache,
        **settings,
    )
    scheduler.start()
    return scheduler


def run_in_turn(
    scheduler: BatchScheduler, engine: Engine, prompts: list[list[int]], new: int, **sampling: Any
) -> list[str]:
    """Each prompt submitted after the previous one finished; their texts."""
    texts = []
    for prompt in prompts:
        req = request(engine, prompt, new, **sampling)
        scheduler.submit(req)
        text, end = collect(req)
        assert isinstance(end, Finished), end
        texts.append(text)
    return texts


def shared_prompts(engine: Engine) -> tuple[list[int], list[int], list[int]]:
    prefix = engine.encode(CORPUS[0] + CORPUS[1] + CORPUS[2])[: 4 * BLOCK + 5]
    assert len(prefix) == 4 * BLOCK + 5
    first = prefix + engine.encode(" and then")
    second = prefix + engine.encode(" but later, x = ")
    return prefix, first, second


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=5)])
def test_shared_prefix_hits_and_equals_uncached_and_solo(engine: Engine, sampling: dict[str, Any]) -> None:
    prefix, first, second = shared_prompts(engine)
    cached = cached_scheduler(engine, 1 << 26)
    plain = cached_scheduler(engine, None)
    try:
        with_cache = run_in_turn(cached, engine, [first, second], 20, **sampling)
        without = run_in_turn(plain, engine, [first, second], 20, **sampling)
        metrics = cached.metrics
        assert metrics.prefix_cache_hits.get() == 1
        # the second prompt shares the prefix's 4 full blocks (and not the fifth)
        assert metrics.prefix_cache_hit_tokens.get() == 4 * BLOCK
        assert metrics.prefix_cache_queries.get() == len(first) + len(second)
        assert plain.metrics.prefix_cache_hit_tokens.get() == 0
    finally:
        cached.stop()
        plain.stop()
    assert with_cache == without
    assert with_cache == [solo(engine, prompt, 20, **sampling)[0] for prompt in (first, second)]


def test_prompts_differing_inside_the_first_block_miss(engine: Engine) -> None:
    _, first, _ = shared_prompts(engine)
    other = [first[0], (first[1] + 1) % engine.session.io.vocab_size, *first[2:]]
    scheduler = cached_scheduler(engine, 1 << 26)
    try:
        texts = run_in_turn(scheduler, engine, [first, other], 12)
        assert scheduler.metrics.prefix_cache_hits.get() == 0
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 0
    finally:
        scheduler.stop()
    assert texts == [solo(engine, first, 12)[0], solo(engine, other, 12)[0]]


def test_a_prompt_that_is_a_cached_prefix_still_prefills_its_last_token(engine: Engine) -> None:
    _, first, _ = shared_prompts(engine)
    exact = first[: 3 * BLOCK]  # three full blocks, all cached by the first request
    scheduler = cached_scheduler(engine, 1 << 26)
    try:
        texts = run_in_turn(scheduler, engine, [first, exact, exact], 12)
        # the last block is never taken: its last token must be prefilled to give logits
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 2 * (2 * BLOCK)
    finally:
        scheduler.stop()
    assert texts[1:] == [solo(engine, exact, 12)[0]] * 2


def test_a_small_budget_holds_under_distinct_prompts(engine: Engine) -> None:
    io = engine.session.io
    names = [name for name in io.past_names if io.window_of(name) is None]
    block_bytes = sum(int(np.prod(io.kv_shape(name, 1, BLOCK))) for name in names) * np.dtype(io.kv_dtype).itemsize
    budget = 5 * block_bytes + block_bytes // 2  # five blocks and a half
    scheduler = cached_scheduler(engine, budget)
    cache = scheduler.prefix_cache
    assert cache is not None
    base = engine.encode(CORPUS[3] + CORPUS[4])[: 3 * BLOCK]
    try:
        for index in range(6):  # distinct from their first token on: every prompt misses
            prompt = [(base[0] + index + 1) % io.vocab_size, *base[1:]]
            run_in_turn(scheduler, engine, [prompt], 3)
            assert cache.bytes <= budget
            assert scheduler.metrics.prefix_cache_bytes.value == cache.bytes
        assert len(cache) == 5 and cache.bytes == 5 * block_bytes
        assert scheduler.metrics.prefix_cache_evictions.get() == 6 * 3 - 5
        assert scheduler.metrics.prefix_cache_hits.get() == 0
        # the most recent prompt's blocks survived: it hits now, and its text is unchanged
        texts = run_in_turn(scheduler, engine, [prompt + engine.encode(" x")], 8)
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 3 * BLOCK
    finally:
        scheduler.stop()
    assert texts == [solo(engine, prompt + engine.encode(" x"), 8)[0]]


def test_unsupported_for_windows_and_states(engine: Engine) -> None:
    from dataclasses import replace

    io = engine.session.io
    assert unsupported(io) is None
    windowed = replace(io, layer_windows=(8,) + (None,) * (io.num_layers - 1))
    assert "sliding window" in (unsupported(windowed) or "")
    stateful = SimpleNamespace(past_names=io.past_names, window_of=io.window_of, state_names=("conv.0",))
    assert "layer states" in (unsupported(stateful) or "")  # type: ignore[arg-type]
    # the server builds none for such an artifact and says so once
    lines: list[str] = []
    fake = SimpleNamespace(session=SimpleNamespace(io=windowed))
    assert prefix_cache_for(fake, Path("unused"), None, Metrics(), lines.append) is None  # type: ignore[arg-type]
    assert lines == ["prefix cache off for this artifact: " + (unsupported(windowed) or "")]
    with pytest.raises(KvforgeError, match="cannot have a prefix cache: its layers bounded by a sliding window"):
        BatchScheduler(
            SimpleNamespace(io=windowed),  # type: ignore[arg-type]
            max_positions=64,
            eos_ids=(),
            max_num_seqs=1,
            max_queued=0,
            prefill_chunk=8,
            metrics=Metrics(),
            prefix_cache=PrefixCache(1 << 20, b"", (), Metrics()),
        )


def test_cli_refuses_a_bad_budget(tiny_artifact: Path) -> None:
    for bad in ("-5", "lots"):
        result = subprocess.run(
            [str(KVFORGE), "serve", str(tiny_artifact), "--port", "0", "--prefix-cache-bytes", bad],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert "--prefix-cache-bytes" in result.stderr and repr(bad) in result.stderr


def _post(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    data = json.loads(connection.getresponse().read())
    connection.close()
    return data


def _metric(server: Server, name: str) -> float:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    for line in text.splitlines():
        if line.startswith(f"kvforge:{name}") and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_server_hits_and_matches_a_server_without_the_cache(tiny_artifact: Path, launch: Any) -> None:
    cached = launch(tiny_artifact, "--prefix-cache-bytes", "16M", "--prefill-chunk", "16")
    plain = launch(tiny_artifact, "--prefix-cache-bytes", "0", "--prefill-chunk", "16")
    assert "prefix cache: capped at 16 MiB" in cached.stderr()
    prefix = CORPUS[0] + CORPUS[1] + CORPUS[2]
    prompts = [prefix + " and then", prefix + " but later"]
    texts = {}
    for name, server in (("cached", cached), ("plain", plain)):
        texts[name] = [
            _post(server, {"model": tiny_artifact.name, "prompt": p, "max_tokens": 16, "temperature": 0})["choices"][0][
                "text"
            ]
            for p in prompts
        ]
    assert texts["cached"] == texts["plain"]
    assert _metric(cached, "prefix_cache_hits_total") == 1
    assert _metric(cached, "prefix_cache_hit_tokens_total") >= BLOCK
    assert 0 < _metric(cached, "prefix_cache_bytes") <= 16 << 20
    assert _metric(plain, "prefix_cache_hits_total") == 0
