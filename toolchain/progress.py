"""Progress of a build's stages, on a terminal or as plain lines.

The build marks its stages (`stage`) and the work inside them reports what it has done
(`advance`, `count`), without knowing who listens. Nothing is shown unless a caller asks
for it with `reporting(...)`: the CLI does, with `Terminal` when stderr is a terminal (one
line redrawn in place: a spinner, a bar where the total is known, the elapsed time) and
`Lines` otherwise (a line when a stage starts and one when it ends, for CI logs). The
Python API shows nothing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:  # the checkpoint loader reports progress too, and needs no onnxruntime
    from kvforge.runners.session import Session


@dataclass
class Stage:
    name: str
    started: float
    done: int = 0
    total: int | None = None
    unit: str = ""

    def counts(self) -> str:
        if not self.unit:
            return ""
        return f"{self.done}/{self.total} {self.unit}" if self.total is not None else f"{self.done} {self.unit}"


class Reporter(Protocol):
    def start(self, stage: Stage) -> None: ...
    def update(self, stage: Stage) -> None: ...
    def end(self, stage: Stage, failed: bool) -> None: ...


_reporter: ContextVar[Reporter | None] = ContextVar("kvforge_progress_reporter", default=None)
_stage: ContextVar[Stage | None] = ContextVar("kvforge_progress_stage", default=None)


@contextmanager
def reporting(reporter: Reporter | None) -> Iterator[None]:
    """Show the stages run inside this block with `reporter` (None: show nothing)."""
    token = _reporter.set(reporter)
    try:
        yield
    finally:
        _reporter.reset(token)


def for_stream(stream: TextIO, quiet: bool = False) -> Reporter | None:
    """The reporter for `stream`: none when quiet, redrawn on a terminal, lines elsewhere."""
    if quiet:
        return None
    isatty = getattr(stream, "isatty", None)
    return Terminal(stream) if callable(isatty) and isatty() else Lines(stream)


def process_seconds() -> float | None:
    """Seconds since this process started, as Linux records it (to a clock tick); None elsewhere.
    What a command spent before its first line of its own: the interpreter, and the imports."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in ticks since boot
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_interrupted = threading.Event()


@contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C inside this block ends the work at the latest when the next stage starts.

    Python raises Ctrl-C's KeyboardInterrupt in whatever code runs in the main thread; where that is
    a callback whose exceptions Python cannot pass on (a weakref's, during an import), it prints
    "Exception ignored" and goes on as if no key was pressed. Here the signal is remembered, such a
    KeyboardInterrupt is not printed, and `stage` raises it again. Outside the main thread, or
    where SIGINT is not Python's default handler (ignored, say), nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        _interrupted.set()
        raise KeyboardInterrupt

    unraisable = sys.unraisablehook

    def on_unraisable(info: Any) -> None:
        if not issubclass(info.exc_type, KeyboardInterrupt):
            unraisable(info)

    _interrupted.clear()
    signal.signal(signal.SIGINT, on_sigint)
    sys.unraisablehook = on_unraisable
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = unraisable
        _interrupted.clear()


@contextmanager
def stage(name: str) -> Iterator[None]:
    if _interrupted.is_set():  # a Ctrl-C that Python swallowed where it was raised (see `interruptible`)
        raise KeyboardInterrupt
    reporter = _reporter.get()
    if reporter is None:
        yield
        return
    current = Stage(name, time.perf_counter())
    token = _stage.set(current)
    reporter.start(current)
    failed = True
    try:
        yield
        failed = False
    finally:
        _stage.reset(token)
        reporter.end(current, failed)


def total(n: int, unit: str) -> None:
    """The current stage will do `n` units of work."""
    if (current := _stage.get()) is not None:
        current.total, current.unit = n, unit
        _update(current)


def advance(n: int = 1) -> None:
    """The current stage did `n` more units of work."""
    if (current := _stage.get()) is not None:
        current.done += n
        _update(current)


def count(done: int, of: int | None, unit: str) -> None:
    """The current stage has done `done` of `of` units."""
    if (current := _stage.get()) is not None:
        current.done, current.total, current.unit = done, of, unit
        _update(current)


def _update(current: Stage) -> None:
    if (reporter := _reporter.get()) is not None:
        reporter.update(current)


class CountedSession:
    """A session whose runs (prefill and each decode step) count as the current stage's work."""

    def __init__(self, inner: Session, unit: str = "steps") -> None:
        self._inner = inner
        self._unit = unit
        self.io = inner.io

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        outputs = self._inner.run(feeds)
        if (current := _stage.get()) is not None:
            current.unit = self._unit
        advance()
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Lines:
    """One line as a stage starts, one as it ends; nothing in between (logs stay readable)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def start(self, stage: Stage) -> None:
        self._write(f"kvforge: {stage.name}...")

    def update(self, stage: Stage) -> None:
        pass

    def end(self, stage: Stage, failed: bool) -> None:
        counts = stage.counts()
        seconds = time.perf_counter() - stage.started
        self._write(
            f"kvforge: {stage.name} {'failed after' if failed else 'done in'} {seconds:.1f} s"
            + (f" ({counts})" if counts else "")
        )

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


class Terminal:
    """One line redrawn in place at most every `interval` seconds (a thread keeps the spinner
    turning through stages that report no counts, such as the export), then left as a
    summary when the stage ends."""

    FRAMES = "|/-\\"
    WIDTH = 24

    def __init__(self, stream: TextIO, interval: float = 0.1) -> None:
        self.stream = stream
        self.interval = interval
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._frame = 0

    def start(self, stage: Stage) -> None:
        self._stop.clear()
        self._draw(stage)
        self._thread = threading.Thread(target=self._spin, args=(stage,), daemon=True)
        self._thread.start()

    def update(self, stage: Stage) -> None:
        pass  # the thread redraws; a weight-by-weight loop never waits for the terminal

    def end(self, stage: Stage, failed: bool) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        counts = stage.counts()
        seconds = time.perf_counter() - stage.started
        status = "failed after" if failed else "done in"
        with self._lock:
            self.stream.write(f"\r\x1b[2K{stage.name} {status} {seconds:.1f} s" + (f" ({counts})" if counts else ""))
            self.stream.write("\n")
            self.stream.flush()

    def _spin(self, stage: Stage) -> None:
        while not self._stop.wait(self.interval):
            self._draw(stage)

    def _draw(self, stage: Stage) -> None:
        frame = self.FRAMES[self._frame % len(self.FRAMES)]
        self._frame += 1
        seconds = time.perf_counter() - stage.started
        parts = [frame, stage.name]
        if stage.total:
            filled = min(self.WIDTH, self.WIDTH * stage.done // stage.total)
            parts.append("[" + "#" * filled + "." * (self.WIDTH - filled) + "]")
        if counts := stage.counts():
            parts.append(counts)
        parts.append(f"{seconds:.0f}s")
        with self._lock:
            self.stream.write("\r\x1b[2K" + " ".join(parts))
            self.stream.flush()
