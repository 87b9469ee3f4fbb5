"""The wire: SSE framing and headers, error shapes, routes, and /health while loading."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvforge.runners.serve.app import State
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.server import HttpServer
from tests.serve.conftest import Server

TIMEOUT_S = 60.0


def connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT_S)


def call(
    url: str, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = connect(url)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def sse_events(payload: bytes) -> list[str]:
    """The data of each event; every event must be exactly `data: ...` followed by a blank line."""
    text = payload.decode("utf-8")
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: ") :] for e in events]


def assert_error_shape(body: bytes, param: str | None = None) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_sse_framing_and_headers(shared_server: Server, path: str) -> None:
    request: dict[str, Any] = {"model": "out", "max_tokens": 10, "temperature": 0, "stream": True}
    if path.endswith("chat/completions"):
        request["messages"] = [{"role": "user", "content": "def"}]
    else:
        request["prompt"] = "def"
    request["stream_options"] = {"include_usage": True}
    status, headers, payload = call(shared_server.url, "POST", path, request)
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"
    events = sse_events(payload)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    finished = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finished) == 1 and finished[0]["choices"][0]["finish_reason"] in ("stop", "length")
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert chunks.index(finished[0]) == len(chunks) - 2  # usage comes after the finish chunk
    if path.endswith("chat/completions"):
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    else:
        assert chunks[0]["object"] == "text_completion"


@pytest.mark.slow
def test_invalid_streaming_request_is_refused_before_any_event(shared_server: Server) -> None:
    request = {"model": "out", "prompt": "def", "stream": True, "temperature": "hot"}
    status, headers, payload = call(shared_server.url, "POST", "/v1/completions", request)
    assert status == 400 and headers["content-type"] == "application/json"
    assert_error_shape(payload, "temperature")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("raw", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"model": "out"}', 400, "prompt"),
        (b'{"model": "out", "prompt": ["a", "b"]}', 400, "prompt"),
        (b'{"model": "out", "prompt": [99999]}', 400, "prompt"),
        (b'{"model": 3, "prompt": "a"}', 400, "model"),
        (b'{"model": "nope", "prompt": "a"}', 404, "model"),
        (b'{"model": "out", "prompt": "a", "presence_penalty": 0.5}', 400, "presence_penalty"),
        (b'{"model": "out", "prompt": "a\\ud800b"}', 400, None),
    ],
)
def test_error_shapes(shared_server: Server, raw: bytes, status: int, param: str | None) -> None:
    got, headers, payload = call(shared_server.url, "POST", "/v1/completions", raw=raw)
    assert got == status and headers["content-type"] == "application/json"
    error = assert_error_shape(payload, param)
    assert error["type"] == "invalid_request_error"


def _nested_schema(depth: int) -> bytes:
    """A schema nested `depth` objects deep, as text: json.dumps itself would recurse too deep."""
    return b'{"type": "object", "properties": {"a": ' * depth + b'{"type": "string"}' + b"}}" * depth


def _json_schema_body(schema: dict[str, Any] | bytes) -> bytes:
    text = schema if isinstance(schema, bytes) else json.dumps(schema).encode()
    return (
        b'{"model": "out", "prompt": "a", "max_tokens": 4, '
        b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ' + text + b"}}}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("raw", "param", "says"),
    [
        (b'{"model": "out", "prompt": "a", "user": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", None, "64 levels"),
        (b'{"model": "out", "prompt": "a", "user": ' + b"[" * 100 + b"]" * 100 + b"}", None, "64 levels"),
        (_json_schema_body(_nested_schema(5_000)), None, "64 levels"),
        (
            _json_schema_body(
                {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "a+b"} for i in range(5_000)}}
            ),
            "response_format.json_schema.schema",
            "at most 2000",
        ),
        (
            _json_schema_body({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}),
            "response_format.json_schema.schema",
            "at most 256",
        ),
        (
            _json_schema_body({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
            "response_format",
            "admits no text",
        ),
    ],
    ids=["body-10000-deep", "body-100-deep", "schema-5000-deep", "5000-patterns", "300-properties", "self-ref"],
)
def test_hostile_request_shapes_are_400s_naming_the_limit(
    shared_server: Server, raw: bytes, param: str | None, says: str
) -> None:
    """Decided when the request is parsed, before any sampling: a 400 naming the limit, never a 500."""
    got, _, payload = call(shared_server.url, "POST", "/v1/completions", raw=raw)
    assert got == 400, payload[:300]
    error = assert_error_shape(payload, param)
    assert says in error["message"]
    assert call(shared_server.url, "GET", "/health")[0] == 200  # and the server is still up


@pytest.mark.slow
def test_chat_message_errors_name_the_message(shared_server: Server) -> None:
    for messages, param in (
        ([], "messages"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0]"),
    ):
        status, _, payload = call(
            shared_server.url, "POST", "/v1/chat/completions", {"model": "out", "messages": messages}
        )
        assert status == 400
        assert_error_shape(payload, param)


@pytest.mark.slow
def test_caller_fields_and_neutral_values_are_accepted_unknown_fields_refused(shared_server: Server) -> None:
    request = {"model": "out", "prompt": "def", "max_tokens": 3, "temperature": 0, "user": "x", "logit_bias": {}}
    status, _, payload = call(shared_server.url, "POST", "/v1/completions", request)
    assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] >= 1
    status, _, payload = call(shared_server.url, "POST", "/v1/completions", request | {"max_token": 5})
    assert status == 400
    assert "max_token" in assert_error_shape(payload, "max_token")["message"]


@pytest.mark.slow
def test_routes_and_methods(shared_server: Server) -> None:
    status, _, payload = call(shared_server.url, "GET", "/v2/nothing")
    assert status == 404
    assert_error_shape(payload)
    status, headers, payload = call(shared_server.url, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    assert_error_shape(payload)
    status, _, payload = call(shared_server.url, "GET", "/health")
    assert status == 200
    status, headers, payload = call(shared_server.url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert b"# TYPE kvforge:time_to_first_token_seconds histogram" in payload
    status, _, payload = call(shared_server.url, "GET", "/openapi.json")
    assert status == 200 and json.loads(payload)["openapi"].startswith("3.")


@pytest.mark.slow
def test_keep_alive_serves_several_requests_on_one_connection(shared_server: Server) -> None:
    conn = connect(shared_server.url)
    try:
        for stream in (True, False, True):
            body = {"model": "out", "prompt": "def", "max_tokens": 3, "temperature": 0, "stream": stream}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
            assert response.status == 200
            assert (payload.endswith(b"data: [DONE]\n\n")) == stream
    finally:
        conn.close()


@pytest.fixture
def loading_server() -> Iterator[str]:
    """The HTTP side with no engine yet: what clients see while the model loads."""
    server = HttpServer("127.0.0.1", 0, State(Metrics()))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_while_loading_health_and_generation_are_503(loading_server: str) -> None:
    status, _, payload = call(loading_server, "GET", "/health")
    assert status == 503 and "loading" in assert_error_shape(payload)["message"]
    status, _, payload = call(loading_server, "GET", "/v1/models")
    assert status == 503
    status, _, payload = call(loading_server, "POST", "/v1/completions", {"model": "out", "prompt": "a"})
    assert status == 503
    assert_error_shape(payload)
    status, _, _ = call(loading_server, "GET", "/metrics")
    assert status == 200


class _FailingDecode:
    """The artifact's session, failing every decode step after the first few."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.io, self.decodes = inner, inner.io, 0

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        if feeds["input_ids"].shape[1] == 1:
            self.decodes += 1
            if self.decodes > 3:
                raise RuntimeError("injected decode failure")
        return dict(self.inner.run(feeds))


