"""The dependency direction of DESIGN.md, checked on the import statements of every module of
every subpackage (`runners/serve`, `runners/triton` included). Our packages are imported as
`kvforge.toolchain`, `kvforge.passes` and `kvforge.runners`; an import is named here by the
package it reaches (`toolchain`, not `kvforge`), and `kvforge` alone is its public front door.

toolchain -> passes, toolchain -> runners; runners imports nothing of ours but itself and
never torch at module level (torch_session, the eager reference, is the one exception);
passes imports neither torch nor onnxruntime nor our other packages.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> what none of its modules may import, anywhere in the module
FORBIDDEN: dict[str, frozenset[str]] = {
    # the runtime install has no onnx: a runner reads and runs graphs through onnxruntime alone
    "runners": frozenset({"kvforge", "toolchain", "passes", "tests", "onnx", "onnx_ir", "onnxscript"}),
    "passes": frozenset({"kvforge", "torch", "onnxruntime", "toolchain", "runners", "transformers"}),
}
# package -> what its modules may import only inside functions (deferred), and the modules exempt
FORBIDDEN_AT_IMPORT: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "runners": (frozenset({"torch", "transformers"}), frozenset({"runners/torch_session.py"})),
}


def modules(root: Path, package: str) -> list[Path]:
    """Every module of `package` under `root`, its subpackages' at any depth."""
    return sorted(path for path in (root / package).rglob("*.py") if "__pycache__" not in path.parts)


def package_of(name: str) -> str:
    """The package a dotted module name belongs to: `kvforge.runners.cache` -> `runners`,
    `numpy.linalg` -> `numpy`; `kvforge` alone (the front door) stays `kvforge`."""
    parts = name.split(".")
    return parts[1] if parts[0] == "kvforge" and len(parts) > 1 else parts[0]


def _imported(node: ast.AST, module: str) -> set[str]:
    """The package names an import statement reaches, relative imports resolved against
    `module` (dotted)."""
    if isinstance(node, ast.Import):
        return {package_of(a.name) for a in node.names}
    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            return {package_of(node.module)} if node.module else set()
        base = module.split(".")[: -node.level]
        return {base[0]} if base else {(node.module or "").split(".")[0]}
    return set()


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts)


def top_level_imports(path: Path, root: Path = ROOT) -> set[str]:
    """Modules imported at module level (imports inside functions are deferred, so allowed)."""
    module = _module_name(path, root)
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        names |= _imported(node, module)
    return names


def all_imports(path: Path, root: Path = ROOT) -> set[str]:
    module = _module_name(path, root)
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names |= _imported(node, module)
    return names


def violations(root: Path, package: str) -> list[str]:
    """Each import of `package`'s modules that runs against the layering, as `path: names`."""
    found = []
    for path in modules(root, package):
        where = path.relative_to(root).as_posix()
        bad = all_imports(path, root) & FORBIDDEN[package]
        deferred_only, exempt = FORBIDDEN_AT_IMPORT.get(package, (frozenset(), frozenset()))
        if where not in exempt:
            bad |= top_level_imports(path, root) & deferred_only
        if bad:
            found.append(f"{where}: {', '.join(sorted(bad))}")
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_against_the_layering(package: str) -> None:
    assert violations(ROOT, package) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_every_subpackage_is_walked(package: str) -> None:
    walked = {path.parent for path in modules(ROOT, package)}
    packages = {init.parent for init in (ROOT / package).rglob("__init__.py")}
    assert packages <= walked
    if package == "runners":
        assert {ROOT / "runners" / "serve", ROOT / "runners" / "triton"} <= walked


@pytest.mark.parametrize(
    ("planted", "source"),
    [
        ("runners/serve/scheduler.py", "from kvforge.toolchain.spec import DecoderSpec\n"),
        ("runners/triton/backend.py", "def f():\n    import kvforge.passes.pipeline\n"),  # deferred counts too
        ("runners/serve/scheduler.py", "import torch\n"),  # torch at module level
        ("passes/fuse_norm.py", "from kvforge.runners.contract import DecoderIO\n"),
        ("runners/engine.py", "from kvforge import build\n"),  # the front door is above runners
    ],
)
def test_an_upward_import_planted_in_a_copy_is_found(planted: str, source: str, tmp_path: Path) -> None:
    package = planted.split("/")[0]
    shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(tmp_path, package) == []
    target = tmp_path / planted
    target.write_text(target.read_text() + "\n" + source)
    assert violations(tmp_path, package) == [f"{planted}: {_name(source)}"]


def _name(source: str) -> str:
    statement = source.strip().splitlines()[-1].strip()
    return package_of(statement.split()[1])


def test_relative_imports_are_resolved_against_their_package(tmp_path: Path) -> None:
    (tmp_path / "runners" / "serve").mkdir(parents=True)
    inside = tmp_path / "runners" / "serve" / "x.py"
    inside.write_text("from . import batch\nfrom ..contract import DecoderIO\n")
    assert all_imports(inside, tmp_path) == {"runners"}


def test_layering_check_sees_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nfrom kvforge.toolchain.spec import DecoderSpec\ndef f():\n    import onnxruntime\n")
    assert top_level_imports(bad, tmp_path) == {"torch", "toolchain"}
    assert all_imports(bad, tmp_path) == {"torch", "toolchain", "onnxruntime"}
