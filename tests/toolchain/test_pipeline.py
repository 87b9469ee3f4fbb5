"""End to end, per architecture: checkpoint -> torch.export -> ONNX -> gate -> artifact -> runner.

The reference is the eager HF model driven by transformers' own `generate`, independent
of kvforge's loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvforge.runners.engine import Engine
from kvforge.runners.generate import empty_cache, forward
from tests.tiny import FAMILIES, hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["def fibonacci(n):", "class Point:\n    def"]
NEW_TOKENS = 24


def eager_greedy(checkpoint: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    return hf_greedy(model, prompt_ids, new_tokens)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_generation_matches_eager_hf(
    model_type: str, tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    artifact = built_artifact(model_type)
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True
    assert manifest["parity"]["decode_steps"] >= 8
    engine = Engine.load(artifact)
    engine.eos_ids = ()  # compare the full length; transformers generates without eos too
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ours = engine.generate_tokens([ids], max_new_tokens=NEW_TOKENS, temperature=0.0)[0]
        assert ours == eager_greedy(tiny_checkpoint(model_type), ids, NEW_TOKENS), prompt


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gemma3_text", "qwen3_moe", "deepseek_v3"])
def test_batch_with_left_padding_equals_one_by_one(model_type: str, built_artifact: Callable[..., Path]) -> None:
    engine = Engine.load(built_artifact(model_type))
    engine.eos_ids = ()
    prompts = [engine.encode(p) for p in ["for i in range(10):", "import os", "héllo wörld, naïve café"]]
    assert len({len(p) for p in prompts}) == 3  # really padded
    batched = engine.generate_tokens(prompts, max_new_tokens=16, temperature=0.0)
    alone = [engine.generate_tokens([p], max_new_tokens=16, temperature=0.0)[0] for p in prompts]
    assert batched == alone


def test_graph_io_follows_contract(built_artifact: Callable[..., Path]) -> None:
    import onnx

    model = onnx.load(built_artifact("llama") / "model.onnx", load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    assert inputs[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert inputs[3:-1] == [f"past_key_values.{i}.{k}" for i in range(2) for k in ("key", "value")]
    assert inputs[-1] == "logits_to_keep"  # the default build: last, with its default as an initializer
    assert [t.name for t in model.graph.initializer if t.name == "logits_to_keep"] == ["logits_to_keep"]
    assert outputs == ["logits"] + [f"present.{i}.{k}" for i in range(2) for k in ("key", "value")]
    logits = model.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in logits] == ["batch", "kept", 384]
    past = model.graph.input[3].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in past] == ["batch", 2, "capacity", 16]  # ort-cpu: shared KV buffer
    # every weight lives in the external data file
    weights = [t for t in model.graph.initializer if np.prod(t.dims) * 4 > 1024]
    assert weights and all(t.data_location == onnx.TensorProto.EXTERNAL for t in weights)


def test_prefill_with_empty_past_and_single_token_decode(built_artifact: Callable[..., Path]) -> None:
    """No 0/1 specialization: past length 0, then seq 1, run on the same graph."""
    engine = Engine.load(built_artifact("qwen2"))
    io = engine.session.io
    cache = empty_cache(io, 1, capacity=2)
    logits, cache = forward(engine.session, np.array([[5]]), np.ones((1, 1), np.int64), cache)
    assert logits.shape == (1, 1, io.vocab_size)
    first_key = cache["past_key_values.0.key"][:, :, :1].copy()
    assert np.abs(first_key).sum() > 0  # written at position 0 of the shared buffer
    logits, cache = forward(engine.session, np.array([[6]]), np.ones((1, 2), np.int64), cache)
    assert logits.shape == (1, 1, io.vocab_size)
    np.testing.assert_array_equal(cache["past_key_values.0.key"][:, :, :1], first_key)  # earlier position kept
    assert np.abs(cache["past_key_values.0.key"][:, :, 1]).sum() > 0
