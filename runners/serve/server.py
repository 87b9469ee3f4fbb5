"""The HTTP side of `kvforge serve`: the standard library's threading HTTP server, SSE by hand.

Each connection has a thread; a generation request is checked and encoded on it, queued to
the engine thread (`BatchScheduler`), and its events are written back as they come, as
server-sent events over chunked transfer encoding, or as one JSON body. While it waits, the
thread watches its socket: a client that has gone away (EOF) has its request cancelled,
whether still queued or already running.

No web framework is used: the protocol needs a few routes, JSON, chunked writes and a
socket to watch, which `http.server` gives without another dependency.
"""

from __future__ import annotations

import hashlib
import logging
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvforge.runners.cache import full_names
from kvforge.runners.decoding import TokenLogprob
from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.openapi import openapi_schema
from kvforge.runners.serve.prefix_cache import BLOCK, PrefixCache, default_budget, unsupported
from kvforge.runners.serve.protocol import (
    ApiError,
    Choice,
    LogprobsWriter,
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
    Request,
    Unavailable,
    choice_requests,
    poll_events,
)
from kvforge.runners.speculative import parse_speculative, takes_turns

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20
# How often a waiting request thread looks at its socket for a client that went away.
_POLL_S = 0.05
_GENERATE_PATHS = {"/v1/completions": False, "/v1/chat/completions": True}


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    max_num_seqs: int = 8
    max_queued: int = 64
    prefill_chunk: int = 256
    drain_timeout: float = 30.0
    runtime: str = "auto"  # kvforge.runners.runtime: which session runs the artifact
    prefix_cache_bytes: int | None = None  # None: a quarter of the memory available; 0: no prefix cache
    speculative: str | None = None  # "prompt-lookup" or "draft:PATH" (kvforge.runners.speculative); None: off
    draft_tokens: int | None = None  # drafted per step with `speculative` (None: the default, 8)
    speculative_rows: int = 1  # verify steps while the batch holds at most this many rows

    def validate(self) -> None:
        for name in ("max_num_seqs", "prefill_chunk", "speculative_rows"):
            if getattr(self, name) < 1:
                raise KvforgeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued < 0:
            raise KvforgeError(f"max_queued must be >= 0, got {self.max_queued}")
        if not 0 <= self.port <= 65535:
            raise KvforgeError(f"port must be in [0, 65535] (0 picks a free one), got {self.port}")
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise KvforgeError(f"prefix_cache_bytes must be >= 0 (0 disables the cache), got {self.prefix_cache_bytes}")
        try:
            parse_speculative(self.speculative, self.draft_tokens)
        except KvforgeError as error:
            raise KvforgeError(f"--speculative / --draft-tokens: {error}") from error
        if self.drain_timeout < 0:
            raise KvforgeError(f"drain_timeout must be >= 0 seconds, got {self.drain_timeout}")


