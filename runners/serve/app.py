"""The HTTP side of `kvforge serve`: an ASGI app (Starlette) that parses, admits and streams.

A generation request is read, checked and encoded off the event loop (a worker thread: a
hostile schema may take a while to compile), queued to the engine thread
(`BatchScheduler`), and its events come back through the loop as the engine thread puts
them (`EventQueue`). They are written as server-sent events or as one JSON body. A client
that goes away has its request cancelled, whether still queued or already running: the
framework cancels an event stream when the connection closes, and a JSON request watches
for the disconnect itself while it waits.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import importlib.resources
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from kvforge.runners.decoding import TokenLogprob
from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.openapi import openapi_schema
from kvforge.runners.serve.protocol import (
    ApiError,
    Choice,
    LogprobsWriter,
    ParsedRequest,
    Reply,
    dumps,
    error_body,
    model_list,
    parse_request,
)
from kvforge.runners.serve.scheduler import (
    BatchScheduler,
    Delta,
    Event,
    Failed,
    Finished,
    Overloaded,
    Unavailable,
    choice_requests,
)
from kvforge.runners.serve.scheduler import Request as EngineRequest
from kvforge.runners.serve.tokenize import detokenize, tokenize

logger = logging.getLogger(__name__)
access_logger = logging.getLogger(__name__.rsplit(".", 1)[0] + ".access")

MAX_BODY_BYTES = 8 << 20
_JSON = "application/json"
# A request this small without a grammar is parsed and encoded on the event loop (a fraction of a
# millisecond); a larger one, or one whose grammar must be compiled, on a worker thread.
_INLINE_BYTES = 16 << 10
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class State:
    """What the requests share: the engine once loaded, metrics, and the server's state."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.engine: Engine | None = None
        self.scheduler: BatchScheduler | None = None
        self.name = ""
        self.created = int(time.time())
        self.draining = False
        self._active = 0
        self._cond = threading.Condition()

    def unavailable(self) -> str | None:
        """Why generation requests are refused now (503), or None when ready."""
        if self.draining:
            return "the server is shutting down; retry on another instance"
        if self.scheduler is None:
            return "the model is still loading; retry when GET /health returns 200"
        if self.scheduler.failure is not None:
            return f"the engine failed ({self.scheduler.failure}); restart the server"
        return None

    def ready(self) -> tuple[Engine, BatchScheduler]:
        """The engine and scheduler, or a 503 naming why they cannot take a request now."""
        reason = self.unavailable()
        if reason is not None or self.engine is None or self.scheduler is None:
            raise ApiError(503, reason or "the model is still loading", type="service_unavailable")
        return self.engine, self.scheduler

    def enter(self) -> None:
        with self._cond:
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._active, timeout)


class EventQueue(queue.SimpleQueue[Event]):
    """A request's event queue as the engine thread sees it (`put`), read on the event loop
    (`next`). A put wakes the loop only when no wake-up is pending already, so the events of
    several steps that come before the reader runs cost one wake-up, and go out in one write."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._wake_pending = False
        self._closed = False

    def put(self, item: Event, block: bool = True, timeout: float | None = None) -> None:
        self._items.append(item)
        if self._wake_pending:  # the reader has yet to run, and will see this event too
            return
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop has closed: the server is gone and nobody reads
            pass

    def _wake(self) -> None:
        self._wake_pending = False  # first: an event put from now on asks for a wake-up of its own
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        """On the loop: the reader's client has gone; `next` returns None from now on."""
        self._closed = True
        self._wake()

    async def next(self) -> Event | None:
        """The next event, or None once closed."""
        while not self._items and not self._closed:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return None if self._closed else self._items.popleft()

    def ready(self) -> bool:
        """Whether an event is waiting to be read."""
        return bool(self._items)


@dataclass
class Record:
    """What the access log says of a request beyond its method, path and status."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_s: float | None = None
    began: float = field(default_factory=time.perf_counter)

    def first_token(self) -> None:
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.began

    def line(self, method: str, path: str, client: str, status: int | str) -> str:
        def count(value: int | None) -> str:
            return "-" if value is None else str(value)

        ttft = "-" if self.first_token_s is None else f"{self.first_token_s:.3f}s"
        return (
            f"{client} {method} {path} {status} prompt_tokens={count(self.prompt_tokens)} "
            f"completion_tokens={count(self.completion_tokens)} ttft={ttft} "
            f"duration={time.perf_counter() - self.began:.3f}s"
        )


def record_of(request: Request) -> Record:
    record = request.scope.get("state", {}).get("record")
    return record if isinstance(record, Record) else Record()


class AccessLog:
    """Outermost: one log line per request; a client's reset or broken pipe is a debug line,
    never a traceback; the request counts as active until its response is written."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], state: State) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        record = Record()
        scope.setdefault("state", {})["record"] = record
        status: int | str = "-"

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "websocket.accept":
                status = 101
            await send(message)

        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else "-"
        self.state.enter()
        try:
            await self.app(scope, receive, sending)
        except (OSError, ClientDisconnect) as error:
            status = "client-gone"
            logger.debug("%s went away: %s", peer, type(error).__name__)
        except Exception:  # a bug costs one request; answered 500 if nothing was sent yet
            logger.exception("request failed: %s %s", scope.get("method", "WS"), scope.get("path", ""))
        finally:
            self.state.leave()
            if access_logger.isEnabledFor(logging.INFO):
                line = record.line(scope.get("method", "WS"), scope.get("path", ""), peer, status)
                access_logger.info("%s", line)


