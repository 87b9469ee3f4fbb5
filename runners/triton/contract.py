"""The tensors a kvforge model in Triton takes and gives: the contract of Triton's OpenAI frontend.

Triton's OpenAI-compatible frontend talks to every model that is not a vLLM one as it talks
to TensorRT-LLM's: `text_input` and `stream`, then `max_tokens`, `stop_words`, the sampling
fields, `return_num_input_tokens` / `return_num_output_tokens`, and `guided_decoding_*` when a
tool is forced, each as a `[1, 1]` tensor (`stop_words`: `[1, n]`). Triton refuses a request
that carries an input the model does not declare, so every one of them is declared here; the
exporter writes `config.pbtxt` from this table and the adapter reads requests with it. The
sampling inputs are every field `SamplingParams` declares (`kvforge.runners.settings`): the
frontend's temperature, top_p, top_k and seed, and min_p and repetition_penalty, which the
frontend does not send but a request to Triton's `generate` endpoints or gRPC may.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.runners.settings import sampling_settings, serving_settings


@dataclass(frozen=True)
class TensorSpec:
    name: str
    data_type: str  # Triton's model-config type name
    dims: tuple[int, ...]  # the whole shape: the model has no batch dimension (max_batch_size 0)
    optional: bool = False


SCALAR = (1, 1)

_HEAD: tuple[TensorSpec, ...] = (
    TensorSpec("text_input", "TYPE_STRING", SCALAR),
    TensorSpec("stream", "TYPE_BOOL", SCALAR, optional=True),
    TensorSpec("max_tokens", "TYPE_INT32", SCALAR, optional=True),
    TensorSpec("stop_words", "TYPE_STRING", (1, -1), optional=True),
)
# The penalties the frontend sends and the engine refuses unless they are 0 (as `kvforge serve`).
PENALTIES: tuple[TensorSpec, ...] = (
    TensorSpec("frequency_penalty", "TYPE_FP32", SCALAR, optional=True),
    TensorSpec("presence_penalty", "TYPE_FP32", SCALAR, optional=True),
)
_TAIL: tuple[TensorSpec, ...] = (
    TensorSpec("return_num_input_tokens", "TYPE_BOOL", SCALAR, optional=True),
    TensorSpec("return_num_output_tokens", "TYPE_BOOL", SCALAR, optional=True),
    TensorSpec("guided_decoding_guide_type", "TYPE_STRING", SCALAR, optional=True),
    TensorSpec("guided_decoding_guide", "TYPE_STRING", SCALAR, optional=True),
)


def sampling_inputs() -> tuple[TensorSpec, ...]:
    """One optional `[1, 1]` input per field `SamplingParams` declares, named as the field
    (`kvforge.runners.settings`): the frontend's temperature, top_p, top_k and seed, and the
    engine's own min_p and repetition_penalty, which a request to Triton's `generate` endpoints or
    gRPC may carry."""
    return tuple(TensorSpec(s.name, s.triton, SCALAR, optional=True) for s in sampling_settings())


def inputs() -> tuple[TensorSpec, ...]:
    """Every input the model declares, in config.pbtxt's order."""
    return (*_HEAD, *sampling_inputs(), *PENALTIES, *_TAIL)


OUTPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("text_output", "TYPE_STRING", SCALAR),
    TensorSpec("num_input_tokens", "TYPE_INT32", SCALAR),
    TensorSpec("num_output_tokens", "TYPE_INT32", SCALAR),
)

# The engine's knobs, as config.pbtxt `parameters` (string values), with `kvforge serve`'s defaults.
ENGINE_PARAMETERS: dict[str, int] = {s.name: s.default for s in serving_settings() if s.triton_parameter}
# The prefix cache's budget in bytes (a count such as 268435456 or 256M; 0: off), or AUTO_BUDGET:
# a quarter of the memory available when the instance loads (kvforge serve's default). A
# config without it has no prefix cache.
PREFIX_CACHE_PARAMETER = "prefix_cache_bytes"
AUTO_BUDGET = "auto"
# Where the artifact lives inside the model's version directory.
ARTIFACT_DIR = "artifact"
