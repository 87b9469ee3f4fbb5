"""examples/embed_app.py runs with only the runner: torch and transformers cannot be imported."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvforge.runners.engine import Engine
from tests.examples.conftest import EXAMPLES, ROOT

pytestmark = pytest.mark.slow

APP = EXAMPLES / "embed_app.py"
# Block torch and transformers (an import of either now fails), run the app's main, and
# check afterwards that nothing imported them.
WRAPPER = """
import runpy, sys
sys.modules["torch"] = None
sys.modules["transformers"] = None
app = runpy.run_path(sys.argv[1])
code = app["main"](["embed_app.py", sys.argv[2]])
loaded = [m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("torch", "transformers")]
assert not loaded, loaded
sys.exit(code)
"""


def run_app(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WRAPPER, str(APP), *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_embed_app_streams_stops_and_chats_without_torch(example_artifact: Path) -> None:
    result = run_app(str(example_artifact))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    engine = Engine.load(example_artifact)

    streamed = out.split("== streaming\n", 1)[1].split("\n[", 1)[0]
    prompt = 'def read_config(path):\n    """'
    assert streamed == prompt + engine.generate(prompt, max_new_tokens=48, temperature=0.7, top_p=0.9, seed=1)
    assert "tokens, first after" in out

    stopped = out.split("== stop string\n", 1)[1].split("<stop>", 1)[0]
    assert stopped.startswith('class Stack:\n    """')
    assert "\n\n" not in stopped  # cut at the first blank line, which is not printed

    chat = out.split("== chat\n", 1)[1]
    assert "chat prompt as the model sees it: '<|user|>\\nHow do I open a file?</s>\\n<|assistant|>\\n'" in chat


def test_embed_app_reports_a_bad_artifact_in_one_line(tmp_path: Path) -> None:
    result = run_app(str(tmp_path / "missing"))
    assert result.returncode == 2
    assert result.stderr.startswith("embed_app: ") and result.stderr.count("\n") == 1
    assert "not an artifact directory" in result.stderr