@pytest.mark.slow
def test_an_engine_failure_mid_stream_is_an_error_event_and_health_turns_503(tiny_artifact: Any) -> None:
    from kvforge.runners.engine import Engine
    from kvforge.runners.serve.scheduler import BatchScheduler

    engine = Engine.load(tiny_artifact)
    app = State(Metrics())
    scheduler = BatchScheduler(
        _FailingDecode(engine.session),
        max_positions=engine.max_positions,
        eos_ids=engine.eos_ids,
        max_num_seqs=2,
        max_queued=2,
        prefill_chunk=16,
        metrics=app.metrics,
    )
    scheduler.start()
    app.engine, app.scheduler, app.name = engine, scheduler, "out"
    server = HttpServer("127.0.0.1", 0, app)
    server.start()
    url = server.url
    try:
        request = {"model": "out", "prompt": "def", "max_tokens": 50, "temperature": 0, "stream": True}
        status, headers, payload = call(url, "POST", "/v1/completions", request)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        events = sse_events(payload)
        assert events[-1] == "[DONE]"
        assert "injected decode failure" in assert_error_shape(events[-2].encode())["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])
        status, _, payload = call(url, "GET", "/health")
        assert status == 503 and "engine failed" in assert_error_shape(payload)["message"]
        status, _, _ = call(url, "POST", "/v1/completions", request | {"stream": False})
        assert status == 503
    finally:
        server.stop()
        scheduler.stop()


# --- malformed requests, fuzzed -----------------------------------------------------------------

_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "stream", "n"]
_FIELDS += ["logprobs", "response_format", "seed", "stream_options", "ignore_eos", "user", "presence_penalty"]


def _request_bodies() -> Any:
    from hypothesis import strategies as st

    from tests.fuzzing import json_values

    values = json_values([0, -1, 2, 2**63, 1e308, "", "out", "a", True, None, [], {}, [1, 2], {"type": "json_object"}])
    fields = st.dictionaries(st.sampled_from(_FIELDS), values, max_size=6)
    bodies = st.builds(lambda f: json.dumps({"model": "out", "max_tokens": 2, **f}).encode(), fields)
    return st.one_of(bodies, st.binary(max_size=64), values.map(lambda v: json.dumps(v).encode()))


