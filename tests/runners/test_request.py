"""The request record: each token in, the text it completes out, and the end of the sequence and why."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.runners.decoding import TokenLogprob
from kvforge.runners.detokenizer import StreamingDetokenizer
from kvforge.runners.request import GenerationRequest
from kvforge.runners.sampling import SamplingParams
from tests.runners.test_detokenizer import byte_level_tokenizer

EOS = 0  # the first special token of the test tokenizer


def _request(budget: int, stop: tuple[str, ...] = (), ignore_eos: bool = False) -> GenerationRequest:
    tokenizer = byte_level_tokenizer()
    return GenerationRequest(
        [5],
        SamplingParams(temperature=0.0),
        budget,
        StreamingDetokenizer(tokenizer, stop=stop),
        eos_ids=(EOS,),
        ignore_eos=ignore_eos,
    )


def _ids(text: str) -> list[int]:
    return byte_level_tokenizer().encode(text, add_special_tokens=False).ids


def test_text_grows_token_by_token_and_the_budget_ends_it_with_length() -> None:
    ids = _ids("hello world")
    request = _request(budget=len(ids))
    text = "".join(request.add(token) for token in ids[:-1])
    assert request.finish_reason is None
    text += request.add(ids[-1])
    assert request.finish_reason == "length" and request.finished
    assert text + request.finish() == "hello world"
    assert request.tokens == ids and request.generated == len(ids)


def test_an_eos_ends_it_with_stop_and_adds_no_text_or_logprob() -> None:
    request = _request(budget=10)
    first = _ids("hi")[0]
    request.add(first, TokenLogprob(first, -0.5))
    assert request.add(EOS, TokenLogprob(EOS, -0.1)) == ""
    assert request.finish_reason == "stop"
    assert request.tokens == [first] and [e.token for e in request.logprobs] == [first]
    assert request.generated == 2  # the eos counts against the budget as the server reports it


def test_ignore_eos_generates_through_an_eos() -> None:
    request = _request(budget=3, ignore_eos=True)
    request.add(EOS)
    assert request.finish_reason is None and request.tokens == [EOS]


def test_a_stop_string_ends_it_and_is_never_part_of_the_text() -> None:
    ids = _ids("say hello there")
    request = _request(budget=50, stop=("hello",))
    text = ""
    for token in ids:
        text += request.add(token)
        if request.finished:
            break
    assert request.finish_reason == "stop"
    assert (text + request.finish()).rstrip() == "say"


def test_new_logprobs_hands_each_entry_out_once() -> None:
    request = _request(budget=10)
    a, b = _ids("a")[0], _ids("b")[0]
    request.add(a, TokenLogprob(a, -1.0))
    assert [e.token for e in request.new_logprobs()] == [a]
    request.add(b, TokenLogprob(b, -2.0))
    assert [e.token for e in request.new_logprobs()] == [b]
    assert request.new_logprobs() == ()


def test_engine_streams_a_record_as_it_streams_its_prompt(built_artifact: Callable[..., Path]) -> None:
    from kvforge.runners.engine import Engine

    engine = Engine.load(built_artifact("llama"), huge_pages=False)
    options: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0.8, "top_k": 20, "seed": 3}
    record = engine.request("def f(x):", **options)
    assert record.ids == engine.encode("def f(x):") and record.budget == 12
    stream = engine.stream(record)
    assert "".join(stream) == "".join(engine.stream("def f(x):", **options))
    assert stream.stats.finish_reason == record.finish_reason and stream.stats.new_tokens == record.generated
