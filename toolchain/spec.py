"""The decoder's shape, normalized once from a Hugging Face `config.json`.

Any decoder-only `model_type` that transformers implements is read the same way: through
its config class, whose `attribute_map` turns a family's own names (gpt2's `n_head`) into
the standardized ones (`num_attention_heads`) and whose defaults fill absent fields, since
transformers builds the traced model from that same config. A family gets an entry in
`LAYOUTS` only where it really differs; the nine families kvforge began with keep entries
that read their fields without transformers (their defaults written out), which the tests
compare with the library's. The KV cache's layout (heads, key and value sizes) is not
taken from here for the contract: `kvforge.toolchain.export.cache_layout` reads it off the
modeling code itself, and `with_cache` records it in the spec.

What the spec does not say: which layers use the sliding window (gemma2 alternates,
qwen2/qwen3 follow `max_window_layers`); `sliding_window` is the window as transformers
reports it in `config.sliding_window`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvforge.runners.contract import KV_KINDS, LayerState
from kvforge.runners.errors import ArtifactError, CheckpointError, KvforgeError, UnsupportedModelError

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

# Families with an entry of their own (LAYOUTS); every other decoder-only model_type of
# transformers is read through its config class (`_generic_layout`).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
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
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")

DEFAULT_ROPE_THETA = 10_000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
# RoPE types whose parameters include the pretraining length (transformers fills it in).
_ROPE_TYPES_WITH_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")

# Upper bounds far beyond any real model; a value past them is a corrupt or hostile config.
_LIMITS: dict[str, int] = {
    "num_layers": 10_000,
    "num_heads": 100_000,
    "num_kv_heads": 100_000,
    "head_dim": 65_536,
    "hidden_size": 1_000_000,
    "intermediate_size": 10_000_000,
    "vocab_size": 10_000_000,
    "max_positions": 10_000_000,
    "sliding_window": 10_000_000,
    "value_head_dim": 65_536,
    "num_experts": 1_000_000,
}


@dataclass(frozen=True)
class _Layout:
    """Where one architecture keeps each setting in config.json, and its absent-field defaults.

    A `None` field name means the architecture has no such setting: no `num_kv_heads` means
    plain multi-head attention, no `head_dim` means hidden_size / heads always, no
    `sliding_window` means full attention everywhere.
    """

    num_layers: str = "num_hidden_layers"
    num_heads: str = "num_attention_heads"
    hidden_size: str = "hidden_size"
    intermediate_size: str = "intermediate_size"
    intermediate_multiple: int | None = None  # absent/null intermediate size = this × hidden
    vocab_size: str = "vocab_size"
    max_positions: str = "max_position_embeddings"
    num_kv_heads: str | None = "num_key_value_heads"
    num_kv_heads_default: int | None = None  # None: as many as query heads
    head_dim: str | None = "head_dim"
    head_dim_default: int | None = None  # None: hidden_size / heads
    norm_kind: str = "rmsnorm"
    norm_eps: str = "rms_norm_eps"
    norm_eps_default: float = 1e-6
    position_embedding: str = "rope"
    rope_theta: str = "rope_theta"  # top-level key, used when rope parameters lack rope_theta
    partial_rotary: str = "partial_rotary_factor"
    partial_rotary_default: float = 1.0
    rope_type_aliases: tuple[tuple[str, str], ...] = ()
    original_max_positions: str | None = None  # top-level pretraining length for scaled RoPE
    original_max_positions_default: int | None = None
    tied_default: bool = False
    sliding_window: str | None = None
    sliding_window_default: int | None = None
    sliding_window_switch: str | None = None  # a flag that must be true for the window to apply
    sliding_window_switch_default: bool = False
    bos_token_default: int | None = None
    eos_token_default: int | None = None
    pad_token_default: int | None = None
    per_layer_type_rope: bool = False  # rope parameters may be one dict per layer kind (gemma3)
    input_first_weights: bool = False  # 2-D matmul weights stored [in, out] (transformers' Conv1D)


# What a family without an entry gets: transformers' standardized names, read from a config
# with the class's defaults filled in (`_standardized`), so no default is needed here.
_GENERIC = _Layout(per_layer_type_rope=True)

LAYOUTS: dict[str, _Layout] = {
    "llama": _Layout(bos_token_default=1, eos_token_default=2),
    "mistral": _Layout(
        bos_token_default=1,
        eos_token_default=2,
        num_kv_heads_default=8,
        sliding_window="sliding_window",
        sliding_window_default=4096,
    ),
    "qwen2": _Layout(
        num_kv_heads_default=32,
        sliding_window="sliding_window",
        sliding_window_default=4096,
        sliding_window_switch="use_sliding_window",
    ),
    "qwen3": _Layout(
        num_kv_heads_default=32,
        head_dim_default=128,
        sliding_window="sliding_window",
        sliding_window_default=4096,
        sliding_window_switch="use_sliding_window",
    ),
    "phi3": _Layout(
        norm_eps_default=1e-5,
        sliding_window="sliding_window",
        rope_type_aliases=(("su", "longrope"), ("yarn", "longrope")),
        original_max_positions="original_max_position_embeddings",
        original_max_positions_default=4096,
        bos_token_default=1,
        eos_token_default=32000,
        pad_token_default=32000,
    ),
    "gemma": _Layout(
        num_kv_heads_default=16,
        head_dim_default=256,
        tied_default=True,
        bos_token_default=2,
        eos_token_default=1,
        pad_token_default=0,
    ),
    "gemma2": _Layout(
        bos_token_default=2,
        eos_token_default=1,
        pad_token_default=0,
        num_kv_heads_default=4,
        head_dim_default=256,
        tied_default=True,
        sliding_window="sliding_window",
        sliding_window_default=4096,
    ),
    "gpt2": _Layout(
        num_layers="n_layer",
        num_heads="n_head",
        hidden_size="n_embd",
        intermediate_size="n_inner",
        intermediate_multiple=4,
        max_positions="n_positions",
        num_kv_heads=None,
        head_dim=None,
        norm_kind="layernorm",
        norm_eps="layer_norm_epsilon",
        norm_eps_default=1e-5,
        position_embedding="learned",
        tied_default=True,
        input_first_weights=True,
        bos_token_default=50256,
        eos_token_default=50256,
    ),
    "gpt_neox": _Layout(
        num_kv_heads=None,
        head_dim=None,
        norm_kind="layernorm",
        norm_eps="layer_norm_eps",
        norm_eps_default=1e-5,
        rope_theta="rotary_emb_base",
        partial_rotary="rotary_pct",
        partial_rotary_default=0.25,
        bos_token_default=0,
        eos_token_default=2,
    ),
}
assert tuple(LAYOUTS) == SUPPORTED_MODEL_TYPES


# Weight names, as transformers' families spell them (suffixes of the checkpoint's names).
TOKEN_EMBEDDINGS: tuple[str, ...] = ("embed_tokens.weight", "wte.weight", "embed_in.weight", "word_embeddings.weight")
POSITION_EMBEDDINGS: tuple[str, ...] = ("wpe.weight", "embed_positions.weight")
OUTPUT_HEADS: tuple[str, ...] = ("lm_head.weight", "embed_out.weight")
# Tensors some checkpoints store that are buffers, not parameters: causal-mask constants
# (old gpt2 / gpt_neox files) and precomputed RoPE frequencies.
BUFFER_SUFFIXES: tuple[str, ...] = (
    ".attn.bias",
    ".attn.masked_bias",
    ".attention.bias",
    ".attention.masked_bias",
    "inv_freq",
)
# A mixture of experts' routed experts: the weights under this module name, stacked over the
# experts in their first dimension (transformers' fused layout) or one module per expert
# (`experts.3.w1`); a shared expert, which every token runs, is named apart.
EXPERTS = ".experts."
SHARED_EXPERT = ".shared_expert"

# Config fields whose setting transformers' SDPA attention ignores (attention-logit softcapping):
# a model that sets one is traced on the eager attention path (kvforge.toolchain.export).
SDPA_IGNORED_FIELDS: tuple[str, ...] = ("attn_logit_softcapping",)

# onnxruntime-genai model types it runs as a plain decoder from these I/O names (its
# ModelType::IsLLM list, less those with a model class of their own: gpt2 reads one combined
# past tensor per layer, phi3 rewinds a long-RoPE factor, lfm2 keeps conv state). Every other
# architecture is "decoder", the type onnxruntime-genai keeps for exactly that (kvforge.toolchain.emit.genai).
GENAI_DECODER_TYPES = frozenset({"gemma", "gemma2", "granite", "llama", "mistral", "olmo", "qwen2", "qwen3"})


def input_first_weights(model_type: str) -> bool:
    """Whether the family stores its 2-D matmul weights [in_features, out_features]."""
    layout = LAYOUTS.get(model_type)
    return layout is not None and layout.input_first_weights


@dataclass(frozen=True)
class DecoderSpec:
    """Everything about a decoder's shape that the compiler and the runner need."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    position_embedding: str  # "rope" | "learned"
    rope_theta: float | None
    rope_scaling: dict[str, Any] | None  # transformers' rope parameters, None for plain RoPE
    partial_rotary_factor: float
    norm_kind: str  # "rmsnorm" | "layernorm"
    norm_eps: float
    tied_embeddings: bool
    sliding_window: int | None
    dtype: str  # "float32" | "float16" | "bfloat16"
    # The KV cache's value size per head; `head_dim` is its key size. They differ where the
    # modeling code caches something other than per-head keys and values (multi-head latent
    # attention caches the compressed latent as "keys" and the rotary part as "values").
    value_head_dim: int
    # Mixture of experts: routed experts per MoE layer and how many each token uses (0, 0: dense).
    num_experts: int
    experts_per_token: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # Each layer's kind and fixed-size states where not every layer is attention (read off the
    # modeling code by `kvforge.toolchain.export.cache_layout`, as the cache's other sizes); None: all
    # layers keep a key/value pair. In `to_dict` only when set.
    layers: tuple[LayerState, ...] | None = None

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        generation_config: Mapping[str, Any] | None = None,
        *,
        context: int | None = None,
        tokenizer_config: Mapping[str, Any] | None = None,
    ) -> DecoderSpec:
        """Normalize a parsed config.json (and generation_config.json, if any).

        The context (`max_positions`) is `context` where given (`kvforge build --context`), at
        most what config.json states; else config.json's; else, for a family whose config names
        none (bloom: ALiBi has no position limit), `tokenizer_config`'s `model_max_length` where
        it is a real length."""
        reader = _Reader(config, CONFIG_FILE)
        model_type = _model_type(reader)
        layout = LAYOUTS.get(model_type)
        if layout is None:
            reader, layout = _generic_layout(reader, model_type)
        shape = _read_shape(reader, layout) | {
            "max_positions": _read_context(reader, layout, context, tokenizer_config)
        }
        rope = _read_rope(reader, layout, shape)
        tokens = _read_tokens(reader, layout, generation_config)
        spec = cls(
            model_type=model_type,
            **shape,
            **rope,
            position_embedding=layout.position_embedding,
            norm_kind=layout.norm_kind,
            norm_eps=_read_norm_eps(reader, layout),
            tied_embeddings=reader.flag("tie_word_embeddings", layout.tied_default),
            sliding_window=_read_sliding_window(reader, layout),
            dtype=_read_dtype(reader),
            value_head_dim=shape["head_dim"],
            **_read_experts(reader),
            **tokens,
        )
        logger.debug("spec for %s: %s", model_type, spec)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict with keys in field order."""
        data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        data["eos_token_ids"] = list(self.eos_token_ids)
        if self.layers is None:
            del data["layers"]
        else:
            data["layers"] = [layer.to_dict() for layer in self.layers]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecoderSpec:
        """Rebuild a spec written by `to_dict` (e.g. from a manifest), checking every field."""
        if not isinstance(data, Mapping):
            raise ArtifactError(f"spec: expected an object, got {type(data).__name__}; rebuild the artifact")
        names = [f.name for f in dataclasses.fields(cls)]
        optional = ("layers",)
        missing = [n for n in names if n not in data and n not in optional]
        unknown = sorted(set(data) - set(names))
        if missing or unknown:
            raise ArtifactError(
                f"spec: missing fields {missing}, unknown fields {unknown}; it was written by an "
                "incompatible kvforge version, rebuild the artifact"
            )
        values = {n: copy.deepcopy(data[n]) for n in names if n in data}
        layers = values.pop("layers", None)
        if layers is not None:
            if not isinstance(layers, list) or len(layers) != values["num_layers"]:
                raise _spec_error("layers", f"must list each of the {values['num_layers']} layers")
            values["layers"] = tuple(LayerState.from_dict(i, layer) for i, layer in enumerate(layers))
        if isinstance(values["eos_token_ids"], list):
            values["eos_token_ids"] = tuple(values["eos_token_ids"])
        _check_field_types(values)
        spec = cls(**values)
        _check_spec(spec)
        return spec

    def with_cache(
        self, num_kv_heads: int, head_dim: int, value_head_dim: int, layers: tuple[LayerState, ...] | None = None
    ) -> DecoderSpec:
        """This spec with the KV cache's layout as the modeling code keeps it."""
        return dataclasses.replace(
            self, num_kv_heads=num_kv_heads, head_dim=head_dim, value_head_dim=value_head_dim, layers=layers
        )

    @property
    def attention_layers(self) -> int:
        """How many layers keep a key/value pair."""
        return self.num_layers if self.layers is None else sum(layer.kind in KV_KINDS for layer in self.layers)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of keys plus values that one token adds to the cache, over the attention layers.

        Counted as if every layer kept every token; on a target that bounds sliding-window
        layers by their window (`DecoderIO.layer_windows`), `DecoderIO.kv_bytes_by_kind` counts
        what they hold.
        """
        _check_dtype_bytes(dtype_bytes)
        return self.attention_layers * self.num_kv_heads * (self.head_dim + self.value_head_dim) * dtype_bytes

    def state_bytes_per_sequence(self, dtype_bytes: int) -> int:
        """Bytes of the fixed-size states (convolution, recurrent) one sequence holds, whatever its length."""
        _check_dtype_bytes(dtype_bytes)
        return sum(math.prod(dims) for layer in self.layers or () for dims in layer.states) * dtype_bytes


def _check_dtype_bytes(dtype_bytes: int) -> None:
    if isinstance(dtype_bytes, bool) or not isinstance(dtype_bytes, int) or dtype_bytes <= 0:
        raise KvforgeError(f"kv_bytes_per_token: dtype_bytes must be a positive int, got {dtype_bytes!r}")


# --- reading config.json ----------------------------------------------------------------


class _Reader:
    """Typed access to one JSON mapping; every error names the file and the field."""

    def __init__(self, data: Mapping[str, Any], source: str, aliases: Mapping[str, str] | None = None) -> None:
        if not isinstance(data, Mapping):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(data).__name__}")
        self.data = data
        self.source = source
        self.aliases = dict(aliases or {})  # standardized name -> the name the file uses

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def fail(self, key: str, problem: str) -> CheckpointError:
        head, dot, rest = key.partition(".")
        key = self.aliases.get(head, head) + dot + rest
        return CheckpointError(f"{self.source}: field '{key}' {problem}; fix {self.source}")

    def int_(self, key: str, default: int | None = None, *, required: bool = False) -> int | None:
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.fail(key, "is missing (required)")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"must be an integer, got {value!r}")
        return value

    def required_int(self, key: str) -> int:
        value = self.int_(key, required=True)
        assert value is not None
        return value

    def number(self, key: str, default: float) -> float:
        value = self.data.get(key)
        if value is None:
            return default
        return _as_number(value, lambda problem: self.fail(key, problem))

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {value!r}")
        return value


def _as_number(value: Any, fail: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(f"must be a number, got {value!r}")
    try:
        number = float(value)  # an int beyond float range (JSON allows 10**400) overflows
    except OverflowError:
        raise fail(f"must be finite, got an integer of {int(value).bit_length()} bits") from None
    if not math.isfinite(number):
        raise fail(f"must be finite, got {value!r}")
    return number


def _model_type(reader: _Reader) -> str:
    value = reader.data.get("model_type")
    if value is None:
        raise reader.fail(
            "model_type", f"is missing; set the transformers model_type, such as {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if isinstance(value, str) and value in LAYOUTS:
        return value
    refusal = _refusal(value)
    if refusal is not None:
        raise UnsupportedModelError(
            f"{CONFIG_FILE}: model_type {value!r} is not supported: {refusal}; kvforge compiles the decoder-only "
            f"causal LMs transformers implements (tested families: {', '.join(verified_families())})"
        )
    return value


def _refusal(model_type: Any) -> str | None:
    """Why transformers' code cannot give kvforge a causal decoder of `model_type`, or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING_NAMES:
        return "transformers has no such model_type (a typo, remote code, or a newer transformers)"
    # Encoders (bert, roberta, ...) have a causal-LM head class too, for use inside
    # encoder-decoders; a masked-LM class is what marks them as encoders.
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "transformers has no causal-LM class for it (an encoder, encoder-decoder or non-text model)"
    return None


