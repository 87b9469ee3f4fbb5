"""DecoderSpec against the real transformers config classes, and every rejected config."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest
import torch
import transformers

from kvforge.runners.contract import LayerState
from kvforge.runners.errors import ArtifactError, CheckpointError, KvforgeError, UnsupportedModelError
from kvforge.toolchain.spec import SUPPORTED_MODEL_TYPES, DecoderSpec, verified_families

logging.getLogger("transformers").setLevel(logging.ERROR)

# Small shapes in each config class's own field names: GQA where the architecture has it,
# head_dim explicit where the class has the field and set off hidden/heads where allowed.
_LLAMA_LIKE: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
TINY: dict[str, dict[str, Any]] = {
    "llama": dict(_LLAMA_LIKE, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    "mistral": dict(_LLAMA_LIKE, sliding_window=32, rms_norm_eps=3e-6),
    "qwen2": dict(
        _LLAMA_LIKE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=48, max_window_layers=1
    ),
    "qwen3": dict(_LLAMA_LIKE, head_dim=8),
    "phi3": dict(_LLAMA_LIKE, partial_rotary_factor=0.5, sliding_window=40, pad_token_id=0, eos_token_id=3),
    "gemma": dict(_LLAMA_LIKE, head_dim=32, num_key_value_heads=1),
    "gemma2": dict(_LLAMA_LIKE, head_dim=16, sliding_window=16, query_pre_attn_scalar=16),
    "gpt2": {
        "vocab_size": 96,
        "n_embd": 48,
        "n_layer": 2,
        "n_head": 6,
        "n_positions": 64,
        "n_inner": None,
        "layer_norm_epsilon": 1e-4,
    },
    "gpt_neox": {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "rotary_pct": 0.5,
        "rotary_emb_base": 5000,
        "layer_norm_eps": 2e-5,
    },
}

# What the test itself must know per architecture: the name of the norm-epsilon attribute.
EPS_ATTRIBUTE = {"gpt2": "layer_norm_epsilon", "gpt_neox": "layer_norm_eps"}

# Field names as each architecture spells them, for the "missing field" cases.
REQUIRED = {
    "gpt2": ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions"),
    "gpt_neox": (
        "num_hidden_layers",
        "num_attention_heads",
        "hidden_size",
        "vocab_size",
        "max_position_embeddings",
        "intermediate_size",
    ),
}
_LLAMA_REQUIRED = (
    "num_hidden_layers",
    "num_attention_heads",
    "hidden_size",
    "vocab_size",
    "max_position_embeddings",
    "intermediate_size",
)


def hf_config(model_type: str, **overrides: Any) -> transformers.PreTrainedConfig:
    return transformers.AutoConfig.for_model(model_type, **{**TINY[model_type], **overrides})


def config_dict(model_type: str, **overrides: Any) -> dict[str, Any]:
    """config.json as save_pretrained would write it (a JSON round trip included)."""
    return json.loads(hf_config(model_type, **overrides).to_json_string())


def assert_matches_library(spec: DecoderSpec, cfg: transformers.PreTrainedConfig) -> None:
    """Every spec field equals what the transformers config object reports."""
    heads = cfg.num_attention_heads
    assert spec.model_type == cfg.model_type
    assert spec.num_layers == cfg.num_hidden_layers
    assert spec.num_heads == heads
    assert spec.num_kv_heads == (getattr(cfg, "num_key_value_heads", None) or heads)
    assert spec.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    assert spec.hidden_size == cfg.hidden_size
    if cfg.model_type == "gpt2":  # GPT2Block: n_inner None means 4 * hidden
        assert spec.intermediate_size == (cfg.n_inner or 4 * cfg.hidden_size)
    else:
        assert spec.intermediate_size == cfg.intermediate_size
    assert spec.vocab_size == cfg.vocab_size
    assert spec.max_positions == cfg.max_position_embeddings
    assert spec.norm_eps == getattr(cfg, EPS_ATTRIBUTE.get(cfg.model_type, "rms_norm_eps"))
    assert spec.tied_embeddings == cfg.tie_word_embeddings
    assert spec.sliding_window == getattr(cfg, "sliding_window", None)
    assert spec.bos_token_id == cfg.bos_token_id
    eos = cfg.eos_token_id
    assert spec.eos_token_ids == (() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))
    assert spec.pad_token_id == cfg.pad_token_id
    rope = getattr(cfg, "rope_parameters", None)
    if rope is None:
        assert spec.position_embedding == "learned"
        assert (spec.rope_theta, spec.rope_scaling) == (None, None)
        return
    assert spec.position_embedding == "rope"
    assert spec.rope_theta == rope["rope_theta"]
    assert spec.partial_rotary_factor == rope.get("partial_rotary_factor", 1.0)
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    assert spec.rope_scaling == (None if rope["rope_type"] == "default" else scaling)


def test_supported_model_types() -> None:
    assert SUPPORTED_MODEL_TYPES == (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma",
        "gemma2",
        "gpt2",
        "gpt_neox",
    )
    assert set(TINY) == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_matches_transformers_config(model_type: str) -> None:
    cfg = hf_config(model_type)
    spec = DecoderSpec.from_config(config_dict(model_type))
    assert_matches_library(spec, cfg)
    assert spec.dtype == "float32"


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_matches_the_built_model(model_type: str) -> None:
    """Norm kind, tying and the attention projections as the instantiated model has them."""
    cfg = hf_config(model_type)
    spec = DecoderSpec.from_config(config_dict(model_type))
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    has_layernorm = any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    assert spec.norm_kind == ("layernorm" if has_layernorm else "rmsnorm")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert spec.tied_embeddings == tied
    out = model(torch.zeros(1, 3, dtype=torch.long), use_cache=True)
    layer = out.past_key_values.layers[0]
    assert tuple(layer.keys.shape) == (1, spec.num_kv_heads, 3, spec.head_dim)
    assert len(out.past_key_values.layers) == spec.num_layers


# Fields a real config.json may lack, per the architecture's own names; dropping them must
# give what transformers assumes (its class defaults), since transformers builds the model.
OPTIONAL = {
    "gpt2": ("n_inner", "layer_norm_epsilon", "tie_word_embeddings", "bos_token_id", "eos_token_id"),
    "gpt_neox": ("rope_parameters", "layer_norm_eps", "tie_word_embeddings"),
}
_LLAMA_OPTIONAL = (
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "sliding_window",
    "use_sliding_window",
)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_absent_fields_take_transformers_defaults(model_type: str) -> None:
    # 32 heads over a 512 hidden size fit every class default for KV heads (up to 32).
    overrides: dict[str, Any] = (
        {"n_head": 32, "n_embd": 512} if model_type == "gpt2" else {"num_attention_heads": 32, "hidden_size": 512}
    )
    full = config_dict(model_type, **overrides)
    for field in OPTIONAL.get(model_type, _LLAMA_OPTIONAL):
        if field not in full:
            continue
        data = {k: v for k, v in full.items() if k != field}
        cfg = type(hf_config(model_type)).from_dict(dict(data))
        assert_matches_library(DecoderSpec.from_config(data), cfg)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "phi3"])
def test_null_kv_heads_means_multi_head(model_type: str) -> None:
    data = config_dict(model_type)
    data["num_key_value_heads"] = None
    cfg = type(hf_config(model_type)).from_dict(dict(data))
    assert DecoderSpec.from_config(data).num_kv_heads == cfg.num_key_value_heads == 4


def test_qwen_window_applies_only_when_switched_on() -> None:
    data = config_dict("qwen2", use_sliding_window=False, sliding_window=48)
    data["sliding_window"] = 48  # hub configs keep the value even when it is off
    assert DecoderSpec.from_config(data).sliding_window is None
    assert DecoderSpec.from_config(config_dict("qwen2")).sliding_window == 48


def test_mistral_null_window_is_full_attention() -> None:
    spec = DecoderSpec.from_config(config_dict("mistral", sliding_window=None))
    assert spec.sliding_window is None


# --- old (transformers 4.x) and new layouts -----------------------------------------------

OLD_LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    (
        "llama",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    ("llama", {"rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
    ("llama", {"rope_theta": 7.0, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5.0}}),
    ("qwen2", {"rope_theta": 1000000.0, "rope_scaling": None}),
    ("mistral", {"rope_theta": 1e6}),
    ("gemma2", {"rope_theta": 20000.0}),
    ("gpt_neox", {"rotary_pct": 0.25, "rotary_emb_base": 10000, "rope_theta": 99.0, "partial_rotary_factor": 0.5}),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1234.0, "partial_rotary_factor": 0.5}}),
    (
        "phi3",
        {
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 64,
            "max_position_embeddings": 256,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6},
        },
    ),
    ("phi3", {"rope_theta": 250000.0}),
]


@pytest.mark.parametrize(("model_type", "fields"), OLD_LAYOUTS)
def test_old_config_layouts_read_like_transformers(model_type: str, fields: dict[str, Any]) -> None:
    data = {**TINY[model_type], "model_type": model_type, **fields}
    cfg = type(hf_config(model_type)).from_dict(json.loads(json.dumps(data)))
    spec = DecoderSpec.from_config(data)
    assert_matches_library(spec, cfg)


def test_phi3_legacy_su_rope_type_is_longrope() -> None:
    data = config_dict("phi3", max_position_embeddings=256, original_max_position_embeddings=64)
    data["rope_parameters"] = {"rope_type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}
    scaling = DecoderSpec.from_config(data).rope_scaling
    assert scaling is not None
    assert scaling["rope_type"] == "longrope"
    assert scaling["original_max_position_embeddings"] == 64


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("torch_dtype", "bfloat16", "bfloat16"),
        ("torch_dtype", "float16", "float16"),
        ("dtype", "float16", "float16"),
        ("dtype", None, "float32"),
    ],
)
def test_dtype_from_either_key(key: str, value: Any, expected: str) -> None:
    data = config_dict("llama")
    data[key] = value
    assert DecoderSpec.from_config(data).dtype == expected
    cfg = transformers.LlamaConfig.from_dict(dict(data))
    assert str(cfg.dtype or torch.float32).removeprefix("torch.") == expected


def test_dtype_key_wins_over_torch_dtype() -> None:
    data = {**config_dict("llama"), "dtype": "float16", "torch_dtype": "bfloat16"}
    assert DecoderSpec.from_config(data).dtype == "float16"


# --- special tokens -----------------------------------------------------------------------


def test_generation_config_eos_list_wins() -> None:
    spec = DecoderSpec.from_config(
        config_dict("llama"), {"eos_token_id": [7, 2, 7], "bos_token_id": 5, "pad_token_id": 9}
    )
    assert spec.eos_token_ids == (7, 2)
    assert (spec.bos_token_id, spec.pad_token_id) == (5, 9)


def test_generation_config_without_tokens_falls_back_to_config() -> None:
    spec = DecoderSpec.from_config(config_dict("llama"), {"eos_token_id": None, "do_sample": True})
    assert (spec.bos_token_id, spec.eos_token_ids, spec.pad_token_id) == (1, (2,), 0)


def test_config_eos_list_and_null_or_absent_tokens() -> None:
    data = config_dict("llama")
    data["eos_token_id"] = [2, 3]
    data["bos_token_id"] = None  # explicitly none
    del data["pad_token_id"]  # absent: transformers' class default (None for llama)
    spec = DecoderSpec.from_config(data)
    assert (spec.bos_token_id, spec.eos_token_ids, spec.pad_token_id) == (None, (2, 3), None)
    del data["bos_token_id"], data["eos_token_id"]  # absent: llama's class defaults
    cfg = transformers.LlamaConfig.from_dict(dict(data))
    spec = DecoderSpec.from_config(data)
    assert (spec.bos_token_id, spec.eos_token_ids) == (cfg.bos_token_id, (cfg.eos_token_id,))


def test_negative_pad_is_unset(caplog: pytest.LogCaptureFixture) -> None:
    data = {**config_dict("llama"), "pad_token_id": -1}
    with caplog.at_level(logging.WARNING):
        assert DecoderSpec.from_config(data).pad_token_id is None
    assert "pad_token_id" in caplog.text


# --- rejected configs ---------------------------------------------------------------------


def check_error(exc: pytest.ExceptionInfo[KvforgeError], *needles: str) -> None:
    message = str(exc.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


@pytest.mark.parametrize("model_type", ["LLaMA", ["llama"], 3, "not_a_model"])
def test_model_type_transformers_lacks_lists_verified_families(model_type: Any) -> None:
    data = {**config_dict("llama"), "model_type": model_type}
    with pytest.raises(UnsupportedModelError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", repr(model_type), "transformers has no such model_type", *verified_families())


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("bert", "no causal-LM class"),  # an encoder
        ("t5", "no causal-LM class"),  # an encoder-decoder
        ("mamba", "has no attention heads"),  # a causal LM, but no layer attends: nothing keeps K/V
    ],
)
def test_transformers_models_that_are_no_kv_decoders_are_refused(model_type: str, why: str) -> None:
    # as their own configs do, these name no attention heads
    data = {k: v for k, v in config_dict("llama").items() if k != "num_attention_heads"} | {"model_type": model_type}
    with pytest.raises(UnsupportedModelError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", repr(model_type), why)


def test_a_family_without_an_entry_is_read_through_its_config_class() -> None:
    """bloom names its fields n_layer / n_head; its config class maps them, and its defaults fill the rest."""
    data = {"model_type": "bloom", "vocab_size": 96, "hidden_size": 64, "n_layer": 3, "n_head": 4, "seq_length": 512}
    spec = DecoderSpec.from_config(data)
    cfg = transformers.AutoConfig.for_model("bloom", **{k: v for k, v in data.items() if k != "model_type"})
    assert (spec.num_layers, spec.num_heads, spec.head_dim) == (3, 4, 16)
    assert spec.norm_eps == cfg.layer_norm_epsilon and spec.norm_kind == "layernorm"
    assert spec.max_positions == 512 and spec.position_embedding == "other"  # ALiBi: its context from seq_length
    assert (spec.bos_token_id, spec.eos_token_ids) == (cfg.bos_token_id, (cfg.eos_token_id,))
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config({**data, "n_head": 0})
    check_error(exc, "config.json", "'n_head'")  # named as the file names it
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config({k: v for k, v in data.items() if k != "seq_length"})
    check_error(exc, "config.json", "max_position_embeddings", "missing")


def test_missing_model_type() -> None:
    data = config_dict("llama")
    del data["model_type"]
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", "model_type", "llama")


@pytest.mark.parametrize(
    ("model_type", "field"), [(mt, f) for mt in SUPPORTED_MODEL_TYPES for f in REQUIRED.get(mt, _LLAMA_REQUIRED)]
)
def test_missing_required_field(model_type: str, field: str) -> None:
    data = config_dict(model_type)
    del data[field]
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", repr(field)[1:-1], "missing")


@pytest.mark.parametrize(
    ("model_type", "field", "value", "needle"),
    [
        ("llama", "num_attention_heads", 0, "positive"),
        ("llama", "num_key_value_heads", 0, "positive"),
        ("gpt2", "n_head", 0, "positive"),
        ("llama", "num_hidden_layers", -2, "positive"),
        ("llama", "head_dim", 0, "positive"),
        ("llama", "max_position_embeddings", 10_000_001, "sanity limit"),
        ("llama", "vocab_size", 20_000_000, "sanity limit"),
        ("gpt2", "n_positions", 10**9, "sanity limit"),
        ("llama", "num_hidden_layers", 100_000, "sanity limit"),
        ("llama", "intermediate_size", 10**8, "sanity limit"),
        ("llama", "num_hidden_layers", "32", "integer"),
        ("llama", "num_attention_heads", True, "integer"),
        ("llama", "hidden_size", 64.0, "integer"),
        ("gpt2", "n_embd", "48", "integer"),
        ("llama", "rms_norm_eps", "1e-6", "number"),
        ("llama", "rms_norm_eps", 0.0, "(0, 1)"),
        ("gpt2", "layer_norm_epsilon", -1e-5, "(0, 1)"),
        ("llama", "tie_word_embeddings", "yes", "true or false"),
        ("llama", "tie_word_embeddings", 1, "true or false"),
        ("llama", "rope_theta", -1.0, "positive"),
        ("mistral", "sliding_window", 0, "positive"),
        ("mistral", "sliding_window", "4096", "integer"),
        ("qwen2", "use_sliding_window", "true", "true or false"),
        ("llama", "rope_parameters", [1, 2], "object"),
        ("llama", "bos_token_id", "<s>", "integer"),
        ("llama", "bos_token_id", -3, "non-negative"),
        ("llama", "eos_token_id", "2", "token id"),
        ("llama", "eos_token_id", [2, None], "token id"),
        ("llama", "eos_token_id", [2, True], "token id"),
        ("gpt_neox", "rotary_pct", 0.0, "(0, 1]"),
        ("gpt_neox", "rotary_pct", 1.5, "(0, 1]"),
        ("gpt_neox", "rotary_pct", 0.1, "rotary dimension"),
        ("phi3", "partial_rotary_factor", "half", "number"),
    ],
)
def test_bad_field_value(model_type: str, field: str, value: Any, needle: str) -> None:
    data = config_dict(model_type)
    data[field] = value
    if field in ("rope_theta", "rotary_pct", "partial_rotary_factor"):
        data.pop("rope_parameters", None)  # let the top-level (old) field be the source
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", field, needle)


def test_bad_value_inside_rope_parameters_names_the_path() -> None:
    data = config_dict("llama")
    data["rope_parameters"] = {"rope_type": "default", "rope_theta": "big"}
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", "rope_parameters.rope_theta", "number")


def test_hidden_not_divisible_by_heads_without_head_dim() -> None:
    data = config_dict("llama")
    data["hidden_size"] = 66
    del data["head_dim"]
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", "hidden_size", "66", "num_attention_heads", "head_dim")
    data["head_dim"] = 16  # an explicit head_dim needs no divisibility
    assert DecoderSpec.from_config(data).head_dim == 16


def test_gpt2_hidden_not_divisible_by_heads() -> None:
    data = config_dict("gpt2")
    data["n_head"] = 5
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", "n_embd", "n_head")


def test_heads_not_divisible_by_kv_heads() -> None:
    data = {**config_dict("llama"), "num_key_value_heads": 3}
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", "num_key_value_heads", "3", "num_attention_heads")


def test_absent_kv_heads_default_that_does_not_divide_says_so() -> None:
    data = config_dict("mistral")  # 4 query heads; transformers assumes 8 KV heads when absent
    del data["num_key_value_heads"]
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "num_key_value_heads", "absent", "default")


@pytest.mark.parametrize("value", ["float64", "int8", "torch.float16", "auto", 16])
def test_unsupported_dtype(value: Any) -> None:
    data = {**config_dict("llama"), "torch_dtype": value}
    with pytest.raises(KvforgeError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", "torch_dtype")


def test_nested_rope_parameters_are_unsupported() -> None:
    data = config_dict("llama")
    data["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(UnsupportedModelError) as exc:
        DecoderSpec.from_config(data)
    check_error(exc, "config.json", "rope_parameters")


def test_config_must_be_a_mapping() -> None:
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config([1, 2])  # type: ignore[arg-type]
    check_error(exc, "config.json", "object")


def test_bad_generation_config_names_its_file() -> None:
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(config_dict("llama"), {"eos_token_id": "</s>"})
    check_error(exc, "generation_config.json", "eos_token_id")


# --- serialization and derived values ------------------------------------------------------


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_dict_round_trip_through_json(model_type: str) -> None:
    spec = DecoderSpec.from_config(config_dict(model_type))
    data = spec.to_dict()
    # `layers` only for a model with fixed-size layer states: other manifests are unchanged
    assert list(data) == [f for f in DecoderSpec.__dataclass_fields__ if f != "layers"]
    text = json.dumps(data)
    assert DecoderSpec.from_dict(json.loads(text)) == spec
    assert json.dumps(DecoderSpec.from_dict(json.loads(text)).to_dict()) == text


def test_layers_round_trip_through_json() -> None:
    plain = DecoderSpec.from_config(config_dict("llama"))
    layers = (LayerState("conv", ((64, 3),)),) + (LayerState("attention"),) * (plain.num_layers - 1)
    spec = dataclasses.replace(plain, layers=layers)
    data = json.loads(json.dumps(spec.to_dict()))
    assert data["layers"][:2] == [{"kind": "conv", "states": {"conv": [64, 3]}}, {"kind": "attention"}]
    assert DecoderSpec.from_dict(data) == spec
    assert spec.attention_layers == plain.num_layers - 1 and spec.state_bytes_per_sequence(2) == 64 * 3 * 2
    assert spec.kv_bytes_per_token(2) * plain.num_layers == plain.kv_bytes_per_token(2) * (plain.num_layers - 1)
    with pytest.raises(ArtifactError, match="layers"):
        DecoderSpec.from_dict(data | {"layers": [data["layers"][0]]})


def test_to_dict_is_a_copy() -> None:
    spec = DecoderSpec.from_config(OLD_CONFIG_WITH_SCALING)
    data = spec.to_dict()
    data["rope_scaling"]["factor"] = 100.0
    assert spec.rope_scaling is not None and spec.rope_scaling["factor"] == 2.0


OLD_CONFIG_WITH_SCALING = {**TINY["llama"], "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"num_layers": None}, "missing"),
        ({"extra": 1}, "unknown"),
        ({"num_heads": "4"}, "num_heads"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"tied_embeddings": "no"}, "tied_embeddings"),
        ({"eos_token_ids": [1, "2"]}, "eos_token_ids"),
        ({"dtype": "float64"}, "dtype"),
        ({"model_type": "no such/type"}, "model_type"),
        ({"norm_eps": "x"}, "norm_eps"),
        ({"rope_theta": None}, "rope_theta"),
        ({"vocab_size": 10**8}, "vocab_size"),
        ({"pad_token_id": -1}, "pad_token_id"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"partial_rotary_factor": 2.0}, "partial_rotary_factor"),
        ({"rope_theta": -5.0}, "rope_theta"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"rope_scaling": [1]}, "rope_scaling"),
    ],
)
def test_from_dict_rejects(change: dict[str, Any], needle: str) -> None:
    data = DecoderSpec.from_config(config_dict("llama")).to_dict()
    for key, value in change.items():
        if value is None and needle == "missing":
            del data[key]
        else:
            data[key] = value
    with pytest.raises(ArtifactError) as exc:
        DecoderSpec.from_dict(data)
    check_error(exc, needle)


def test_from_dict_needs_an_object() -> None:
    with pytest.raises(ArtifactError, match="expected an object"):
        DecoderSpec.from_dict([("model_type", "llama")])  # type: ignore[arg-type]


def test_kv_bytes_per_token() -> None:
    spec = DecoderSpec.from_config(config_dict("llama"))  # 3 layers, 2 KV heads of 16
    assert spec.kv_bytes_per_token(2) == 2 * 3 * 2 * 16 * 2
    windowed = DecoderSpec.from_config(config_dict("mistral"))
    assert windowed.sliding_window == 32
    assert windowed.kv_bytes_per_token(4) == 2 * 3 * 2 * 16 * 4
    for bad in (0, -2, True, 2.0):
        with pytest.raises(KvforgeError):
            spec.kv_bytes_per_token(bad)  # type: ignore[arg-type]
