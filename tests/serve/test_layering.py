"""The server is part of the run-time package: no torch, nothing of toolchain or passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_layering import all_imports, top_level_imports

SERVE = Path(__file__).resolve().parents[2] / "runners" / "serve"


@pytest.mark.parametrize("path", sorted(SERVE.glob("*.py")), ids=lambda p: p.name)
def test_serve_depends_on_runners_and_the_standard_library_only(path: Path) -> None:
    assert not all_imports(path) & {"toolchain", "passes", "tests", "torch", "transformers"}
    assert not top_level_imports(path) & {"onnxruntime"}


def test_the_package_has_modules() -> None:
    assert {p.name for p in SERVE.glob("*.py")} >= {"server.py", "scheduler.py", "protocol.py"}
