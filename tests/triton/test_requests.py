"""Triton request tensors to an engine request (checked by the HTTP server's own parser), and the
engine's events to Triton responses; no Triton needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvforge.runners.engine import Engine
from kvforge.runners.serve.scheduler import Delta, Failed, Finished, Request
from kvforge.runners.triton.requests import Generation, Read, Reply, ReplyStream, TritonRequestError, parse_inputs
from tests.triton.frontend import frontend_request

_NUMPY = {"BOOL": np.bool_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64}


def reader(request: dict[str, list[Any]]) -> Read:
    """The tensors as Triton's Python backend hands them over: numpy, strings as bytes objects."""
    arrays: dict[str, np.ndarray] = {}
    for name, (datatype, values) in request.items():
        if datatype == "BYTES":
            arrays[name] = np.array(
                [[v if isinstance(v, bytes) else v.encode() for v in row] for row in values], object
            )
        else:
            arrays[name] = np.array(values, dtype=_NUMPY[datatype])
    return arrays.get


@pytest.fixture(scope="module")
def engine(tiny_artifact: Path) -> Engine:
    return Engine.load(tiny_artifact)


def parse(engine: Engine, request: dict[str, list[Any]]) -> Generation:
    return parse_inputs(reader(request), engine, "tiny")


def test_every_frontend_input_maps_onto_the_engine_request(engine: Engine) -> None:
    request = frontend_request("def f(x):", stream=True, max_tokens=12, stop=["\n\n", "return"], guided=("", ""))
    generation = parse(engine, request)
    parsed = generation.parsed
    assert parsed.ids == engine.encode("def f(x):")
    assert parsed.budget == 12 and parsed.stop == ("\n\n", "return") and parsed.stream
    assert (parsed.params.temperature, parsed.params.top_p, parsed.params.top_k, parsed.params.seed) == (0, 1, 0, 7)
    assert generation.return_input_tokens and generation.return_output_tokens


def test_absent_inputs_take_the_defaults(engine: Engine) -> None:
    generation = parse(engine, {"text_input": ["BYTES", [["def"]]]})
    assert not generation.stream and not generation.return_input_tokens and not generation.return_output_tokens
    assert generation.parsed.params == engine.defaults
    assert generation.parsed.budget == engine.max_positions - len(engine.encode("def"))
    top_k_off = parse(engine, {"text_input": ["BYTES", [["def"]]], "top_k": ["INT32", [[-1]]]})
    assert top_k_off.parsed.params.top_k == 0  # TensorRT-LLM's and vLLM's spelling of "off"


@pytest.mark.parametrize(
    ("change", "code", "message"),
    [
        (
            {"guided_decoding_guide_type": ["BYTES", [["json_schema"]]]},
            "INVALID_ARG",
            "needs the json_schema in guided_decoding_guide",
        ),
        (
            {"guided_decoding_guide": ["BYTES", [['{"type": "object"}']]]},
            "UNSUPPORTED",
            "guided_decoding_guide_type '' is not supported",
        ),
        (
            {"guided_decoding_guide_type": ["BYTES", [["json_schema"]]], "guided_decoding_guide": ["BYTES", [["{x"]]]},
            "INVALID_ARG",
            "input guided_decoding_guide: the JSON schema is not JSON",
        ),
        (
            {"presence_penalty": ["FP32", [[0.5]]]},
            "INVALID_ARG",
            "presence_penalty=0.5 is not supported by this server; leave it out",
        ),
        ({"frequency_penalty": ["FP32", [[-1.0]]]}, "INVALID_ARG", "frequency_penalty=-1.0 is not supported"),
        ({"temperature": ["FP32", [[-1.0]]]}, "INVALID_ARG", "temperature must be >= 0"),
        ({"top_p": ["FP32", [[0.0]]]}, "INVALID_ARG", "top_p must be in (0, 1]"),
        ({"max_tokens": ["INT32", [[0]]]}, "INVALID_ARG", "max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": ["INT32", [[100000]]]}, "INVALID_ARG", "exceeds the model's context of 256 positions"),
        ({"max_tokens": ["INT32", [[4, 5]]]}, "INVALID_ARG", "input max_tokens must hold one value, got 2"),
        ({"stop_words": ["BYTES", [["", "x"]]]}, "INVALID_ARG", "input stop_words: stop must be a non-empty string"),
        ({"text_input": ["BYTES", [[""]]]}, "INVALID_ARG", "input text_input: prompt is empty"),
        ({"text_input": ["BYTES", [[b"\xff\xfe"]]]}, "INVALID_ARG", "input text_input is not valid UTF-8"),
    ],
)
def test_bad_inputs_are_refused_naming_the_input(
    engine: Engine, change: dict[str, list[Any]], code: str, message: str
) -> None:
    request = {**frontend_request("def", stream=True, max_tokens=8), **change}
    with pytest.raises(TritonRequestError) as error:
        parse(engine, request)
    assert error.value.code == code
    assert message in str(error.value)