def verified_families() -> tuple[str, ...]:
    """The model_types the test suite builds and checks against transformers (docs/architectures.md)."""
    return (*SUPPORTED_MODEL_TYPES, *GENERIC_TESTED)


# Families without an entry of their own that the test suite builds end to end.
GENERIC_TESTED: tuple[str, ...] = (
    "stablelm",
    "phi",
    "granite",
    "starcoder2",
    "smollm3",
    "opt",
    "olmo2",
    "gemma3_text",
    "cohere",
    "falcon",
    "bloom",
    "gpt_bigcode",
    "qwen3_moe",
    "mixtral",
    "granitemoe",
    "gpt_oss",
    "deepseek_v3",
    "lfm2",
    "qwen3_5_text",
    "qwen3_next",
    "bamba",
    "granitemoehybrid",
    "nemotron_h",
    "jamba",
    "falcon_h1",
)

# Standardized config attributes a spec reads; the config class resolves each (its
# attribute_map, its defaults) for a family without an entry.
_STANDARD_FIELDS = (
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "sliding_window",
    "num_local_experts",
    "num_experts_per_tok",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)
_CONTEXT_FIELDS = ("n_positions", "n_ctx", "seq_length", "max_sequence_length")
_NORM_EPS_FIELDS = (("rms_norm_eps", "rmsnorm"), ("layer_norm_eps", "layernorm"), ("layer_norm_epsilon", "layernorm"))


