"""The dependency direction of DESIGN.md, checked on the import statements of every module.

toolchain -> passes, toolchain -> runners; runners imports nothing of ours but itself and
never torch at module level (torch_session, the eager reference, is the one exception);
passes imports neither torch nor onnxruntime nor our other packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def top_level_imports(path: Path) -> set[str]:
    """Modules imported at module level (imports inside functions are deferred, so allowed)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def all_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "runners").glob("*.py")), ids=lambda p: p.name)
def test_runners_depend_on_nothing_of_ours(path: Path) -> None:
    assert not all_imports(path) & {"toolchain", "passes", "tests"}
    if path.name != "torch_session.py":
        assert not top_level_imports(path) & {"torch", "transformers"}


@pytest.mark.parametrize("path", sorted((ROOT / "passes").glob("*.py")), ids=lambda p: p.name)
def test_passes_stay_graph_only(path: Path) -> None:
    assert not all_imports(path) & {"torch", "onnxruntime", "toolchain", "runners", "transformers"}


def test_layering_check_sees_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom toolchain.spec import DecoderSpec\ndef f():\n    import onnxruntime\n")
    assert top_level_imports(bad) == {"torch", "toolchain"}
    assert all_imports(bad) == {"torch", "toolchain", "onnxruntime"}
