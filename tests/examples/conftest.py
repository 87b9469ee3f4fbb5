from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EXAMPLE_MODEL = EXAMPLES / "model"


@pytest.fixture(scope="session")
def example_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """examples/model built once per test session with the Python API."""
    from toolchain.build import build

    return build(EXAMPLE_MODEL, tmp_path_factory.mktemp("example") / "out").output
