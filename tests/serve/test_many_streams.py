"""Many open streams held by one server: N clients each open a long streamed completion and
read nothing while the engine works through them slowly; the server holds them all (running
or queued), answers other clients at once, and its memory grows by a bounded amount per
stream; when the clients leave, every request is cancelled and the server serves the next
one. N is 100 here; KVFORGE_TEST_STREAMS=1000 gives the figure in docs/serving.md."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.serve.conftest import Server
from tests.serve.test_faults import wait_for
from tests.serve.test_http import call

pytestmark = pytest.mark.slow
STREAMS = int(os.environ.get("KVFORGE_TEST_STREAMS", "100"))
TOKENS = 200
PER_STREAM_BYTES = 256 << 10  # the bound on what one held stream may cost the server


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


@pytest.fixture
def slower_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Servers started after this take 50 ms more per model step: the streams stay open."""
    hook = Path(__file__).parent / "slow_steps"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("KVFORGE_TEST_STEP_S", "0.05")
    yield


def open_stream(host: str, port: int) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=120)
    body = {"model": "out", "prompt": "def", "max_tokens": TOKENS, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    data = json.dumps(body).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
    sock.sendall(head.encode() + data)
    return sock


def test_one_server_holds_many_open_streams(
    launch: Callable[..., Server], tiny_artifact: Path, slower_steps: None
) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "8", "--max-queued", str(STREAMS), "--quiet")
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    assert call(server.url, "POST", "/v1/completions", {"model": "out", "prompt": "def", "max_tokens": 2})[0] == 200
    before = rss(server.process.pid)
    socks = [open_stream(parts.hostname, parts.port) for _ in range(STREAMS)]
    try:

        def arrived(m: dict[str, float]) -> bool:
            return (
                m["num_requests_running"] + m["num_requests_waiting"] + m["request_success_total:length"] == STREAMS + 1
            )

        held = wait_for(server, arrived, "every stream arrived")
        during = rss(server.process.pid)
        began = time.monotonic()
        for path, body in (("/tokenize", {"prompt": "def"}), ("/health", None), ("/v1/models", None)):
            assert call(server.url, "POST" if body else "GET", path, body)[0] == 200
        answered = time.monotonic() - began
        print(
            f"{STREAMS} streams ({held['num_requests_running']:.0f} running, {held['num_requests_waiting']:.0f} "
            f"queued, {held['request_success_total:length']:.0f} done, unread): server RSS {before >> 20} MiB "
            f"before, {during >> 20} MiB held, {(during - before) / STREAMS / 1024:.1f} KiB per stream; "
            f"three other requests answered in {answered:.2f} s"
        )
        assert answered < 5.0
        assert during - before < STREAMS * PER_STREAM_BYTES
    finally:
        for sock in socks:
            sock.close()
    after = wait_for(
        server,
        lambda m: (
            m["num_requests_running"] + m["num_requests_waiting"] == 0
            and m["request_aborted_total"] + m["request_success_total:length"] == STREAMS + 1
        ),
        "every request that lost its client cancelled",
    )
    assert after["request_aborted_total"] >= STREAMS - after["request_success_total:length"]
    status, _, _ = call(server.url, "POST", "/v1/completions", {"model": "out", "prompt": "def", "max_tokens": 2})
    assert status == 200
