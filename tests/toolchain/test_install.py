"""`pip install .` is the runtime: in a clean environment, without torch, `kvforge generate`
runs an artifact and `kvforge build` says in one line what to install."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def fibonacci(n):"

# What pip prints when it cannot reach a package index (or the index lacks a dependency)
_UNREACHABLE = (
    "Could not find a version that satisfies",
    "No matching distribution found",
    "NewConnectionError",
    "Temporary failure in name resolution",
    "Network is unreachable",
    "ConnectTimeoutError",
    "Max retries exceeded",
)


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding `pip install .` and nothing else."""
    venv = tmp_path_factory.mktemp("runtime") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if install.returncode != 0:
        if any(sign in install.stderr for sign in _UNREACHABLE):
            pytest.skip(f"the package registry is unreachable from here: {install.stderr.strip().splitlines()[-1]}")
        pytest.fail(f"pip install . failed:\n{install.stderr}")
    return venv


def test_the_runtime_install_has_no_torch_and_generates_what_the_engine_generates(
    runtime_venv: Path, built_artifact: Callable[..., Path]
) -> None:
    from kvforge import Engine

    python = runtime_venv / "bin" / "python"
    for heavy in ("torch", "transformers", "onnx", "onnxscript"):
        found = subprocess.run([str(python), "-c", f"import {heavy}"], capture_output=True, text=True)
        assert found.returncode != 0, f"pip install . installed {heavy}"
    artifact = built_artifact("llama")
    args = ["generate", str(artifact), PROMPT, "--max-new-tokens", "16", "--temperature", "0"]
    result = subprocess.run([str(runtime_venv / "bin" / "kvforge"), *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    expected = Engine.load(artifact).generate(PROMPT, max_new_tokens=16, temperature=0.0)
    assert isinstance(expected, str) and expected
    assert result.stdout in (expected, expected + "\n")


def test_the_runtime_install_is_one_package_named_kvforge(runtime_venv: Path, tmp_path: Path) -> None:
    """Outside the repository (whose folders would otherwise be found from the working
    directory), the install holds `kvforge` and its public runtime names, and no generic
    top-level package."""
    python = str(runtime_venv / "bin" / "python")
    public = "import sys; from kvforge import Engine, SamplingParams, KvforgeError; print('torch' in sys.modules)"
    result = subprocess.run([python, "-c", public], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
    for generic in ("runners", "toolchain", "passes"):
        found = subprocess.run([python, "-c", f"import {generic}"], capture_output=True, text=True, cwd=tmp_path)
        assert found.returncode != 0 and "No module named" in found.stderr, f"pip install . installed {generic}"
    listing = subprocess.run(
        [python, "-c", "import kvforge; print(' '.join(kvforge.__all__))"], capture_output=True, text=True, cwd=tmp_path
    )
    assert {"Engine", "build", "BuildOptions", "serve"} <= set(listing.stdout.split())


def test_build_without_the_compiler_says_to_install_it(runtime_venv: Path, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(runtime_venv / "bin" / "kvforge"), "build", str(ROOT / "examples" / "model"), "-o", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvforge: error: `kvforge build` needs ")
    assert lines[0].endswith("install kvforge[build]")
    assert not (tmp_path / "out").exists()
