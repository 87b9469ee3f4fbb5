from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where `fusion_testing.canonical_graph` keeps the tiny checkpoints it exports, once per session."""
    return tmp_path_factory.getbasetemp()
