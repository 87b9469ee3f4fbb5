"""The server's prefix cache: shared prefixes hit down to the token (a repeated prompt prefills
only its last token, a prompt sharing part of a block restores that part), outputs equal the
uncached server and a solo generation, the byte budget holds under distinct prompts, and bad
budgets are refused."""

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
    _, first, second = shared_prompts(engine)
    cached = cached_scheduler(engine, 1 << 26)
    plain = cached_scheduler(engine, None)
    try:
        with_cache = run_in_turn(cached, engine, [first, second], 20, **sampling)
        without = run_in_turn(plain, engine, [first, second], 20, **sampling)
        metrics = cached.metrics
        assert metrics.prefix_cache_hits.get() == 1
        # the second prompt shares the prefix's 4 full blocks and part of the first prompt's
        # trailing partial block: all of them are restored
        common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        assert 4 * BLOCK + 5 <= common < 5 * BLOCK
        assert metrics.prefix_cache_hit_tokens.get() == common
        assert metrics.prefix_cache_queries.get() == len(first) + len(second)
        assert plain.metrics.prefix_cache_hit_tokens.get() == 0
    finally:
        cached.stop()
        plain.stop()
    assert with_cache == without
    assert with_cache == [solo(engine, prompt, 20, **sampling)[0] for prompt in (first, second)]


def test_prompts_differing_from_their_first_id_miss_and_from_their_second_hit_one(engine: Engine) -> None:
    _, first, _ = shared_prompts(engine)
    vocab = engine.session.io.vocab_size
    other = [(first[0] + 1) % vocab, *first[1:]]
    second = [first[0], (first[1] + 1) % vocab, *first[2:]]
    scheduler = cached_scheduler(engine, 1 << 26)
    try:
        texts = run_in_turn(scheduler, engine, [first, other], 12)
        assert scheduler.metrics.prefix_cache_hits.get() == 0
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 0
        texts += run_in_turn(scheduler, engine, [second], 12)
        assert scheduler.metrics.prefix_cache_hits.get() == 1
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 1
    finally:
        scheduler.stop()
    assert texts == [solo(engine, prompt, 12)[0] for prompt in (first, other, second)]


def test_a_cached_prefix_prefills_its_last_token_then_nothing_once_its_logits_are_kept(engine: Engine) -> None:
    _, first, _ = shared_prompts(engine)
    exact = first[: 3 * BLOCK]  # three full blocks, all cached by the first request
    scheduler = cached_scheduler(engine, 1 << 26)
    try:
        texts = run_in_turn(scheduler, engine, [first, exact, exact], 12)
        # the first time all but its last token is restored (that token's logits choose the first
        # token, and were not kept: the first prompt went on); its third block then keeps them,
        # and the second time the whole prompt is restored, with no prefill
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == (3 * BLOCK - 1) + 3 * BLOCK
        assert scheduler.metrics.prefix_cache_hits.get() == 2
    finally:
        scheduler.stop()
    assert texts[1:] == [solo(engine, exact, 12)[0]] * 2


def logits_bytes(engine: Engine) -> int:
    """Bytes of one position's logits, kept with a stored prompt's last block (fp32 on the tiny artifact)."""
    return engine.session.io.vocab_size * np.dtype(np.float32).itemsize


def block_bytes(engine: Engine, columns: int = BLOCK) -> int:
    """Bytes of `columns` cached positions of every full-history layer."""
    io = engine.session.io
    names = [name for name in io.past_names if io.window_of(name) is None]
    return sum(int(np.prod(io.kv_shape(name, 1, columns))) for name in names) * np.dtype(io.kv_dtype).itemsize


def test_a_repeated_prompt_is_not_prefilled_and_an_extension_prefills_its_new_ids(engine: Engine) -> None:
    ids = engine.encode("".join(reversed(CORPUS)))
    prompt = ids[: 4 * BLOCK + 6]  # four full blocks and a trailing partial one of 6 ids
    extended = ids[: 5 * BLOCK + 3]
    assert len(extended) == 5 * BLOCK + 3
    scheduler = cached_scheduler(engine, 1 << 26)
    cache = scheduler.prefix_cache
    assert cache is not None
    hit = scheduler.metrics.prefix_cache_hit_tokens.get
    try:
        first = run_in_turn(scheduler, engine, [prompt], 12)
        kept = logits_bytes(engine)
        assert len(cache) == 5 and cache.bytes == 4 * block_bytes(engine) + block_bytes(engine, 6) + kept
        again = run_in_turn(scheduler, engine, [prompt], 12)
        assert hit() == len(prompt)  # the whole prompt and its last logits: no prefill
        # an extension of it restores the whole of it, the partial block included
        longer = run_in_turn(scheduler, engine, [extended], 12)
        assert hit() == 2 * len(prompt)
        # its full fifth block replaces the partial one it extends: five full blocks, one partial
        # (with the extension's logits)
        assert len(cache) == 6 and cache.bytes == 5 * block_bytes(engine) + block_bytes(engine, 3) + kept
        # the shorter prompt again: served by the fifth block's first columns (whose logits are
        # not its own: its last token is prefilled), nothing stored
        shorter = run_in_turn(scheduler, engine, [prompt], 12)
        assert hit() == 2 * len(prompt) + (len(prompt) - 1)
        assert len(cache) == 6 and scheduler.metrics.prefix_cache_hits.get() == 3
    finally:
        scheduler.stop()
    assert first == again == shorter == [solo(engine, prompt, 12)[0]]
    assert longer == [solo(engine, extended, 12)[0]]


