"""Families without an entry of their own: the spec read through transformers' config
classes, the KV cache's layout read off the modeling code, MoE parameters counted, and a
family in no kvforge table built and compared with eager."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvforge.runners.engine import Engine
from kvforge.runners.errors import CheckpointError, KvforgeError
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain import kv_layout
from kvforge.toolchain.export import cache_layout, layer_windows
from kvforge.toolchain.footprint import footprint
from kvforge.toolchain.spec import LAYOUTS, DecoderSpec, verified_families
from tests.tiny import BUILD_CONTEXT, FAMILIES, GENERIC, LLAMA_LIKE, hf_greedy, make_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _spec(directory: Path) -> DecoderSpec:
    ckpt = checkpoints.load(directory)
    context = BUILD_CONTEXT.get(ckpt.config["model_type"])
    return cache_layout(ckpt.config, DecoderSpec.from_config(ckpt.config, ckpt.generation_config, context=context))


@pytest.mark.parametrize("model_type", FAMILIES)
def test_cache_layout_is_what_the_model_caches(model_type: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """The meta-device probe against a real forward of the real model on the CPU."""
    from transformers import AutoModelForCausalLM, DynamicCache

    directory = tiny_checkpoint(model_type)
    spec = _spec(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    # layers with a fixed-size state need the cache objects the config gives them
    cache = DynamicCache(config=model.config) if spec.layers is not None else DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache)
    assert len(cache.layers) == spec.num_layers
    kinds = [layer.kind for layer in spec.layers] if spec.layers is not None else ["attention"] * spec.num_layers
    for layer, kind, state in zip(cache.layers, kinds, spec.layers or [None] * spec.num_layers):
        if kind in ("attention", "hybrid"):
            assert tuple(layer.keys.shape) == (1, spec.num_kv_heads, 3, spec.head_dim)
            assert tuple(layer.values.shape) == (1, spec.num_kv_heads, 3, spec.value_head_dim)
        if kind != "attention":
            assert state is not None and (1, *state.states[0]) == tuple(layer.conv_states[0].shape)
            if kind in ("linear_attention", "hybrid"):
                assert (1, *state.states[1]) == tuple(layer.recurrent_states[0].shape)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_layout_read_from_the_config_is_the_modeling_codes(
    model_type: str, tiny_checkpoint: Callable[..., Path]
) -> None:
    """What `inspect` reads without torch equals what the meta-device probe reads, wherever it reads one."""
    ckpt = checkpoints.load(tiny_checkpoint(model_type))
    read = DecoderSpec.from_config(ckpt.config, ckpt.generation_config, context=BUILD_CONTEXT.get(model_type))
    derived = kv_layout.from_config(ckpt.config, read)
    listed = model_type in kv_layout.PLAIN_FAMILIES | kv_layout.SLIDING_FAMILIES
    assert (derived is not None) == listed
    if derived is not None:
        traced = cache_layout(ckpt.config, read)
        assert derived == (traced, layer_windows(ckpt.config, traced))


@pytest.mark.parametrize("model_type", sorted(kv_layout.PLAIN_FAMILIES))
def test_the_plain_families_bound_no_layer_by_default(model_type: str) -> None:
    """A config.json without layer_types or sliding_window reads as no window: so does its config class."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    assert getattr(config, "sliding_window", None) is None and getattr(config, "attention_chunk_size", None) is None
    assert set(getattr(config, "layer_types", None) or ["full_attention"]) == {"full_attention"}


def test_a_window_only_the_config_class_would_give_is_left_to_the_modeling_code() -> None:
    fields = dict(LLAMA_LIKE, model_type="mistral", vocab_size=256)  # MistralConfig's default window: 4096
    assert kv_layout.from_config(fields, DecoderSpec.from_config(fields)) is None
    gemma = dict(LLAMA_LIKE, model_type="gemma3_text", head_dim=16, vocab_size=256)  # a window per its class's pattern
    assert kv_layout.from_config(gemma, DecoderSpec.from_config(gemma)) is None
    fields = dict(
        LLAMA_LIKE, model_type="qwen2", sliding_window=32, vocab_size=256
    )  # without layer_types: the class decides
    assert kv_layout.from_config(fields, DecoderSpec.from_config(fields)) is None


def test_cache_layouts_that_differ_from_the_config(tiny_checkpoint: Callable[..., Path]) -> None:
    mla = _spec(tiny_checkpoint("deepseek_v3"))  # a compressed latent and its rotary part, one head
    assert (mla.num_kv_heads, mla.head_dim, mla.value_head_dim) == (1, 16, 8)
    assert _spec(tiny_checkpoint("gpt_bigcode")).num_kv_heads == 1  # multi-query


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_inspect_counts_active_parameters(model_type: str, tiny_checkpoint: Callable[..., Path]) -> None:
    """Active = all parameters but the routed experts a token is not sent to, counted from the model's modules."""
    from transformers import AutoModelForCausalLM

    directory = tiny_checkpoint(model_type)
    spec = _spec(directory)
    fp = footprint(checkpoints.load(directory), spec, batch=1, seq=16)
    model = AutoModelForCausalLM.from_pretrained(directory)
    experts = [m for name, m in model.named_modules() if re.search(r"\.experts$", name)]
    routed = sum(p.numel() for m in experts for p in m.parameters())
    assert routed > 0 and spec.num_experts == 4 and spec.experts_per_token == 2
    stored = {t.data_ptr(): t.numel() for t in model.state_dict().values()}  # buffers too (routing biases)
    assert fp.parameters == sum(stored.values())
    assert fp.parameters - fp.active_parameters == routed // 2  # 2 of 4 experts idle per token


