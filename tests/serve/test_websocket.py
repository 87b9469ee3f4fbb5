"""The WebSocket route at the generation paths: the SSE stream's events, one JSON message
each, the same usage; refusals as an error message and a 4000 + status close; a client that
vanishes mid-stream has its request cancelled."""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.serve.conftest import LONG, Server
from tests.serve.test_faults import wait_for
from tests.serve.test_http import call, sse_events

pytestmark = pytest.mark.slow
TIMEOUT_S = 60.0


def ws_url(server: Server, path: str) -> str:
    return server.url.replace("http://", "ws://", 1) + path


def ws_messages(server: Server, path: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], int | None]:
    """Every message of one request over a WebSocket, and the close code the server sent."""
    messages = []
    with connect(ws_url(server, path), open_timeout=TIMEOUT_S) as websocket:
        websocket.send(json.dumps(body))
        try:
            while True:
                messages.append(json.loads(websocket.recv(timeout=TIMEOUT_S)))
        except ConnectionClosed as closed:
            return messages, closed.rcvd.code if closed.rcvd else None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_websocket_streams_the_sse_events(shared_server: Server, path: str) -> None:
    body: dict[str, Any] = {"model": "out", "max_tokens": 12, "temperature": 0, "stream": True}
    body |= {"stream_options": {"include_usage": True}}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "def"}]
    else:
        body["prompt"] = "def"
    messages, code = ws_messages(shared_server, path, body)
    assert code == 1000
    status, _, payload = call(shared_server.url, "POST", path, body)
    assert status == 200
    events = [json.loads(e) for e in sse_events(payload)[:-1]]

    def comparable(chunks: list[dict[str, Any]]) -> list[Any]:  # ids and timestamps differ per request
        return [(c["object"], c["choices"], c.get("usage")) for c in chunks]

    assert comparable(messages) == comparable(events)
    assert messages[-1]["choices"] == [] and messages[-1]["usage"]["completion_tokens"] >= 1


def test_a_refused_request_is_an_error_message_and_a_close_naming_the_status(shared_server: Server) -> None:
    messages, code = ws_messages(shared_server, "/v1/completions", {"model": "out", "prompt": "a", "top_p": 5})
    assert code == 4400
    assert len(messages) == 1 and messages[0]["error"]["param"] == "top_p"
    messages, code = ws_messages(shared_server, "/v1/completions", {"model": "nope", "prompt": "a"})
    assert code == 4404 and messages[0]["error"]["code"] == "model_not_found"


def test_a_client_that_vanishes_mid_stream_has_its_request_cancelled(
    launch: Callable[..., Server], tiny_artifact: Path, long_request_has_no_eos: None, slow_steps: None
) -> None:
    server = launch(tiny_artifact, "--max-num-seqs", "2")
    body = {"model": "out", "prompt": "def", "max_tokens": LONG, "temperature": 0}
    websocket = connect(ws_url(server, "/v1/completions"), open_timeout=TIMEOUT_S)
    websocket.send(json.dumps(body))
    assert "choices" in json.loads(websocket.recv(timeout=TIMEOUT_S))
    raw = websocket.socket  # gone without a close frame: the connection is reset
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    raw.close()
    after = wait_for(server, lambda m: m["request_aborted_total"] == 1 and m["num_requests_running"] == 0, "aborted")
    assert after["request_success_total:length"] == 0 and after["generation_tokens_total"] < LONG
    messages, code = ws_messages(server, "/v1/completions", body | {"max_tokens": 3})  # still serving
    assert code == 1000 and messages[-1]["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in server.stderr()