def test_kept_logits_sample_as_a_prefill_would_every_time(engine: Engine) -> None:
    prompt = engine.encode(CORPUS[3] + CORPUS[4])[: 2 * BLOCK + 3]
    assert len(prompt) == 2 * BLOCK + 3
    sampling = dict(temperature=0.9, top_p=0.95, seed=11)
    scheduler = cached_scheduler(engine, 1 << 26)
    try:  # seeded sampling from the kept logits gives a prefill's texts, each time
        texts = run_in_turn(scheduler, engine, [prompt] * 3, 10, **sampling)
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 2 * len(prompt)
    finally:
        scheduler.stop()
    assert texts == [solo(engine, prompt, 10, **sampling)[0]] * 3


def test_a_prompt_sharing_part_of_a_full_block_restores_that_part(engine: Engine) -> None:
    ids = engine.encode("".join(CORPUS))
    first = ids[: 6 * BLOCK]
    assert len(first) == 6 * BLOCK
    vocab = engine.session.io.vocab_size
    diverging = [*first[: 2 * BLOCK + 9], (first[2 * BLOCK + 9] + 1) % vocab, *first[2 * BLOCK + 10 :]]
    scheduler = cached_scheduler(engine, 1 << 26)
    try:
        texts = run_in_turn(scheduler, engine, [first, diverging], 10, temperature=0.0)
        # two full blocks, then 9 of the third block's 16 columns
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 2 * BLOCK + 9
    finally:
        scheduler.stop()
    assert texts == [solo(engine, prompt, 10)[0] for prompt in (first, diverging)]


def test_a_small_budget_holds_under_distinct_prompts(engine: Engine) -> None:
    io = engine.session.io
    block = block_bytes(engine)
    budget = 5 * block + block // 2  # five blocks and a half
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
        # five blocks and the logits of the newest prompt's last one
        assert len(cache) == 5 and cache.bytes == 5 * block + logits_bytes(engine)
        assert scheduler.metrics.prefix_cache_evictions.get() == 6 * 3 - 5
        assert scheduler.metrics.prefix_cache_hits.get() == 0
        # the most recent prompt's blocks survived: it hits now, and its text is unchanged
        texts = run_in_turn(scheduler, engine, [prompt + engine.encode(" x")], 8)
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == 3 * BLOCK
    finally:
        scheduler.stop()
    assert texts == [solo(engine, prompt + engine.encode(" x"), 8)[0]]


def test_partial_blocks_are_weighed_by_their_columns_and_evicted_within_the_budget(engine: Engine) -> None:
    block, partial = block_bytes(engine), block_bytes(engine, 5) + logits_bytes(engine)
    budget = 2 * block + partial  # a prompt's full block and partial one (with its logits), and a full one
    scheduler = cached_scheduler(engine, budget)
    cache = scheduler.prefix_cache
    assert cache is not None
    io = engine.session.io
    base = engine.encode(CORPUS[1] + CORPUS[2])[: BLOCK + 5]
    try:
        for index in range(4):  # distinct from their first id on: every prompt misses
            prompt = [(base[0] + index + 1) % io.vocab_size, *base[1:]]
            run_in_turn(scheduler, engine, [prompt], 3)
            assert cache.bytes <= budget and scheduler.metrics.prefix_cache_bytes.value == cache.bytes
        # the newest prompt's full and partial blocks and the one before's full block
        assert len(cache) == 3 and cache.bytes == budget
        assert scheduler.metrics.prefix_cache_evictions.get() == 4 * 2 - 3
        assert scheduler.metrics.prefix_cache_hits.get() == 0
        texts = run_in_turn(scheduler, engine, [prompt], 8)
        assert scheduler.metrics.prefix_cache_hit_tokens.get() == len(prompt)
    finally:
        scheduler.stop()
    assert texts == [solo(engine, prompt, 8)[0]]


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