def _generic_layout(reader: _Reader, model_type: str) -> tuple[_Reader, _Layout]:
    """A reader over the config as transformers' config class resolves it, and the layout
    of standardized names to read it with."""
    from transformers import AutoConfig

    fields = {k: v for k, v in reader.data.items() if k not in ("model_type", "auto_map")}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # config classes validate with ValueError, TypeError, KeyError, ...
        raise CheckpointError(
            f"{CONFIG_FILE}: transformers' {model_type} config rejects it ({type(e).__name__}: {_first_line(e)}); "
            f"fix {CONFIG_FILE}"
        ) from e
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{CONFIG_FILE}: model_type {model_type!r} is an encoder-decoder model; kvforge compiles decoder-only LMs"
        )
    if getattr(config, "num_attention_heads", None) is None:
        raise UnsupportedModelError(
            f"{CONFIG_FILE}: model_type {model_type!r} has no attention heads (num_attention_heads); kvforge compiles "
            "softmax-attention decoders with a key/value cache"
        )
    aliases = {standard: own for standard, own in getattr(config, "attribute_map", {}).items()}
    data = dict(reader.data)
    for name in _STANDARD_FIELDS:
        if data.get(aliases.get(name, name)) is None:
            value = getattr(config, name, None)
            if value is not None:
                data[name] = value
        elif name in aliases:
            data[name] = data[aliases[name]]
    layer_types = getattr(config, "layer_types", None)
    windowed = (
        any(kind in ("sliding_attention", "chunked_attention") for kind in layer_types)
        if layer_types
        else getattr(config, "use_sliding_window", True) is not False
    )
    if not windowed:  # the window is off (qwen2_moe keeps sliding_window 0 with use_sliding_window false)
        data["sliding_window"] = None
    if data.get("max_position_embeddings") is None:  # older configs name the context otherwise
        context = next((data[f] for f in _CONTEXT_FIELDS if data.get(f) is not None), None)
        if context is not None:
            data["max_position_embeddings"] = context
    eps_field, norm_kind = next(((f, kind) for f, kind in _NORM_EPS_FIELDS if data.get(f) is not None), ("", "rmsnorm"))
    layout = dataclasses.replace(
        _GENERIC,
        intermediate_multiple=None if data.get("intermediate_size") is not None else 4,
        norm_kind=norm_kind,
        norm_eps=eps_field or _GENERIC.norm_eps,
        position_embedding="rope" if data.get("rope_parameters") is not None else "other",
        sliding_window="sliding_window",
    )
    return _Reader(data, CONFIG_FILE, aliases), layout