# -- plain routes -----------------------------------------------------------------------


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(body), status, headers, media_type=_JSON)


def _state(request: Request) -> State:
    state: State = request.app.state.server
    return state


async def health(request: Request) -> Response:
    reason = _state(request).unavailable()
    if reason is None:
        return json_response(200, {"status": "ok"})
    return json_response(503, error_body(reason, "service_unavailable"))


async def models(request: Request) -> Response:
    state = _state(request)
    if state.engine is None:
        return json_response(503, error_body(state.unavailable() or "loading", "service_unavailable"))
    return json_response(200, model_list(state.name, state.engine.max_positions, state.created))


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), 200, media_type=METRICS_CONTENT_TYPE)


async def openapi(request: Request) -> Response:
    return json_response(200, openapi_schema(_state(request).name or None))


# The page may talk to this server and nothing else: inline script and style, no other origin.
_PAGE_POLICY = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
    "img-src data:; base-uri 'none'; form-action 'none'"
)


@functools.cache
def _page() -> bytes:
    return importlib.resources.files(__package__).joinpath("chat.html").read_bytes()


async def chat_page(request: Request) -> Response:
    """The chat page: one self-contained file that streams replies through /v1/chat/completions."""
    headers = {"Content-Security-Policy": _PAGE_POLICY, "Cache-Control": "no-cache"}
    return Response(_page(), 200, headers, media_type="text/html; charset=utf-8")


async def read_body(request: Request) -> bytes:
    """The request's body, refused (413) past MAX_BODY_BYTES, whether its length is declared or not."""
    length = request.headers.get("content-length")
    if length is not None and not (length.isdigit() and int(length) <= MAX_BODY_BYTES):
        message = f"Content-Length {length!r} is not a size in [0, {MAX_BODY_BYTES}] bytes"
        raise ApiError(413, message, headers={"Connection": "close"})
    parts: list[bytes] = []
    size = 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            message = f"the request body exceeds {MAX_BODY_BYTES} bytes; send a smaller one"
            raise ApiError(413, message, headers={"Connection": "close"})
        parts.append(part)
    return b"".join(parts)


async def tokenize_route(request: Request) -> Response:
    raw = await read_body(request)
    engine, _ = _state(request).ready()
    body = await run_in_threadpool(tokenize, raw, engine, _state(request).name)
    return json_response(200, body)


async def detokenize_route(request: Request) -> Response:
    raw = await read_body(request)
    engine, _ = _state(request).ready()
    body = await run_in_threadpool(detokenize, raw, engine, _state(request).name)
    return json_response(200, body)


# -- generation -------------------------------------------------------------------------


@dataclass
class Admitted:
    """A generation request checked, encoded and queued: its choices and where their events come."""

    parsed: ParsedRequest
    requests: list[EngineRequest]
    events: EventQueue
    scheduler: BatchScheduler
    reply: Reply
    writers: list[LogprobsWriter | None]
    ended: set[int] = field(default_factory=set)  # the choices whose last event has been read

    def cancel(self) -> None:
        """Cancel the choices that have not ended (all of them after a failure)."""
        for request in self.requests:
            if request.index not in self.ended:
                self.scheduler.cancel(request)


def _prepare(state: State, raw: bytes, chat: bool, arrival: float) -> tuple[ParsedRequest, list[EngineRequest]]:
    """Parse and encode (on a worker thread): the checked request and its engine requests."""
    engine, scheduler = state.ready()
    parsed = parse_request(raw, chat=chat, engine=engine, served_name=state.name)
    if parsed.n > scheduler.max_num_seqs:
        raise ApiError(
            400, f"n={parsed.n} exceeds the server's --max-num-seqs {scheduler.max_num_seqs}; ask for fewer", "n"
        )
    try:
        return parsed, choice_requests(engine, parsed, arrival)
    except KvforgeError as error:
        raise ApiError(400, str(error), "stop") from error


