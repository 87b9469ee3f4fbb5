"""The wire: SSE framing and headers, error shapes, routes, and /health while loading."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.server import App, _Server
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
    server = _Server(("127.0.0.1", 0), App(Metrics()))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


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
    app = App(Metrics())
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
    server = _Server(("127.0.0.1", 0), app)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
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
        server.shutdown()
        server.server_close()
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