def _read_experts(reader: _Reader) -> dict[str, Any]:
    """Routed experts and experts per token, by transformers' standardized names (each MoE
    config class maps its own, such as deepseek's n_routed_experts, onto them)."""
    experts = reader.int_("num_local_experts", 0) or 0
    per_token = (reader.int_("num_experts_per_tok", 0) or 0) if experts else 0
    if experts and not 1 <= per_token <= experts:
        raise reader.fail("num_experts_per_tok", f"= {per_token} must be between 1 and the {experts} experts")
    return {"num_experts": experts, "experts_per_token": per_token}


def _first_line(error: Exception) -> str:
    lines = str(error).splitlines()
    return lines[0] if lines else ""


def _read_shape(reader: _Reader, layout: _Layout) -> dict[str, Any]:
    num_heads = _bounded(reader, layout.num_heads, reader.required_int(layout.num_heads), "num_heads")
    hidden = _bounded(reader, layout.hidden_size, reader.required_int(layout.hidden_size), "hidden_size")
    return {
        "num_layers": _bounded(reader, layout.num_layers, reader.required_int(layout.num_layers), "num_layers"),
        "num_heads": num_heads,
        "num_kv_heads": _read_kv_heads(reader, layout, num_heads),
        "head_dim": _read_head_dim(reader, layout, hidden, num_heads),
        "hidden_size": hidden,
        "intermediate_size": _read_intermediate(reader, layout, hidden),
        "vocab_size": _bounded(reader, layout.vocab_size, reader.required_int(layout.vocab_size), "vocab_size"),
    }


TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _read_context(
    reader: _Reader, layout: _Layout, context: int | None, tokenizer_config: Mapping[str, Any] | None
) -> int:
    """The positions the artifact serves (see `DecoderSpec.from_config`)."""
    key = layout.max_positions
    limit = _LIMITS["max_positions"]
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= limit):
        raise KvforgeError(f"--context must be an integer between 1 and {limit:,}, got {context!r}")
    if reader.has(key):
        stated = _bounded(reader, key, reader.required_int(key), "max_positions")
        if context is not None and context > stated:
            raise KvforgeError(
                f"--context {context} is beyond the model's context: {CONFIG_FILE} field "
                f"'{reader.aliases.get(key, key)}' = {stated}; pass --context {stated} or less"
            )
        return stated if context is None else context
    if context is not None:
        return context
    length = (tokenizer_config or {}).get("model_max_length")
    if not isinstance(length, bool) and isinstance(length, int) and 1 <= length <= limit:
        logger.info("context: %d positions, %s's model_max_length", length, TOKENIZER_CONFIG_FILE)
        return length
    # transformers writes a placeholder of about 1e30 where a tokenizer has no length of its own
    told = "" if length is None else f" (its model_max_length {str(length)[:40]} is no context length)"
    raise CheckpointError(
        f"{CONFIG_FILE}: field '{reader.aliases.get(key, key)}' is missing and {TOKENIZER_CONFIG_FILE} gives no "
        f"model_max_length in its place{told}; the model's positions have no limit of their own (ALiBi or "
        "similar): pass --context N, the most positions (prompt plus new tokens) the artifact will serve"
    )


