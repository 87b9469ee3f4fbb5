"""Hashing a build's files in a helper process gives the hashes hashing them here gives."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from kvforge.toolchain import hashing


def _files(directory: Path) -> list[Path]:
    directory.mkdir()
    contents = {"b.bin": b"\x00" * 3_000_001, "a.json": b"{}\n", "empty": b""}
    for name, data in contents.items():
        (directory / name).write_bytes(data)
    return [directory / name for name in contents]


def test_the_helper_hashes_every_file_sorted_by_name(tmp_path: Path) -> None:
    files = _files(tmp_path / "d")
    pending = hashing.Pending(files)
    result = pending.result()
    assert list(result) == ["a.json", "b.bin", "empty"]
    assert result == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    assert result == hashing.sha256_files(files)


def test_what_the_helper_has_not_done_is_hashed_by_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(tmp_path / "d")
    monkeypatch.setattr(sys, "executable", "")  # no helper can start: everything is hashed in `result`
    assert hashing.Pending(files).result() == hashing.sha256_files(files)


def test_a_stopped_helper_leaves_no_process_and_its_partial_output_is_ignored(tmp_path: Path) -> None:
    files = _files(tmp_path / "d")
    pending = hashing.Pending(files)
    helper = pending._helper
    assert helper is not None
    helper.kill()  # at any point of its work
    assert pending.result() == hashing.sha256_files(files)
    assert helper.returncode is not None
    with hashing.Pending(files) as cancelled:
        helper = cancelled._helper
    assert helper is not None and helper.returncode is not None


def test_a_file_the_helper_cannot_read_is_reported_by_the_caller(tmp_path: Path) -> None:
    files = [*_files(tmp_path / "d"), tmp_path / "d" / "missing"]
    with pytest.raises(FileNotFoundError):
        hashing.Pending(files).result()
