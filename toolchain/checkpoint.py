"""A local Hugging Face checkpoint directory, checked and opened without running its code.

`load` finds and validates the files (config, weights, tokenizer, generation config) and
returns a `Checkpoint`; weights are read lazily: `state_dict` memory-maps safetensors
files, and `tensor_metadata` reads their headers only. Pickled weights
(`pytorch_model.bin`) are opt-in and loaded with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runners.errors import CheckpointError

logger = logging.getLogger(__name__)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
TOKENIZER = "tokenizer.json"
OPTIONAL_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

_HASH_CHUNK = 1 << 20

# safetensors' dtype names for torch dtypes, so pickled weights report like safetensors ones.
_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint directory; nothing heavy is read until asked."""

    path: Path  # resolved directory
    config: dict[str, Any]  # parsed config.json
    weight_files: tuple[Path, ...]  # safetensors shards (or the single pytorch_model.bin)
    tokenizer_files: tuple[
        Path, ...
    ]  # tokenizer.json, then tokenizer_config / special_tokens_map / chat_template.jinja
    generation_config: dict[str, Any] | None
    uses_pickle: bool
    index_file: Path | None = None  # model.safetensors.index.json when the weights are sharded

    def state_dict(self) -> dict[str, torch.Tensor]:
        """All weights as CPU tensors backed by memory maps of the files (no copy is made)."""
        if self.uses_pickle:
            return _load_pickle(self.weight_files[0])
        tensors: dict[str, torch.Tensor] = {}
        for file in self.weight_files:
            _merge(tensors, _load_safetensors(file), file)
        return tensors

    def tensor_metadata(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Tensor name -> (safetensors dtype name such as "F32", shape), from headers only.

        Pickled weights have no header; they are memory-mapped and inspected without
        touching the data.
        """
        if self.uses_pickle:
            return {
                name: (_dtype_name(t.dtype, self.weight_files[0], name), tuple(t.shape))
                for name, t in self.state_dict().items()
            }
        metadata: dict[str, tuple[str, tuple[int, ...]]] = {}
        for file in self.weight_files:
            _merge(metadata, _safetensors_header(file), file)
        return metadata

    def source_hashes(self) -> dict[str, str]:
        """File name -> sha256 of every input file, sorted by name."""
        return {file.name: _sha256(file) for file in sorted(self.input_files(), key=lambda f: f.name)}

    def input_files(self) -> tuple[Path, ...]:
        """Every file the build reads: config, weights (and index), tokenizer, generation config."""
        files = [self.path / CONFIG, *self.weight_files, *self.tokenizer_files]
        if self.index_file is not None:
            files.append(self.index_file)
        if self.generation_config is not None:
            files.append(self.path / GENERATION_CONFIG)
        return tuple(files)


def load(path: str | Path, *, allow_pickle: bool = False) -> Checkpoint:
    """Validate a local checkpoint directory and describe its files.

    Raises CheckpointError naming the file and what to do when anything is missing,
    malformed or unsafe (remote code, shard names escaping the directory, pickles
    without `allow_pickle`).
    """
    directory = _checkpoint_dir(path)
    config = _read_json(directory / CONFIG, required=True)
    assert config is not None
    _refuse_remote_code(config, directory / CONFIG)
    weight_files, index_file, uses_pickle = _find_weights(directory, allow_pickle=allow_pickle)
    checkpoint = Checkpoint(
        path=directory,
        config=config,
        weight_files=weight_files,
        tokenizer_files=_find_tokenizer(directory),
        generation_config=_read_json(directory / GENERATION_CONFIG, required=False),
        uses_pickle=uses_pickle,
        index_file=index_file,
    )
    logger.info("checkpoint %s: %d weight file(s)%s", directory, len(weight_files), " (pickle)" if uses_pickle else "")
    return checkpoint


# --- finding files ----------------------------------------------------------------------

_EXPECTED = f"a local checkpoint directory with {CONFIG}, {TOKENIZER} and {SAFETENSORS} (or {SAFETENSORS_INDEX})"


def _checkpoint_dir(path: str | Path) -> Path:
    given = Path(path).expanduser()
    if not given.exists():
        raise CheckpointError(f"{given}: no such directory; expected {_EXPECTED} (Hub ids are not downloaded)")
    if not given.is_dir():
        raise CheckpointError(f"{given}: is a file, not a directory; expected {_EXPECTED}")
    directory = given.resolve()
    if not any(directory.iterdir()):
        raise CheckpointError(f"{directory}: the directory is empty; expected {_EXPECTED}")
    return directory


def _read_json(file: Path, *, required: bool) -> dict[str, Any] | None:
    if not file.is_file():
        if required:
            raise CheckpointError(f"{file}: not found; a checkpoint needs {file.name} ({_EXPECTED})")
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}; fix or regenerate the file"
        ) from e
    except (UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{file}: cannot be read as UTF-8 text ({e}); fix or regenerate the file") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def _refuse_remote_code(config: dict[str, Any], file: Path) -> None:
    if "auto_map" in config:
        raise CheckpointError(
            f"{file}: field 'auto_map' asks to run the checkpoint's own Python code, which kvforge "
            "never does; use a checkpoint of a model_type transformers implements natively"
        )


def _find_weights(directory: Path, *, allow_pickle: bool) -> tuple[tuple[Path, ...], Path | None, bool]:
    """(weight files, index file or None, uses_pickle); safetensors first, as transformers does."""
    if (directory / SAFETENSORS).is_file():
        return (directory / SAFETENSORS,), None, False
    if (directory / SAFETENSORS_INDEX).is_file():
        index = directory / SAFETENSORS_INDEX
        return _shards_from_index(index), index, False
    if (directory / PICKLE).is_file():
        if not allow_pickle:
            raise CheckpointError(
                f"{directory / PICKLE}: pickled weights can run code when loaded; convert the "
                "checkpoint to safetensors, or pass --allow-pickle if you trust its source"
            )
        return (directory / PICKLE,), None, True
    if (directory / PICKLE_INDEX).is_file():
        raise CheckpointError(
            f"{directory / PICKLE_INDEX}: sharded pickled weights are not supported; convert the "
            "checkpoint to safetensors"
        )
    raise CheckpointError(
        f"{directory}: no weights found; expected {SAFETENSORS} or {SAFETENSORS_INDEX} ({PICKLE} with --allow-pickle)"
    )


def _shards_from_index(index: Path) -> tuple[Path, ...]:
    data = _read_json(index, required=True)
    assert data is not None
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: field 'weight_map' must be a non-empty object of tensor name -> shard file; regenerate the index"
        )
    names: list[str] = []
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{index}: weight_map[{tensor!r}] must be a file name, got {shard!r}")
        if shard not in names:
            names.append(shard)
    return tuple(_shard_path(index, name) for name in sorted(names))


def _shard_path(index: Path, name: str) -> Path:
    """The shard as a plain file inside the checkpoint directory, or an error."""
    directory = index.parent
    if not name or name in (".", "..") or "/" in name or "\\" in name or os.path.isabs(name):
        raise CheckpointError(
            f"{index}: shard name {name!r} in weight_map is not a plain file name; shards must "
            "sit directly in the checkpoint directory"
        )
    shard = directory / name
    if not shard.is_file():
        raise CheckpointError(f"{index}: shard {name!r} listed in weight_map does not exist in {directory}")
    if not shard.resolve().is_relative_to(directory):
        raise CheckpointError(
            f"{index}: shard {name!r} is a link to {shard.resolve()}, outside the checkpoint "
            "directory; copy the file into the directory"
        )
    return shard


def _find_tokenizer(directory: Path) -> tuple[Path, ...]:
    tokenizer = directory / TOKENIZER
    if not tokenizer.is_file():
        raise CheckpointError(
            f"{tokenizer}: not found; kvforge needs a fast tokenizer file; save one with "
            "AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
        )
    optional = tuple(directory / name for name in OPTIONAL_TOKENIZER_FILES if (directory / name).is_file())
    for file in optional:
        if file.suffix == ".json":
            _read_json(file, required=True)
    return (tokenizer, *optional)


# --- reading weights --------------------------------------------------------------------


def _load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file, device="cpu")  # memory-mapped: tensors view the mapped file
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); re-download or re-save it") from e


def _safetensors_header(file: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as handle:
            slices = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118 (not iterable)
            return {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); re-download or re-save it") from e


def _load_pickle(file: Path) -> dict[str, torch.Tensor]:
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises many types for a bad or unsafe pickle
        raise CheckpointError(
            f"{file}: cannot be loaded with weights_only=True ({type(e).__name__}: {e}); "
            "convert the checkpoint to safetensors"
        ) from e
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise CheckpointError(f"{file}: expected a dict of tensor name -> tensor (a state dict)")
    return data


def _merge(into: dict[str, Any], more: dict[str, Any], file: Path) -> None:
    duplicates = sorted(set(into) & set(more))
    if duplicates:
        raise CheckpointError(
            f"{file}: tensor {duplicates[0]!r} also appears in another shard; regenerate the checkpoint"
        )
    into.update(more)


def _dtype_name(dtype: torch.dtype, file: Path, tensor: str) -> str:
    try:
        return _TORCH_DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"{file}: tensor {tensor!r} has unsupported dtype {dtype}") from None


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        for chunk in _chunks(f):
            digest.update(chunk)
    return digest.hexdigest()


def _chunks(f: Any) -> Iterable[bytes]:
    while chunk := f.read(_HASH_CHUNK):
        yield chunk