def _bounded(reader: _Reader, key: str, value: int, limit: str) -> int:
    if value <= 0:
        raise reader.fail(key, f"must be positive, got {value}")
    if value > _LIMITS[limit]:
        raise reader.fail(key, f"is {value}, beyond the sanity limit {_LIMITS[limit]:,}")
    return value


def _read_kv_heads(reader: _Reader, layout: _Layout, num_heads: int) -> int:
    key = layout.num_kv_heads
    if key is None:
        return num_heads
    if key in reader.data:  # present: null means "as many as query heads", as in transformers
        value = reader.int_(key, num_heads)
        note = ""
    else:
        value = layout.num_kv_heads_default or num_heads
        note = " (absent; transformers' default for this model_type)"
    assert value is not None
    _bounded(reader, key, value, "num_kv_heads")
    if num_heads % value:
        raise reader.fail(
            key,
            f"= {value}{note} does not divide {layout.num_heads} = {num_heads}; "
            "query heads must be a multiple of key/value heads",
        )
    return value


def _read_head_dim(reader: _Reader, layout: _Layout, hidden: int, num_heads: int) -> int:
    key = layout.head_dim
    if key is not None and reader.has(key):
        return _bounded(reader, key, reader.required_int(key), "head_dim")
    if key is not None and key not in reader.data and layout.head_dim_default is not None:
        return layout.head_dim_default
    if hidden % num_heads:
        raise reader.fail(
            layout.hidden_size,
            f"= {hidden} is not divisible by {layout.num_heads} = {num_heads} "
            "and no head_dim is given; set head_dim or fix the head count",
        )
    return hidden // num_heads


def _read_intermediate(reader: _Reader, layout: _Layout, hidden: int) -> int:
    key = layout.intermediate_size
    if layout.intermediate_multiple is not None and not reader.has(key):
        return layout.intermediate_multiple * hidden
    return _bounded(reader, key, reader.required_int(key), "intermediate_size")


def _read_norm_eps(reader: _Reader, layout: _Layout) -> float:
    eps = reader.number(layout.norm_eps, layout.norm_eps_default)
    if not 0.0 < eps < 1.0:
        raise reader.fail(layout.norm_eps, f"must be in (0, 1), got {eps}")
    return eps


def _read_sliding_window(reader: _Reader, layout: _Layout) -> int | None:
    if layout.sliding_window is None:
        return None
    switch = layout.sliding_window_switch
    if switch is not None and not reader.flag(switch, layout.sliding_window_switch_default):
        return None
    if layout.sliding_window in reader.data:
        window = reader.int_(layout.sliding_window)
    else:
        window = layout.sliding_window_default
    if window is None:
        return None
    return _bounded(reader, layout.sliding_window, window, "sliding_window")


def _read_dtype(reader: _Reader) -> str:
    key = "dtype" if reader.has("dtype") else "torch_dtype"
    value = reader.data.get(key)
    if value is None:
        return "float32"
    if not isinstance(value, str):
        raise reader.fail(key, f"must be a string such as 'float16', got {value!r}")
    if value not in SUPPORTED_DTYPES:
        raise UnsupportedModelError(
            f"{CONFIG_FILE}: field '{key}' is {value!r}; supported weight dtypes: "
            f"{', '.join(SUPPORTED_DTYPES)}; convert the checkpoint to one of them"
        )
    return value


# --- RoPE -------------------------------------------------------------------------------


