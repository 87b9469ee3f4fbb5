"""Reading an artifact's manifest and checking its files against it.

The manifest is written last by the build, so a directory without one is incomplete.
The runner refuses an artifact whose files do not hash to what the manifest records.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvforge.runners.contract import DecoderIO
from kvforge.runners.cpus import usable_cpus
from kvforge.runners.errors import ArtifactError

MANIFEST = "manifest.json"
SCHEMA_VERSION = 3
# Version 3 only adds fields (io.capacity, flags.weights, engine, the distribution report):
# artifacts of version 2 read the same.
READABLE_SCHEMA_VERSIONS = (2, 3)
_CHUNK = 1 << 20
# Bounds on the io section's sizes, checked before DecoderIO derives names from them: a
# manifest claiming 10**12 layers must fail at once, not while listing their inputs.
# A manifest is a few kilobytes; refusing a huge one keeps a hostile file from filling memory.
_MAX_MANIFEST_BYTES = 16 << 20


def sha256_file(path: Path) -> str:
    """The sha256 of a file's bytes, streamed in chunks of `_CHUNK` bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in _chunks(f):
            digest.update(chunk)
    return digest.hexdigest()


def _chunks(f: io.BufferedIOBase) -> Iterator[memoryview]:
    """The file's bytes, read into one buffer a chunk at a time."""
    buffer = memoryview(bytearray(_CHUNK))
    while size := f.readinto(buffer):
        yield buffer[:size]


def read_json_object(path: Path, max_bytes: int = _MAX_MANIFEST_BYTES, missing_ok: bool = False) -> dict[str, Any]:
    """A JSON object from an artifact file, or an ArtifactError naming the file.

    With `missing_ok`, an optional file that is absent reads as {}.
    """
    if missing_ok and not path.is_file():
        return {}
    try:
        if path.stat().st_size > max_bytes:
            limit = max_bytes >> 20
            raise ArtifactError(
                f"{path}: larger than {limit} MiB, which no kvforge artifact file is; rebuild the artifact"
            )
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror or e}); check its permissions") from e
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, huge integers, absurd nesting
        raise ArtifactError(f"{path}: not valid JSON ({type(e).__name__}: {e}); rebuild the artifact") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object, got {type(data).__name__}; rebuild the artifact")
    return data


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(
            f"{directory}: not an artifact directory; build one with `kvforge build CHECKPOINT -o {directory}`"
        )
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; the artifact is incomplete, rebuild it with `kvforge build`")
    if path.is_symlink():
        raise ArtifactError(f"{path}: a symlink, not a plain file; rebuild the artifact")
    manifest = read_json_object(path)
    version = manifest.get("schema_version")
    if isinstance(version, bool) or version not in READABLE_SCHEMA_VERSIONS:
        raise ArtifactError(
            f"{path}: schema_version {_short(version)} is not supported (expected one of "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}); "
            "rebuild the artifact with this kvforge version"
        )
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Every file in the directory is listed with the right hash, and nothing else is there.

    Names must be plain file names: a manifest cannot point the runner outside its
    directory, and a symlink inside it is refused, whatever it points to.
    """
    FileHashes(directory, listed_files(directory, manifest)).wait()


def listed_files(directory: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """The manifest's files (name to sha256), once the directory holds exactly them as plain files.

    Everything of `verify_files` but the hashes: cheap, so it is done before any file is opened.
    """
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{directory / MANIFEST}: field files is missing or empty; rebuild the artifact")
    try:
        present = {p.name for p in directory.iterdir()} - {MANIFEST}
    except OSError as e:
        raise ArtifactError(f"{directory}: cannot be listed ({e.strerror or e}); check its permissions") from e
    for extra in sorted(present - set(files)):
        raise ArtifactError(f"{directory / extra}: not listed in {MANIFEST}; remove it or rebuild the artifact")
    for name, expected in sorted(files.items()):
        if not is_plain_file_name(name) or name == MANIFEST or not isinstance(expected, str):
            raise ArtifactError(
                f"{directory / MANIFEST}: files entry {_short(name)}: {_short(expected)} is not a plain file name "
                "with a sha256 hex digest; rebuild the artifact"
            )
        path = directory / name
        if not path.is_file() or path.is_symlink():
            raise ArtifactError(f"{path}: listed in {MANIFEST} but missing or not a plain file; rebuild the artifact")
    return dict(sorted(files.items()))


class FileHashes:
    """The files' sha256 checks, run in threads from construction on; `wait` raises if one fails.

    hashlib releases the GIL while it hashes, so the caller can do other work (onnxruntime
    creating its session) while the files are read; whatever it made from them must be
    dropped if a check fails. The small files go first, so that waiting for all but the
    weights does not wait for the weights' hash, even with one worker. An error is that of
    the first failing file in name order, whichever thread finished first.
    """

    def __init__(self, directory: Path, files: Mapping[str, str], workers: int | None = None) -> None:
        names = sorted(files, key=lambda name: (_size(directory / name), name))
        workers = max(1, min(len(names), workers or usable_cpus()))
        executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvforge-sha256")
        self._checks = {name: executor.submit(check_hash, directory / name, files[name]) for name in names}
        executor.shutdown(wait=False)  # the threads end when the last file is hashed

    def failure(self, exclude: Collection[str] = ()) -> BaseException | None:
        """The error of the first file in name order that fails its hash (waiting as far as that),
        or None once every file but those excluded has matched."""
        checks = sorted((name, check) for name, check in self._checks.items() if name not in exclude)
        return next((error for _, check in checks if (error := check.exception()) is not None), None)

    def wait(self, exclude: Collection[str] = ()) -> None:
        """Return once every file but those excluded is hashed, or raise `failure(exclude)`."""
        failure = self.failure(exclude)
        if failure is not None:
            raise failure


def check_hash(path: Path, expected: str) -> None:
    """The file hashes to `expected`, or an ArtifactError says it does not."""
    try:
        actual = sha256_file(path)
    except OSError as e:
        raise ArtifactError(f"{path}: cannot be read ({e.strerror or e}); check its permissions") from e
    if actual != expected:
        raise ArtifactError(f"{path}: sha256 does not match {MANIFEST}; the file was modified, rebuild the artifact")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # check_hash says why


def is_plain_file_name(name: str) -> bool:
    """A name that can only mean a file directly inside a directory, on any platform.

    No separators, no ``.`` or ``..``, no drive letters or NUL, no surrounding spaces
    (Windows drops trailing ones); stricter than needed, and kvforge writes no other names.
    """
    return (
        name not in ("", ".", "..")
        and name.strip() == name
        and not any(c in name for c in "/\\:\0")
        and Path(name).name == name
    )


def read_io(directory: Path, manifest: dict[str, Any]) -> DecoderIO:
    """The manifest's I/O contract, with its sizes checked before anything is derived from them."""
    io = manifest.get("io")
    if not isinstance(io, dict):
        raise ArtifactError(f"{directory / MANIFEST}: field io is missing or not an object; rebuild the artifact")
    return DecoderIO.from_dict(io)


