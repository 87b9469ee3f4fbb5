"""onnxruntime-genai's runtime on the example model: its Generator and tokenizer write the text
kvforge's runner writes, from Python (examples/genai/genai_stream.py) and from C
(examples/genai/genai_stream.c, built with the C compiler where the machine has one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.conftest import EXAMPLES
from tests.genai import genai_greedy

pytestmark = pytest.mark.slow

og = pytest.importorskip("onnxruntime_genai")
SCRIPT = EXAMPLES / "genai" / "genai_stream.py"
C_SOURCE = EXAMPLES / "genai" / "genai_stream.c"
PROMPTS = ("def read_config(path):", "import os\nimport sys\n", "class Stack:\n    def push(self, item):")
NEW_TOKENS = 32


def test_generator_and_tokenizer_match_kvforge_on_the_example_model(example_artifact: Path) -> None:
    from kvforge.runners.engine import Engine

    model = og.Model(str(example_artifact))
    tokenizer = og.Tokenizer(model)
    engine = Engine.load(example_artifact, huge_pages=False)
    for prompt in PROMPTS:
        ids = [int(i) for i in tokenizer.encode(prompt)]
        assert ids == engine.encode(prompt)
        tokens = genai_greedy(og, model, ids, NEW_TOKENS)
        assert tokens == engine.generate_tokens([ids], max_new_tokens=NEW_TOKENS, temperature=0)[0]
        expected = engine.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0)
        body = [t for t in tokens if t not in engine.eos_ids]
        assert "\ufffd" not in expected and tokenizer.decode(body) == expected


def _kvforge_text(artifact: Path, prompt: str) -> str:
    from kvforge.runners.engine import Engine

    return Engine.load(artifact, huge_pages=False).generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0)


def test_python_example_streams_kvforges_text(example_artifact: Path) -> None:
    prompt = PROMPTS[0]
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(example_artifact), prompt, str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": ""},  # onnxruntime-genai alone: no kvforge on the path
    )
    assert result.stdout == _kvforge_text(example_artifact, prompt) + "\n"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
def test_c_example_streams_kvforges_text(example_artifact: Path, tmp_path: Path) -> None:
    import onnxruntime

    genai_lib = Path(og.__file__).parent
    ort_lib = tmp_path / "ort"
    ort_lib.mkdir()
    (ort_lib / "libonnxruntime.so.1").symlink_to(
        next((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    )
    binary = tmp_path / "genai_stream"
    subprocess.run(
        [
            "cc",
            "-std=c11",
            "-Wall",
            "-Werror",
            str(C_SOURCE),
            "-o",
            str(binary),
            f"-L{genai_lib}",
            "-lonnxruntime-genai",
            f"-Wl,-rpath,{genai_lib}",
        ],
        check=True,
        timeout=120,
    )
    prompt = PROMPTS[0]
    result = subprocess.run(
        [str(binary), str(example_artifact), prompt, str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LD_LIBRARY_PATH": str(ort_lib)},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == _kvforge_text(example_artifact, prompt) + "\n"
