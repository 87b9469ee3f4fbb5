"""examples/build_and_generate.sh: build and generate from the shell, with honest exit codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLE_MODEL, EXAMPLES, ROOT

SCRIPT = EXAMPLES / "build_and_generate.sh"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, check=False)


@pytest.mark.slow
def test_builds_and_generates_from_the_example_model(tmp_path: Path) -> None:
    out = tmp_path / "artifact"
    result = run_script(str(EXAMPLE_MODEL), str(out), "import os\n")
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "manifest.json").read_text())["parity"]["passed"] is True
    assert "parity passed" in result.stderr
    assert "finish: " in result.stderr  # the generation statistics line
    assert len(result.stdout.strip()) > 20  # the generated text


def test_a_missing_checkpoint_fails_with_one_line(tmp_path: Path) -> None:
    result = run_script(str(tmp_path / "nothing"), str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("kvforge: error: ") and "no such directory" in result.stderr
    assert not (tmp_path / "out").exists()


def test_usage_without_arguments() -> None:
    result = run_script()
    assert result.returncode == 2
    assert result.stderr.startswith("usage: ")
