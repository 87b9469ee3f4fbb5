"""Back the memory a session allocates for its weights with 2 MiB pages (Linux).

Decode streams every weight once per step. onnxruntime copies the weights it prepacks into
memory of its own, which glibc maps in 4 KiB pages: a 125M fp32 model is then about 100,000
pages per step, the hardware prefetchers stop at every page boundary, and the TLB misses
on each. NumPy already asks for huge pages for its large arrays (the KV cache, and the copy
`kvforge bench` measures bandwidth with); this module does the same for the memory
onnxruntime mapped while a session was created (docs/performance.md has what it buys).

The advice is given while the session is created. A thread looks for new mappings every
few milliseconds and advises each as soon as it appears, so that what onnxruntime has not
written yet faults in as 2 MiB pages; at its next look it collapses the mapping into huge
pages (`MADV_COLLAPSE`), which copies only what was written in 4 KiB pages before the
advice. When the session is made, every new mapping is advised and collapsed once more,
which finds little left to do. Collapsing everything only at the end, as this module once
did, copies every prepacked byte a second time after the session is made.

Only memory mapped while the block ran is advised: whatever the process held before, the
caller's own memory included, is left as it is (memory other threads map meanwhile is
advised too). Elsewhere than Linux, on a kernel without `MADV_COLLAPSE` (before 6.1) or
with transparent huge pages disabled, nothing changes but speed: every call here is advice
the kernel may refuse.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1: collapse into huge pages now, not when khugepaged gets to it
_MAPS = Path("/proc/self/maps")

Range = tuple[int, int]


@contextmanager
def huge_pages_for_new_memory(report: list[int] | None = None, *, poll_s: float = 0.01) -> Iterator[None]:
    """Advise huge pages for the anonymous memory mapped while the block runs.

    New mappings are advised and collapsed while the block runs (looking every `poll_s`), and
    all of them once more when it ends without an error. `report`, when given, receives the
    bytes advised at the end (whole huge pages only)."""
    before = _anonymous_ranges()
    if before is None:
        yield
        if report is not None:
            report.append(0)
        return
    watcher = _Watcher(before, poll_s)
    try:
        yield
    finally:
        watcher.stop()
    advised = sum(_advise(start, end) for start, end in _subtract(_anonymous_ranges() or [], before))
    if report is not None:
        report.append(advised)


class _Watcher:
    """A thread advising huge pages for each new anonymous mapping as soon as it sees it, and
    collapsing the mapping at its next look (what was written before the advice is in 4 KiB pages)."""

    def __init__(self, before: list[Range], poll_s: float) -> None:
        self._before = before
        self._advised: set[Range] = set()
        self._collapsed: set[Range] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="kvforge-huge-pages", daemon=True)
        self._thread.start()

    def _run(self, poll_s: float) -> None:
        while not self._stopping.wait(poll_s):
            for start, end in _subtract(_anonymous_ranges() or [], self._before):
                if (start, end) not in self._advised:
                    _advise(start, end, collapse=False)
                    self._advised.add((start, end))
                elif (start, end) not in self._collapsed:
                    _advise(start, end)
                    self._collapsed.add((start, end))

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()


def _anonymous_ranges() -> list[Range] | None:
    """Writable private anonymous mappings of this process, or None where /proc says nothing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split()
        # address perms offset dev inode [path]: anonymous memory has no path
        if len(fields) == 5 and fields[1].startswith("rw") and fields[1].endswith("p"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def _subtract(ranges: list[Range], taken: list[Range]) -> list[Range]:
    """The parts of `ranges` outside every range of `taken` (the kernel merges a new
    mapping with an adjacent older one, so a new range may contain old memory)."""
    out = []
    taken = sorted(taken)
    for start, end in sorted(ranges):
        for old_start, old_end in taken:
            if old_end <= start or old_start >= end:
                continue
            if old_start > start:
                out.append((start, old_start))
            start = max(start, old_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def _advise(start: int, end: int, *, collapse: bool = True) -> int:
    """Advise huge pages for the whole huge pages inside [start, end), and collapse them into
    huge pages unless `collapse` is False; the bytes advised."""
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return 0
    madvise = _madvise()
    if madvise is None or madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        return 0
    if collapse:
        madvise(first, last - first, _MADV_COLLAPSE)  # refused on older kernels: khugepaged collapses later
    return last - first


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, looked up once."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function
