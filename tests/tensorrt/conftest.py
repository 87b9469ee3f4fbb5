from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvforge.passes.targets import TARGETS

if TYPE_CHECKING:
    from kvforge.toolchain.build import BuildResult


@pytest.fixture(scope="session")
def tensorrt_artifact(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., BuildResult]:
    """`--target tensorrt` builds of the tiny checkpoints (graph and gate; an engine only where TensorRT
    and a GPU are present), once per test session."""
    from kvforge import BuildOptions, build

    built: dict[str, BuildResult] = {}

    def get(model_type: str = "llama") -> BuildResult:
        if model_type not in built:
            out = tmp_path_factory.mktemp(f"trt-{model_type}") / "out"
            built[model_type] = build(tiny_checkpoint(model_type), out, BuildOptions(target=TARGETS["tensorrt"]))
        return built[model_type]

    return get
