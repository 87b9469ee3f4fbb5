"""Footprint against real transformers models: parameter counts and KV-cache bytes."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import save_file

from kvforge.runners.errors import CheckpointError, GenerationError, KvforgeError
from kvforge.toolchain.checkpoint import Checkpoint, load
from kvforge.toolchain.footprint import (
    Footprint,
    QuantLayout,
    footprint,
    format_footprint,
    quantized_bytes,
    quantized_weight_bytes,
)
from kvforge.toolchain.spec import SUPPORTED_MODEL_TYPES, DecoderSpec

logging.getLogger("transformers").setLevel(logging.ERROR)

_LLAMA_LIKE: dict[str, Any] = {
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY: dict[str, dict[str, Any]] = {
    "llama": {**_LLAMA_LIKE, "tie_word_embeddings": False},
    "mistral": {**_LLAMA_LIKE, "sliding_window": 32},
    "qwen2": {**_LLAMA_LIKE, "tie_word_embeddings": True},
    "qwen3": {**_LLAMA_LIKE, "head_dim": 8},
    "phi3": {**_LLAMA_LIKE, "partial_rotary_factor": 0.5},
    "gemma": {**_LLAMA_LIKE, "head_dim": 32, "num_key_value_heads": 1},
    "gemma2": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 16, "query_pre_attn_scalar": 16},
    "gpt2": {"vocab_size": 100, "n_embd": 48, "n_layer": 3, "n_head": 6, "n_positions": 64},
    "gpt_neox": {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "rotary_pct": 0.5,
    },
}


def save_model(directory: Path, model_type: str, dtype: torch.dtype = torch.float32) -> transformers.PreTrainedModel:
    """A random-weight checkpoint written by save_pretrained, plus a stub tokenizer file."""
    config = transformers.AutoConfig.for_model(model_type, **TINY[model_type])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text("{}")
    return model


def load_with_spec(directory: Path) -> tuple[Checkpoint, DecoderSpec]:
    checkpoint = load(directory)
    return checkpoint, DecoderSpec.from_config(checkpoint.config, checkpoint.generation_config)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_parameters_and_kv_bytes_match_the_model(tmp_path: Path, model_type: str) -> None:
    model = save_model(tmp_path, model_type)
    checkpoint, spec = load_with_spec(tmp_path)
    batch, seq = 2, 5  # seq below every sliding window, so the cache holds all of it
    fp = footprint(checkpoint, spec, batch=batch, seq=seq)

    n_params = sum(p.numel() for p in model.parameters())  # tied weights appear once
    assert fp.parameters_by_dtype == {"F32": n_params}
    assert fp.weight_bytes == 4 * n_params
    assert fp.weight_bytes_at["fp32"] == 4 * n_params
    assert fp.weight_bytes_at["fp16"] == 2 * n_params
    assert fp.weight_bytes_at["fp16"] > fp.weight_bytes_at["int8"] > fp.weight_bytes_at["int4"]

    with torch.no_grad():
        out = model(torch.ones(batch, seq, dtype=torch.long), use_cache=True)
    cache = out.past_key_values
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert cache.layers[0].keys.dtype == torch.float32
    assert fp.kv_bytes_per_token["fp32"] == kv_bytes // (batch * seq)
    assert kv_bytes % (batch * seq) == 0
    assert fp.kv_bytes_per_token["fp16"] * 2 == fp.kv_bytes_per_token["fp32"]
    assert fp.kv_bytes_total == {k: v * batch * seq for k, v in fp.kv_bytes_per_token.items()}
    assert fp.kv_bytes_total["fp32"] == kv_bytes
    assert (fp.batch, fp.seq) == (batch, seq)


def test_stored_dtype_and_half_kv(tmp_path: Path) -> None:
    model = save_model(tmp_path, "qwen3", dtype=torch.bfloat16)
    checkpoint, spec = load_with_spec(tmp_path)
    fp = footprint(checkpoint, spec, batch=1, seq=4)
    n_params = sum(p.numel() for p in model.parameters())
    assert fp.parameters_by_dtype == {"BF16": n_params}
    assert fp.weight_bytes == 2 * n_params == fp.weight_bytes_at["fp16"]
    with torch.no_grad():
        cache = model(torch.ones(1, 4, dtype=torch.long), use_cache=True).past_key_values
    assert cache.layers[0].keys.dtype == torch.bfloat16
    kv_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert fp.kv_bytes_total["fp16"] == kv_bytes


def test_tied_head_stored_twice_is_counted_once(tmp_path: Path) -> None:
    model = save_model(tmp_path, "qwen2")  # tied
    state = {k: v.contiguous() for k, v in load(tmp_path).state_dict().items()}
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(tmp_path / "model.safetensors"))
    checkpoint, spec = load_with_spec(tmp_path)
    fp = footprint(checkpoint, spec, batch=1, seq=1)
    assert fp.parameters == sum(p.numel() for p in model.parameters())


def test_buffers_in_old_checkpoints_are_not_parameters(tmp_path: Path) -> None:
    model = save_model(tmp_path, "gpt2")
    state = {k: v.contiguous() for k, v in load(tmp_path).state_dict().items()}
    prefix = "transformer.h.0.attn."
    state[prefix + "bias"] = torch.tril(torch.ones(1, 1, 64, 64, dtype=torch.bool))
    state[prefix + "masked_bias"] = torch.tensor(-1e4)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, str(tmp_path / "model.safetensors"))
    checkpoint, spec = load_with_spec(tmp_path)
    fp = footprint(checkpoint, spec, batch=1, seq=1)
    assert fp.parameters_by_dtype == {"F32": sum(p.numel() for p in model.parameters())}


# --- quantized sizes, derived by hand ---------------------------------------------------------


def write_synthetic(directory: Path, model_type: str, tensors: dict[str, torch.Tensor], **config: Any) -> Path:
    directory.mkdir()
    base = {"model_type": model_type, **TINY[model_type], **config}
    (directory / "config.json").write_text(json.dumps(base))
    (directory / "tokenizer.json").write_text("{}")
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_block_quantized_bytes_of_one_matrix() -> None:
    # [3 out, 40 in]: 40 inputs need two blocks of 32 (the second padded), so 6 blocks; so few
    # scales are fp32 (the build's constant folding would widen their Cast anyway).
    # int4: 6 blocks × (32 × 4 bits = 16 bytes + a 4-byte fp32 scale) = 120 bytes.
    # int8: 6 blocks × (32 bytes + 4) = 216 bytes.
    assert quantized_bytes((3, 40), QuantLayout(4)) == 120
    assert quantized_bytes((3, 40), QuantLayout(8)) == 216
    assert quantized_bytes((1, 32), QuantLayout(4)) == 20  # exactly one block, no padding
    assert quantized_bytes((2, 33), QuantLayout(8)) == 2 * 2 * 36
    # blocks of 64: one per row of 40, 32 bytes of int4 codes + a 4-byte scale
    assert quantized_bytes((3, 40), QuantLayout(4, block=64)) == 3 * 36
    # --asymmetric: a 4-bit zero point per block, a row's two packed in one byte
    assert quantized_bytes((3, 40), QuantLayout(4, zero_points=True)) == 120 + 3
    assert quantized_bytes((3, 40), QuantLayout(8, zero_points=True)) == 216 + 6
    # --free-min: a float minimum per block beside its scale, in the compute dtype
    assert quantized_bytes((3, 40), QuantLayout(4, free_min=True)) == 120 + 6 * 4
    assert quantized_bytes((3, 40), QuantLayout(4, free_min=True), compute_bytes=2) == 6 * (16 + 2 + 2)
    # more than 1024 scales: fp16, 2 bytes each (fp32 where the layout says so: DequantizeLinear)
    assert quantized_bytes((1025, 32), QuantLayout(4)) == 1025 * (16 + 2)
    assert quantized_bytes((1024, 32), QuantLayout(4)) == 1024 * (16 + 4)
    assert quantized_bytes((1025, 64), QuantLayout(8)) == 1025 * 2 * (32 + 2)
    assert quantized_bytes((1025, 32), QuantLayout(4, scale_bytes=4)) == 1025 * (16 + 4)


def test_precisions_of_a_small_llama_by_hand(tmp_path: Path) -> None:
    tensors = {
        "model.embed_tokens.weight": torch.zeros(10, 40),  # token table: quantized like a [10 out, 40 in] weight
        "model.layers.0.mlp.down_proj.weight": torch.zeros(3, 40),  # matmul [out 3, in 40]
        "model.norm.weight": torch.zeros(40),  # norm: fp32, 160
        "model.layers.0.self_attn.q_proj.bias": torch.zeros(3, dtype=torch.float16),  # bias: fp32, 12
    }
    directory = write_synthetic(tmp_path / "m", "llama", tensors, tie_word_embeddings=True)
    checkpoint, spec = load_with_spec(directory)
    fp = footprint(checkpoint, spec, batch=1, seq=1)
    assert fp.parameters_by_dtype == {"F16": 3, "F32": 400 + 120 + 40}
    assert fp.weight_bytes == 4 * 560 + 2 * 3
    assert fp.weight_bytes_at == {
        "fp32": 4 * 563,
        "fp16": 2 * 563,
        # tied: one 8-bit matrix the lookup and the head both read (the default target's lookup
        # reads the head's codes)
        "int8": quantized_bytes((10, 40), QuantLayout(8)) + 216 + 160 + 12,
        # int4, the default recipe: the tied table and head one symmetric 8-bit matrix the lookup
        # and the head both read (2 blocks of 32 a row of 40, a float32 scale each: too few to
        # count as float16), and zero points (a row's packed in bytes) elsewhere: the default mix
        # keeps the down projection (a layer `more_bits` picks) at 8 bits
        "int4": 10 * 2 * (32 + 4) + 3 * (2 * (32 + 4) + 2) + 160 + 12,
    }
    # a recipe's own layout: the default's is the table's figure; where the lookup cannot read the
    # head's codes (a DequantizeLinear target), each holds its own, the table at 4 bits
    default = QuantLayout(4, zero_points=True, mix="all_attention", table_block=16, tied_lookup=True)
    assert quantized_weight_bytes(checkpoint, spec, default) == fp.weight_bytes_at["int4"]
    apart = quantized_weight_bytes(checkpoint, spec, replace(default, tied_lookup=False))
    assert apart == 10 * (3 * (8 + 4) + 2) + 10 * (2 * (16 + 4) + 1) + 3 * (2 * (32 + 4) + 2) + 160 + 12
    # symmetric; a free minimum adds a float per 4-bit block (the table's 2 × 10 rows × 2 blocks;
    # with no mix the projection's 3 × 2 too), 4 bytes each
    symmetric = quantized_weight_bytes(checkpoint, spec, QuantLayout(4, mix="all_attention"))
    assert symmetric == 2 * quantized_bytes((10, 40), QuantLayout(4)) + 216 + 160 + 12
    free_min = quantized_weight_bytes(checkpoint, spec, QuantLayout(4, free_min=True, mix="all_attention"))
    assert free_min == symmetric + 2 * 10 * 2 * 4
    plain = quantized_weight_bytes(checkpoint, spec, QuantLayout(4))
    assert plain == symmetric - 216 + 120
    assert quantized_weight_bytes(checkpoint, spec, QuantLayout(4, free_min=True)) == plain + (2 * 10 * 2 + 3 * 2) * 4


def test_the_head_is_quantized_tied_or_not(tmp_path: Path) -> None:
    """Untied, the head is a 4-bit weight of its own beside the 4-bit table; tied, the default
    int4 keeps the two as one symmetric 8-bit matrix (one parameter in the checkpoint)."""
    tensors = {"model.embed_tokens.weight": torch.zeros(10, 40), "lm_head.weight": torch.zeros(10, 40)}
    # the default int4: zero points, the lookup's table in blocks of 16, the head in blocks of 32
    lookup = quantized_bytes((10, 40), QuantLayout(4, block=16, zero_points=True))
    head = quantized_bytes((10, 40), QuantLayout(4, zero_points=True))
    untied = write_synthetic(tmp_path / "untied", "llama", tensors, tie_word_embeddings=False)
    fp = footprint(*load_with_spec(untied), batch=1, seq=1)
    assert fp.weight_bytes_at["int4"] == lookup + head
    tied = write_synthetic(tmp_path / "tied", "llama", tensors, tie_word_embeddings=True)
    fp = footprint(*load_with_spec(tied), batch=1, seq=1)
    assert fp.parameters == 400
    assert fp.weight_bytes_at["int4"] == quantized_bytes((10, 40), QuantLayout(8)) < lookup + head


def test_gpt2_conv1d_weights_are_input_first(tmp_path: Path) -> None:
    tensors = {
        "transformer.wte.weight": torch.zeros(10, 40),  # token table [vocab, hidden], not input-first
        "transformer.wpe.weight": torch.zeros(64, 40),  # learned positions: fp32
        "transformer.h.0.mlp.c_fc.weight": torch.zeros(40, 3),  # Conv1D [in 40, out 3]
    }
    directory = write_synthetic(tmp_path / "m", "gpt2", tensors)
    fp = footprint(*load_with_spec(directory), batch=1, seq=1)
    # gpt2 ties its head to wte: one [10 out, 40 in] 8-bit matrix for both (int4's default)
    shared = quantized_bytes((10, 40), QuantLayout(8))
    c_fc = quantized_bytes((3, 40), QuantLayout(4, zero_points=True))
    assert fp.weight_bytes_at["int4"] == shared + 64 * 40 * 4 + c_fc


def test_unknown_stored_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = write_synthetic(tmp_path / "m", "llama", {"model.norm.weight": torch.zeros(4)})
    checkpoint, spec = load_with_spec(directory)
    monkeypatch.setattr(Checkpoint, "tensor_metadata", lambda self: {"model.norm.weight": ("F4", (4,))})
    with pytest.raises(CheckpointError, match="model.norm.weight.*F4"):
        footprint(checkpoint, spec, batch=1, seq=1)


def test_checkpoint_with_only_buffers(tmp_path: Path) -> None:
    directory = write_synthetic(tmp_path / "m", "llama", {"model.rotary_emb.inv_freq": torch.zeros(4)})
    with pytest.raises(CheckpointError, match="no parameters"):
        footprint(*load_with_spec(directory), batch=1, seq=1)


# --- requests, totals and the table -----------------------------------------------------------


@pytest.fixture
def llama(tmp_path: Path) -> tuple[Checkpoint, DecoderSpec]:
    save_model(tmp_path, "llama")
    return load_with_spec(tmp_path)


@pytest.mark.parametrize(("batch", "seq"), [(0, 4), (1, 0), (-1, 4), (True, 4), (1, 2.0)])
def test_bad_batch_or_seq(llama: tuple[Checkpoint, DecoderSpec], batch: Any, seq: Any) -> None:
    with pytest.raises(GenerationError):
        footprint(*llama, batch=batch, seq=seq)


def test_seq_beyond_max_positions_warns(
    llama: tuple[Checkpoint, DecoderSpec],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvforge.toolchain.footprint"):
        fp = footprint(*llama, batch=1, seq=65)
    assert "max_position_embeddings" in caplog.text
    assert fp.kv_bytes_total["fp16"] == 65 * fp.kv_bytes_per_token["fp16"]


def test_total_bytes(llama: tuple[Checkpoint, DecoderSpec]) -> None:
    fp = footprint(*llama, batch=3, seq=64)
    for weights in ("fp32", "fp16", "int8", "int4"):
        for kv in ("fp32", "fp16", "int8"):
            assert fp.total_bytes(weights, kv) == fp.weight_bytes_at[weights] + fp.kv_bytes_total[kv]
    assert fp.kv_bytes_total["fp16"] == 2 * fp.kv_bytes_total["int8"]  # --kv-dtype int8: a byte an element
    with pytest.raises(KvforgeError, match="int4"):
        fp.total_bytes("int2", "fp16")
    with pytest.raises(KvforgeError, match="fp16"):
        fp.total_bytes("fp16", "int4")


def test_format_footprint(llama: tuple[Checkpoint, DecoderSpec]) -> None:
    checkpoint, spec = llama
    fp = footprint(checkpoint, spec, batch=2, seq=64)
    text = format_footprint(fp, spec)
    assert text.startswith("llama: 2 layers, 4 heads (2 KV) × 16")
    assert f"{fp.parameters:,} F32" in text
    for precision in ("fp32", "fp16", "int8", "int4"):
        assert f"{fp.weight_bytes_at[precision]:,}" in text
    assert f"{fp.kv_bytes_total['fp16']:,}" in text and "batch 2 × seq 64" in text
    assert f"{fp.total_bytes('int4', 'fp16'):,}" in text
    assert "GiB" in text and f"{fp.weight_bytes / 2**30:.3f}" in text


def test_footprint_is_a_frozen_value(llama: tuple[Checkpoint, DecoderSpec]) -> None:
    fp = footprint(*llama, batch=1, seq=8)
    assert isinstance(fp, Footprint)
    with pytest.raises(AttributeError):
        fp.seq = 9  # type: ignore[misc]
    assert math.prod((fp.batch, fp.seq)) == 8
