"""Triton request tensors in, engine request out; engine events in, Triton responses out.

Both directions are plain functions over numpy arrays and the engine's events, so they are
tested without Triton. The request's fields are checked by the HTTP server's own parser
(`kvforge.runners.serve.protocol.parse_request`): the tensors are read into the OpenAI body they came
from (guided decoding's json and json_schema as its response_format), so ranges, stop strings,
the context check and the refused penalties are exactly `kvforge serve`'s, and its messages
name the Triton input where its name differs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.protocol import ApiError, ParsedRequest, parse_request
from kvforge.runners.serve.scheduler import Delta, Event, Failed, Finished, Request
from kvforge.runners.triton.contract import PENALTIES, sampling_inputs

# A request's input tensor by name, as numpy, or None when the request does not carry it.
Read = Callable[[str], "np.ndarray | None"]

_TRITON_NAMES = {"prompt": "text_input", "stop": "stop_words"}
_NO_LLGUIDANCE = "guided decoding needs llguidance in the Python backend's environment ({}); pip install llguidance"
_ERROR_CODES = {400: "INVALID_ARG", 404: "INVALID_ARG", 429: "UNAVAILABLE", 503: "UNAVAILABLE"}


class TritonRequestError(KvforgeError):
    """A request the model refuses or could not finish; `code` names the TritonError code."""

    def __init__(self, message: str, code: str = "INVALID_ARG") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Generation:
    """A checked request: prompt ids, sampler, budget and stop strings, and what to send back."""

    parsed: ParsedRequest
    return_input_tokens: bool = False
    return_output_tokens: bool = False

    @property
    def stream(self) -> bool:
        return self.parsed.stream


def parse_inputs(read: Read, engine: Engine, model_name: str) -> Generation:
    """Check a request's tensors and encode its prompt, or raise TritonRequestError naming the input."""
    body: dict[str, Any] = {"model": model_name, "prompt": _string(read, "text_input"), "stream": _flag(read, "stream")}
    regex = _guided_decoding(read, body)
    if body["prompt"] is None:
        raise TritonRequestError("input text_input is missing; send the prompt as text_input")
    for name in _same_name():
        value = _scalar(read, name)
        if value is not None:
            body[name] = value
    stops = _strings(read, "stop_words")
    if stops:
        body["stop"] = stops
    try:
        parsed = parse_request(json.dumps(body).encode(), chat=False, engine=engine, served_name=model_name)
    except ApiError as error:
        raise TritonRequestError(_triton_message(error), _ERROR_CODES.get(error.status, "INTERNAL")) from error
    except ImportError as error:  # llguidance missing from the backend's environment
        raise TritonRequestError(_NO_LLGUIDANCE.format(error), "UNSUPPORTED") from error
    if regex is not None:
        try:
            parsed = replace(parsed, grammar=engine.compile_grammar(regex=regex))
        except ImportError as error:
            raise TritonRequestError(_NO_LLGUIDANCE.format(error), "UNSUPPORTED") from error
        except KvforgeError as error:
            raise TritonRequestError(f"input guided_decoding_guide: {error}") from error
    return Generation(parsed, _flag(read, "return_num_input_tokens"), _flag(read, "return_num_output_tokens"))


def _same_name() -> tuple[str, ...]:
    """Inputs that are the OpenAI field of the same name: max_tokens, the sampling fields, the penalties."""
    return ("max_tokens", *(spec.name for spec in (*sampling_inputs(), *PENALTIES)))


def _triton_message(error: ApiError) -> str:
    name = _TRITON_NAMES.get(error.param or "")
    return f"input {name}: {error.message}" if name else error.message