_Graph = Sequence[tuple[str, str, Sequence[object]]]


def check_io_against_graph(model_path: Path, io: DecoderIO, inputs: _Graph, outputs: _Graph) -> None:
    """The graph's inputs and outputs, each as (name, element type, dims) in order, are what the
    manifest's contract says: the same names, dtypes and fixed sizes (vocabulary, heads, head
    size, capacity). The manifest is not hashed itself; what the runner reads from it must
    agree with the hashed graph, or the artifact is refused."""
    names = [name for name, _, _ in inputs], [name for name, _, _ in outputs]
    expected = [t.name for t in io.inputs], [t.name for t in io.outputs]
    if names != expected:
        raise ArtifactError(
            f"{model_path}: graph I/O {_short(names, 200)} does not match the manifest's contract "
            f"{_short(expected, 200)}; rebuild the artifact"
        )
    for tensor, (name, element, dims) in zip([*io.inputs, *io.outputs], [*inputs, *outputs]):
        dtype = _ONNX_ELEMENT_TYPES.get(element, element)
        fixed = [d if isinstance(d, int) else None for d in dims]
        declared = [d if isinstance(d, int) else None for d in tensor.dims]
        if dtype != tensor.dtype or fixed != declared:
            raise ArtifactError(
                f"{model_path}: {name} is {dtype} {_short(list(dims))} in the graph, but {MANIFEST}'s io says "
                f"{tensor.dtype} {_short(list(tensor.dims))}; the manifest was modified, rebuild the artifact"
            )


# onnxruntime's element type names, as the contract's numpy names
_ONNX_ELEMENT_TYPES = {
    f"tensor({onnx})": numpy
    for onnx, numpy in {
        "float": "float32",
        "double": "float64",
        "float16": "float16",
        "bfloat16": "bfloat16",
        "int64": "int64",
        "int32": "int32",
        "int8": "int8",
        "uint8": "uint8",
        "bool": "bool",
    }.items()
}


def check_spec_against_io(directory: Path, manifest: dict[str, Any], io: DecoderIO) -> None:
    """The spec's sizes that the contract also states agree with it (a modified spec is refused)."""
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        raise ArtifactError(f"{directory / MANIFEST}: field spec is missing or not an object; rebuild the artifact")
    for field in ("vocab_size", "num_layers"):
        if spec.get(field) != getattr(io, field) or isinstance(spec.get(field), bool):
            raise ArtifactError(
                f"{directory / MANIFEST}: spec.{field} is {_short(spec.get(field))} but io.{field} is "
                f"{getattr(io, field)}; the manifest was modified, rebuild the artifact"
            )


def read_max_positions(directory: Path, manifest: dict[str, Any]) -> int:
    """The model's context length (spec.max_positions): prompt plus new tokens must fit in it."""
    spec = manifest.get("spec")
    value = spec.get("max_positions") if isinstance(spec, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 1 << 40:
        raise ArtifactError(
            f"{directory / MANIFEST}: spec.max_positions must be a positive integer, got {_short(value)}; "
            "rebuild the artifact"
        )
    return value


def built_with(manifest: Mapping[str, Any], package: str) -> str | None:
    """The release of `package` the artifact was built and verified with (its manifest's `tools`),
    where the manifest names one."""
    tools = manifest.get("tools")
    found = tools.get(package) if isinstance(tools, dict) else None
    return found if isinstance(found, str) and release(found) else None


def release(text: str) -> tuple[int, ...]:
    """The numeric release of a version string: "2.13.0+cpu" -> (2, 13, 0), "1.0.0rc1" -> (1, 0, 0)."""
    parts: list[int] = []
    for part in text.split("."):
        digits = re.match(r"\d+", part)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() != len(part):
            break
    return tuple(parts)


def _short(value: object, limit: int = 80) -> str:
    """repr for a message: a hostile manifest's values can be megabytes long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
