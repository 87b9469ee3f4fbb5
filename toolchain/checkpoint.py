"""A local Hugging Face checkpoint directory, checked and opened without running its code.

`load` finds and validates the files (config, weights, tokenizer, generation config) and
returns a `Checkpoint`; weights are read lazily: `state_dict` memory-maps safetensors
files, and `tensor_metadata` reads their headers only. Pickled weights
(`pytorch_model.bin`) are opt-in and loaded with `weights_only=True`.

The directory may also be a snapshot of the Hugging Face cache, named by its Hub id
(`kvforge.toolchain.hub`): there every file is a link, followed only into the same repository's
`blobs/`.

Every file is untrusted: paths taken from files must stay inside the directory, every
safetensors header is validated by `kvforge.toolchain.safetensors_check` before the library opens
the file, and every failure is a `CheckpointError` naming the file and the field or tensor.
`check_against_spec` then checks the weights' and tokenizer's sizes against the config.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import io
import json
import logging
import math
import mmap
import os
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.runners.errors import CheckpointError
from kvforge.toolchain import gguf, hashing, hub, prequantized, progress, safetensors_check
from kvforge.toolchain.safetensors_check import short_repr
from kvforge.toolchain.spec import POSITION_EMBEDDINGS, TOKEN_EMBEDDINGS, TOKENIZER_CONFIG_FILE, DecoderSpec

if TYPE_CHECKING:  # torch loads where tensors are read: a config and safetensors headers need none
    import torch

logger = logging.getLogger(__name__)

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE = "pytorch_model.bin"
PICKLE_INDEX = "pytorch_model.bin.index.json"
TOKENIZER = "tokenizer.json"
OPTIONAL_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# JSON inputs are read whole; far beyond any real config, index or tokenizer file.
MAX_JSON_BYTES = 512 << 20

# The first torch whose weights_only unpickler has no published bypass: 2.6.0 fixed
# CVE-2025-32434 (GHSA-53q9-r3pm-6pq6, code execution through torch.load(weights_only=True)),
# 2.10.0 fixed CVE-2026-24747 (GHSA-63cw-57p8-fm3p, memory corruption in the weights_only
# unpickler). pyproject asks for a newer torch; this guards environments that ignore it.
MIN_TORCH_FOR_PICKLE = "2.10.0"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format, the only one torch can memory-map


@functools.cache
def _torch_dtype_names() -> dict[torch.dtype, str]:
    """safetensors' dtype names for torch dtypes, so pickled weights report like safetensors ones."""
    import torch

    return {
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


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    return {name: dtype for dtype, name in _torch_dtype_names().items()}


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
    hub: hub.HubSnapshot | None = None  # the Hugging Face cache snapshot the directory is, if it is one
    # config.json's quantization_config: weights shipped quantized (AWQ, GPTQ), None otherwise
    quantization: prequantized.Quantization | None = None
    # a GGUF file the directory was made from (`kvforge.toolchain.gguf`): then the build's only input
    gguf: Path | None = None
    # what keeps a made directory alive (a tempfile.TemporaryDirectory, removed with its last reference)
    scratch: Any = field(default=None, repr=False, compare=False)

    def state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """All weights as CPU tensors, floating ones converted to `dtype` if given.

        Safetensors weights are mapped one tensor at a time (`_tensor_bytes`), each converted
        as it arrives: a weight that a later stage replaces (packed, quantized) is freed with
        its last reference, where one mapping of the whole file would keep every page it ever
        touched resident; and a checkpoint built in a narrower dtype never sits in memory at
        its stored width.

        Weights shipped quantized (`quantization`) come as the float weights they stand for
        (`kvforge.toolchain.prequantized.dequantize_into`), dequantized from their stored scales."""
        if self.uses_pickle:
            tensors = _load_pickle(self.weight_files[0])
        else:
            tensors = {}
            origin: dict[str, Path] = {}
            progress.total(len(_read_headers(self.weight_files)), "tensors")
            for file in self.weight_files:
                _merge(tensors, _read_safetensors(file, None if self.quantization else dtype), file, origin)
        if self.quantization is not None:
            prequantized.dequantize_into(tensors, self.quantization, self.path, dtype)
        elif not self.uses_pickle:
            return tensors
        return {name: _in_dtype(t, dtype) for name, t in tensors.items()}

    def quantized_weights(self) -> dict[str, prequantized.Imported]:
        """The weights the checkpoint ships quantized, by the name of the float weight each
        stands for (`kvforge.toolchain.prequantized.records`; a GGUF file's,
        `kvforge.toolchain.gguf.quantized_weights`); empty when it ships none."""
        if self.gguf is not None:
            return gguf.quantized_weights(self.gguf, self.tensor_metadata(), self.config)
        if self.quantization is None:
            return {}
        tensors: dict[str, torch.Tensor] = {}
        for file in self.weight_files:
            tensors.update(_load_pickle(file) if self.uses_pickle else _read_safetensors(file, None))
        return prequantized.records(tensors, self.quantization, self.path)

    def quantization_header(self) -> dict[str, Any] | None:
        """What the manifest's `imported_weights` says of the checkpoint's quantization; None
        when it ships no quantized weights."""
        if self.gguf is not None:
            return {"method": "gguf", "file": self.gguf.name}
        return None if self.quantization is None else self.quantization.to_dict()

    def tensor_metadata(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Tensor name -> (safetensors dtype name such as "F32", shape), from headers only.

        Pickled weights have no header; they are memory-mapped and inspected without
        touching the data.
        """
        return {name: (dtype, shape) for name, (_, dtype, shape) in self.tensor_locations().items()}

    def tensor_locations(self) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
        """Tensor name -> (the file holding it, safetensors dtype name, shape), from headers only."""
        if self.uses_pickle:
            file = self.weight_files[0]
            return {
                name: (file, _dtype_name(t.dtype, file, name), tuple(t.shape)) for name, t in _load_pickle(file).items()
            }
        return {
            name: (file, entry.dtype, entry.shape) for name, (file, entry) in _read_headers(self.weight_files).items()
        }

    def source_hashes(self) -> dict[str, str]:
        """File name -> sha256 of every input file, sorted by name."""
        return hashing.sha256_files(self.input_files())

    def input_files(self) -> tuple[Path, ...]:
        """Every file the build reads: config, weights (and index), tokenizer, generation config;
        or the GGUF file they were made from."""
        if self.gguf is not None:
            return (self.gguf,)
        files = [self.path / CONFIG, *self.weight_files, *self.tokenizer_files]
        if self.index_file is not None:
            files.append(self.index_file)
        if self.generation_config is not None:
            files.append(self.path / GENERATION_CONFIG)
        return tuple(files)


def _load_gguf(file: Path) -> Checkpoint:
    """The checkpoint a GGUF file holds, dequantized to float32 into a scratch directory that the
    `Checkpoint` keeps alive (`kvforge.toolchain.gguf`); it names the file as its only input."""
    file = file.absolute()  # not resolved: a link (a Hub snapshot's, into blobs/) keeps its name
    stat = file.stat()
    key = (str(file), stat.st_size, stat.st_mtime_ns)
    if (held := _FROM_GGUF.get(key)) is not None:
        return held
    scratch = tempfile.TemporaryDirectory(prefix="kvforge-gguf-")
    try:
        gguf.dequantize(file, Path(scratch.name))
        ckpt = load(scratch.name)
    except BaseException:
        scratch.cleanup()
        raise
    ckpt = dataclasses.replace(ckpt, gguf=file, scratch=scratch)
    _FROM_GGUF[key] = ckpt
    return ckpt


# The checkpoints made from GGUF files that something still holds, by file, size and mtime: a
# second load of an unchanged file in the same process (a test session building it at several
# precisions, say) reuses the dequantized copy rather than reading the file again.
_FROM_GGUF: weakref.WeakValueDictionary[tuple[str, int, int], Checkpoint] = weakref.WeakValueDictionary()


def load(path: str | Path, *, allow_pickle: bool = False, revision: str | None = None) -> Checkpoint:
    """Validate a local checkpoint directory (or a Hub id's cached snapshot) and describe its files;
    a GGUF file (or a directory holding one) is read by `kvforge.toolchain.gguf`.

    Raises CheckpointError naming the file and what to do when anything is missing,
    malformed or unsafe (remote code, shard names escaping the directory, pickles
    without `allow_pickle`, safetensors headers that do not describe their file, an
    index that disagrees with its shards, a cache snapshot's link leading out of its blobs).
    """
    located = hub.locate(path, revision)
    gguf_file = gguf.find(located)
    if gguf_file is not None:
        return _load_gguf(gguf_file)
    directory = _checkpoint_dir(located)
    snapshot = hub.snapshot_of(directory)
    if snapshot is not None:
        for name in _READ_BY_NAME:
            if os.path.lexists(directory / name):
                _snapshot_file(directory / name, snapshot)
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
        hub=snapshot,
        quantization=prequantized.read_config(config, directory / CONFIG),
    )
    if not uses_pickle:  # headers only: cheap, and every broken file is refused before any work
        headers = _read_headers(weight_files)
        if index_file is not None:
            _check_index_matches_shards(index_file, headers)
    logger.info("checkpoint %s: %d weight file(s)%s", directory, len(weight_files), " (pickle)" if uses_pickle else "")
    return checkpoint


def check_against_spec(checkpoint: Checkpoint, spec: DecoderSpec) -> None:
    """Refuse weights or a tokenizer whose sizes contradict config.json, before any model is built.

    Reads safetensors headers (a pickle is memory-mapped, not read) and tokenizer.json.
    Shapes of the other tensors are checked when transformers loads the weights
    (`kvforge.toolchain.export.eager_model`).
    """
    locations = checkpoint.tensor_locations()
    check_embedding_shapes(locations, spec)
    check_parameter_count(locations, spec, checkpoint.path / CONFIG)
    check_tokenizer_fits(checkpoint, spec)
    check_runner_reads(checkpoint)


def check_runner_reads(checkpoint: Checkpoint) -> None:
    """The tokenizer and generation files as the runner will read them from the artifact: what
    `Engine.load` would refuse is refused here, before anything is built or published."""
    from kvforge.runners.engine import generation_settings
    from kvforge.runners.errors import ArtifactError
    from kvforge.runners.tokenizer import TokenizerBundle

    # the artifact's ids are the spec's, already checked; the sampling fields are copied as they are
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    generation = {k: v for k, v in (checkpoint.generation_config or {}).items() if k not in ids}
    try:
        TokenizerBundle.load(checkpoint.path)
        generation_settings(generation, source=str(checkpoint.path / GENERATION_CONFIG))
    except ArtifactError as e:
        problem = str(e).rsplit("; ", 1)[0]
        raise CheckpointError(f"{problem}; fix the checkpoint's file (the runner would refuse the artifact)") from e


# --- finding files ----------------------------------------------------------------------

# Every file the loader opens by a fixed name (shards are named by the index).
_READ_BY_NAME = (
    CONFIG,
    GENERATION_CONFIG,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    PICKLE,
    PICKLE_INDEX,
    TOKENIZER,
    *OPTIONAL_TOKENIZER_FILES,
)

_EXPECTED = (
    f"a local checkpoint directory with {CONFIG}, {TOKENIZER} and {SAFETENSORS} (or {SAFETENSORS_INDEX}), "
    "or a .gguf file"
)


def _checkpoint_dir(path: str | Path) -> Path:
    given = Path(path).expanduser()
    if not given.exists():
        raise CheckpointError(
            f"{given}: no such directory; expected {_EXPECTED}, or a Hub id ORG/NAME in the local Hugging Face cache"
        )
    if not given.is_dir():
        raise CheckpointError(f"{given}: is a file, not a directory; expected {_EXPECTED}")
    directory = given.resolve()
    try:
        empty = not any(directory.iterdir())
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot be listed ({e.strerror or e}); check its permissions") from e
    if empty:
        raise CheckpointError(f"{directory}: the directory is empty; expected {_EXPECTED}")
    return directory


# transformers writes the floats JSON has no literal for as {"__float__": "Infinity"} (its
# configs' to_json_string) and reads them back as floats; so does kvforge.
_SPECIAL_FLOATS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def _special_float(obj: dict[str, Any]) -> Any:
    tag = obj.get("__float__") if len(obj) == 1 else None
    return _SPECIAL_FLOATS[tag] if isinstance(tag, str) and tag in _SPECIAL_FLOATS else obj


def _read_json(file: Path, *, required: bool) -> dict[str, Any] | None:
    if not file.is_file():
        if required:
            raise CheckpointError(f"{file}: not found; a checkpoint needs {file.name} ({_EXPECTED})")
        return None
    try:
        if file.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(
                f"{file}: {file.stat().st_size:,} bytes, beyond the {MAX_JSON_BYTES:,}-byte limit for a JSON "
                "file; it is corrupt or not a checkpoint file"
            )
        data = json.loads(file.read_text(encoding="utf-8"), object_hook=_special_float)
    except json.JSONDecodeError as e:
        raise CheckpointError(
            f"{file}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}; fix or regenerate the file"
        ) from e
    except (UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{file}: cannot be read as UTF-8 text ({e}); fix or regenerate the file") from e
    except (ValueError, RecursionError) as e:  # numbers too long for Python, nesting too deep
        raise CheckpointError(f"{file}: invalid JSON ({e}); fix or regenerate the file") from e
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
        return tuple(sorted(set(read_index(index).values()))), index, False
    if (directory / PICKLE).is_file():
        if not allow_pickle:
            raise CheckpointError(
                f"{directory / PICKLE}: pickled weights can run code when loaded; convert the "
                "checkpoint to safetensors, or pass --allow-pickle if you trust its source"
            )
        _require_safe_torch(directory / PICKLE)
        return (directory / PICKLE,), None, True
    if (directory / PICKLE_INDEX).is_file():
        raise CheckpointError(
            f"{directory / PICKLE_INDEX}: sharded pickled weights are not supported; convert the "
            "checkpoint to safetensors"
        )
    raise CheckpointError(
        f"{directory}: no weights found; expected {SAFETENSORS} or {SAFETENSORS_INDEX} ({PICKLE} with --allow-pickle)"
    )


def read_index(index: Path) -> dict[str, Path]:
    """Tensor name -> shard path, every shard a checked plain file inside the index's directory.

    All names are checked before any shard is opened.
    """
    data = _read_json(index, required=True)
    assert data is not None
    return shard_map(data, index)


def shard_map(data: dict[str, Any], index: Path) -> dict[str, Path]:
    """`read_index` over an index already parsed from `index` (apart, so it can be fuzzed)."""
    weight_map = data.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(
            f"{index}: field 'weight_map' must be a non-empty object of tensor name -> shard file; regenerate the index"
        )
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(
                f"{index}: weight_map[{short_repr(tensor)}] must be a file name, got {short_repr(shard)}"
            )
    paths = {name: _shard_path(index, name) for name in sorted(set(weight_map.values()))}
    return {tensor: paths[shard] for tensor, shard in weight_map.items()}


def _shard_path(index: Path, name: str) -> Path:
    """The shard as a plain file inside the checkpoint directory, or an error; opens nothing."""
    directory = index.parent
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or os.path.isabs(name)
        or Path(name).name != name
    ):
        raise CheckpointError(
            f"{index}: shard name {short_repr(name)} in weight_map is not a plain file name; shards must "
            "sit directly in the checkpoint directory"
        )
    if not name.endswith(".safetensors"):
        raise CheckpointError(
            f"{index}: shard name {short_repr(name)} in weight_map does not end in .safetensors; "
            "shards must be safetensors files"
        )
    shard = directory / name
    snapshot = hub.snapshot_of(directory)
    if snapshot is not None:
        _snapshot_file(shard, snapshot, f"{index}: shard {name!r}")
        return shard
    target = shard.resolve()
    if not target.is_relative_to(directory):
        raise CheckpointError(
            f"{index}: shard {name!r} is a link to {target}, outside the checkpoint "
            "directory; copy the file into the directory"
        )
    if not shard.is_file():
        raise CheckpointError(f"{index}: shard {name!r} listed in weight_map does not exist in {directory}")
    return shard


def _snapshot_file(file: Path, snapshot: hub.HubSnapshot, what: str | None = None) -> None:
    """A cache snapshot's file: a link (or a chain of links) that ends at an existing file in
    the repository's own blobs/, or a plain file in the snapshot; anything else is refused
    before it is opened."""
    what = what or str(file)
    target = file.resolve()
    inside = target.is_relative_to(file.parent) or target.is_relative_to(snapshot.blobs.resolve())
    if not inside:
        raise CheckpointError(
            f"{what}: is a link to {target}, outside {snapshot.blobs} (the blobs of {snapshot.repo_id} in the "
            f"Hugging Face cache); refusing to follow it, re-download with `hf download {snapshot.repo_id}`"
        )
    if not target.is_file():
        raise CheckpointError(
            f"{what}: is a link to {target}, which does not exist or is not a file; the download is incomplete, "
            f"complete it with `hf download {snapshot.repo_id}`"
        )


def _check_index_matches_shards(index: Path, headers: dict[str, tuple[Path, Any]]) -> None:
    """Every tensor the index lists is in the shard it names, and every shard tensor is listed."""
    listed = read_index(index)
    for tensor, shard in listed.items():
        found = headers.get(tensor)
        if found is None:
            raise CheckpointError(
                f"{index}: weight_map lists tensor {short_repr(tensor)} in {shard.name}, but no shard contains it; "
                "the checkpoint is incomplete, re-download it"
            )
        if found[0] != shard:
            raise CheckpointError(
                f"{index}: weight_map puts tensor {short_repr(tensor)} in {shard.name}, but it is in {found[0].name}; "
                "regenerate the index"
            )
    unlisted = sorted(set(headers) - set(listed))
    if unlisted:
        raise CheckpointError(
            f"{headers[unlisted[0]][0]}: tensor {short_repr(unlisted[0])} is not listed in {index.name}'s weight_map; "
            "regenerate the index"
        )


def _find_tokenizer(directory: Path) -> tuple[Path, ...]:
    tokenizer = directory / TOKENIZER
    if not tokenizer.is_file():
        raise CheckpointError(
            f"{tokenizer}: not found; kvforge needs a fast tokenizer file; save one with "
            "AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
        )
    optional = tuple(directory / name for name in OPTIONAL_TOKENIZER_FILES if (directory / name).is_file())
    for file in (tokenizer, *optional):
        if file.suffix == ".json":
            _read_json(file, required=True)
    return (tokenizer, *optional)


def tokenizer_config(checkpoint: Checkpoint) -> dict[str, Any] | None:
    """tokenizer_config.json, parsed (`load` has checked it), or None where there is none."""
    file = checkpoint.path / TOKENIZER_CONFIG_FILE
    return _read_json(file, required=False) if file in checkpoint.tokenizer_files else None


# --- checks against the config ----------------------------------------------------------


Locations = dict[str, tuple[Path, str, tuple[int, ...]]]


def check_embedding_shapes(locations: Locations, spec: DecoderSpec) -> None:
    """The embedding tables are [vocab_size, hidden_size] (and [max_positions, hidden_size])."""
    expected = [(TOKEN_EMBEDDINGS, (spec.vocab_size, spec.hidden_size), "vocab_size, hidden_size")]
    if spec.position_embedding == "learned":
        expected.append((POSITION_EMBEDDINGS, (spec.max_positions, spec.hidden_size), "max_positions, hidden_size"))
    for suffixes, shape, fields in expected:
        for name, (file, _, found) in locations.items():
            if _has_suffix(name, suffixes) and found != shape:
                raise CheckpointError(
                    f"{file}: tensor {short_repr(name)} has shape {list(found)}, but {CONFIG} gives [{fields}] = "
                    f"{list(shape)}; check that {CONFIG} belongs to these weights"
                )


def check_parameter_count(locations: Locations, spec: DecoderSpec, config_file: Path) -> None:
    """Refuse a config that describes a larger model than the weights hold.

    A lower bound every supported architecture exceeds: the token embedding, and per layer
    the query projection and one MLP matrix. Caught here, a config/weights mismatch never
    makes transformers allocate the config's (possibly enormous) model.
    """
    per_layer = spec.hidden_size * spec.num_heads * spec.head_dim + spec.hidden_size * spec.intermediate_size
    needed = spec.vocab_size * spec.hidden_size + spec.num_layers * per_layer
    stored = sum(math.prod(shape) * _values_per_element(name, dtype) for name, (_, dtype, shape) in locations.items())
    if needed > stored:
        raise CheckpointError(
            f"{config_file}: describes a model of at least {needed:,} parameters ({spec.num_layers} layers, "
            f"hidden size {spec.hidden_size}, intermediate size {spec.intermediate_size}, vocab {spec.vocab_size}), "
            f"but the weights hold {stored:,}; check that {CONFIG} belongs to these weights"
        )


def _values_per_element(name: str, dtype: str) -> int:
    """Parameters one stored element holds, at least: an int32 of a packed `qweight` holds four
    8-bit codes (eight 4-bit ones)."""
    return 4 if name.endswith(".qweight") and dtype == "I32" else 1


def check_tokenizer_fits(checkpoint: Checkpoint, spec: DecoderSpec) -> None:
    """Every token id of tokenizer.json (added tokens included) indexes the embedding table."""
    from tokenizers import Tokenizer

    file = checkpoint.path / TOKENIZER
    try:
        vocab = Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
    except Exception as e:  # the tokenizers library raises plain Exception for a malformed file
        raise CheckpointError(
            f"{file}: the tokenizers library cannot load it ({_first_line(e)}); save the tokenizer again "
            "with AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
        ) from e
    if not vocab:
        raise CheckpointError(f"{file}: the tokenizer has no tokens; save the tokenizer again")
    token, top = max(vocab.items(), key=lambda item: item[1])
    if top >= spec.vocab_size:
        raise CheckpointError(
            f"{file}: the tokenizer has {top + 1} token ids (added tokens included; token {short_repr(token)} is "
            f"id {top}), but the embedding table has only {spec.vocab_size} rows ({CONFIG} vocab_size); "
            "use the tokenizer that belongs to these weights"
        )


def _has_suffix(name: str, suffixes: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in suffixes)


# --- reading weights --------------------------------------------------------------------


def _read_headers(files: tuple[Path, ...]) -> dict[str, tuple[Path, safetensors_check.TensorEntry]]:
    """Tensor name -> (file, header entry) over all shards; a name in two shards is refused."""
    entries: dict[str, tuple[Path, safetensors_check.TensorEntry]] = {}
    for file in files:
        for name, entry in safetensors_check.read_header(file).items():
            if name in entries:
                raise CheckpointError(
                    f"{file}: tensor {short_repr(name)} also appears in {entries[name][0].name}; a tensor must be "
                    "stored once, regenerate the checkpoint"
                )
            entries[name] = (file, entry)
    return entries


def _read_safetensors(file: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file at the offsets its checked header gives, one at a time,
    each in a mapping of its own bytes (`_tensor_bytes`)."""
    entries = safetensors_check.read_header(file)  # bounds, dtypes and sizes checked against the file
    tensors: dict[str, torch.Tensor] = {}
    try:
        with file.open("rb") as f:
            start = safetensors_check.LENGTH_BYTES + int.from_bytes(f.read(safetensors_check.LENGTH_BYTES), "little")
            for name, entry in entries.items():
                stored = _torch_dtypes()[entry.dtype]
                raw = _tensor_bytes(f, start + entry.begin, entry.end - entry.begin, stored.itemsize)
                if raw is None:
                    raise CheckpointError(f"{file}: the file ended inside tensor {short_repr(name)}; re-download it")
                tensors[name] = _in_dtype(raw.view(stored).reshape(entry.shape), dtype)
                progress.advance()
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e}); check the file's permissions") from e
    return tensors


def _tensor_bytes(f: io.BufferedReader, offset: int, length: int, itemsize: int) -> torch.Tensor | None:
    """The `length` bytes at `offset` of `f` (None where the file ends before them): mapped
    (`_mapped`) where they can be, else read into memory of their own (an offset the dtype
    cannot be aligned at, a file that cannot be mapped, a kernel that cannot populate a
    mapping)."""
    import torch

    if length and offset % itemsize == 0:
        mapped = _mapped(f, offset, length)
        if mapped is not None:
            return mapped
    raw = torch.empty(length, dtype=torch.uint8)
    f.seek(offset)
    return raw if f.readinto(raw.numpy().data) == length else None


def _mapped(f: io.BufferedReader, offset: int, length: int) -> torch.Tensor | None:
    """The bytes in a private copy-on-write mapping of just their pages: the page cache's own
    memory, where a read would fault in and fill as much new memory (docs/performance.md has
    the load times either way). The mapping goes with the tensor's last reference, so a weight that a later stage
    replaces (packed, quantized) or converts to the build dtype leaves nothing behind, where
    one mapping of the whole file would keep every page it touched.

    The pages are populated at once (`MADV_POPULATE_READ`, Linux 5.14), so that a read error
    is an OSError here, naming the file, rather than a SIGBUS at first touch. None where that
    cannot be done."""
    page = offset - offset % mmap.ALLOCATIONGRANULARITY
    try:
        mapped = mmap.mmap(f.fileno(), offset + length - page, offset=page, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):  # not a mappable file, or one shorter than the header says
        return None
    try:
        _populate(mapped)
    except OSError as e:
        mapped.close()
        if e.errno in (errno.EINVAL, errno.ENOSYS):  # a kernel without MADV_POPULATE_READ
            return None
        raise
    import torch

    return torch.from_numpy(np.frombuffer(mapped, dtype=np.uint8, count=length, offset=offset - page))


_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; Python names it from 3.13


def _populate(mapped: mmap.mmap) -> None:
    mapped.madvise(_MADV_POPULATE_READ)


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A floating tensor in `dtype` (None: as it is); integer and bool tensors as they are."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _require_safe_torch(file: Path) -> None:
    import torch
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < MIN_TORCH_FOR_PICKLE:
        raise CheckpointError(
            f"{file}: pickled weights need torch >= {MIN_TORCH_FOR_PICKLE}, whose weights_only loader has no "
            f"known bypass; this is torch {torch.__version__}; upgrade torch or convert the checkpoint to safetensors"
        )


def _load_pickle(file: Path) -> dict[str, torch.Tensor]:
    import torch

    _require_safe_torch(file)
    try:
        with file.open("rb") as f:
            mmap = f.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC
        # weights_only=True, passed explicitly: torch then ignores TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD,
        # which only applies when the argument is left unset. There is no fallback.
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises many types for a bad or unsafe pickle
        raise CheckpointError(
            f"{file}: cannot be loaded with weights_only=True ({type(e).__name__}: {_first_line(e)}); "
            "convert the checkpoint to safetensors"
        ) from e
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in data.items()
    ):
        raise CheckpointError(f"{file}: expected a dict of tensor name -> tensor (a state dict)")
    return data


def _merge(into: dict[str, Any], more: dict[str, Any], file: Path, origin: dict[str, Path]) -> None:
    duplicates = sorted(set(into) & set(more))
    if duplicates:
        raise CheckpointError(
            f"{file}: tensor {short_repr(duplicates[0])} also appears in {origin[duplicates[0]].name}; "
            "a tensor must be stored once, regenerate the checkpoint"
        )
    into.update(more)
    origin.update(dict.fromkeys(more, file))


def _dtype_name(dtype: torch.dtype, file: Path, tensor: str) -> str:
    try:
        return _torch_dtype_names()[dtype]
    except KeyError:
        raise CheckpointError(f"{file}: tensor {short_repr(tensor)} has unsupported dtype {dtype}") from None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""
