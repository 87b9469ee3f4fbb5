"""An on-disk cache of lowered cut-down graphs: a rebuild of the same model skips torch.export
and the torch.onnx lowering.

Tracing and lowering the cut-down model (`kvforge.toolchain.stamp`) is the largest cost of a
build that does not calibrate, and it is the same for every build of one model: the graph
depends on the modeling code, the config and the shapes of the weights, never on their
values. A stamped build keeps the lowered cut-down graph here, its weights left out (each is
a reference to the eager model's tensor of that name), and a later build whose key matches
reads it back and binds the eager model's tensors in place of tracing again. The key is a
hash of everything the trace reads: kvforge's version and own source, the versions of torch,
transformers and the ONNX packages, the config (every field), every submodule's class,
plain attributes and tensor shapes (and the values of buffers), and the cut-down model's
spec and I/O contract. The quantization, target and pass options do not enter it: they act
on the graph after lowering.

A cached graph is checked like a traced one: it is stamped (which proves its layers alike
again), and the build's parity gate compares the whole stamped graph with the eager model.
A stamped graph the gate refuses has its entry removed. An entry that cannot be read, or
whose weights do not match the model's, is a miss; files here are parsed as ONNX protobuf,
never executed.

Where: KVFORGE_LOWERING_CACHE (a directory, or `off`), else $XDG_CACHE_HOME/kvforge/lowered,
else ~/.cache/kvforge/lowered. An entry is a few hundred kilobytes (a graph without weights).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from kvforge.toolchain.lower import torch_tensor
from kvforge.toolchain.system import user_cache, write_atomically

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENV = "KVFORGE_LOWERING_CACHE"
OFF = ("off", "0", "none", "false")
# where an entry's weight points: the eager model's tensor of the initializer's name
_BOUND = "kvforge:eager-model-tensor"
# the packages whose releases can change a lowered graph (kvforge's own source is hashed besides)
_PACKAGES = ("kvforge", "torch", "transformers", "onnx", "onnx-ir", "onnxscript")
# buffers up to this size enter the key with their values (rotary tables and the like)
_BUFFER_VALUE_BYTES = 1 << 24


def directory() -> Path | None:
    """The cache's directory, or None where KVFORGE_LOWERING_CACHE turns it off."""
    chosen = os.environ.get(ENV)
    if chosen is not None:
        return None if chosen.strip().lower() in (*OFF, "") else Path(chosen).expanduser()
    return user_cache() / "kvforge" / "lowered"


def entry(directory: Path, model: torch.nn.Module, parts: tuple[Any, ...]) -> Path:
    """The entry's file in `directory` for tracing `model` with `parts` (`key`)."""
    return directory / f"{key(model, parts)}.onnx"


def key(model: torch.nn.Module, parts: tuple[Any, ...]) -> str:
    """The entry's name for tracing `model` (the full model, before any cutting down) with
    `parts`, whose repr is deterministic: every submodule's class, plain attributes and tensor
    shapes and dtypes (`stamp.cache_entry`), the plan, the cut-down spec and I/O contract."""
    digest = hashlib.sha256()
    for chunk in _key_chunks(model, parts):
        digest.update(chunk)
        digest.update(b"\0")
    return digest.hexdigest()


def _key_chunks(model: torch.nn.Module, parts: tuple[Any, ...]) -> Iterator[bytes]:
    yield f"format {FORMAT_VERSION}".encode()
    yield _source_digest().encode()
    yield sys.version.encode()
    for package in _PACKAGES:
        try:
            yield f"{package} {importlib.metadata.version(package)}".encode()
        except importlib.metadata.PackageNotFoundError:
            yield f"{package} absent".encode()
    config = getattr(model, "config", None)
    fields = {k: v for k, v in vars(config).items() if k not in ("_name_or_path", "_commit_hash")} if config else {}
    yield json.dumps(fields, sort_keys=True, default=repr).encode()
    for name, tensor in model.named_buffers():  # their shapes and dtypes are in `parts`
        if tensor.numel() * tensor.element_size() <= _BUFFER_VALUE_BYTES and tensor.device.type != "meta":
            yield name.encode()
            yield tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
    yield repr(parts).encode()


@functools.cache
def _source_digest() -> str:
    """kvforge's own Python source: any change to it may change how a graph is traced or lowered."""
    import kvforge
    import kvforge.passes
    import kvforge.runners
    import kvforge.toolchain

    digest = hashlib.sha256()
    for package in (kvforge, kvforge.passes, kvforge.runners, kvforge.toolchain):
        for root in map(Path, package.__path__):
            for path in sorted(root.rglob("*.py")):
                digest.update(f"{package.__name__}/{path.relative_to(root)}".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def dump(lowered: ir.Model, model: torch.nn.Module) -> bytes:
    """`lowered` serialized with every weight that is `model`'s tensor of its name left out
    (`model` as it was traced: the cut-down model). Others (constants the exporter lifted)
    are kept in the entry. `lowered` is left as it was."""
    tensors = _tensors(model)
    swapped: list[tuple[ir.Value, Any]] = []
    try:
        for value in lowered.graph.initializers.values():
            held = value.const_value
            tensor = tensors.get(value.name or "")
            raw = getattr(held, "raw", None)
            if held is None or tensor is None or not isinstance(raw, torch.Tensor) or not _same(raw, tensor):
                continue
            swapped.append((value, held))
            value.const_value = ir.ExternalTensor(
                _BOUND, offset=0, length=0, dtype=held.dtype, shape=ir.Shape(held.shape.numpy()), name=held.name or ""
            )
        return ir.to_proto(lowered).SerializeToString()
    finally:
        for value, held in swapped:
            value.const_value = held


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()


def load(path: Path, model: torch.nn.Module) -> ir.Model | None:
    """The entry at `path` with `model`'s tensors (the cut-down model) bound in, or None (a
    miss: no entry, an unreadable one, or one whose weights `model` does not have alike)."""
    if not path.is_file():
        return None
    try:
        lowered = ir.load(path)
    except Exception as e:  # a truncated or foreign file: any parse error means the same
        log.warning("%s: unreadable lowering cache entry (%s); tracing afresh", path, e)
        return None
    tensors = _tensors(model)
    for value in lowered.graph.initializers.values():
        held = value.const_value
        if not isinstance(held, ir.ExternalTensor):
            continue
        tensor = tensors.get(value.name or "")
        bound = None if tensor is None else torch_tensor(tensor, held.name or value.name or "")
        if str(held.location) != _BOUND or bound is None or bound.shape != held.shape or bound.dtype != held.dtype:
            log.info("%s: weight %s does not match the model's; tracing afresh", path, value.name)
            return None
        value.const_value = bound
    return lowered


def store(path: Path, data: bytes) -> None:
    """Write an entry whole or not at all; a cache that cannot be written is a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, data)
    except OSError as e:
        log.warning(
            "%s: cannot write the lowering cache (%s); the next build traces again (set %s to a writable "
            "directory, or to off)",
            path,
            e,
            ENV,
        )


def forget(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("%s: cannot remove a refused lowering cache entry (%s)", path, e)
