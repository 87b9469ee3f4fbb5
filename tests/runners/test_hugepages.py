"""Huge pages for the memory a session maps while loading, and only for that memory."""

from __future__ import annotations

import ctypes
import itertools
import mmap
import sys
import time
from pathlib import Path

import pytest

from kvforge.runners.hugepages import HUGE_PAGE, _subtract, huge_pages_for_new_memory


def _pages(ranges: list[tuple[int, int]]) -> set[int]:
    return {p for start, end in ranges for p in range(start, end)}


@pytest.mark.parametrize("taken", [[], [(0, 3)], [(2, 5)], [(4, 6), (8, 9)], [(0, 12)], [(1, 2), (3, 4), (9, 11)]])
def test_subtract_keeps_exactly_the_parts_outside_what_was_taken(taken: list[tuple[int, int]]) -> None:
    for ranges in ([(0, 10)], [(0, 4), (6, 12)], [(3, 7)]):
        got = _subtract(ranges, taken)
        assert _pages(got) == _pages(ranges) - _pages(taken)
        assert all(start < end for start, end in got)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(got))  # disjoint, in order


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding `address` (`hg`: huge pages advised)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(x, 16) for x in first.split("-"))
            inside = start <= address < end
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _anonymous(size: int) -> tuple[mmap.mmap, int]:
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.write(b"\1" * size)  # touched, as loaded weights are
    return memory, ctypes.addressof(ctypes.c_char.from_buffer(memory))


def _transparent_huge_pages() -> bool:
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return sys.platform.startswith("linux") and setting.exists() and "[never]" not in setting.read_text()


@pytest.mark.skipif(not _transparent_huge_pages(), reason="no transparent huge pages here (Linux, not disabled)")
def test_memory_mapped_inside_the_block_is_advised_and_older_memory_is_not() -> None:
    size = 8 * HUGE_PAGE
    older, older_address = _anonymous(size)
    report: list[int] = []
    with huge_pages_for_new_memory(report):
        newer, newer_address = _anonymous(size)
    # the kernel may place the new mapping next to the old one and merge them: only new pages count
    assert report[0] >= 6 * HUGE_PAGE
    assert "hg" in _vm_flags(newer_address + size // 2)
    assert "hg" not in _vm_flags(older_address + size // 2)
    older.close()
    newer.close()


@pytest.mark.skipif(not _transparent_huge_pages(), reason="no transparent huge pages here (Linux, not disabled)")
def test_memory_mapped_inside_the_block_is_advised_before_the_block_ends() -> None:
    """What onnxruntime has not written yet when the watcher sees its mapping faults in as huge pages:
    the advice comes while the block runs, not only at its end."""
    size = 8 * HUGE_PAGE
    with huge_pages_for_new_memory(poll_s=0.001):
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        for _ in range(10_000):  # up to 10 s on a loaded machine; a few milliseconds as a rule
            if "hg" in _vm_flags(address + size // 2):
                break
            time.sleep(0.001)
        assert "hg" in _vm_flags(address + size // 2)
    memory.close()
