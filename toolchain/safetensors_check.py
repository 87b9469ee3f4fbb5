"""A safetensors file's header, validated by us before the safetensors library sees the file.

The format: 8 bytes of little-endian header length N, N bytes of UTF-8 JSON (an object of
tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}, plus an optional
"__metadata__" object of strings), then the data section. Offsets are relative to the data
section; the tensors must tile it exactly, without gaps or overlaps, to its last byte.

Every rule is checked here, so a broken or hostile file is refused with a message that
names the file and the tensor or field at fault, instead of whatever the library (or a
memory map of a short file) would do with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.runners.errors import CheckpointError

LENGTH_BYTES = 8
# The safetensors library refuses larger headers; a real one is a few hundred KB at most.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

# Bytes per element of every dtype kvforge loads (the names are safetensors' own).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "F32": 4,
    "I64": 8,
    "F64": 8,
}

# Beyond any real tensor; bounds the arithmetic on hostile shapes (torch sizes are int64).
MAX_RANK = 64
MAX_DIM = (1 << 63) - 1

_FIX = "re-download the file or re-save it with safetensors"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it; `begin`/`end` are offsets into the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def read_header(file: Path) -> dict[str, TensorEntry]:
    """Validate `file`'s header against its length; tensor name -> entry, in header order."""
    try:
        with file.open("rb") as f:
            size = _file_size(f)
            prefix = f.read(LENGTH_BYTES)
            length = _header_length(prefix, size, str(file))
            header = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e}); check the file's permissions") from e
    return check_header(header, length, size, str(file))


def parse_bytes(data: bytes, source: str) -> dict[str, TensorEntry]:
    """The same validation over a whole file held in memory (tests and fuzzing)."""
    length = _header_length(data[:LENGTH_BYTES], len(data), source)
    return check_header(data[LENGTH_BYTES : LENGTH_BYTES + length], length, len(data), source)


def check_header(header: bytes, length: int, file_size: int, source: str) -> dict[str, TensorEntry]:
    """Validate the `length`-byte JSON header of a `file_size`-byte file named `source`."""
    if len(header) != length:
        raise CheckpointError(f"{source}: the file ended while reading its {length}-byte header; {_FIX}")
    raw = _parse_json(header, source)
    _check_metadata(raw.pop(METADATA_KEY, None), source)
    entries = {name: _entry(name, value, source) for name, value in raw.items()}
    _check_coverage(entries, file_size - LENGTH_BYTES - length, source)
    return entries


# --- the pieces -------------------------------------------------------------------------


def _file_size(f: Any) -> int:
    f.seek(0, 2)
    size = int(f.tell())
    f.seek(0)
    return size


def _header_length(prefix: bytes, file_size: int, source: str) -> int:
    if len(prefix) < LENGTH_BYTES:
        raise CheckpointError(
            f"{source}: the file is {file_size} bytes, too short for a safetensors file "
            f"(it starts with an {LENGTH_BYTES}-byte header length); {_FIX}"
        )
    length = int.from_bytes(prefix, "little")
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{source}: header length {length:,} bytes exceeds the safetensors limit of "
            f"{MAX_HEADER_BYTES:,}; the file is corrupt or not safetensors; {_FIX}"
        )
    if LENGTH_BYTES + length > file_size:
        raise CheckpointError(
            f"{source}: header length {length:,} claims bytes past the end of the file "
            f"({file_size:,} bytes); the file is truncated or not safetensors; {_FIX}"
        )
    return length


def _parse_json(header: bytes, source: str) -> dict[str, Any]:
    if not header.startswith(b"{"):
        raise CheckpointError(f"{source}: the header is not a JSON object (it must start with '{{'); {_FIX}")
    try:
        raw = json.loads(header.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{source}: the header is not UTF-8 (byte {e.start}); {_FIX}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{source}: the header is not valid JSON ({e.msg} at char {e.pos}); {_FIX}") from e
    except (ValueError, RecursionError) as e:  # duplicate keys, NaN, over-long numbers, deep nesting
        raise CheckpointError(f"{source}: the header is not valid safetensors JSON ({e}); {_FIX}") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{source}: the header is not a JSON object; {_FIX}")
    return raw


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Two entries for one name would let readers disagree on which tensor is meant."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {short_repr(key)} appears twice")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_metadata(metadata: Any, source: str) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{source}: field {METADATA_KEY!r} must be an object of strings; {_FIX}")


def _entry(name: str, value: Any, source: str) -> TensorEntry:
    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"{source}: tensor {short_repr(name)}: {problem}; {_FIX}")

    if not isinstance(value, dict):
        raise fail(f"expected an object with dtype, shape and data_offsets, got {short_repr(value)}")
    dtype, shape, offsets = value.get("dtype"), value.get("shape"), value.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise fail(f"dtype {short_repr(dtype)} is not one kvforge reads ({', '.join(DTYPE_SIZES)})")
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_count(d) and d <= MAX_DIM for d in shape):
        raise fail(f"shape {short_repr(shape)} must be a list of at most {MAX_RANK} non-negative int64 sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        raise fail(f"data_offsets {short_repr(offsets)} must be [begin, end], two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise fail(f"data_offsets [{begin}, {end}] end before they begin")
    numel = 1
    for dim in shape:
        numel *= dim
    needed = numel * DTYPE_SIZES[dtype]
    if end - begin != needed:
        raise fail(
            f"data_offsets [{begin}, {end}] hold {end - begin} bytes, but dtype {dtype} × shape {shape} needs {needed}"
        )
    return TensorEntry(dtype, tuple(shape), begin, end)


def _check_coverage(entries: dict[str, TensorEntry], data_bytes: int, source: str) -> None:
    """The tensors must tile the data section exactly: no byte unread, none read twice."""
    position, previous = 0, None
    for name, entry in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.end > data_bytes:
            raise CheckpointError(
                f"{source}: tensor {short_repr(name)}: data_offsets [{entry.begin}, {entry.end}] reach past the end "
                f"of the data section ({data_bytes} bytes); the file is truncated or its header is wrong; {_FIX}"
            )
        if entry.begin < position:
            raise CheckpointError(
                f"{source}: tensors {short_repr(previous)} and {short_repr(name)} overlap (the data of "
                f"{short_repr(name)} starts at {entry.begin}, before the other's ends at {position}); {_FIX}"
            )
        if entry.begin > position:
            after = "the start of the data section" if previous is None else f"tensor {short_repr(previous)}"
            raise CheckpointError(
                f"{source}: bytes {position}..{entry.begin} of the data section, after {after}, belong "
                f"to no tensor (tensor {short_repr(name)} starts at {entry.begin}); {_FIX}"
            )
        position, previous = entry.end, name
    if position != data_bytes:
        raise CheckpointError(
            f"{source}: {data_bytes - position} trailing bytes after the last tensor's data (the data "
            f"section is {data_bytes} bytes, the tensors cover {position}); the file is corrupt or "
            f"was appended to; {_FIX}"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def short_repr(value: Any) -> str:
    """A bounded description of a hostile value: never a huge or deeply nested repr."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    try:
        text = repr(value)
    except RecursionError:
        return f"a deeply nested {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."
