"""The lowering cache: a rebuild of the same model reads its lowered cut-down graph back
instead of tracing, and builds the same bytes; anything the trace reads changes the key; an
entry that does not fit, or that the gate refuses, is never used again."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from kvforge.runners.contract import DecoderIO
from kvforge.toolchain import build as build_module
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain import lowering_cache, stamp
from kvforge.toolchain.build import BuildOptions, build, read_spec
from kvforge.toolchain.export import eager_model
from tests.tiny import make_checkpoint


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt-llama4"), "llama", num_hidden_layers=4)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "lowered"
    monkeypatch.setenv(lowering_cache.ENV, str(directory))
    return directory


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.onnx")) if directory.is_dir() else []


def _tree_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("traced although the lowering cache holds the graph")

    monkeypatch.setattr(stamp, "export_decoder", refuse)
    monkeypatch.setattr(stamp, "to_onnx", refuse)


def test_a_rebuild_reads_the_lowered_layers_back_and_builds_the_same_bytes(
    llama4: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = build(llama4, tmp_path / "a")
    assert first.lowering is not None and first.lowering.stamped and not first.lowering.cached
    (entry,) = _entries(cache)
    assert entry.stat().st_size < 200_000  # the graph without its weights
    _no_tracing(monkeypatch)
    again = build(llama4, tmp_path / "b")
    assert again.lowering is not None and again.lowering.cached and again.parity.passed
    assert "their graph from the lowering cache" in again.lowering.summary()
    assert _tree_hashes(tmp_path / "a") == _tree_hashes(tmp_path / "b")
    # the weights come from the checkpoint being built, not from the entry: other values, the same key
    other = make_checkpoint(tmp_path / "other", "llama", num_hidden_layers=4, seed=7)
    rebuilt = build(other, tmp_path / "c")
    assert rebuilt.lowering is not None and rebuilt.lowering.cached and rebuilt.parity.passed
    assert _tree_hashes(tmp_path / "c")["model.onnx.data"] != _tree_hashes(tmp_path / "a")["model.onnx.data"]


def test_off_keeps_nothing(llama4: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build(llama4, tmp_path / "a", BuildOptions(lowering_cache=False))
    assert _entries(cache) == []
    monkeypatch.setenv(lowering_cache.ENV, "off")
    assert lowering_cache.directory() is None
    monkeypatch.delenv(lowering_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert lowering_cache.directory() == tmp_path / "xdg" / "kvforge" / "lowered"


def _key(checkpoint: Path, dtype: torch.dtype = torch.float32) -> str:
    ckpt = checkpoints.load(checkpoint)
    spec = read_spec(ckpt)
    io = DecoderIO.for_spec(spec)
    model = eager_model(ckpt, spec, dtype)
    return stamp.cache_entry(Path("lowered"), model, stamp.plan(model, spec), spec, io).name


def test_the_key_follows_what_the_trace_reads(llama4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    same = _key(llama4)
    assert _key(llama4) == same
    assert _key(make_checkpoint(tmp_path / "seed", "llama", num_hidden_layers=4, seed=7)) == same  # values: no
    assert _key(make_checkpoint(tmp_path / "rope", "llama", num_hidden_layers=4, rope_theta=500.0)) != same
    assert _key(make_checkpoint(tmp_path / "deep", "llama", num_hidden_layers=5)) != same
    assert _key(llama4, torch.float16) != same
    monkeypatch.setattr(lowering_cache, "_source_digest", lambda: "another kvforge")
    assert _key(llama4) != same
    monkeypatch.undo()
    monkeypatch.setattr(lowering_cache.importlib.metadata, "version", lambda package: "0.0")
    assert _key(llama4) != same


def test_an_entry_that_does_not_fit_is_a_miss(
    llama4: Path, cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    build(llama4, tmp_path / "a")
    (entry,) = _entries(cache)
    ckpt = checkpoints.load(llama4)
    model = eager_model(ckpt, read_spec(ckpt))
    chosen = stamp.plan(model, read_spec(ckpt))
    with stamp.cut_down(model, chosen):
        assert lowering_cache.load(entry, model) is not None
        # a weight of another shape under the same name
        layer = model.model.layers[0].mlp.down_proj
        layer.weight = torch.nn.Parameter(torch.zeros(layer.weight.shape[0], layer.weight.shape[1] + 1))
        assert lowering_cache.load(entry, model) is None
    entry.write_bytes(entry.read_bytes()[:1000])  # cut short, as by a full disk
    with caplog.at_level(logging.WARNING):
        assert lowering_cache.load(entry, model) is None
    assert "unreadable lowering cache entry" in caplog.text
    result = build(llama4, tmp_path / "b")  # traced again, and the entry written whole again
    assert result.lowering is not None and not result.lowering.cached and result.parity.passed
    assert lowering_cache.load(entry, eager_model(ckpt, read_spec(ckpt))) is not None


@pytest.mark.slow
def test_a_cached_graph_the_gate_refuses_is_forgotten(
    llama4: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    build(llama4, tmp_path / "a")
    (entry,) = _entries(cache)
    real = stamp.torch_tensor

    def wrong(tensor: torch.Tensor, name: str) -> Any:  # every stamped weight off by half
        return real(tensor * 1.5, name)

    monkeypatch.setattr(stamp, "torch_tensor", wrong)
    result = build(llama4, tmp_path / "b")
    assert result.lowering is not None and not result.lowering.stamped
    assert result.lowering.reason == build_module._REFUSED and result.parity.passed
    assert not entry.exists()


def test_a_cache_that_cannot_be_written_is_one_warning_naming_the_variable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with caplog.at_level(logging.WARNING):
        lowering_cache.store(blocked / "entry.onnx", b"graph")  # no exception: the build goes on
    assert "cannot write the lowering cache" in caplog.text and lowering_cache.ENV in caplog.text
    assert blocked.read_text() == "not a directory" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
