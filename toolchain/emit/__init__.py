"""Writing the artifact's files: the ONNX model with external weights, tokenizer, generation config."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kvforge.toolchain.checkpoint import Checkpoint
from kvforge.toolchain.spec import DecoderSpec

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
GENERATION_CONFIG = "generation_config.json"
# Tensors up to this size stay inside model.onnx: shape constants must, since onnxruntime's
# shape inference cannot read external data; every weight matrix goes to model.onnx.data.
_INLINE_MAX_BYTES = 1024
# Weight bytes the writer may hold copied in memory at once, beyond the tensor it writes
# (onnx-ir's default is 1 GiB: a build's peak memory would grow by that much).
_WRITE_BUFFER_BYTES = 64 << 20


def write_onnx(model: ir.Model, directory: Path) -> Path:
    """model.onnx with every weight in model.onnx.data, so models over 2 GB work."""
    path = directory / MODEL_FILE
    # onnx-ir 1.0 has no bound on the bytes in flight (1.1 added it): pass it where it exists
    bound: dict[str, Any] = (
        {"max_in_flight_bytes": _WRITE_BUFFER_BYTES}
        if "max_in_flight_bytes" in inspect.signature(ir.save).parameters
        else {}
    )
    ir.save(model, path, external_data=DATA_FILE, size_threshold_bytes=_INLINE_MAX_BYTES, **bound)
    return path


def write_json(path: Path, data: Any) -> None:
    """Stable bytes for the same data: sorted keys, fixed indentation, trailing newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def copy_tokenizer(checkpoint: Checkpoint, directory: Path) -> None:
    for source in checkpoint.tokenizer_files:
        shutil.copyfile(source, directory / source.name)


def generation_config(checkpoint: Checkpoint, spec: DecoderSpec) -> dict[str, Any]:
    """The checkpoint's generation defaults, with eos/bos/pad ids resolved from the spec."""
    config = dict(checkpoint.generation_config or {})
    config.pop("transformers_version", None)  # says which library wrote it, not how to generate
    config["eos_token_id"] = list(spec.eos_token_ids)
    config["bos_token_id"] = spec.bos_token_id
    config["pad_token_id"] = spec.pad_token_id
    return config


def write_generation_config(checkpoint: Checkpoint, spec: DecoderSpec, directory: Path) -> None:
    write_json(directory / GENERATION_CONFIG, generation_config(checkpoint, spec))
