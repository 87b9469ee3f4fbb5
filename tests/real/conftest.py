"""Real trained checkpoints (tests/real/models.py) as the GGUF files their packages ship (a file
assembled from parts is cached under pytest's cache directory, keyed by the package's version),
and their artifacts, built from those files once per session."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.real.models import BUILD_SECONDS, MODELS, missing


@pytest.fixture(scope="session")
def real_checkpoint(request: pytest.FixtureRequest) -> Callable[[str], Path]:
    from kvforge.toolchain import checkpoint as checkpoints

    made: dict[str, Path] = {}
    held: list[checkpoints.Checkpoint] = []  # each file read once: loads of it reuse this while held

    def get(name: str) -> Path:
        model = MODELS[name]
        if (why := missing(model)) is not None:
            pytest.skip(f"{model.name}: {why}")
        if name not in made:
            made[name] = model.gguf_path(Path(request.config.cache.mkdir("kvforge-real-gguf")))
            held.append(checkpoints.load(made[name]))
        return made[name]

    return get


@pytest.fixture(scope="session")
def real_artifact(
    real_checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., Path]:
    """The artifact of a real checkpoint's GGUF file, built once per session: the default build
    (the file's codes at int8 activations), or with `exact=True` its codes at float activations
    (`--exact-activations`, the float gate)."""
    from kvforge import BuildOptions, build

    built: dict[tuple[str, bool], Path] = {}

    def get(name: str, exact: bool = False) -> Path:
        key = (name, exact)
        if key not in built:
            label = "exact" if exact else "default"
            out = tmp_path_factory.mktemp(f"real-{name}-{label}") / "out"
            checkpoint = real_checkpoint(name)  # assembled and read, the first time, before the clock starts
            start = time.perf_counter()
            built[key] = build(checkpoint, out, BuildOptions(exact_activations=exact)).output
            BUILD_SECONDS[f"{name} {label}"] = time.perf_counter() - start
        return built[key]

    return get


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its build times to the controller (tests/conftest.py prints them)."""
    workeroutput = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker: hand them on
    if workeroutput is not None:
        workeroutput["real_build_seconds"] = dict(BUILD_SECONDS)
