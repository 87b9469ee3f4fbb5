from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.real.models import BUILD_SECONDS
from tests.tiny import BUILD_CONTEXT, make_checkpoint


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`-n 2` in the README's test command), each worker runs on its own
    share of the CPUs, as if on a smaller machine: onnxruntime's and torch's thread pools size
    themselves from the affinity mask (`runners.cpus.usable_cpus`), and two workers each
    spinning pools over every core slow each other down. Servers and CLIs the tests start
    inherit the mask."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    index = int(worker[2:])
    share = set(cpus[index::count]) or {cpus[index % len(cpus)]}
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))


_pin_xdist_worker()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `--dist loadgroup`, a test with no `xdist_group` of its own runs on the worker that
    runs the rest of its module: a module's fixtures (a server, a venv, its families' artifacts)
    are made once, not once per worker."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))


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


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's controller: what a worker's real builds took
def pytest_testnodedown(node: Any, error: object) -> None:
    BUILD_SECONDS.update(getattr(node, "workeroutput", {}).get("real_build_seconds", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if BUILD_SECONDS:
        builds = ", ".join(f"{k} {v:.0f} s" for k, v in BUILD_SECONDS.items())
        terminalreporter.write_line(f"real checkpoints built: {builds}")
