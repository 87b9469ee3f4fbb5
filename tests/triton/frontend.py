"""What Triton's OpenAI frontend sends to a model that is not vLLM's, written down independently
of kvforge's contract so that the tests compare the two.

Source: triton-inference-server/server, python/openai/openai_frontend/engine/utils/triton.py,
`_create_trtllm_generate_request` (the format used for Python-backend, ensemble and TensorRT-LLM
models): every value is a `[1, 1]` tensor except `stop_words`, `[1, n]`. `top_k` is not sent
by that function today but is a field of the same request format (TensorRT-LLM's), so a model
must take it too.
"""

from __future__ import annotations

from typing import Any

# name -> Triton datatype as the frontend's numpy arrays carry it
FRONTEND_INPUTS: dict[str, str] = {
    "text_input": "BYTES",
    "stream": "BOOL",
    "max_tokens": "INT32",
    "stop_words": "BYTES",
    "top_p": "FP32",
    "frequency_penalty": "FP32",
    "presence_penalty": "FP32",
    "seed": "UINT64",
    "temperature": "FP32",
    "top_k": "INT32",
    "guided_decoding_guide_type": "BYTES",
    "guided_decoding_guide": "BYTES",
    "return_num_input_tokens": "BOOL",
    "return_num_output_tokens": "BOOL",
}
# kvforge's sampling fields that the frontend does not send, declared too: a request to Triton's
# `generate` endpoints or gRPC may carry them (FP32 [1, 1], as TensorRT-LLM's backend takes them).
ENGINE_SAMPLING_INPUTS = {"min_p", "repetition_penalty"}
FRONTEND_OUTPUTS = {"text_output", "num_input_tokens", "num_output_tokens"}
# Triton's model-config type of each datatype
CONFIG_TYPES = {
    "BYTES": "TYPE_STRING",
    "BOOL": "TYPE_BOOL",
    "INT32": "TYPE_INT32",
    "FP32": "TYPE_FP32",
    "UINT64": "TYPE_UINT64",
}


def frontend_request(
    prompt: str,
    *,
    stream: bool,
    max_tokens: int,
    stop: list[str] | None = None,
    guided: tuple[str, str] | None = None,
) -> dict[str, list[Any]]:
    """Every input the frontend may send, with greedy sampling and neutral penalties:
    name -> [datatype, nested values], the shapes being the frontend's."""
    request: dict[str, list[Any]] = {
        "text_input": ["BYTES", [[prompt]]],
        "stream": ["BOOL", [[stream]]],
        "max_tokens": ["INT32", [[max_tokens]]],
        "top_p": ["FP32", [[1.0]]],
        "frequency_penalty": ["FP32", [[0.0]]],
        "presence_penalty": ["FP32", [[0.0]]],
        "seed": ["UINT64", [[7]]],
        "temperature": ["FP32", [[0.0]]],
        "top_k": ["INT32", [[0]]],
        "return_num_input_tokens": ["BOOL", [[True]]],
        "return_num_output_tokens": ["BOOL", [[True]]],
    }
    if stop:
        request["stop_words"] = ["BYTES", [stop]]
    if guided:
        request["guided_decoding_guide_type"] = ["BYTES", [[guided[0]]]]
        request["guided_decoding_guide"] = ["BYTES", [[guided[1]]]]
    return request