def _read_rope(reader: _Reader, layout: _Layout, shape: Mapping[str, int]) -> dict[str, Any]:
    if layout.position_embedding != "rope":
        return {"rope_theta": None, "rope_scaling": None, "partial_rotary_factor": 1.0}
    params, key = _rope_source(reader, layout)
    theta, theta_field = _rope_number(reader, params, key, "rope_theta", layout.rope_theta, DEFAULT_ROPE_THETA)
    if theta <= 0:
        raise reader.fail(theta_field, f"(RoPE base) must be positive, got {theta}")
    partial, partial_field = _rope_number(
        reader,
        params,
        key,
        "partial_rotary_factor",
        layout.partial_rotary,
        layout.partial_rotary_default,
    )
    _check_partial(reader, partial_field, partial, shape["head_dim"])
    return {
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, layout, params, shape["max_positions"]),
        "partial_rotary_factor": partial,
    }


def _rope_source(reader: _Reader, layout: _Layout) -> tuple[dict[str, Any], str]:
    """The RoPE parameters dict; transformers lets `rope_scaling` (old name) win when both exist.
    Parameters per layer kind (gemma3: one base for sliding, one for full layers) give those
    of the full-attention layers, where the family's code reads them so."""
    key = "rope_scaling" if reader.data.get("rope_scaling") else "rope_parameters"
    raw = reader.data.get(key)
    if raw is None:
        return {}, key
    if not isinstance(raw, Mapping):
        raise reader.fail(key, f"must be an object, got {raw!r}")
    nested = {kind: v for kind, v in raw.items() if isinstance(v, Mapping)}
    if nested:
        if not layout.per_layer_type_rope:
            raise UnsupportedModelError(
                f"{CONFIG_FILE}: field '{key}' holds per-layer-type RoPE parameters, which kvforge "
                "does not support for this model_type"
            )
        kind = "full_attention" if "full_attention" in nested else sorted(nested)[0]
        return dict(nested[kind]), f"{key}.{kind}"
    return dict(raw), key


def _rope_number(
    reader: _Reader,
    params: Mapping[str, Any],
    key: str,
    name: str,
    top_level: str,
    default: float,
) -> tuple[float, str]:
    """A RoPE setting and the field it came from: the parameters dict first, then top level."""
    if params.get(name) is not None:
        field = f"{key}.{name}"
        return _as_number(params[name], lambda problem: reader.fail(field, problem)), field
    return reader.number(top_level, default), top_level


def _check_partial(reader: _Reader, field: str, partial: float, head_dim: int) -> None:
    if not 0.0 < partial <= 1.0:
        raise reader.fail(field, f"(partial rotary factor) must be in (0, 1], got {partial}")
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise reader.fail(
            field,
            f"= {partial} gives a rotary dimension of {rotary_dim} for head_dim "
            f"{head_dim}; it must be a positive even number",
        )


def _rope_scaling(
    reader: _Reader,
    layout: _Layout,
    params: dict[str, Any],
    max_positions: int,
) -> dict[str, Any] | None:
    """Scaled-RoPE parameters as transformers standardizes them, without theta and partial factor."""
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if not isinstance(rope_type, str):
        raise reader.fail("rope_parameters.rope_type", f"must be a string, got {rope_type!r}")
    rope_type = dict(layout.rope_type_aliases).get(rope_type, rope_type)
    if rope_type == "default":
        return None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    if rope_type in _ROPE_TYPES_WITH_ORIGINAL_LENGTH:
        if layout.original_max_positions is not None:
            scaling["original_max_position_embeddings"] = reader.int_(
                layout.original_max_positions,
                layout.original_max_positions_default,
            )
        else:
            scaling.setdefault("original_max_position_embeddings", max_positions)
    return scaling


# --- special tokens ---------------------------------------------------------------------


