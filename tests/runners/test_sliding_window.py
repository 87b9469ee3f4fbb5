"""Sliding-window layers keep a cache bounded by their window (target ort-cpu).

A bounded layer's past holds the last min(history, window - 1) positions; full-attention
layers keep their whole history in the shared buffer. Greedy output must equal transformers'
own across the window boundary, alone, in a left-padded batch and through the server's
chunked prefill; `kvforge inspect` and `kvforge bench` count what the layers really hold.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.runners.bench import kv_bytes_per_step
from kvforge.runners.contract import DecoderIO
from kvforge.runners.engine import Engine
from kvforge.runners.errors import ArtifactError
from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.serve.scheduler import Finished
from tests.serve.test_scheduler import collect, request, scheduler_for, solo
from tests.tiny import CORPUS, hf_greedy, make_checkpoint

WINDOW = 8
NEW_TOKENS = 24
IO = DecoderIO(3, 2, 16, 100, layer_windows=(8, None, 4))


# --- the contract -------------------------------------------------------------------------


def test_layer_windows_are_in_the_manifest_only_when_set() -> None:
    data = IO.to_dict()
    assert data["layer_windows"] == [8, None, 4]
    assert DecoderIO.from_dict(data) == IO
    assert "layer_windows" not in DecoderIO(3, 2, 16, 100).to_dict()
    dims = {t.name: t.dims for t in IO.inputs + IO.outputs}
    assert dims["past_key_values.0.key"] == ("batch", 2, "window_past", 16)
    assert dims["present.2.value"] == ("batch", 2, "window_total", 16)
    assert dims["past_key_values.1.key"] == ("batch", 2, "past", 16)


@pytest.mark.parametrize(
    ("value", "message"),
    [([8, None], "list of 3 entries"), ([8, 1, None], r"\[2, "), ([None, None, None], "bounds no layer"), (8, "list")],
)
def test_bad_layer_windows_are_refused(value: object, message: str) -> None:
    data = IO.to_dict() | {"layer_windows": value}
    with pytest.raises(ArtifactError, match=message):
        DecoderIO.from_dict(data)


def test_kv_bytes_by_kind_is_the_arithmetic_of_what_each_layer_holds() -> None:
    per_layer_position = 2 * (16 + 16) * 4  # heads x (key + value) x float32
    assert IO.kv_bytes_by_kind(100, batch=3) == {
        "sliding": (7 + 3) * per_layer_position * 3,  # window - 1 each: 7 and 3 positions
        "full": 100 * per_layer_position * 3,
    }
    assert IO.kv_bytes_by_kind(2) == {"sliding": 2 * 2 * per_layer_position, "full": 2 * per_layer_position}
    assert DecoderIO(3, 2, 16, 100).kv_bytes_by_kind(10) == {"full": 3 * 10 * per_layer_position}
    assert kv_bytes_per_step(IO, 100, 3) == sum(IO.kv_bytes_by_kind(100, 3).values())


@pytest.mark.parametrize(
    ("model_type", "overrides", "expected"),
    [
        ("mistral", {"sliding_window": 8}, (8, 8)),
        ("mistral", {"sliding_window": 256}, None),  # the whole context: nothing to bound
        ("qwen2", {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1}, (None, 8)),
        ("qwen2", {"sliding_window": 8}, None),  # use_sliding_window false
        ("gemma2", {}, (8, None)),
        ("llama", {}, None),
    ],
)
def test_layer_windows_are_transformers_layer_types(
    model_type: str, overrides: dict[str, object], expected: tuple[int | None, ...] | None
) -> None:
    from kvforge.toolchain.export import layer_windows
    from kvforge.toolchain.spec import DecoderSpec
    from tests.tiny import _COMMON, ARCH_CONFIGS

    fields = dict(_COMMON, model_type=model_type, **(ARCH_CONFIGS[model_type] | overrides))
    assert layer_windows(fields, DecoderSpec.from_config(fields)) == expected


# --- compiled models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A mistral checkpoint with a window of 8 on every layer, and its ort-cpu artifact."""
    from kvforge import build

    checkpoint = make_checkpoint(tmp_path_factory.mktemp("ckpt-mistral-w8"), "mistral", sliding_window=WINDOW)
    return checkpoint, build(checkpoint, tmp_path_factory.mktemp("art-mistral-w8") / "out").output


def _eager(checkpoint: Path) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 384, size=length).tolist()


