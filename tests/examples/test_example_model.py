"""The bundled example model end to end: the compiled artifact generates exactly what the
eager transformers model generates, token for token, and the model has learned something.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from kvforge.runners.engine import Engine
from tests.examples.conftest import EXAMPLE_MODEL
from tests.tiny import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "def read_config(path):\n",
    "import os\nimport sys\n\n\nclass ",
    "    for i in range(len(items)):\n        if ",
    '"""Utilities for parsing command-line arguments."""\n',
    "héllo = 'wörld'  # ",
]
NEW_TOKENS = 64
# A stdlib-style snippet written for this test (the training corpus never saw it).
SNIPPET = '''def chunked(iterable, size):
    """Yield successive lists of at most size items from iterable."""
    if size < 1:
        raise ValueError("size must be at least 1")
    chunk = []
    for item in iterable:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
'''


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(EXAMPLE_MODEL, dtype=torch.float32, attn_implementation="eager").eval()


def test_checkpoint_is_small_and_complete() -> None:
    names = {p.name for p in EXAMPLE_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "generation_config.json" in names
    assert "chat_template.jinja" in names or "chat_template" in json.loads(
        (EXAMPLE_MODEL / "tokenizer_config.json").read_text()
    )
    assert sum(p.stat().st_size for p in EXAMPLE_MODEL.iterdir()) < 20 * 2**20


def test_greedy_continuations_match_eager_hf(example_artifact: Path, hf_model: torch.nn.Module) -> None:
    manifest = json.loads((example_artifact / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    engine = Engine.load(example_artifact)
    engine.eos_ids = ()  # compare the full length; transformers generates without eos too
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ours = engine.generate_tokens([ids], max_new_tokens=NEW_TOKENS, temperature=0.0)[0]
        assert ours == hf_greedy(hf_model, ids, NEW_TOKENS), prompt


def test_model_has_learned_python(hf_model: torch.nn.Module) -> None:
    """Loss on unseen stdlib-style code is far below that of a uniform guess."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(EXAMPLE_MODEL / "tokenizer.json")).encode(SNIPPET).ids
    with torch.no_grad():
        loss = hf_model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    uniform = math.log(hf_model.config.vocab_size)
    assert loss < 0.6 * uniform, (loss, uniform)
