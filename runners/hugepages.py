"""Back the memory a session allocates for its weights with 2 MiB pages (Linux).

Decode streams every weight once per step. onnxruntime copies the weights it prepacks into
memory of its own, which glibc maps in 4 KiB pages: a 125M fp32 model is then about 100,000
pages per step, the hardware prefetchers stop at every page boundary, and the TLB misses
on each. NumPy already asks for huge pages for its large arrays (the KV cache, and the copy
`kvforge bench` measures bandwidth with); this module does the same for the memory
onnxruntime mapped while a session was created. On the 125M reference it put 382 MiB of
weights in huge pages for 0.3 to 0.9 s more at load, and decode steps took about 8% less
time at batch 1 and at batch 8 (docs/performance.md).

Only memory mapped while the block ran is advised: whatever the process held before, the
caller's own memory included, is left as it is. Elsewhere than Linux, on a kernel without
`MADV_COLLAPSE` (before 6.1) or with transparent huge pages disabled, nothing changes but
speed: every call here is advice the kernel may refuse.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux 6.1: collapse into huge pages now, not when khugepaged gets to it
_MAPS = Path("/proc/self/maps")

Range = tuple[int, int]


@contextmanager
def huge_pages_for_new_memory(report: list[int] | None = None) -> Iterator[None]:
    """Advise huge pages for the anonymous memory mapped while the block runs.

    `report`, when given, receives the bytes advised (whole huge pages only)."""
    before = _anonymous_ranges()
    yield
    advised = 0
    if before is not None:
        after = _anonymous_ranges() or []
        for start, end in _subtract(after, before):
            advised += _advise(start, end)
    if report is not None:
        report.append(advised)


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


def _advise(start: int, end: int) -> int:
    """Advise huge pages for the whole huge pages inside [start, end); the bytes advised."""
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if last <= first:
        return 0
    madvise = _madvise()
    if madvise is None or madvise(first, last - first, _MADV_HUGEPAGE) != 0:
        return 0
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