async def admit(state: State, raw: bytes, chat: bool, arrival: float) -> Admitted:
    """Check, encode and queue a generation request; an ApiError (400/404/429/503) if refused."""
    state.ready()
    if len(raw) <= _INLINE_BYTES and b"response_format" not in raw:
        parsed, requests = _prepare(state, raw, chat, arrival)  # a hop to a thread costs more than this
    else:
        parsed, requests = await run_in_threadpool(_prepare, state, raw, chat, arrival)
    engine, scheduler = state.ready()
    events = EventQueue(asyncio.get_running_loop())
    for request in requests:
        request.events = events
    try:
        scheduler.submit(*requests)
    except Overloaded as error:
        state.metrics.request_rejected.inc()
        raise ApiError(429, str(error), None, "rate_limit_exceeded", "rate_limit_error", {"Retry-After": "1"}) from None
    except Unavailable as error:
        raise ApiError(503, str(error), type="service_unavailable") from error
    writers = [LogprobsWriter(engine, chat) if parsed.logprobs is not None else None for _ in requests]
    return Admitted(parsed, requests, events, scheduler, Reply.new(chat, state.name), writers)


def note(admitted: Admitted, record: Record, event: Event) -> None:
    """What an event read tells the access log and which choices have ended."""
    if isinstance(event, Delta):
        record.first_token()
    elif isinstance(event, Finished):
        admitted.ended.add(event.index)
        record.prompt_tokens = event.prompt_tokens
        record.completion_tokens = (record.completion_tokens or 0) + event.completion_tokens


async def generation_events(admitted: Admitted, record: Record) -> AsyncIterator[Event]:
    """The events of a request's choices until each has ended (a failed choice ends them all);
    a reader that stops early (its client left) cancels the choices still running."""
    try:
        while len(admitted.ended) < len(admitted.requests):
            event = await admitted.events.next()
            if event is None:
                return
            note(admitted, record, event)
            yield event
            if isinstance(event, Failed):
                return
    finally:
        admitted.cancel()


async def generate(request: Request) -> Response:
    arrival = time.perf_counter()
    chat = request.url.path == "/v1/chat/completions"
    state = _state(request)
    raw = await read_body(request)
    record = record_of(request)
    try:
        admitted = await admit(state, raw, chat, arrival)
    except ApiError as error:
        if error.status == 503:
            state.metrics.request_rejected.inc()
        raise
    record.prompt_tokens = len(admitted.parsed.ids)
    if admitted.parsed.stream:
        return EventStream(admitted, record)
    return await collect(request, admitted, record)


async def collect(request: Request, admitted: Admitted, record: Record) -> Response:
    """The whole reply as one JSON body; the request is cancelled if the client leaves first."""
    response: Response = Response(status_code=499)  # what the log says if the client left
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await disconnected(request.receive)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        response = await _gather(admitted, record)
        group.cancel_scope.cancel()
    return response


async def disconnected(receive: Receive, gone: str = "http.disconnect") -> None:
    """Returns once the client has gone (a message of type `gone`; the body read, or the
    WebSocket's request received, nothing else is expected from it)."""
    while (await receive())["type"] != gone:
        pass


async def _gather(admitted: Admitted, record: Record) -> Response:
    size = len(admitted.requests)
    parts: list[list[str]] = [[] for _ in range(size)]
    entries: list[list[TokenLogprob]] = [[] for _ in range(size)]
    choices: list[Choice] = []
    async for event in generation_events(admitted, record):
        if isinstance(event, Delta):
            parts[event.index].append(event.text)
            entries[event.index].extend(event.logprobs)
        elif isinstance(event, Finished):
            writer = admitted.writers[event.index]
            logprobs = None if writer is None else writer.render(entries[event.index])
            text = "".join(parts[event.index])
            choices.append(Choice(event.index, text, event.reason, logprobs, incomplete=event.incomplete))
        elif isinstance(event, Failed):
            return json_response(500, error_body(event.message, "server_error"))
    choices.sort(key=lambda c: c.index)
    prompt, completion = record.prompt_tokens or 0, record.completion_tokens or 0
    return json_response(200, admitted.reply.complete(choices, prompt, completion))


def stream_chunks(admitted: Admitted, event: Event) -> list[Any]:
    """The stream's messages for one event (shared by SSE and the WebSocket)."""
    reply, usage = admitted.reply, admitted.parsed.include_usage
    if isinstance(event, Delta):
        writer = admitted.writers[event.index]
        logprobs = None if writer is None else writer.render(event.logprobs)
        return [reply.chunk(event.text, index=event.index, logprobs=logprobs, include_usage=usage)]
    if isinstance(event, Finished):
        return [
            reply.chunk("", index=event.index, reason=event.reason, include_usage=usage, incomplete=event.incomplete)
        ]
    return [error_body(event.message, "server_error")]