def test_a_model_without_a_context_length_takes_context_or_the_tokenizers(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """bloom (ALiBi) names no context length, as its real configs: `--context` gives it, else
    tokenizer_config.json's model_max_length where that is a length; else the error says to pass
    --context. Where config.json states one, --context may only lower it."""
    from kvforge.toolchain.export import read_spec

    bloom = checkpoints.load(tiny_checkpoint("bloom"))
    assert not {"max_position_embeddings", "seq_length", "n_positions"} & set(bloom.config)
    with pytest.raises(CheckpointError) as exc:
        read_spec(bloom)
    assert "pass --context N" in str(exc.value) and "model_max_length" in str(exc.value)
    assert read_spec(bloom, 300).max_positions == 300

    directory = tmp_path / "bloom"
    shutil.copytree(tiny_checkpoint("bloom"), directory)
    tokenizer = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": 512}))
    assert read_spec(checkpoints.load(directory)).max_positions == 512
    assert read_spec(checkpoints.load(directory), 64).max_positions == 64
    # transformers' placeholder where a tokenizer has no length of its own is no context length
    (directory / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": int(1e30)}))
    with pytest.raises(CheckpointError, match="is no context length.*pass --context N"):
        read_spec(checkpoints.load(directory))

    llama = checkpoints.load(tiny_checkpoint("llama"))  # max_position_embeddings 256
    assert read_spec(llama).max_positions == 256 and read_spec(llama, 128).max_positions == 128
    with pytest.raises(KvforgeError, match="--context 257 is beyond the model's context.*256"):
        read_spec(llama, 257)


def test_every_tested_family_has_a_tiny_checkpoint_and_a_docs_row() -> None:
    assert set(verified_families()) == set(FAMILIES)
    assert not set(GENERIC) & set(LAYOUTS)  # the generic families really have no entry
    table = (ROOT / "docs" / "architectures.md").read_text()
    for family in FAMILIES:
        assert re.search(rf"\| [^|]*\b{family}\b", table), f"docs/architectures.md has no row for {family}"


# olmo (OLMo 1): in no kvforge table and not among the tested families above: what a user
# bringing a family kvforge has never seen gets.
UNSEEN = "olmo"
UNSEEN_CONFIG = dict(LLAMA_LIKE, clip_qkv=8.0)  # OLMo 1 clips q/k/v


@pytest.mark.slow
def test_a_family_in_no_table_builds_and_matches_eager(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from kvforge import build

    assert UNSEEN not in LAYOUTS and UNSEEN not in verified_families()
    directory = make_checkpoint(tmp_path / "ckpt", UNSEEN, arch=UNSEEN_CONFIG)
    artifact = build(directory, tmp_path / "out").output
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["parity"]["passed"] is True and manifest["spec"]["model_type"] == UNSEEN
    engine = Engine.load(artifact)
    engine.eos_ids = ()
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    for prompt in ["def fibonacci(n):", "class Point:\n    def"]:
        ids = engine.encode(prompt)
        assert engine.generate_tokens([ids], max_new_tokens=24, temperature=0.0)[0] == hf_greedy(model, ids, 24)


@pytest.mark.slow
def test_moe_manifest_and_bench_count_the_experts_a_step_reads(
    built_artifact: Callable[..., Path], tiny_checkpoint: Callable[..., Path]
) -> None:
    from kvforge.runners.bench import weight_bytes_per_step

    artifact = built_artifact("qwen3_moe")
    manifest = json.loads((artifact / "manifest.json").read_text())
    directory = tiny_checkpoint("qwen3_moe")
    fp = footprint(checkpoints.load(directory), _spec(directory), batch=1, seq=16)
    assert manifest["experts"] == {"routed": 4, "per_token": 2, "weight_bytes": 4 * fp.expert_parameters}
    dense_count = weight_bytes_per_step(artifact, {k: v for k, v in manifest.items() if k != "experts"})
    assert weight_bytes_per_step(artifact, manifest) == dense_count - 4 * fp.expert_parameters // 2  # 2 of 4 idle
    assert "experts" not in json.loads((built_artifact("llama") / "manifest.json").read_text())


@pytest.mark.slow
def test_moe_int8_build_passes_the_distribution_gate(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    from kvforge import BuildOptions, build
    from kvforge.passes.quantize import WeightQuantization

    result = build(tiny_checkpoint("mixtral"), tmp_path / "out", BuildOptions(weights=WeightQuantization(bits=8)))
    assert result.manifest["parity"]["passed"] is True
    assert result.manifest["flags"]["weights"]["bits"] == 8
