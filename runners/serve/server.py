"""`kvforge serve`: the server's lifecycle around its HTTP side (`kvforge.runners.serve.app`).

The socket listens before the model loads (uvicorn on a thread of its own, so /health
answers 503 meanwhile); the main thread loads the engine, starts the engine thread
(`BatchScheduler`), and on SIGTERM or SIGINT stops admitting, drains what is in flight and
stops the HTTP side. The web framework is imported here only when a server starts: the
Triton backend reads `prefix_cache_for` without it.
"""

from __future__ import annotations

import hashlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvforge.runners.cache import full_names
from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.prefix_cache import BLOCK, PrefixCache, default_budget, unsupported
from kvforge.runners.serve.scheduler import BatchScheduler
from kvforge.runners.speculative import parse_speculative, takes_turns

if TYPE_CHECKING:
    from kvforge.runners.serve.app import State

logger = logging.getLogger(__name__)

_BACKLOG = 2048
_GRACE_S = 2  # after the drain, how long open connections get to finish before they are closed


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
    web_page: bool = True  # the chat page at GET /
    quiet: bool = False  # no access-log line per request

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


class HttpServer:
    """uvicorn serving the ASGI app (`kvforge.runners.serve.app`) on a thread of its own with its
    own event loop. It binds in the constructor (a KvforgeError names the address it could not
    take), so the port is known, and taken, before `start`."""

    def __init__(self, host: str, port: int, state: State, *, web_page: bool = True, keep_alive_s: float = 120) -> None:
        import uvicorn

        from kvforge.runners.serve.app import AccessLog, create_app

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind((host, port))
            self.socket.listen(_BACKLOG)
        except OSError as error:
            self.socket.close()
            raise KvforgeError(f"cannot listen on {host}:{port} ({error}); choose another --host or --port") from error
        self.socket.setblocking(False)
        app = AccessLog(create_app(state, web_page=web_page), state)
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_keep_alive=int(keep_alive_s),
            timeout_graceful_shutdown=_GRACE_S,
            backlog=_BACKLOG,
            server_header=False,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="kvforge-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.socket.getsockname()[:2]
        return f"http://{_url_host(str(host))}:{port}"

    def _run(self) -> None:
        self.server.run(sockets=[self.socket])  # on uvloop where it is installed

    def start(self, timeout: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise KvforgeError(f"the HTTP server did not start on {self.url}; see the log above")
            time.sleep(0.01)

    def stop(self, timeout: float = _GRACE_S + 5) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.socket.close()


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
    from kvforge.runners.serve.app import State, access_logger

    options.validate()
    if not options.quiet:
        access_logger.setLevel(logging.INFO)
    metrics = Metrics()
    state = State(metrics)
    http = HttpServer(options.host, options.port, state, web_page=options.web_page)
    http.start()
    stop = threading.Event()

    def on_signal() -> None:  # in the signal handler: stop admitting at once, drain in the main loop
        state.draining = True
        stop.set()

    restore = _on_signals(on_signal)
    try:
        announce(f"listening on {http.url}, loading {artifact}")
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
        state.name = options.served_model_name or Path(artifact).resolve().name
        metrics.model_name = state.name
        state.engine, state.scheduler = engine, scheduler
        page = f", chat page at {http.url}/" if options.web_page else ""
        announce(
            f"ready: model {state.name!r}, context {engine.max_positions} tokens, "
            f"at most {options.max_num_seqs} sequences at once{page}"
        )
        while not stop.wait(0.2):
            pass
        state.draining = True
        waiting = scheduler.in_system
        announce(
            f"shutting down: draining {waiting} request{'' if waiting == 1 else 's'} "
            f"(at most {options.drain_timeout:g}s)"
        )
        scheduler.wait_idle(options.drain_timeout)
        scheduler.stop()
        state.wait_idle(2.0)  # let the streams write what the engine last gave them
    finally:
        restore()
        http.stop()


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
    cap = budget / (1 << 20)
    announce(f"prefix cache: capped at {cap:.0f} MiB (filled as prompts are reused), blocks of {BLOCK} tokens")
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
