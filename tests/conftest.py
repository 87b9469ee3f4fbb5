from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.tiny import BUILD_CONTEXT, make_checkpoint

# Every build traces: a test of lowering (or one that patches it) never reads a graph another
# test, or an earlier run, left in a lowering cache. tests/toolchain/test_lowering_cache.py turns it on.
os.environ["KVFORGE_LOWERING_CACHE"] = "off"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Tiny checkpoints by model type (and dtype), made once per test session."""
    made: dict[tuple[str, str], Path] = {}

    def get(model_type: str = "llama", dtype: str = "float32") -> Path:
        key = (model_type, dtype)
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{model_type}-{dtype}"), model_type, dtype)
        return made[key]

    return get


@pytest.fixture(scope="session")
def built_artifact(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """Artifacts built from the tiny checkpoints, once per test session."""
    from kvforge import BuildOptions, build

    built: dict[tuple[str, str], Path] = {}

    def get(model_type: str = "llama", dtype: str = "float32") -> Path:
        key = (model_type, dtype)
        if key not in built:
            out = tmp_path_factory.mktemp(f"art-{model_type}-{dtype}") / "out"
            options = BuildOptions(context=BUILD_CONTEXT.get(model_type))
            built[key] = build(tiny_checkpoint(model_type, dtype), out, options).output
        return built[key]

    return get


@pytest.fixture(scope="session")
def example_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/model (the bundled example model) built once per test session with the Python API."""
    from kvforge import build

    model = Path(__file__).resolve().parents[1] / "examples" / "model"
    return build(model, tmp_path_factory.mktemp("example") / "out").output
