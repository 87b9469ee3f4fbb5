"""The Triton adapter is part of the run-time package: no torch, nothing of toolchain or passes,
and neither Triton's stub module nor onnxruntime at import (the main environment has neither stub)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_layering import all_imports, top_level_imports

TRITON = Path(__file__).resolve().parents[2] / "runners" / "triton"


@pytest.mark.parametrize("path", sorted(TRITON.glob("*.py")), ids=lambda p: p.name)
def test_the_adapter_depends_on_runners_and_the_standard_library_only(path: Path) -> None:
    assert not all_imports(path) & {"toolchain", "passes", "tests", "torch", "transformers"}
    assert not top_level_imports(path) & {"onnxruntime", "triton_python_backend_utils", "tritonclient"}


def test_the_package_has_modules() -> None:
    assert {p.name for p in TRITON.glob("*.py")} >= {"backend.py", "contract.py", "requests.py"}
