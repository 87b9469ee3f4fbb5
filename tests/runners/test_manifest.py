"""Checking an artifact's files against its manifest: the listing first, then the hashes in threads."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

import pytest

import kvforge.runners.manifest as manifest_module
from kvforge.runners.errors import ArtifactError
from kvforge.runners.manifest import MANIFEST, FileHashes, listed_files, verify_files


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


# --- the manifest's io against the graph --------------------------------------------------------

_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)"}


def _graph_of(io: object, **changes: tuple[str, object]) -> tuple[list[tuple[str, str, list[object]]], ...]:
    """onnxruntime's view of a graph made exactly to `io` (symbolic dims as strings), with some
    tensors' (type, dims) replaced."""
    from kvforge.runners.contract import DecoderIO

    assert isinstance(io, DecoderIO)

    def view(tensors: tuple[Any, ...]) -> list[tuple[str, str, list[object]]]:
        rows = []
        for t in tensors:
            element, dims = changes.get(t.name, (_ORT_TYPES[t.dtype], list(t.dims)))
            rows.append((t.name, str(element), list(dims)))
        return rows

    return view(io.inputs), view(io.outputs)


def test_a_graph_made_to_the_contract_passes() -> None:
    from kvforge.runners.contract import DecoderIO
    from kvforge.runners.manifest import check_io_against_graph

    io = DecoderIO(num_layers=2, num_kv_heads=2, head_dim=4, vocab_size=32)
    check_io_against_graph(Path("m.onnx"), io, *_graph_of(io))


@pytest.mark.parametrize(
    ("name", "change", "expected"),
    [
        ("logits", ("tensor(float)", ["batch", "seq", 31]), r"logits is float32 \['batch', 'seq', 31\] in the graph"),
        ("past_key_values.1.value", ("tensor(float16)", ["batch", 2, "past", 4]), "is float16"),
        ("present.0.key", ("tensor(float)", ["batch", 2, "total", 8]), r"present\.0\.key is float32"),
        ("input_ids", ("tensor(int64)", ["batch", 1]), r"input_ids is int64 \['batch', 1\]"),
    ],
)
def test_a_graph_that_disagrees_with_the_manifest_is_refused(name: str, change: tuple[Any, ...], expected: str) -> None:
    from kvforge.runners.contract import DecoderIO
    from kvforge.runners.manifest import check_io_against_graph

    io = DecoderIO(num_layers=2, num_kv_heads=2, head_dim=4, vocab_size=32)
    with pytest.raises(ArtifactError, match=expected) as exc:
        check_io_against_graph(Path("m.onnx"), io, *_graph_of(io, **{name: change}))
    assert "the manifest was modified" in str(exc.value)
