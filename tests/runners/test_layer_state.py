"""Models whose layers keep a fixed-size state next to attention (lfm2's short convolutions,
qwen3_5's gated delta nets: a convolution and a recurrent state): the contract's per-layer
states, built on ort-cpu, compared with eager transformers, through the runner (left padding,
chunked prefill) and the server's scheduler."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvforge.passes.targets import TARGETS
from kvforge.runners.bench import kv_bytes_per_step
from kvforge.runners.contract import DecoderIO, LayerState
from kvforge.runners.engine import Engine
from kvforge.runners.errors import ArtifactError
from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.serve.scheduler import Finished
from tests.tiny import GENERIC_CONFIGS, hf_greedy

PROMPTS = ["def fibonacci(n):", "class Point:\n    def"]
NEW_TOKENS = 24
HIDDEN = GENERIC_CONFIGS["lfm2"]["hidden_size"]
KERNEL = 3  # lfm2's conv_L_cache default
STATEFUL = ("lfm2", "qwen3_5_text", "bamba", "nemotron_h", "jamba", "falcon_h1")


@pytest.fixture(scope="module")
def artifact(built_artifact: Callable[..., Path]) -> Path:
    return built_artifact("lfm2")


@pytest.fixture(scope="module", params=STATEFUL)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def engine(built_artifact: Callable[..., Path], family: str) -> Engine:
    e = Engine.load(built_artifact(family))
    e.eos_ids = ()  # compare the full length; transformers generates without eos too
    return e


@pytest.fixture(scope="module")
def lfm2_engine(artifact: Path) -> Engine:
    return Engine.load(artifact)


@pytest.mark.slow  # builds the tiny lfm2 artifact
def test_manifest_records_each_layer_and_its_state(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    io = manifest["io"]
    conv = {"kind": "conv", "states": {"conv": [HIDDEN, KERNEL]}}
    assert io["layers"] == [conv, {"kind": "attention"}, conv]
    assert [t["name"] for t in io["inputs"][3:]] == [
        "past_conv.0",
        "past_key_values.1.key",
        "past_key_values.1.value",
        "past_conv.2",
        "logits_to_keep",  # the default build's, after every state
    ]
    assert [t["name"] for t in io["outputs"][1:]] == [
        "present_conv.0",
        "present.1.key",
        "present.1.value",
        "present_conv.2",
    ]
    assert io["inputs"][3]["dims"] == ["batch", HIDDEN, KERNEL]  # no sequence axis
    assert io["kv_mode"] == "shared"  # the attention layer's cache is still written in place
    assert manifest["parity"]["passed"] is True
    errors = {e["name"] for e in manifest["parity"]["prefill"]}
    assert {"present_conv.0", "present_conv.2", "present.1.key"} <= errors  # the gate compares every state
    assert "genai_config.json" not in manifest["files"]


@pytest.mark.slow  # builds the tiny qwen3_5_text artifact
def test_manifest_records_linear_attention_states(built_artifact: Callable[..., Path]) -> None:
    config = GENERIC_CONFIGS["qwen3_5_text"]
    key, value = config["linear_key_head_dim"], config["linear_value_head_dim"]
    heads = config["linear_num_value_heads"]
    channels = 2 * config["linear_num_key_heads"] * key + heads * value  # q, k and v through one convolution
    manifest = json.loads((built_artifact("qwen3_5_text") / "manifest.json").read_text())
    io = manifest["io"]
    linear = {
        "kind": "linear_attention",
        "states": {"conv": [channels, config["linear_conv_kernel_dim"]], "recurrent": [heads, key, value]},
    }
    assert io["layers"] == [linear, {"kind": "attention"}, linear]
    assert [t["name"] for t in io["inputs"][3:]] == [
        "past_conv.0",
        "past_recurrent.0",
        "past_key_values.1.key",
        "past_key_values.1.value",
        "past_conv.2",
        "past_recurrent.2",
        "logits_to_keep",
    ]
    assert io["inputs"][4]["dims"] == ["batch", heads, key, value]
    assert manifest["parity"]["passed"] is True
    errors = {e["name"] for e in manifest["parity"]["prefill"]}
    assert {"present_recurrent.0", "present_conv.2", "present.1.key"} <= errors  # the gate compares every state


@pytest.mark.slow  # builds the tiny jamba artifact
def test_manifest_records_selective_scan_states(built_artifact: Callable[..., Path]) -> None:
    """jamba's Mamba-1 layers: a convolution over expand × hidden channels and a selective-scan
    state per channel, traced as one Scan per layer (`kvforge.toolchain.recurrence.selective_scan`)."""
    import onnx

    config = GENERIC_CONFIGS["jamba"]
    channels = config["mamba_expand"] * config["hidden_size"]
    artifact = built_artifact("jamba")
    io = json.loads((artifact / "manifest.json").read_text())["io"]
    mamba = {
        "kind": "linear_attention",
        "states": {"conv": [channels, config["mamba_d_conv"]], "recurrent": [channels, config["mamba_d_state"]]},
    }
    assert io["layers"] == [mamba, {"kind": "attention"}, mamba]
    graph = onnx.load(artifact / "model.onnx", load_external_data=False)
    ops = [node.op_type for node in graph.graph.node] + [
        node.op_type for function in graph.functions for node in function.node
    ]
    assert ops.count("Scan") == 2  # one per Mamba layer, whatever the prompt's length


@pytest.mark.slow  # builds the tiny falcon_h1 artifact
def test_manifest_records_hybrid_layers(built_artifact: Callable[..., Path]) -> None:
    """falcon_h1 runs attention and a Mamba-2 mixer side by side in every layer: each layer keeps
    a key/value pair and a convolution and an SSM state, in that order."""
    config = GENERIC_CONFIGS["falcon_h1"]
    heads, head, state = config["mamba_n_heads"], config["mamba_d_head"], config["mamba_d_state"]
    channels = heads * head + 2 * config["mamba_n_groups"] * state  # x, B and C through one convolution
    manifest = json.loads((built_artifact("falcon_h1") / "manifest.json").read_text())
    io = manifest["io"]
    hybrid = {
        "kind": "hybrid",
        "states": {"conv": [channels, config["mamba_d_conv"]], "recurrent": [heads, head, state]},
    }
    assert io["layers"] == [hybrid, hybrid]
    assert [t["name"] for t in io["inputs"][3:7]] == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_conv.0",
        "past_recurrent.0",
    ]
    assert io["kv_mode"] == "shared" and manifest["parity"]["passed"] is True
    errors = {e["name"] for e in manifest["parity"]["prefill"]}
    assert {"present.0.key", "present_conv.0", "present_recurrent.1"} <= errors  # the gate compares every state


@pytest.mark.slow  # builds the tiny lfm2 artifact
def test_state_bytes_by_arithmetic(lfm2_engine: Engine) -> None:
    io = lfm2_engine.session.io
    assert io.state_bytes_per_sequence() == 2 * HIDDEN * KERNEL * 4  # two conv layers, fp32
    assert io.kv_bytes_by_kind(1) == {"full": 1 * 2 * (16 + 16) * 4}  # one attention layer, 2 KV heads × 16
    cache = empty_cache(io, batch=3, capacity=10)
    assert cache["past_conv.0"].shape == (3, HIDDEN, KERNEL)
    assert cache["past_key_values.1.key"].shape == (3, 2, 10, 16)
    assert kv_bytes_per_step(io, context=10, batch=3) == sum(a.nbytes for a in cache.values())  # what bench counts


@pytest.mark.slow  # builds the tiny stateful artifacts
def test_greedy_generation_matches_transformers(
    engine: Engine, family: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(family)).eval()
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        ours = engine.generate_tokens([ids], max_new_tokens=NEW_TOKENS, temperature=0.0)[0]
        assert ours == hf_greedy(model, ids, NEW_TOKENS), prompt


@pytest.mark.slow  # builds the tiny stateful artifacts
def test_left_padded_batch_equals_one_by_one(engine: Engine) -> None:
    prompts = [engine.encode(p) for p in ["for i in range(10):", "import os", "héllo wörld, naïve café"]]
    assert len({len(p) for p in prompts}) == 3  # really padded
    batched = engine.generate_tokens(prompts, max_new_tokens=16, temperature=0.0)
    alone = [engine.generate_tokens([p], max_new_tokens=16, temperature=0.0)[0] for p in prompts]
    assert batched == alone


@pytest.mark.slow  # builds the tiny stateful artifacts
def test_states_do_not_grow_and_chunked_prefill_equals_one_shot(engine: Engine) -> None:
    io = engine.session.io
    ids = np.asarray([engine.encode(PROMPTS[0] + " return n")], dtype=np.int64)
    n = ids.shape[1]
    one_logits, one = forward(engine.session, ids, np.ones((1, n), np.int64), empty_cache(io, 1, n))
    cache = empty_cache(io, 1, n)
    for start in range(0, n, 4):  # 4 tokens at a time over the growing cache
        end = min(start + 4, n)
        logits, cache = forward(engine.session, ids[:, start:end], np.ones((1, end), np.int64), cache)
    assert io.state_names
    for name in io.state_names:
        assert cache[name].shape == one[name].shape == io.state_shape(name, 1)  # no sequence axis
        scale = float(np.abs(one[name]).max())
        assert scale > 0, name  # the prompt wrote the state
        np.testing.assert_allclose(cache[name], one[name], rtol=1e-4, atol=1e-5 * scale)
    np.testing.assert_allclose(logits[:, -1], one_logits[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # builds the tiny stateful artifacts
def test_server_rows_equal_each_request_alone(engine: Engine) -> None:
    """Six requests over two rows, prefilled in chunks of 3, arriving while others decode: rows
    are reused and moved, so a state not zeroed per request, or not moved with its row, changes tokens."""
    from tests.serve.test_scheduler import collect, request, scheduler_for, solo, wait_generating

    prompts = ["for i in range(10):", "import os", "héllo wörld", "class Point:", "def fibonacci(n):", "x = 1"]
    budgets = [8, 30, 6, 25, 5, 20]
    scheduler = scheduler_for(engine, max_num_seqs=2, prefill_chunk=3)
    try:
        first = request(engine, prompts[0], budgets[0])
        scheduler.submit(first)
        wait_generating(first)
        rest = [request(engine, p, n) for p, n in zip(prompts[1:], budgets[1:])]
        scheduler.submit(*rest)
        for index, req in enumerate([first, *rest]):
            text, end = collect(req)
            assert isinstance(end, Finished), end
            assert (text, end.completion_tokens) == solo(engine, prompts[index], budgets[index]), prompts[index]
    finally:
        scheduler.stop()


@pytest.mark.slow  # builds the tiny stateful artifacts
def test_speculative_decoding_is_refused_naming_the_states(engine: Engine) -> None:
    """A rejected draft cannot be taken back out of a convolution state (speculation rolls back
    by shortening the KV cache), so speculation is refused rather than silently wrong."""
    from kvforge.runners.errors import GenerationError

    with pytest.raises(GenerationError, match=r"\['(conv|linear_attention|hybrid)'\] layers \(io.layers"):
        engine.generate(PROMPTS[0], max_new_tokens=4, speculative="prompt-lookup")


def test_inspect_reports_state_bytes(tiny_checkpoint: Callable[..., Path]) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    result = CliRunner().invoke(main, ["inspect", str(tiny_checkpoint("lfm2")), "--seq", "100"])
    assert result.exit_code == 0, result.output
    per_token, state = 1 * 2 * (16 + 16) * 4, 2 * HIDDEN * KERNEL * 4
    assert f"{per_token:,}" in result.output and f"{per_token * 100 + state:,}" in result.output
    assert "fixed state per sequence" in result.output and f"{state:,}" in result.output


def test_layers_round_trip_and_malformed_layers_are_refused() -> None:
    io = DecoderIO(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=384,
        layers=(LayerState("conv", ((64, 3),)), LayerState("attention")),
    )
    assert DecoderIO.from_dict(io.to_dict()) == io
    assert io.past_names == ("past_key_values.1.key", "past_key_values.1.value")
    bad = io.to_dict() | {"layers": [{"kind": "mamba"}, {"kind": "attention"}]}
    with pytest.raises(ArtifactError, match=r"io.layers\[0\]: kind 'mamba'"):
        DecoderIO.from_dict(bad)
    bad = io.to_dict() | {"layers": [{"kind": "conv", "states": {"conv": [64, 0]}}, {"kind": "attention"}]}
    with pytest.raises(ArtifactError, match=r"states.conv must be"):
        DecoderIO.from_dict(bad)
    with pytest.raises(ArtifactError, match="each of the 2 layers"):
        DecoderIO.from_dict(io.to_dict() | {"layers": [{"kind": "attention"}]})


def test_a_hybrid_layer_keeps_keys_values_and_both_states_in_that_order() -> None:
    io = DecoderIO(
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=384,
        layers=(LayerState("hybrid", ((40, 4), (2, 16, 8))), LayerState("attention")),
    )
    assert DecoderIO.from_dict(io.to_dict()) == io
    assert io.cache_names == (
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_conv.0",
        "past_recurrent.0",
        "past_key_values.1.key",
        "past_key_values.1.value",
    )
    assert io.past_names == io.cache_names[:2] + io.cache_names[4:]  # both layers keep a key/value pair
    assert io.kv_bytes_by_kind(1) == {"full": 2 * 2 * (16 + 16) * 4}  # two layers, 2 KV heads × 16
    assert io.state_bytes_per_sequence() == (40 * 4 + 2 * 16 * 8) * 4
    cache = empty_cache(io, batch=3, capacity=10)
    assert cache["past_recurrent.0"].shape == (3, 2, 16, 8) and cache["past_key_values.0.key"].shape == (3, 2, 0, 16)


def test_targets_without_state_support_are_refused(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    from kvforge import BuildOptions, build

    with pytest.raises(ArtifactError, match="conv layers keep a fixed-size state.*--target ort-cpu"):
        build(tiny_checkpoint("lfm2"), tmp_path / "out", BuildOptions(target=TARGETS["tensorrt"]))
