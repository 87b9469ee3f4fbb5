"""Continuous batching in the server: the engine core (`kvforge.runners.core`) stepped on one engine thread.

`BatchScheduler` is an `EngineCore` with a bounded queue in front of it and a thread that steps it
while requests wait or run; `submit` and `cancel` come from request threads. What a step does
(decode, speculative verify, chunked prefill, the prefix cache) is the core's, the same step
`Engine` runs inline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from kvforge.runners.core import Delta, EngineCore, Event, Failed, Finished, Request
from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.prefix_cache import PrefixCache, unsupported
from kvforge.runners.serve.protocol import ParsedRequest
from kvforge.runners.session import Session
from kvforge.runners.speculative import Speculation

__all__ = [
    "BatchScheduler",
    "Delta",
    "Event",
    "Failed",
    "Finished",
    "Overloaded",
    "Request",
    "Unavailable",
    "choice_requests",
    "poll_events",
]

logger = logging.getLogger(__name__)


class Overloaded(KvforgeError):
    """Every batch slot and queue place is taken; the client should retry later."""


class Unavailable(KvforgeError):
    """The engine is shutting down or has failed."""


def poll_events(events: queue.SimpleQueue[Event], gone: Callable[[], bool], interval: float) -> Iterator[Event]:
    """A request's events as they come, until `gone()` (the client left, the frontend cancelled),
    which is asked at least every `interval` seconds, events or not; then it ends. The caller stops
    reading when the request has ended, and otherwise treats the end as the client's leaving."""
    checked = time.monotonic()
    while True:
        try:
            event: Event | None = events.get(timeout=interval)
        except queue.Empty:
            event = None
        now = time.monotonic()
        if event is None or now - checked >= interval:
            checked = now
            if gone():
                return
        if event is not None:
            yield event


def choice_requests(engine: Engine, parsed: ParsedRequest, arrival: float) -> list[Request]:
    """The engine requests of one checked API request: one per choice, sharing one event queue,
    choice i seeded with seed + i (unseeded choices draw independently). A bad stop string
    raises the detokenizer's KvforgeError."""
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    requests = []
    for index in range(parsed.n):
        params = (
            parsed.params if parsed.params.seed is None else replace(parsed.params, seed=parsed.params.seed + index)
        )
        requests.append(
            Request(
                parsed.ids,
                params,
                parsed.budget,
                engine.tokenizer.detokenizer(parsed.stop, context_ids=parsed.ids),
                events=events,
                arrival=arrival,
                eos_ids=engine.eos_ids,
                ignore_eos=parsed.ignore_eos,
                decoder=engine.decoder(params, parsed.ids, parsed.grammar, parsed.logprobs),
                index=index,
            )
        )
    return requests


class BatchScheduler(EngineCore):
    """The engine core on its engine thread, behind a bounded queue; `submit` and `cancel` are thread-safe."""

    def __init__(
        self,
        session: Session,
        *,
        max_positions: int,
        eos_ids: Sequence[int],
        max_num_seqs: int,
        max_queued: int,
        prefill_chunk: int,
        metrics: Metrics,
        prefix_cache: PrefixCache | None = None,
        speculation: Speculation | None = None,
        speculative_rows: int = 1,
    ) -> None:
        reason = None if prefix_cache is None else unsupported(session.io)
        if reason is not None:
            raise KvforgeError(f"this artifact cannot have a prefix cache: {reason}; run without one")
        super().__init__(
            session,
            max_positions=max_positions,
            eos_ids=eos_ids,
            max_num_seqs=max_num_seqs,
            prefill_chunk=prefill_chunk,
            metrics=metrics,
            prefix_cache=prefix_cache,
            speculation=speculation,
            speculative_rows=speculative_rows,
        )
        self.max_queued = max_queued
        self.failure: str | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)

    # -- called from request threads ---------------------------------------------------

    @classmethod
    def for_engine(cls, engine: Engine, **settings: Any) -> BatchScheduler:
        """A scheduler over a loaded engine's session, with its context and end-of-text ids; `settings`
        are `__init__`'s other keywords."""
        return cls(engine.session, max_positions=engine.max_positions, eos_ids=engine.eos_ids, **settings)

    def start(self) -> None:
        self._thread.start()

    def submit(self, *requests: Request) -> None:
        """Queue requests (the choices of one, all or none), or raise Overloaded (429) /
        Unavailable (503) at once."""
        with self._cond:
            if self.failure is not None:
                raise Unavailable(f"the engine failed ({self.failure}); restart the server")
            if self._stopping:
                raise Unavailable("the server is shutting down; retry on another instance")
            if self._in_system + len(requests) > self.max_num_seqs + self.max_queued:
                raise Overloaded(
                    f"server at capacity: {self.max_num_seqs} requests running (--max-num-seqs) and "
                    f"{self.max_queued} waiting (--max-queued); retry later"
                )
            self.add(*requests)

    def cancel(self, request: Request) -> None:
        """Abort a request: a waiting one leaves the queue now, a running one at the next step."""
        with self._cond:
            if request.released:
                return
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self.metrics.waiting.set(len(self._waiting))
                self._release(request)
                self.metrics.request_aborted.inc()
            self._cond.notify_all()

    def wait_released(self, request: Request, timeout: float) -> bool:
        """Wait until the engine has let go of `request` (finished, failed or aborted after
        `cancel`); False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: request.released, timeout)

    @property
    def in_system(self) -> int:
        return self._in_system

    @property
    def compactions(self) -> int:
        """Times the batch was shifted left over shared padding."""
        return self._batch.compactions

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is waiting or running; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_system, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step; requests still in flight fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all("the server is shutting down")

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._rows or self._prefill or self._waiting or self._stopping):
                        self._cond.wait()
                    if self._stopping:
                        return
                self.step()
        except Exception as error:  # the session itself failed: no request can go on
            logger.exception("engine step failed")
            with self._cond:
                self.failure = f"{type(error).__name__}: {error}"
            self._fail_all(f"the engine failed ({self.failure}); the server must be restarted")