@pytest.mark.slow
def test_fuzzed_request_bodies_are_never_a_server_error(shared_server: Server) -> None:
    """Arbitrary bodies over the real field names (most invalid, some valid at 2 tokens): no 5xx, and
    every refusal has OpenAI's error shape."""
    from hypothesis import HealthCheck, given, settings

    @given(raw=_request_bodies())
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(raw: bytes) -> None:
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, _, payload = call(shared_server.url, "POST", path, raw=raw)
            assert status < 500, (raw[:200], payload[:300])
            if status >= 400:
                assert_error_shape(payload)

    check()
    assert call(shared_server.url, "GET", "/health")[0] == 200


# --- /tokenize and /detokenize ------------------------------------------------------------------


@pytest.mark.slow
def test_tokenize_and_detokenize_match_the_engine(shared_server: Server, tiny_artifact: Any) -> None:
    from kvforge.runners.engine import Engine

    engine = Engine.load(tiny_artifact)
    text = "def fibonacci(n):"
    status, _, payload = call(shared_server.url, "POST", "/tokenize", {"model": "out", "prompt": text})
    assert status == 200
    body = json.loads(payload)
    assert body["tokens"] == engine.tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.max_positions and body["token_strs"] is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    status, _, payload = call(shared_server.url, "POST", "/tokenize", {"messages": messages})
    assert status == 200 and json.loads(payload)["tokens"] == engine.encode_chat(messages)
    status, _, payload = call(shared_server.url, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    strs = json.loads(payload)["token_strs"]
    assert status == 200 and "".join(strs).replace("Ġ", " ").replace("▁", " ").strip().endswith("(n):")
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    status, _, payload = call(shared_server.url, "POST", "/detokenize", {"model": "out", "tokens": ids})
    assert status == 200 and json.loads(payload) == {"prompt": engine.tokenizer.decode(ids)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"messages": [{"content": "a"}]}, 400, "messages[0].role"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [99999]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "skip": True}, 400, "skip"),
    ],
)
def test_tokenize_errors_name_the_field(
    shared_server: Server, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    got, headers, payload = call(shared_server.url, "POST", path, body)
    assert got == status and headers["content-type"] == "application/json"
    assert_error_shape(payload, param)


def test_tokenize_while_loading_is_503(loading_server: str) -> None:
    status, _, payload = call(loading_server, "POST", "/tokenize", {"prompt": "a"})
    assert status == 503 and "loading" in assert_error_shape(payload)["message"]


def test_a_body_past_the_limit_is_413_whether_its_length_is_declared_or_not(loading_server: str) -> None:
    from kvforge.runners.serve.app import MAX_BODY_BYTES

    conn = connect(loading_server)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 413 and "Content-Length" in assert_error_shape(response.read())["message"]
    finally:
        conn.close()
    conn = connect(loading_server)
    try:  # chunked, no Content-Length: counted as it arrives
        chunks = iter([b"x" * (1 << 20)] * 9)
        conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413 and "exceeds" in assert_error_shape(response.read())["message"]
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the whole body was sent
    finally:
        conn.close()


# --- operations: the access log, client resets -------------------------------------------------


@pytest.mark.slow
def test_each_request_logs_one_line_and_a_reset_mid_stream_logs_no_traceback(launch: Any, tiny_artifact: Any) -> None:
    import socket
    import struct
    import time

    server = launch(tiny_artifact)
    body = {"model": "out", "prompt": "def", "max_tokens": 5, "temperature": 0, "stream": True}
    assert call(server.url, "POST", "/v1/completions", body)[0] == 200
    parts = urlsplit(server.url)
    assert parts.hostname is not None and parts.port is not None
    for _ in range(3):  # read a little of a long stream, then reset the connection (RST, not FIN)
        sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S)
        data = json.dumps(body | {"max_tokens": 200}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
        sock.sendall(head.encode() + data)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    assert call(server.url, "GET", "/health")[0] == 200
    deadline = time.monotonic() + TIMEOUT_S
    while server.stderr().count("POST /v1/completions") < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = server.stderr()
    assert "Traceback" not in log and "Error" not in log, log
    lines = [line for line in log.splitlines() if "POST /v1/completions 200" in line]
    assert len(lines) == 4, log
    assert "prompt_tokens=" in lines[0] and "completion_tokens=5" in lines[0] and "ttft=0." in lines[0]
    assert "duration=" in lines[0]


@pytest.mark.slow
def test_quiet_logs_no_request(launch: Any, tiny_artifact: Any) -> None:
    server = launch(tiny_artifact, "--quiet")
    assert call(server.url, "GET", "/health")[0] == 200
    assert "GET /health" not in server.stderr()
