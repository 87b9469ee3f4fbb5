"""Faults: disconnects while running and queued, a burst past the queue, SIGTERM draining."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest

from kvforge.runners.engine import Engine
from tests.serve.conftest import LONG, Server

pytestmark = pytest.mark.slow
TIMEOUT_S = 30.0


def metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=TIMEOUT_S) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"kvforge:(\w+)\{([^}]*)\} (\S+)$", line)
        if match and "le=" not in match.group(2):
            reason = re.search(r'finished_reason="(\w+)"', match.group(2))
            values[match.group(1) + (f":{reason.group(1)}" if reason else "")] = float(match.group(3))
    return values


def wait_for(server: Server, condition: Callable[[dict[str, float]], bool], what: str) -> dict[str, float]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        values = metrics(server)
        if condition(values):
            return values
        time.sleep(0.01)
    raise AssertionError(f"{what}: not reached within {TIMEOUT_S}s; metrics {metrics(server)}")


def open_request(server: Server, body: dict[str, Any]) -> socket.socket:
    """Send a completion request on a raw socket (to be closed by the test)."""
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S)
    data = json.dumps({"model": "out", **body}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> bytes:
    received = b""
    while marker not in received:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed before {marker!r}: {received!r}"
        received += chunk
    return received


def test_disconnect_while_running_frees_the_slot(
    launch: Callable[..., Server], tiny_artifact: Path, long_request_has_no_eos: None, slow_steps: None
) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "2")
    for stream in (True, False):
        sock = open_request(server, {"prompt": "def", "max_tokens": LONG, "temperature": 0, "stream": stream})
        if stream:
            read_until(sock, b"data: ")
        else:
            wait_for(server, lambda m: m["num_requests_running"] == 1, "request running")
        sock.close()
    after = wait_for(server, lambda m: m["request_aborted_total"] == 2 and m["num_requests_running"] == 0, "aborted")
    assert after["request_success_total:length"] == 0
    assert after["generation_tokens_total"] < 2 * LONG
    assert after["kv_cache_usage_perc"] == 0


def test_disconnect_while_queued_leaves_the_queue(
    launch: Callable[..., Server], tiny_artifact: Path, long_request_has_no_eos: None, slow_steps: None
) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "1")
    running = open_request(server, {"prompt": "def", "max_tokens": LONG, "temperature": 0, "stream": True})
    read_until(running, b"data: ")
    queued = [open_request(server, {"prompt": "def", "max_tokens": LONG, "temperature": 0}) for _ in range(2)]
    wait_for(server, lambda m: m["num_requests_waiting"] == 2, "two requests queued")
    queued[1].close()
    during = wait_for(server, lambda m: m["request_aborted_total"] == 1, "queued request aborted")
    assert during["num_requests_waiting"] == 1 and during["num_requests_running"] == 1
    for sock in (queued[0], running):
        sock.close()
    final = wait_for(
        server,
        lambda m: m["num_requests_running"] == m["num_requests_waiting"] == 0 and m["request_aborted_total"] >= 2,
        "idle",
    )
    assert final["request_aborted_total"] + final["request_success_total:length"] == 3


def test_a_burst_past_the_queue_gets_fast_429s_and_the_server_stays_healthy(
    launch: Callable[..., Server], tiny_artifact: Path
) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "1", "--max-queued", "2")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    start = threading.Barrier(12)

    def one(_: int) -> tuple[str, float, Any]:
        start.wait(TIMEOUT_S)
        began = time.monotonic()
        try:
            client.completions.create(model="out", prompt="def", max_tokens=LONG, temperature=0)
            return "ok", time.monotonic() - began, None
        except openai.RateLimitError as error:
            return "429", time.monotonic() - began, error

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    rejected = [r for r in results if r[0] == "429"]
    assert rejected and len(results) - len(rejected) >= 3
    for _, seconds, error in rejected:
        assert seconds < 5.0  # refused at once, not after waiting for a slot
        assert error.response.headers["retry-after"] == "1" and error.code == "rate_limit_exceeded"
    with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT_S) as response:
        assert response.status == 200
    after = client.completions.create(model="out", prompt="def", max_tokens=4, temperature=0)
    assert after.choices[0].finish_reason == "length"
    assert metrics(server)["request_rejected_total"] == len(rejected)


def test_bad_requests_and_disconnects_do_not_disturb_others(launch: Callable[..., Server], tiny_artifact: Path) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "4")
    engine = Engine.load(tiny_artifact)
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    prompts = ["def", "class Point:", "for i in"]

    def good(prompt: str) -> str:
        chunks = client.completions.create(model="out", prompt=prompt, max_tokens=60, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(good, p) for p in prompts]
        for _ in range(3):
            open_request(server, {"prompt": "def", "max_tokens": 50, "stream": True}).close()
            with pytest.raises(openai.BadRequestError):
                client.completions.create(model="out", prompt="def", temperature=-1)
        texts = [f.result(TIMEOUT_S) for f in futures]
    assert texts == [engine.generate(p, max_new_tokens=60, temperature=0) for p in prompts]


def test_sigterm_drains_in_flight_requests(
    launch: Callable[..., Server], tiny_artifact: Path, long_request_has_no_eos: None, slow_steps: None
) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "1")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    stream = client.completions.create(model="out", prompt="def", max_tokens=LONG, temperature=0, stream=True)
    chunks = [next(iter(stream))]
    # three more long requests queued behind it: the drain runs all four one after another, so
    # it lasts long enough for the request below to arrive while it runs, however loaded the machine
    queued = [open_request(server, {"prompt": "def", "max_tokens": LONG, "stream": True}) for _ in range(3)]
    wait_for(server, lambda m: m["num_requests_waiting"] == 3, "three requests queued")
    server.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5.0
    while True:  # the signal arrives asynchronously: /health turns 503 as soon as it is handled
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=TIMEOUT_S):
                assert time.monotonic() < deadline, "/health still 200 5 s after SIGTERM"
        except urllib.error.HTTPError as error:
            assert error.code == 503
            break
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="out", prompt="def", max_tokens=2)
    assert refused.value.status_code == 503
    chunks.extend(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == Engine.load(tiny_artifact).generate("def", max_new_tokens=LONG, temperature=0)
    assert server.process.wait(TIMEOUT_S) == 0
    for sock in queued:
        assert b"finish_reason" in read_until(sock, b"[DONE]")  # the queued requests were drained, not dropped
        sock.close()
    assert "shutting down" in server.stderr()