class App:
    """What the request threads share: the engine once loaded, metrics, and the server's state."""

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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], app: App) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.app = app
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "kvforge"
    timeout = 120  # an idle keep-alive connection is closed after this many seconds
    server: _Server
    _streaming = False  # headers of an event stream sent: errors must go in the stream

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    # -- routing ------------------------------------------------------------------------

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        app.enter()
        try:
            if path == "/health":
                reason = app.unavailable()
                if reason is None:
                    self._send_json(200, {"status": "ok"})
                else:
                    self._send_json(503, error_body(reason, "service_unavailable"))
            elif path == "/v1/models":
                if app.engine is None:
                    self._send_json(503, error_body(app.unavailable() or "loading", "service_unavailable"))
                else:
                    self._send_json(200, model_list(app.name, app.engine.max_positions, app.created))
            elif path == "/metrics":
                self._send(200, app.metrics.render().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/openapi.json":
                self._send_json(200, openapi_schema(app.name or None))
            elif path in _GENERATE_PATHS:
                self._method_not_allowed("POST")
            else:
                self._not_found(path)
        finally:
            app.leave()

    def do_POST(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        app.enter()
        try:
            raw = self._read_body()
            if raw is None:
                return
            if path not in _GENERATE_PATHS:
                if path in ("/health", "/v1/models", "/metrics", "/openapi.json"):
                    self._method_not_allowed("GET")
                else:
                    self._not_found(path)
                return
            self._streaming = False
            try:
                self._generate(raw, _GENERATE_PATHS[path])
            except ApiError as error:
                self._send_json(error.status, error.body(), error.headers)
            except Exception as error:  # a bug must cost one request, not the connection thread
                logger.exception("request failed")
                self.close_connection = True
                if not self._streaming:
                    message = f"internal error: {type(error).__name__}: {error}"
                    self._send_json(500, error_body(message, "server_error"))
        finally:
            app.leave()

    def _other_method(self) -> None:
        path = self.path.split("?", 1)[0]
        self._read_body()
        self._method_not_allowed("POST" if path in _GENERATE_PATHS else "GET")

    do_PUT = do_DELETE = do_PATCH = _other_method

    def _not_found(self, path: str) -> None:
        message = f"no route {path!r}; the API is under /v1 (see GET /openapi.json)"
        self._send_json(404, error_body(message, "invalid_request_error", None, "not_found"))

    def _method_not_allowed(self, allowed: str) -> None:
        message = f"method {self.command} is not allowed on {self.path!r}; use {allowed}"
        self._send_json(405, error_body(message, "invalid_request_error"), {"Allow": allowed})

    def _read_body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is None:
            if self.headers.get("Transfer-Encoding"):
                self.close_connection = True
                self._send_json(411, error_body("send the request body with a Content-Length", "invalid_request_error"))
                return None
            return b""
        try:
            size = int(length)
        except ValueError:
            size = -1
        if not 0 <= size <= MAX_BODY_BYTES:
            self.close_connection = True
            message = f"Content-Length {length!r} is not a size in [0, {MAX_BODY_BYTES}] bytes"
            self._send_json(413, error_body(message, "invalid_request_error"))
            return None
        return self.rfile.read(size)

    # -- generation ---------------------------------------------------------------------

    def _generate(self, raw: bytes, chat: bool) -> None:
        arrival = time.perf_counter()
        app = self.server.app
        reason = app.unavailable()
        if reason is not None:
            app.metrics.request_rejected.inc()
            raise ApiError(503, reason, type="service_unavailable")
        engine, scheduler = app.engine, app.scheduler
        assert engine is not None and scheduler is not None
        parsed = parse_request(raw, chat=chat, engine=engine, served_name=app.name)
        if parsed.n > scheduler.max_num_seqs:
            raise ApiError(
                400, f"n={parsed.n} exceeds the server's --max-num-seqs {scheduler.max_num_seqs}; ask for fewer", "n"
            )
        try:
            requests = choice_requests(engine, parsed, arrival)
        except KvforgeError as error:
            raise ApiError(400, str(error), "stop") from error
        try:
            scheduler.submit(*requests)
        except Overloaded as error:
            app.metrics.request_rejected.inc()
            raise ApiError(
                429, str(error), None, "rate_limit_exceeded", "rate_limit_error", {"Retry-After": "1"}
            ) from None
        except Unavailable as error:
            app.metrics.request_rejected.inc()
            raise ApiError(503, str(error), type="service_unavailable") from error
        reply = Reply.new(chat, app.name)
        writers = [LogprobsWriter(engine, chat) if parsed.logprobs is not None else None for _ in requests]
        if parsed.stream:
            self._stream(requests, reply, writers, parsed.include_usage)
        else:
            self._collect(requests, reply, writers)

    def _events(self, requests: list[Request]) -> Iterator[Event]:
        """The events of a request's choices until each has ended; stops early (cancelling them
        all) if the client left. A failed choice ends them all."""
        open_choices = len(requests)
        for event in poll_events(requests[0].events, self._client_gone, _POLL_S):  # shared by the choices
            yield event
            if isinstance(event, Failed):
                self._cancel(requests)
                return
            if isinstance(event, Finished):
                open_choices -= 1
                if not open_choices:
                    return
        self._abandon(requests)

    def _collect(self, requests: list[Request], reply: Reply, writers: list[LogprobsWriter | None]) -> None:
        parts: list[list[str]] = [[] for _ in requests]
        entries: list[list[TokenLogprob]] = [[] for _ in requests]
        choices: list[Choice] = []
        prompt_tokens = completion_tokens = 0
        for event in self._events(requests):
            if isinstance(event, Delta):
                parts[event.index].append(event.text)
                entries[event.index].extend(event.logprobs)
            elif isinstance(event, Finished):
                writer = writers[event.index]
                logprobs = None if writer is None else writer.render(entries[event.index])
                text = "".join(parts[event.index])
                choices.append(Choice(event.index, text, event.reason, logprobs, incomplete=event.incomplete))
                prompt_tokens = event.prompt_tokens
                completion_tokens += event.completion_tokens
                if len(choices) == len(requests):
                    choices.sort(key=lambda c: c.index)
                    self._send_json(200, reply.complete(choices, prompt_tokens, completion_tokens))
            elif isinstance(event, Failed):
                self._send_json(500, error_body(event.message, "server_error"))

    def _stream(
        self, requests: list[Request], reply: Reply, writers: list[LogprobsWriter | None], include_usage: bool
    ) -> None:
        self._streaming = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("X-Accel-Buffering", "no")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        finished = 0
        prompt_tokens = completion_tokens = 0
        try:
            if reply.chat:
                for request in requests:
                    self._sse(reply.chunk("", index=request.index, first=True, include_usage=include_usage))
            for event in self._events(requests):
                if isinstance(event, Delta):
                    writer = writers[event.index]
                    logprobs = None if writer is None else writer.render(event.logprobs)
                    self._sse(
                        reply.chunk(event.text, index=event.index, logprobs=logprobs, include_usage=include_usage)
                    )
                elif isinstance(event, Finished):
                    self._sse(
                        reply.chunk(
                            "",
                            index=event.index,
                            reason=event.reason,
                            include_usage=include_usage,
                            incomplete=event.incomplete,
                        )
                    )
                    finished += 1
                    prompt_tokens = event.prompt_tokens
                    completion_tokens += event.completion_tokens
                    if finished == len(requests):
                        if include_usage:
                            self._sse(reply.usage_chunk(prompt_tokens, completion_tokens))
                        self._sse_done()
                elif isinstance(event, Failed):
                    self._sse(error_body(event.message, "server_error"))
                    self._sse_done()
        except OSError:  # the client went away mid-stream
            self._abandon(requests)

    def _sse(self, body: Any) -> None:
        self._chunk(b"data: " + dumps(body) + b"\n\n")

    def _sse_done(self) -> None:
        self._chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _abandon(self, requests: list[Request]) -> None:
        self.close_connection = True
        self._cancel(requests)

    def _cancel(self, requests: list[Request]) -> None:
        scheduler = self.server.app.scheduler
        if scheduler is not None:
            for request in requests:
                scheduler.cancel(request)

    def _client_gone(self) -> bool:
        """True when the peer has closed its side (readable with nothing to read) or reset it."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # -- plain responses ----------------------------------------------------------------

    def _send_json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, dumps(body), "application/json", headers)

    def _send(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


def serve(
    artifact: str | Path,
    options: ServeOptions = ServeOptions(),
    announce: Callable[[str], None] = logger.info,
) -> None:
    """Serve ARTIFACT until SIGTERM or SIGINT, then drain in-flight requests and return.

    The socket listens before the model loads, so /health answers 503 while it loads.
    `announce` receives one line when listening (with the port actually bound, so port 0
    works) and one when ready.
    """
    options.validate()
    metrics = Metrics()
    app = App(metrics)
    try:
        server = _Server((options.host, options.port), app)
    except OSError as error:
        raise KvforgeError(
            f"cannot listen on {options.host}:{options.port} ({error}); choose another --host or --port"
        ) from error
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    thread.start()
    stop = threading.Event()

    def on_signal() -> None:  # in the signal handler: stop admitting at once, drain in the main loop
        app.draining = True
        stop.set()

    restore = _on_signals(on_signal)
    try:
        host, port = server.server_address[:2]
        announce(f"listening on http://{_url_host(str(host))}:{port}, loading {artifact}")
        engine = Engine.load(artifact, runtime=options.runtime, stop_spinning=takes_turns(options.speculative))
        try:
            speculation = engine.speculation(options.speculative, options.draft_tokens)
        except KvforgeError as error:
            raise KvforgeError(f"--speculative {options.speculative}: {error}") from error
        scheduler = BatchScheduler.for_engine(
            engine,
            max_num_seqs=options.max_num_seqs,
            max_queued=options.max_queued,
            prefill_chunk=options.prefill_chunk,
            metrics=metrics,
            prefix_cache=prefix_cache_for(engine, Path(artifact), options.prefix_cache_bytes, metrics, announce),
            speculation=speculation,
            speculative_rows=options.speculative_rows,
        )
        scheduler.start()
        app.name = options.served_model_name or Path(artifact).resolve().name
        metrics.model_name = app.name
        app.engine, app.scheduler = engine, scheduler
        announce(f"ready: model {app.name!r}, context {engine.max_positions}, max {options.max_num_seqs} sequences")
        while not stop.wait(0.2):
            pass
        app.draining = True
        announce(f"shutting down: draining {scheduler.in_system} requests (at most {options.drain_timeout:g}s)")
        scheduler.wait_idle(options.drain_timeout)
        scheduler.stop()
        app.wait_idle(2.0)  # let request threads write what the engine last gave them
    finally:
        restore()
        server.shutdown()
        server.server_close()


def prefix_cache_for(
    engine: Engine, artifact: Path, budget: int | None, metrics: Metrics, announce: Callable[[str], None]
) -> PrefixCache | None:
    """The server's prefix cache over ARTIFACT, keyed by its manifest's digest; None when the
    budget is 0 or the artifact's layers cannot take one (said once in the log)."""
    if budget == 0:
        return None
    io = engine.session.io
    reason = unsupported(io)
    if reason is not None:
        announce(f"prefix cache off for this artifact: {reason}")
        return None
    budget = default_budget() if budget is None else budget
    identity = hashlib.sha256((artifact / "manifest.json").read_bytes()).digest()
    names = full_names(io)
    announce(f"prefix cache: {budget / (1 << 20):.0f} MiB in blocks of {BLOCK} tokens")
    return PrefixCache(budget, identity, names, metrics)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _on_signals(handler: Callable[[], None]) -> Callable[[], None]:
    """SIGTERM and SIGINT ask for a graceful stop; returns what restores the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        signal.signal(sig, lambda *_: handler())

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