def test_a_request_without_text_input_is_refused(engine: Engine) -> None:
    with pytest.raises(TritonRequestError, match="input text_input is missing"):
        parse(engine, {"max_tokens": ["INT32", [[4]]]})


# -- responses --------------------------------------------------------------------------


def stream_for(engine: Engine, *, stream: bool, counts: bool = True) -> ReplyStream:
    request_inputs = frontend_request("def", stream=stream, max_tokens=8)
    generation = parse(engine, request_inputs)
    if not counts:
        generation = Generation(generation.parsed)
    parsed = generation.parsed
    request = Request(parsed.ids, parsed.params, parsed.budget, engine.tokenizer.detokenizer())
    return ReplyStream(generation, request)


def test_streamed_replies_count_the_tokens_since_the_previous_one(engine: Engine) -> None:
    replies = stream_for(engine, stream=True)
    prompt = len(replies.request.ids)
    replies.request.generated = 2
    assert replies.replies([Delta("de"), Delta("f")]) == [Reply("def", False, prompt, 2)]
    replies.request.generated = 3  # a token whose text is held back (an undecided stop string) sends nothing
    assert replies.replies([]) == []
    replies.request.generated = 5
    assert replies.replies([Delta(" x"), Finished("length", prompt, 5)]) == [Reply(" x", True, prompt, 3)]
    assert replies.done


def test_a_stream_that_ends_without_text_still_sends_a_final_reply(engine: Engine) -> None:
    replies = stream_for(engine, stream=True, counts=False)
    assert replies.replies([Finished("stop", 1, 1)]) == [Reply("", True, None, None)]
    assert set(Reply("", True).outputs()) == {"text_output"}


def test_an_unstreamed_request_gets_one_reply_with_everything(engine: Engine) -> None:
    replies = stream_for(engine, stream=False)
    prompt = len(replies.request.ids)
    replies.request.generated = 4
    assert replies.replies([Delta("a"), Delta("b")]) == []
    assert replies.replies([Delta("c")]) == []
    [reply] = replies.replies([Delta("d"), Finished("stop", prompt, 6)])
    assert reply == Reply("abcd", True, prompt, 6)
    outputs = reply.outputs()
    assert outputs["text_output"].shape == (1, 1) and outputs["text_output"][0, 0] == b"abcd"
    assert outputs["num_input_tokens"].dtype == np.int32 and outputs["num_output_tokens"][0, 0] == 6


def test_an_engine_failure_is_the_requests_error(engine: Engine) -> None:
    replies = stream_for(engine, stream=True)
    [reply] = replies.replies([Delta("a"), Failed("the engine failed (boom)")])
    assert reply.final and reply.error is not None and reply.error.code == "INTERNAL"
    assert str(reply.error) == "the engine failed (boom)" and replies.done