def _guided_decoding(read: Read, body: dict[str, Any]) -> str | None:
    """TensorRT-LLM's guided decoding inputs: `json` (any JSON object) and `json_schema` become the
    OpenAI body's response_format; `regex` is returned, to be compiled after the body is checked.
    Other guide types (`ebnf_grammar`, `structural_tag`) are refused."""
    kind, guide = _string(read, "guided_decoding_guide_type"), _string(read, "guided_decoding_guide")
    if not kind and not guide:
        return None
    if kind == "json":
        body["response_format"] = {"type": "json_object"}
        return None
    if kind in ("json_schema", "regex") and not guide:
        raise TritonRequestError(f"guided_decoding_guide_type {kind!r} needs the {kind} in guided_decoding_guide")
    if kind == "json_schema":
        try:
            schema = json.loads(str(guide))
        except ValueError as error:
            raise TritonRequestError(f"input guided_decoding_guide: the JSON schema is not JSON ({error})") from error
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "guide", "schema": schema}}
        return None
    if kind == "regex":
        return guide
    raise TritonRequestError(
        f"guided_decoding_guide_type {kind or ''!r} is not supported by kvforge's engine; use json, json_schema or "
        "regex, or send the request without guided_decoding_guide_type and guided_decoding_guide",
        "UNSUPPORTED",
    )


def _values(read: Read, name: str) -> list[Any] | None:
    array = read(name)
    return None if array is None else np.asarray(array).reshape(-1).tolist()


def _scalar(read: Read, name: str) -> Any:
    values = _values(read, name)
    if values is None:
        return None
    if len(values) != 1:
        raise TritonRequestError(f"input {name} must hold one value, got {len(values)}; send a [1, 1] tensor")
    return values[0]


def _flag(read: Read, name: str) -> bool:
    return bool(_scalar(read, name))


def _decode(name: str, value: object) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes):
        raise TritonRequestError(f"input {name} must be a BYTES (string) tensor, got {type(value).__name__}")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as error:
        raise TritonRequestError(f"input {name} is not valid UTF-8 ({error.reason}); send UTF-8 text") from error


def _string(read: Read, name: str) -> str | None:
    value = _scalar(read, name)
    return None if value is None else _decode(name, value)


def _strings(read: Read, name: str) -> list[str]:
    return [_decode(name, value) for value in _values(read, name) or []]


# -- responses --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """One Triton response: text and token counts, or an error; `final` closes the request."""

    text: str = ""
    final: bool = False
    input_tokens: int | None = None
    output_tokens: int | None = None
    error: TritonRequestError | None = None

    def outputs(self) -> dict[str, np.ndarray]:
        arrays = {"text_output": np.array([[self.text.encode("utf-8")]], dtype=np.object_)}
        if self.input_tokens is not None:
            arrays["num_input_tokens"] = np.array([[self.input_tokens]], dtype=np.int32)
        if self.output_tokens is not None:
            arrays["num_output_tokens"] = np.array([[self.output_tokens]], dtype=np.int32)
        return arrays


class ReplyStream:
    """The responses of one request, from its engine events.

    Streamed, each batch of text events becomes one response and the end one final response
    (with the text that came with it). Not streamed, everything goes in one final response,
    as Triton's OpenAI frontend expects. `num_output_tokens` counts the tokens generated since
    the previous response, so that they add up to the request's total (the frontend sums them).
    """

    def __init__(self, generation: Generation, request: Request) -> None:
        self.generation = generation
        self.request = request
        self.done = False
        self._held: list[str] = []
        self._counted = 0

    def replies(self, events: Sequence[Event]) -> list[Reply]:
        text = "".join(event.text for event in events if isinstance(event, Delta))
        end = next((event for event in events if not isinstance(event, Delta)), None)
        if isinstance(end, Failed):
            self.done = True
            return [Reply(final=True, error=TritonRequestError(end.message, "INTERNAL"))]
        if not self.generation.stream:
            self._held.append(text)
            if end is None:
                return []
            text = "".join(self._held)
        if isinstance(end, Finished):
            self.done = True
            return [self._reply(text, end.completion_tokens, final=True)]
        return [self._reply(text, self.request.generated, final=False)] if text else []

    def _reply(self, text: str, generated: int, final: bool) -> Reply:
        new = max(generated - self._counted, 0)
        self._counted += new
        return Reply(
            text,
            final,
            len(self.request.ids) if self.generation.return_input_tokens else None,
            new if self.generation.return_output_tokens else None,
        )