def _read_tokens(
    reader: _Reader,
    layout: _Layout,
    generation_config: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """bos / eos / pad ids: generation_config.json wins where it sets one (as `generate` does);
    a field absent from config.json takes the transformers class default."""
    gen = None if generation_config is None else _Reader(generation_config, GENERATION_CONFIG_FILE)
    # config.json's own ids are checked even where generation_config.json overrides them:
    # transformers' config class validates them again when the model is built
    if gen is not None:
        for key in ("bos_token_id", "pad_token_id"):
            if gen.has(key):
                reader.int_(key)
        if gen.has("eos_token_id") and "eos_token_id" in reader.data:
            _token_list(reader, "eos_token_id")
    bos = _token_source(gen, reader, "bos_token_id")
    pad = _token_source(gen, reader, "pad_token_id")
    eos = _token_source(gen, reader, "eos_token_id")
    default_eos = () if layout.eos_token_default is None else (layout.eos_token_default,)
    return {
        "bos_token_id": layout.bos_token_default if bos is None else _token(bos, "bos_token_id"),
        "eos_token_ids": default_eos if eos is None else _token_list(eos, "eos_token_id"),
        "pad_token_id": layout.pad_token_default if pad is None else _token(pad, "pad_token_id"),
    }


def _token_source(gen: _Reader | None, reader: _Reader, key: str) -> _Reader | None:
    """The file that sets `key`, or None when neither does (take the default)."""
    if gen is not None and gen.has(key):
        return gen
    return reader if key in reader.data else None


def _token(reader: _Reader, key: str) -> int | None:
    value = reader.int_(key)
    if value is None or value >= 0:
        return value
    if key == "pad_token_id":  # some old configs write -1 for "no padding token"
        logger.warning("%s: %s = %d is negative; treating it as unset", reader.source, key, value)
        return None
    raise reader.fail(key, f"must be a non-negative token id, got {value}")


def _token_list(reader: _Reader, key: str) -> tuple[int, ...]:
    value = reader.data[key]
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    ids: list[int] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise reader.fail(key, f"must be a token id or a list of token ids, got {value!r}")
        if item not in ids:
            ids.append(item)
    return tuple(ids)


# --- checking a rebuilt spec ------------------------------------------------------------

# "other": a family without an entry whose config has no RoPE parameters (learned tables,
# ALiBi, ...): the modeling code does what it does, and the gate checks it.
POSITION_KINDS = ("rope", "learned", "other")

_INT_FIELDS = (
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "value_head_dim",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "max_positions",
)


def _spec_error(name: str, problem: str) -> ArtifactError:
    return ArtifactError(f"spec: field '{name}' {problem}; the manifest is corrupt, rebuild the artifact")


def _check_field_types(values: Mapping[str, Any]) -> None:
    for name in _INT_FIELDS:
        _check_int(name, values[name], optional=False)
    for name in ("sliding_window", "bos_token_id", "pad_token_id"):
        _check_int(name, values[name], optional=True)
    for name in ("num_experts", "experts_per_token"):
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _LIMITS["num_experts"]:
            raise _spec_error(name, f"must be an int in [0, {_LIMITS['num_experts']}], got {value!r}")
    for name in ("norm_eps", "partial_rotary_factor", "rope_theta"):
        value = values[name]
        if value is None and name == "rope_theta":
            continue
        _as_number(value, lambda problem, n=name: _spec_error(n, problem))
    eos = values["eos_token_ids"]
    if not isinstance(eos, tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        raise _spec_error("eos_token_ids", f"must be a list of ints, got {eos!r}")
    if not isinstance(values["tied_embeddings"], bool):
        raise _spec_error("tied_embeddings", f"must be a bool, got {values['tied_embeddings']!r}")
    if values["rope_scaling"] is not None and not isinstance(values["rope_scaling"], dict):
        raise _spec_error("rope_scaling", f"must be an object or null, got {values['rope_scaling']!r}")


def _check_int(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    lowest = 0 if name in ("bos_token_id", "pad_token_id") else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise _spec_error(name, f"must be an int >= {lowest}, got {value!r}")


def _check_spec(spec: DecoderSpec) -> None:
    if not isinstance(spec.model_type, str) or not spec.model_type.replace("_", "").isalnum():
        raise _spec_error("model_type", f"is {spec.model_type!r}, not a transformers model_type")
    choices = {
        "position_embedding": POSITION_KINDS,
        "norm_kind": ("rmsnorm", "layernorm"),
        "dtype": SUPPORTED_DTYPES,
    }
    for name, allowed in choices.items():
        if getattr(spec, name) not in allowed:
            raise _spec_error(name, f"is {getattr(spec, name)!r}, expected one of {allowed}")
    for name in _INT_FIELDS:
        if getattr(spec, name) > _LIMITS[name]:
            raise _spec_error(name, f"is beyond the sanity limit {_LIMITS[name]:,}")
    if spec.num_heads % spec.num_kv_heads:
        raise _spec_error("num_kv_heads", f"= {spec.num_kv_heads} does not divide num_heads = {spec.num_heads}")
    if spec.position_embedding != "other" and (spec.position_embedding == "rope") != (spec.rope_theta is not None):
        raise _spec_error(
            "rope_theta", f"= {spec.rope_theta} contradicts position_embedding {spec.position_embedding!r}"
        )
    ranges = (
        ("norm_eps", spec.norm_eps, 0.0 < spec.norm_eps < 1.0),
        ("partial_rotary_factor", spec.partial_rotary_factor, 0.0 < spec.partial_rotary_factor <= 1.0),
        ("rope_theta", spec.rope_theta, spec.rope_theta is None or spec.rope_theta > 0),
    )
    for name, value, ok in ranges:
        if not ok:
            raise _spec_error(name, f"= {value} is out of range")
