"""GGUF files (llama.cpp's format) as checkpoints: `kvforge build model.gguf`.

A GGUF file carries the config, the tokenizer with its chat template, and the weights (most
of them quantized). Everything kvforge reads from one is read here:

- `find` says whether a path names a GGUF file (the file itself, or a directory holding
  exactly one and no config.json);
- `dequantize` writes the checkpoint the file holds into a directory as an ordinary one,
  which `kvforge.toolchain.checkpoint.load` reads (into a scratch directory it keeps alive as
  long as the `Checkpoint`), so the pipeline and its checks are those of every checkpoint; the
  `Checkpoint` names the GGUF file as its only input (the manifest's sources). The config and
  the tokenizer are transformers' own from the metadata (`AutoConfig`, `AutoTokenizer`), the
  weights what its GGUF loader loads, float32, each tensor dequantized once in numpy by the
  gguf package (a memory map and numpy arrays: nothing in the file is executed) without
  building the model;
- `tensors` gives the file's own tensors, still in their GGUF types, by Hugging Face name;
- `quantized_weights` the quantized ones as records the build imports with their own codes
  (`kvforge.toolchain.gguf_import`), their rows in the order transformers' loader gives the weights;
  `holds_quantized` says whether there are any (a file that has them builds, by default, with
  its codes at int8 activations: `kvforge.toolchain.build`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.runners.errors import CheckpointError
from kvforge.toolchain import progress

if TYPE_CHECKING:
    from kvforge.toolchain.prequantized import Imported

logger = logging.getLogger(__name__)

SUFFIX = ".gguf"
TOKEN_EMBEDDING, OUTPUT, LM_HEAD = "token_embd.weight", "output.weight", "lm_head.weight"
MAGIC = b"GGUF"


def find(path: Path) -> Path | None:
    """The GGUF file `path` names: `path` itself if it is one, or the one `.gguf` file of a
    directory without config.json; None for anything else (the checkpoint loader reports it)."""
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    try:
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == SUFFIX and p.is_file())
    except OSError:
        return None  # the checkpoint loader names the directory and why it cannot be listed
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4])
        raise CheckpointError(
            f"{path}: holds {len(found)} GGUF files ({names}); pass the one to build: kvforge build {found[0]} ..."
        )
    return found[0] if found else None


def dequantize(file: Path, out: Path) -> None:
    """Write the checkpoint `file` holds into the directory `out`, its weights dequantized to
    float32 (see the module's docstring): what `kvforge.toolchain.checkpoint.load` then reads as
    any checkpoint.

    Raises CheckpointError naming the file when it is not a GGUF file, or when transformers
    cannot read it (an architecture its GGUF loader does not know, a truncated file)."""
    _check_magic(file)
    file = file.absolute()  # not resolved: a link (a Hub snapshot's, into blobs/) keeps its name
    with progress.stage("gguf"), _transformers_reading(file):
        _write_checkpoint(file, out)
    logger.info("%s: dequantized to float32 into %s", file, out)


@contextmanager
def _transformers_reading(file: Path) -> Iterator[None]:
    """transformers' GGUF readers, reading `file` through the reader the build holds (`_reader`)
    and its metadata parsed once (`AutoConfig` and `AutoTokenizer` each parse it otherwise,
    every token of the vocabulary a Python call), with its progress bars off: the stage
    reports it."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loader
    from transformers.utils import logging as transformers_logging

    package_reader, package_names = gguf.GGUFReader, gguf.get_tensor_name_map
    package_metadata = loader.load_gguf_checkpoint
    parsed: list[dict[str, Any]] = []

    def shared(path: Any, mode: str = "r") -> Any:
        same = mode == "r" and Path(path).absolute() == file
        return _reader(file) if same else package_reader(path, mode)  # type: ignore[arg-type]

    def metadata(path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
        if return_tensors or args or kwargs or Path(path).absolute() != file:
            return package_metadata(path, return_tensors, *args, **kwargs)
        if not parsed:
            parsed.append(package_metadata(path, return_tensors=False))
        # a caller may change the config it is given; the tokenizer's lists are only read
        return {name: copy.deepcopy(part) if name == "config" else part for name, part in parsed[0].items()}

    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    # transformers imports these from their modules as it reads; it asks for the architecture's
    # name table once per module of the model (a table of thousands of formatted names each time)
    gguf.GGUFReader = shared  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = _name_table
    loader.load_gguf_checkpoint = metadata  # type: ignore[assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = package_reader  # type: ignore[misc]
        gguf.get_tensor_name_map = package_names
        loader.load_gguf_checkpoint = package_metadata
        if shown:
            transformers_logging.enable_progress_bar()


@functools.lru_cache(maxsize=8)
def _name_table(arch: Any, blocks: int) -> Any:
    """The gguf package's tensor-name table of an architecture with `blocks` blocks (read only),
    made once."""
    from gguf.tensor_mapping import get_tensor_name_map

    return get_tensor_name_map(arch, blocks)


def _check_magic(file: Path) -> None:
    try:
        with file.open("rb") as f:
            head = f.read(len(MAGIC))
    except OSError as e:
        raise CheckpointError(f"{file}: cannot be read ({e.strerror or e}); check the file's permissions") from e
    if head != MAGIC:
        raise CheckpointError(
            f"{file}: not a GGUF file (it does not start with {MAGIC.decode()}); pass a .gguf file or a checkpoint "
            "directory"
        )


def _write_checkpoint(file: Path, out: Path) -> None:
    """config.json, generation_config.json, the tokenizer's files (its chat template included)
    and model.safetensors (float32) of `file`, written into `out`.

    The config and the tokenizer are transformers' own from the file's metadata
    (`AutoConfig` and `AutoTokenizer` given `gguf_file`); the weights are what its GGUF loader
    loads, without building the model: each tensor dequantized once, in numpy, by the gguf
    package, then put through transformers' tensor processor for the architecture (the llama
    query and key rows back in their order, Gemma's norms less one) under the name its
    GGUF-to-Hugging-Face table gives (`_hf_weights`)."""
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(
            file.parent, gguf_file=file.name, config=config, local_files_only=True
        )
        weights = _hf_weights(file, config)
    except ImportError as e:  # gguf and accelerate: optional dependencies of transformers
        raise CheckpointError(
            f"{file}: reading GGUF files needs a package that is not installed ({_first_line(e)}); "
            "install kvforge[build]"
        ) from e
    except CheckpointError:
        raise
    except Exception as e:  # transformers raises ValueError, KeyError, struct errors... for a file it cannot read
        raise CheckpointError(
            f"{file}: transformers' GGUF loader cannot read it ({type(e).__name__}: {_first_line(e)}); "
            "check that transformers supports its architecture, or convert the model to a checkpoint directory"
        ) from e
    # the weights are written dequantized: the checkpoint is an ordinary float32 one
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    count = _token_count(file)
    if any(token_id >= count for token_id in tokenizer.added_tokens_decoder):  # else tokenizer.json is not read back
        _keep_only_the_files_tokens(out / "tokenizer.json", count)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


def _hf_weights(file: Path, config: Any) -> dict[str, np.ndarray]:
    """The model's weights as transformers' GGUF loader loads them (`load_gguf_checkpoint` given
    tensors), in float32 numpy arrays by Hugging Face name: every tensor of the file that names
    one of the model's weights, dequantized and put through the architecture's tensor
    processor. The names come from transformers' table over the model's modules, built on the
    meta device (nothing allocated). A tied LM head is left out (the table holds it); a weight
    of the model that the file does not give is an error naming it."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = _reader(file)
    parsed: dict[str, Any] = {"config": config.to_dict(), "tensors": {}}
    processor = TENSOR_PROCESSORS.get(str(_field(reader, file, "general.architecture")), TensorProcessor)(
        config=parsed["config"]
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = get_gguf_hf_weights_map(model, processor)
    expected = set(model.state_dict())
    del model
    tensors: dict[str, np.ndarray] = parsed["tensors"]
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=names, parsed_parameters=parsed
        )
        if result.name in names:
            tensors[names[result.name]] = np.ascontiguousarray(result.weights, dtype=np.float32)
    if config.tie_word_embeddings:  # one tensor under two names: safetensors stores it once
        tensors.pop(LM_HEAD, None)
        expected.discard(LM_HEAD)
    for name, value in tensors.items():
        if not isinstance(value, np.ndarray):  # a processor that set a torch tensor itself (MoE experts)
            tensors[name] = np.ascontiguousarray(np.asarray(value), dtype=np.float32)
    missing = sorted(expected - set(tensors))
    if missing:
        raise CheckpointError(
            f"{file}: holds no tensor for {len(missing)} of the model's weights ({', '.join(missing[:4])}); "
            "the file is incomplete, or its architecture's tensors are named in a way transformers does not map"
        )
    return {name: tensors[name] for name in expected & set(tensors)}


def _token_count(file: Path) -> int:
    tokens = _reader(file).get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise CheckpointError(f"{file}: metadata key 'tokenizer.ggml.tokens' is missing; the file has no tokenizer")
    return len(tokens.data)


def _keep_only_the_files_tokens(tokenizer_json: Path, count: int) -> None:
    """Drop the added tokens past the file's `count` tokens. transformers' loader builds a
    byte-level vocabulary with GPT-2's defaults, which add `<|endoftext|>` where the file has
    no such token (Llama 3's files, say): an id past the embedding table, not the model's."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    added = data.get("added_tokens") or []
    kept = [token for token in added if token["id"] < count]
    if len(kept) != len(added):
        dropped = ", ".join(repr(t["content"]) for t in added if t["id"] >= count)
        logger.info("%s: dropped token(s) %s, which the GGUF file does not list", tokenizer_json, dropped)
        data["added_tokens"] = kept
        tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# --- the file's own tensors -------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor as the GGUF file stores it."""

    gguf_name: str  # its name in the file, e.g. "blk.0.attn_q.weight"
    type: Any  # gguf.GGMLQuantizationType: F32, F16, Q8_0, Q4_K...
    shape: tuple[int, ...]  # in PyTorch's order (outermost first); GGUF lists it innermost first
    data: np.ndarray  # the stored bytes (or elements, for unquantized types), memory-mapped from the file


def tensors(file: Path, hf_names: Iterable[str]) -> dict[str, GGUFTensor]:
    """The file's tensors by Hugging Face name, in their GGUF types, without dequantizing.

    `hf_names` (a checkpoint's tensor names: `Checkpoint.tensor_metadata()`'s keys) map to
    the file's names through the gguf package's own table for the file's architecture, the
    one llama.cpp's converter names tensors by. A name the file has no tensor for (a tied
    `lm_head.weight`, a buffer) is left out.

    What the file stores is llama.cpp's layout, which is not always the Hugging Face one: for
    the llama architecture the query and key rows are in llama.cpp's rotary order, and
    transformers' loader undoes that after dequantizing; a consumer of the raw data must too.
    """
    import gguf

    reader = _reader(file)
    arch_name = _field(reader, file, "general.architecture")
    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch_name), None)
    if arch is None:
        raise CheckpointError(f"{file}: architecture {arch_name!r} is unknown to the gguf package; upgrade gguf")
    blocks = int(_field(reader, file, f"{arch_name}.block_count"))
    stored = {t.name: t for t in reader.tensors}
    table = _name_table(arch, blocks)
    found: dict[str, GGUFTensor] = {}
    for hf_name in hf_names:
        gguf_name = _gguf_name(table, hf_name)
        tensor = stored.get(gguf_name) if gguf_name is not None else None
        if tensor is not None:
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            found[hf_name] = GGUFTensor(tensor.name, tensor.tensor_type, shape, tensor.data)
    return found


def holds_quantized(file: Path) -> bool:
    """Whether the file stores any matrix quantized (any 2-D tensor not F32, F16 or BF16): read
    from its tensor index, without touching the data."""
    from gguf import GGMLQuantizationType

    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    return any(len(t.shape) == 2 and t.tensor_type not in floats for t in _reader(file).tensors)


def quantized_weights(file: Path, hf_names: Iterable[str], config: Mapping[str, Any]) -> dict[str, Imported]:
    """The file's quantized matrices as pre-quantized records (`kvforge.toolchain.gguf_import.decode`),
    by Hugging Face weight name, each recording its GGUF type (`Imported.stored_as`).

    Where transformers' loader reorders a tensor's rows after dequantizing it (the llama
    architecture's query and key rows, which llama.cpp's converter interleaves), the record's
    rows (codes, scales, mins) take the same order: the order is read from transformers' own
    tensor processor for the file's architecture, given the row indices. A tensor the processor
    changes otherwise (its values, shape or name) is not imported: the dequantized checkpoint
    holds it in float. A file without an output matrix ties the LM head to the token
    embedding table: its record is the LM head's (`lm_head.weight`) too."""
    from kvforge.toolchain.gguf_import import decode

    reader = _reader(file)
    arch_name = str(_field(reader, file, "general.architecture"))
    stored = {t.name for t in reader.tensors}
    found: dict[str, Imported] = {}
    tied: Imported | None = None
    for hf_name, tensor in tensors(file, hf_names).items():
        if len(tensor.shape) != 2:
            continue
        n, k = tensor.shape
        imported = decode(np.asarray(tensor.data), tensor.type, (n, k))
        if imported is None:
            continue
        order = _row_order(arch_name, tensor.gguf_name, n, config)
        if order is None:
            logger.info("%s: %s is reordered by transformers' loader in a way its codes cannot follow", file, hf_name)
            continue
        q = imported.record
        if not np.array_equal(order, np.arange(n)):
            mins = None if q.mins is None else q.mins[order]
            zero_points = None if q.zero_points is None else q.zero_points[order]
            factors = None if q.factors is None else q.factors.rows(order)
            q = dataclasses.replace(
                q, codes=q.codes[order], scales=q.scales[order], zero_points=zero_points, mins=mins, factors=factors
            )
        found[hf_name] = dataclasses.replace(imported, record=q, stored_as=tensor.type.name)
        if tensor.gguf_name == TOKEN_EMBEDDING and OUTPUT not in stored:
            tied = found[hf_name]  # the LM head reads the table: the graph may name it either way
    if tied is not None:
        found.setdefault(LM_HEAD, tied)
    return found


def _row_order(arch_name: str, gguf_name: str, rows: int, config: Mapping[str, Any]) -> np.ndarray | None:
    """Which stored row each row of the weight transformers loads is (identity when it keeps
    them), from its tensor processor run on the row indices; None where it does more than
    reorder rows."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=dict(config))
    probe = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    try:
        result = processor.process(
            weights=probe, name=gguf_name, tensor_key_mapping={}, parsed_parameters={"tensors": {}}
        )
    except Exception:  # a processor that needs more of the file than one tensor: not followed
        return None
    weights = np.asarray(result.weights)
    if result.name != gguf_name or weights.shape != (rows, 1):
        return None
    order = weights[:, 0]
    if not np.array_equal(np.sort(order), np.arange(rows)):
        return None
    return order.astype(np.int64)


def _reader(file: Path) -> Any:
    """The gguf package's reader of `file`, parsed once for as long as the file is unchanged
    (its path, size and mtime): the build and transformers' loader share it."""
    _check_magic(file)
    stat = file.stat()
    return _parsed(str(file), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed(file: str, size: int, mtime_ns: int) -> Any:
    try:
        return _fast_reader()(file, "r")
    except Exception as e:  # the reader raises ValueError, IndexError... for a malformed file
        raise CheckpointError(
            f"{file}: the gguf package cannot read it ({type(e).__name__}: {_first_line(e)}); re-download it"
        ) from e


@functools.cache
def _fast_reader() -> type:
    """`gguf.GGUFReader`, its fields read from a plain array over the file's memory map: the
    package slices its `np.memmap` once per value, and a memmap slice runs Python code of
    numpy's (a vocabulary of 49k tokens is a million slices). An array of numbers or of strings
    (the vocabulary, its scores and types, the merges) is walked in one loop rather than a call
    of the package's per element. The fields are the package's: the same parts (views of the
    same map), data indices and types."""
    import struct

    from gguf.constants import GGUFValueType
    from gguf.gguf_reader import GGUFReader  # the class itself, while transformers reads through `shared`

    class Reader(GGUFReader):  # type: ignore[misc]
        def _plain_view(self) -> np.ndarray[Any, Any]:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            return plain  # type: ignore[no-any-return]

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray[Any, Any]:
            count = int(count)
            array = self._plain_view()[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return array if order == "I" else array.view(array.dtype.newbyteorder(order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            plain = self._plain_view()
            (item_type,) = struct.unpack_from("<I", plain.data, orig_offs)
            item = GGUFValueType(item_type)
            scalar = self.gguf_scalar_to_np.get(item)
            if item != GGUFValueType.STRING and scalar is None:  # arrays of arrays: the package's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            head = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
            count = int(head[1][0])
            offs = orig_offs + 12
            if scalar is not None:
                size = np.dtype(scalar).itemsize * count
                values = list(plain[offs : offs + size].view(scalar).reshape(count, 1))
                return 12 + size, head + values, list(range(2, 2 + count)), [GGUFValueType.ARRAY, item]
            parts: list[np.ndarray[Any, Any]] = head
            unpack, buffer = struct.Struct("<Q").unpack_from, plain.data
            for _ in range(count):
                (length,) = unpack(buffer, offs)
                parts.append(plain[offs : offs + 8].view(np.uint64))
                parts.append(plain[offs + 8 : offs + 8 + length])
                offs += 8 + length
            return offs - orig_offs, parts, list(range(3, 2 + 2 * count, 2)), [GGUFValueType.ARRAY, item]

    return Reader


def _field(reader: Any, file: Path, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise CheckpointError(f"{file}: metadata key {key!r} is missing; the file is incomplete or not a model")
    return field.contents()


def _gguf_name(table: Any, hf_name: str) -> str | None:
    """The GGUF name of `hf_name`, trying it without its leading module names too (a
    causal LM's `model.` prefix, where the table lists the base model's names)."""
    stem, _, suffix = hf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        stem, suffix = hf_name, ""
    parts = stem.split(".")
    for start in range(len(parts)):
        name = table.get_name(".".join(parts[start:]))
        if name is not None:
            return f"{name}.{suffix}" if suffix else name
    return None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else type(error).__name__
