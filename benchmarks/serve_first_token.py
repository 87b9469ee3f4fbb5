"""Where `kvforge serve`'s time to first token goes, stage by stage, with one client.

    python benchmarks/serve_first_token.py ARTIFACT [--requests 30] [--prompt 64] [--repeated]

Runs the server in this process (the HTTP side on its thread, the engine thread) and stamps
each stage of a streamed completion as it passes: the client sends; the ASGI app receives
(arrival); the body is read; parsed, validated and tokenized; queued to the engine thread;
the engine thread takes it (queue wait); prefill ends; the first token is sampled; it is
detokenized and put on the request's event queue; the event loop reads it; the client has its
first text event. It prints each stage's median, p10 and p90 over the requests (the first one,
a warm-up, left out). With --repeated the server has a prefix cache and each prompt is sent
twice in a row; the figures are the second sends' (a prompt the server has seen, whose prefill
is its last token). The stamps come from wrapping the functions at each seam, the engine
thread's private ones among them, so a rename there breaks this script, not the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.runners.engine import Engine
from kvforge.runners.serve import app
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.scheduler import BatchScheduler
from kvforge.runners.serve.server import HttpServer, prefix_cache_for

STAGES = (
    "client sent",
    "arrival",
    "body read",
    "parsed + tokenized",
    "queued",
    "engine takes it",
    "prefill done",
    "first token sampled",
    "detokenized, put",
    "event loop reads it",
    "client has text",
)
stamps: dict[str, float] = {}


def stamp(stage: str) -> None:
    stamps.setdefault(stage, time.perf_counter())


def wrapped(function: Callable[..., Any], before: str | None = None, after: str | None = None) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if before:
            stamp(before)
        result = function(*args, **kwargs)
        if after:
            stamp(after)
        return result

    return call


def instrument_http_side() -> None:
    access_log, read_body, next_event = app.AccessLog.__call__, app.read_body, app.EventQueue.next

    async def arrive(self: app.AccessLog, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            stamp("arrival")
        await access_log(self, scope, receive, send)

    async def read(request: Any) -> bytes:
        body = await read_body(request)
        stamp("body read")
        return body

    async def next_one(self: app.EventQueue) -> Any:
        event = await next_event(self)
        stamp("event loop reads it")
        return event

    app.AccessLog.__call__ = arrive  # type: ignore[method-assign]
    app.read_body = read
    app.parse_request = wrapped(app.parse_request, after="parsed + tokenized")
    app.EventQueue.put = wrapped(app.EventQueue.put, before="detokenized, put")  # type: ignore[method-assign]
    app.EventQueue.next = next_one  # type: ignore[method-assign]


def instrument_engine_side(scheduler: BatchScheduler) -> None:
    scheduler.submit = wrapped(scheduler.submit, after="queued")  # type: ignore[method-assign]
    admit = scheduler._admit

    def take() -> None:
        if scheduler._waiting:  # the loop calls it on every pass; only a taking call counts
            stamp("engine takes it")
        admit()

    scheduler._admit = take  # type: ignore[method-assign]
    sample = wrapped(scheduler._sample_rows, before="prefill done", after="first token sampled")
    scheduler._sample_rows = sample  # type: ignore[method-assign]


def first_text(url: str, body: dict[str, Any]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        stamp("client sent")
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        for line in response:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                stamp("client has text")
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in token ids")
    parser.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn from [3, vocab)")
    parser.add_argument("--repeated", action="store_true", help="time each prompt's second send (prefix cache on)")
    args = parser.parse_args()
    instrument_http_side()
    state = app.State(Metrics())
    server = HttpServer("127.0.0.1", 0, state)
    server.start()
    engine = Engine.load(args.artifact)
    cache = prefix_cache_for(engine, Path(args.artifact), 1 << 30, state.metrics, print) if args.repeated else None
    scheduler = BatchScheduler.for_engine(
        engine, max_num_seqs=8, max_queued=64, prefill_chunk=256, metrics=state.metrics, prefix_cache=cache
    )
    instrument_engine_side(scheduler)
    scheduler.start()
    state.name, state.engine, state.scheduler = "model", engine, scheduler
    rng = random.Random(0)
    runs: list[dict[str, float]] = []
    try:
        for _ in range(args.requests + 1):
            prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt)]
            body = {"model": "model", "prompt": prompt, "max_tokens": 4, "ignore_eos": True, "stream": True}
            for _ in range(2 if args.repeated else 1):
                stamps.clear()
                first_text(server.url, {**body, "temperature": 0})
            runs.append(dict(stamps))
            time.sleep(0.05)
    finally:
        scheduler.stop()
        server.stop()
    report(runs[1:])


def report(runs: list[dict[str, float]]) -> None:
    print(f"{'stage':<44} {'p50 ms':>8} {'p10':>8} {'p90':>8}")
    for before, after in zip(STAGES, STAGES[1:]):
        spans = sorted(1e3 * (run[after] - run[before]) for run in runs if before in run and after in run)
        low, high = spans[len(spans) // 10], spans[9 * len(spans) // 10]
        print(f"{before + ' -> ' + after:<44} {statistics.median(spans):>8.3f} {low:>8.3f} {high:>8.3f}")
    total = statistics.median(1e3 * (run["client has text"] - run["client sent"]) for run in runs)
    print(f"{'time to first text (client)':<44} {total:>8.3f}")


if __name__ == "__main__":
    main()