@pytest.mark.slow
def test_mistral_greedy_matches_transformers_across_the_window(mistral: tuple[Path, Path]) -> None:
    checkpoint, artifact = mistral
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["io"]["layer_windows"] == [WINDOW, WINDOW]
    assert manifest["io"]["kv_mode"] == "shared"  # GroupQueryAttention, each layer's past its own
    assert "genai_config.json" not in manifest["files"]
    engine = Engine.load(artifact)
    engine.eos_ids = ()
    model = _eager(checkpoint)
    for prompt in (engine.encode("def fibonacci(n):"), engine.encode(CORPUS[1])):  # shorter, longer than the window
        ours = engine.generate_tokens([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0)[0]
        assert ours == hf_greedy(model, prompt, NEW_TOKENS), len(prompt)


@pytest.mark.slow
def test_mistral_left_padded_batch_equals_each_row_alone(mistral: tuple[Path, Path]) -> None:
    engine = Engine.load(mistral[1])
    engine.eos_ids = ()
    prompts = [_prompt(3, 1), _prompt(11, 2), _prompt(20, 3)]  # inside, across and past the window
    batched = engine.generate_tokens(prompts, max_new_tokens=16, temperature=0.0)
    alone = [engine.generate_tokens([p], max_new_tokens=16, temperature=0.0)[0] for p in prompts]
    assert batched == alone


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gemma3_text", "gpt_oss"])
def test_alternating_layers_hold_window_minus_one_positions_whatever_the_capacity(
    model_type: str, tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    engine = Engine.load(built_artifact(model_type))
    io = engine.session.io
    assert io.layer_windows == (WINDOW, None)  # tests/tiny.py: sliding, then full attention
    prompt = _prompt(40)
    ids, mask = np.array([prompt]), np.ones((1, 40), np.int64)
    steps = []
    for capacity in (41, 100):
        logits, cache = forward(engine.session, ids, mask, empty_cache(io, 1, capacity))
        assert cache["past_key_values.0.key"].shape == (1, io.num_kv_heads, WINDOW - 1, io.head_dim)
        assert cache["past_key_values.0.value"].shape[2] == WINDOW - 1
        assert cache["past_key_values.1.key"].shape[2] == (capacity if io.shared_kv else 40)
        held = sum(cache[name].nbytes for name in io.past_names if name.startswith("past_key_values.0."))
        assert held == io.kv_bytes_by_kind(40)["sliding"]
        step, cache = forward(engine.session, np.array([[7]]), np.ones((1, 41), np.int64), cache)
        assert cache["past_key_values.0.key"].shape[2] == WINDOW - 1
        steps.append(np.concatenate([logits[:, -1], step[:, -1]]))
    np.testing.assert_allclose(steps[0], steps[1], rtol=0, atol=1e-5)
    # and what transformers computes over the whole history, past the window
    import torch

    with torch.no_grad():
        expected = _eager(tiny_checkpoint(model_type))(input_ids=torch.tensor([[*prompt, 7]])).logits[0, -2:]
    np.testing.assert_allclose(steps[0], expected.numpy(), rtol=0, atol=2e-4 * float(expected.abs().max()))
    engine.eos_ids = ()
    ours = engine.generate_tokens([prompt], max_new_tokens=NEW_TOKENS, temperature=0.0)[0]
    assert ours == hf_greedy(_eager(tiny_checkpoint(model_type)), prompt, NEW_TOKENS)


@pytest.mark.slow
def test_server_chunked_prefill_across_the_window_equals_alone(mistral: tuple[Path, Path]) -> None:
    """Chunks of 5 over prompts longer than the window; rows join, leave and compact."""
    engine = Engine.load(mistral[1])
    scheduler = scheduler_for(engine, max_num_seqs=3, prefill_chunk=5)
    prompts = [_prompt(23, 4), _prompt(4, 5), _prompt(17, 6), _prompt(9, 7), _prompt(30, 8)]
    budgets = [30, 6, 20, 12, 14]
    try:
        reqs = [request(engine, p, n) for p, n in zip(prompts, budgets)]
        for req in reqs:
            scheduler.submit(req)
        for req, prompt, budget in zip(reqs, prompts, budgets):
            text, end = collect(req)
            assert isinstance(end, Finished), end
            assert (text, end.completion_tokens) == solo(engine, prompt, budget)
        assert scheduler.wait_idle(60)
    finally:
        scheduler.stop()


@pytest.mark.slow
def test_inspect_counts_kv_bytes_per_layer_kind(tiny_checkpoint: Callable[..., Path]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tiny_checkpoint("gemma3_text")), "--seq", "40", "--batch", "2"])
    assert result.exit_code == 0, result.output
    per_layer_position = 2 * (16 + 16)  # KV heads x (key + value) elements
    for name, size in (("fp32", 4), ("fp16", 2)):
        full, sliding = 40 * 2 * per_layer_position * size, (WINDOW - 1) * 2 * per_layer_position * size
        assert re.search(rf"^  {name} .*\b{full + sliding:,}\b", result.output, re.M), result.output
        assert re.search(rf"1 full-attention layers .*\b{full:,}\b", result.output), result.output
        assert re.search(rf"1 sliding layers \(window 8\) .*\b{sliding:,}\b", result.output), result.output
