"""`genai_config.json`: what onnxruntime-genai's runtime needs to open an artifact as it is.

onnxruntime-genai (`og.Model(ARTIFACT)`) reads this file beside the ONNX decoder. Every field
derives from the I/O contract (`DecoderIO`), the spec and the artifact's generation config, and
the names are the ones onnxruntime-genai's config reader (src/config.cpp) and its model builder
write: `model.decoder.inputs/outputs` name the graph I/O (`%d` is the layer), `search` holds the
generation defaults, and `search.past_present_share_buffer` says the graph updates its cache in
place (kv_mode `shared`), so the runtime allocates each past buffer once, `max_length` long, and
binds it as the present output too. The tokenizer is read from tokenizer.json and
tokenizer_config.json beside it (onnxruntime-genai's default tokenizer directory).

What needs no field, because both runtimes already agree (docs/artifact.md says more):
position ids and the attention mask are fed as `[batch, seq]` and `[batch, total]` int64 by
both; a graph whose logits have one position (`logits_positions: last`) is one
onnxruntime-genai detects from the graph's static dim and samples from as it is. A default
build's `logits_to_keep` input (`logits_positions: keep`) is one it does not feed: its default
in the graph, 0, returns every position, the `[batch, seq, vocab]` onnxruntime-genai allocates
for a graph whose positions dim is not 1 (it binds its own output buffer of that shape, so the
default could not be 1); it then computes the LM head on every prompt position, as with `all`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvforge.passes.targets import Target
from kvforge.runners.contract import DecoderIO
from kvforge.runners.engine import generation_settings
from kvforge.runners.settings import SamplingParams, declared
from kvforge.toolchain.emit import GENERATION_CONFIG, MODEL_FILE, write_json
from kvforge.toolchain.spec import GENAI_DECODER_TYPES, DecoderSpec

GENAI_CONFIG = "genai_config.json"
# Cache dtypes onnxruntime's CPU provider computes (bfloat16 is a TensorRT artifact's).
_KV_DTYPES = ("float32", "float16")
GENERIC_TYPE = "decoder"
# transformers' GenerationConfig defaults, for a greedy config
_HF_SAMPLING: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def drives(target: Target, io: DecoderIO) -> bool:
    """Whether onnxruntime-genai can run an artifact of this target (its record's `genai`) and
    contract (its config has one head size for keys and values: not multi-head latent attention's cache;
    one cache length for every layer: not layers bounded by a sliding window, whose past it would
    not cut to the window; and names key/value caches only: no layer with a fixed-size state)."""
    return (
        target.genai
        and io.kv_dtype in _KV_DTYPES
        and io.capacity is None
        and io.value_head_dim is None
        and io.layer_windows is None
        and io.layers is None
    )


def model_type(spec: DecoderSpec) -> str:
    return spec.model_type if spec.model_type in GENAI_DECODER_TYPES else GENERIC_TYPE


def genai_config(spec: DecoderSpec, io: DecoderIO, generation: Mapping[str, Any]) -> dict[str, Any]:
    """The config onnxruntime-genai reads, from what the artifact already records."""
    eos = list(spec.eos_token_ids)
    fallback = eos[0] if eos else 0  # kvforge's runner pads with the first eos id too
    pad = spec.pad_token_id if spec.pad_token_id is not None else fallback
    bos = spec.bos_token_id if spec.bos_token_id is not None else fallback
    inputs = [t.name for t in io.inputs]
    outputs = [t.name for t in io.outputs]
    return {
        "model": {
            "type": model_type(spec),
            "context_length": spec.max_positions,
            "vocab_size": io.vocab_size,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "decoder": {
                "filename": MODEL_FILE,
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "hidden_size": spec.hidden_size,
                "num_attention_heads": spec.num_heads,
                "num_hidden_layers": io.num_layers,
                "num_key_value_heads": io.num_kv_heads,
                "head_size": io.head_dim,
                "inputs": {
                    "input_ids": inputs[0],
                    "attention_mask": inputs[1],
                    "position_ids": inputs[2],
                    "past_key_names": _template(io.past_name(0, "key")),
                    "past_value_names": _template(io.past_name(0, "value")),
                },
                "outputs": {
                    "logits": outputs[0],
                    "present_key_names": _template(io.present_name(0, "key")),
                    "present_value_names": _template(io.present_name(0, "value")),
                },
            },
        },
        "search": search_defaults(generation, spec, io),
    }


def search_defaults(generation: Mapping[str, Any], spec: DecoderSpec, io: DecoderIO) -> dict[str, Any]:
    """The generation config's defaults as onnxruntime-genai's `search` section: the same
    greedy-or-sampling choice and values as kvforge's runner reads from generation_config.json:
    each sampling field with a `search` key in its declaration (`kvforge.runners.settings`;
    min_p has no counterpart there and is left out; top_k 0 is off in both). A greedy config
    gets Hugging Face's default sampling values, for a caller that turns sampling on.
    `max_length` counts the prompt too."""
    params = generation_settings(generation, source=GENERATION_CONFIG).defaults  # checked: ArtifactError
    sampling = params.temperature > 0
    if not sampling:
        params = replace(params, **_HF_SAMPLING)
    values = {s.genai: getattr(params, s.name) for s in declared(SamplingParams) if s.genai is not None}
    return {
        "do_sample": sampling,
        **values,
        "top_k": min(values["top_k"], io.vocab_size),
        "num_beams": 1,
        "num_return_sequences": 1,
        "min_length": 0,
        "max_length": spec.max_positions,
        "past_present_share_buffer": io.shared_kv,
        "early_stopping": True,
    }


def write_genai_config(directory: Path, spec: DecoderSpec, io: DecoderIO, generation: Mapping[str, Any]) -> Path:
    path = directory / GENAI_CONFIG
    write_json(path, genai_config(spec, io, generation))
    return path


def _template(layer_zero_name: str) -> str:
    """`past_key_values.0.key` -> `past_key_values.%d.key`: onnxruntime-genai's per-layer name form."""
    head, sep, tail = layer_zero_name.partition(".0.")
    if not sep:
        raise ValueError(f"{layer_zero_name!r} does not hold the layer index as '.0.'")
    return f"{head}.%d.{tail}"
