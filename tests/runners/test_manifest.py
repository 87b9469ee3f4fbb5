"""Checking an artifact's files against its manifest: the listing first, then the hashes in threads."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

import runners.manifest as manifest_module
from runners.errors import ArtifactError
from runners.manifest import MANIFEST, FileHashes, listed_files, verify_files


def _artifact(directory: Path, contents: dict[str, bytes]) -> dict[str, str]:
    directory.mkdir(exist_ok=True)
    for name, content in contents.items():
        (directory / name).write_bytes(content)
    (directory / MANIFEST).write_text("{}")
    return {name: hashlib.sha256(content).hexdigest() for name, content in contents.items()}


def test_every_failing_file_is_reported_as_the_first_in_name_order(tmp_path: Path) -> None:
    files = _artifact(tmp_path, {"a.bin": b"a", "b.bin": b"b" * 100_000, "c.bin": b"c"})
    assert FileHashes(tmp_path, files).failure() is None
    wrong = {**files, "b.bin": files["a.bin"], "c.bin": files["a.bin"]}
    for workers in (1, 2, 3):
        with pytest.raises(ArtifactError, match=r"b\.bin: sha256 does not match manifest\.json"):
            FileHashes(tmp_path, wrong, workers=workers).wait()
    with pytest.raises(ArtifactError, match=r"b\.bin: sha256 does not match"):
        verify_files(tmp_path, {"files": wrong})


def test_hashes_run_beside_the_caller_until_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _artifact(tmp_path, {"a.bin": b"a"})
    release = threading.Event()
    sha256_file = manifest_module.sha256_file

    def held(path: Path) -> str:
        assert release.wait(timeout=60)
        return sha256_file(path)

    monkeypatch.setattr(manifest_module, "sha256_file", held)
    hashes = FileHashes(tmp_path, files)  # returns while the hash is held
    release.set()
    hashes.wait()


def test_the_listing_is_checked_before_any_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _artifact(tmp_path, {"a.bin": b"a", "b.bin": b"b"})
    monkeypatch.setattr(manifest_module, "sha256_file", lambda path: pytest.fail(f"{path} was read"))
    (tmp_path / "b.bin").unlink()
    with pytest.raises(ArtifactError, match=r"b\.bin: listed in manifest\.json but missing"):
        listed_files(tmp_path, {"files": files})
    (tmp_path / "b.bin").write_bytes(b"b")
    (tmp_path / "extra.bin").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"extra\.bin: not listed in manifest\.json"):
        verify_files(tmp_path, {"files": files})
    (tmp_path / "extra.bin").unlink()
    assert listed_files(tmp_path, {"files": files}) == files
