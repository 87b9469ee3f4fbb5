from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
EXAMPLE_MODEL = EXAMPLES / "model"

# example_artifact (examples/model built once per session) is in tests/conftest.py.