async def stream_messages(admitted: Admitted, record: Record) -> AsyncIterator[list[Any]]:
    """The JSON messages of a streamed reply, in batches (the messages of the events waiting when
    one is read): a role chunk per choice (chat), a chunk per event, then the usage (when asked
    for); an engine failure ends it with an error. A reader that stops early (its client left)
    cancels the choices still running."""
    reply, usage, events = admitted.reply, admitted.parsed.include_usage, admitted.events
    batch = [reply.chunk("", index=r.index, first=True, include_usage=usage) for r in admitted.requests]
    if not reply.chat:
        batch = []
    failed = False
    try:
        while len(admitted.ended) < len(admitted.requests) and not failed:
            if batch and not events.ready():
                yield batch
                batch = []
            event = await events.next()
            if event is None:  # the client has gone
                return
            note(admitted, record, event)
            batch.extend(stream_chunks(admitted, event))
            failed = isinstance(event, Failed)
        if usage and not failed:
            batch.append(reply.usage_chunk(record.prompt_tokens or 0, record.completion_tokens or 0))
        yield batch
    finally:
        admitted.cancel()


class EventStream(Response):
    """A streamed reply as server-sent events, written straight to the ASGI server, a batch of
    messages per write. A client that leaves (seen on `receive`) closes the event queue, which
    ends the stream and cancels the request."""

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, admitted: Admitted, record: Record) -> None:
        self.admitted, self.record = admitted, record
        self.status_code = 200
        self.background = None
        self.init_headers(_SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = asyncio.ensure_future(self._watch(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for batch in stream_messages(self.admitted, self.record):
                body = b"".join(b"data: " + dumps(message) + b"\n\n" for message in batch)
                await send({"type": "http.response.body", "body": body, "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
        finally:
            watch.cancel()
            self.admitted.cancel()  # the choices still running, where the client left mid-write

    async def _watch(self, receive: Receive) -> None:
        await disconnected(receive)
        self.admitted.events.close()


# -- the WebSocket ----------------------------------------------------------------------


async def generate_websocket(websocket: WebSocket) -> None:
    """A generation over a WebSocket at the same paths: the client sends the request's JSON body
    as one message, and gets the SSE stream's events, one JSON message each (no [DONE]: the
    server closes with 1000 after the last). A refused request gets its error body, then a close
    with code 4000 + the HTTP status. A client that leaves cancels its request."""
    chat = websocket.url.path == "/v1/chat/completions"
    state: State = websocket.app.state.server
    record = websocket.scope.get("state", {}).get("record") or Record()
    await websocket.accept()
    try:
        message = await websocket.receive()
    except WebSocketDisconnect:
        return
    if message["type"] == "websocket.disconnect":
        return
    arrival = time.perf_counter()
    raw = message.get("bytes") or (message.get("text") or "").encode("utf-8", "surrogatepass")
    try:
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request message exceeds {MAX_BODY_BYTES} bytes; send a smaller one")
        admitted = await admit(state, raw, chat, arrival)
    except ApiError as error:
        if error.status == 503:
            state.metrics.request_rejected.inc()
        await websocket.send_text(dumps(error.body()).decode())
        await websocket.close(4000 + error.status)
        return
    record.prompt_tokens = len(admitted.parsed.ids)
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await disconnected(websocket.receive, "websocket.disconnect")
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            async for batch in stream_messages(admitted, record):
                for message in batch:
                    await websocket.send_text(dumps(message).decode())
            await websocket.close(1000)
        finally:
            admitted.cancel()  # what has ended is left as it is; a choice still running is cancelled
            group.cancel_scope.cancel()


# -- errors -----------------------------------------------------------------------------


async def api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    return json_response(error.status, error.body(), error.headers)


async def http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    if error.status_code == 405:
        allowed = ", ".join(sorted(m for m in (error.headers or {}).get("Allow", "").split(", ") if m != "HEAD"))
        message = f"method {request.method} is not allowed on {request.url.path!r}; use {allowed}"
        return json_response(405, error_body(message, "invalid_request_error"), {"Allow": allowed})
    if error.status_code == 404:
        message = f"no route {request.url.path!r}; the API is under /v1 (see GET /openapi.json)"
        return json_response(404, error_body(message, "invalid_request_error", None, "not_found"))
    return json_response(error.status_code, error_body(str(error.detail), "invalid_request_error"))


async def server_error(request: Request, error: Exception) -> Response:
    """A bug costs one request, answered as a 500 in OpenAI's shape (`AccessLog` logs it)."""
    message = f"internal error: {type(error).__name__}: {error}"
    return json_response(500, error_body(message, "server_error"))


def create_app(state: State, *, web_page: bool = True) -> Starlette:
    """The routes; `web_page` adds the chat page at GET /."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
        WebSocketRoute("/v1/completions", generate_websocket),
        WebSocketRoute("/v1/chat/completions", generate_websocket),
    ]
    if web_page:
        routes.append(Route("/", chat_page, methods=["GET"]))
    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
    )
    app.state.server = state
    return app
