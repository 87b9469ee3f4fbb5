"""Conformance of `kvforge serve` as the official `openai` client sees it."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import openai
import pytest

from kvforge.runners.engine import Completion, Engine
from tests.serve.conftest import Server

pytestmark = pytest.mark.slow
MODEL = "out"  # the served name: the artifact directory's name
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def client(shared_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=shared_server.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def engine(tiny_artifact: Path) -> Engine:
    return Engine.load(tiny_artifact)


def solo_text(engine: Engine, prompt: str, max_tokens: int, chat: bool = False, **sampling: Any) -> str:
    text = engine.generate(prompt, max_new_tokens=max_tokens, chat=chat, **({"temperature": 0.0} | sampling))
    assert isinstance(text, str)
    return text


def stream_completion(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], str]:
    chunks = list(client.completions.create(model=MODEL, stream=True, **kwargs))
    return chunks, "".join(c.choices[0].text for c in chunks if c.choices)


def test_models_lists_the_served_model_with_its_context(client: openai.OpenAI, engine: Engine) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra is not None and models[0].model_extra["max_model_len"] == engine.max_positions


def test_completion_text_and_usage(client: openai.OpenAI, engine: Engine) -> None:
    prompt = "class Point:"
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    choice = result.choices[0]
    assert choice.text == solo_text(engine, prompt, 12)
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(engine.encode(prompt))
    tokens = engine.generate_tokens([engine.encode(prompt)], max_new_tokens=12, temperature=0)[0]
    assert result.usage.completion_tokens == len(tokens)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert choice.finish_reason == ("length" if len(tokens) == 12 else "stop")


@pytest.mark.parametrize("prompt", ["def", "for i in range(10):", "naïve café"])
def test_stream_equals_non_stream_at_temperature_zero(client: openai.OpenAI, engine: Engine, prompt: str) -> None:
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    chunks, streamed = stream_completion(client, prompt=prompt, max_tokens=30, temperature=0)
    assert streamed == whole.choices[0].text == solo_text(engine, prompt, 30)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]


def test_chat_stream_equals_non_stream_and_starts_with_the_role(client: openai.OpenAI, engine: Engine) -> None:
    messages: Any = [{"role": "user", "content": "for i in range(10):"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content == solo_text(engine, "for i in range(10):", 20, chat=True)
    assert whole.choices[0].message.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
    assert whole.usage is not None and whole.usage.prompt_tokens == len(engine.encode("for i in range(10):", chat=True))


def test_finish_reasons(client: openai.OpenAI, engine: Engine) -> None:
    full = solo_text(engine, "def", 40)
    length = client.completions.create(model=MODEL, prompt="def", max_tokens=3, temperature=0)
    assert length.choices[0].finish_reason == "length"
    assert length.usage is not None and length.usage.completion_tokens == 3
    stop = full[10:13]
    stopped = client.completions.create(model=MODEL, prompt="def", max_tokens=40, temperature=0, stop=stop)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == full[: full.find(stop)]


def test_the_four_include_usage_cases(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(prompt="import os", max_tokens=8, temperature=0)
    whole = client.completions.create(model=MODEL, **kwargs)
    assert whole.usage is not None  # not streamed: always there
    for options in (None, {"include_usage": False}):
        extra = {} if options is None else {"stream_options": options}
        chunks, _ = stream_completion(client, **kwargs, **extra)
        assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    chunks, _ = stream_completion(client, **kwargs, stream_options={"include_usage": True})
    *body, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None and c.choices for c in body)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 5}, "n"),  # above the server's --max-num-seqs 4
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        # the field not used (max_completion_tokens wins) is checked too, as the schema says
        ({"max_tokens": 0, "extra_body": {"max_completion_tokens": 3}}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"seed": -3}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"extra_body": {"min_p": 2}}, "min_p"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ],
)
def test_bad_parameters_are_bad_requests_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="def", **({"max_tokens": 4} | fields))
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert body["type"] == "invalid_request_error" and param in body["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"echo": True}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
    ],
)
def test_fields_the_server_does_not_implement_are_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="def", max_tokens=4, **fields)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param and param in body["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ],
)
def test_chat_fields_the_server_does_not_implement_are_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **fields
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param and param in body["message"]


def test_context_overflow_is_a_bad_request_with_its_code(client: openai.OpenAI, engine: Engine) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="def", max_tokens=engine.max_positions)
    assert info.value.code == "context_length_exceeded"
    long_prompt = "x = 1\n" * engine.max_positions
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}], stream=True)
    assert info.value.code == "context_length_exceeded"


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4o", prompt="def", max_tokens=2)
    assert info.value.code == "model_not_found"


def test_same_seed_same_text_under_concurrency(client: openai.OpenAI, engine: Engine) -> None:
    def sampled(seed: int) -> str:
        result = client.completions.create(
            model=MODEL, prompt="class Point:", max_tokens=24, temperature=1.0, top_p=0.95, seed=seed
        )
        return result.choices[0].text

    seeds = [5, 5, 9, 5, 9, 5]
    with concurrent.futures.ThreadPoolExecutor(len(seeds)) as pool:
        texts = list(pool.map(sampled, seeds))
    expected = {seed: solo_text(engine, "class Point:", 24, temperature=1.0, top_p=0.95, seed=seed) for seed in (5, 9)}
    assert texts == [expected[seed] for seed in seeds]


def test_top_k_and_min_p_through_extra_body(client: openai.OpenAI, engine: Engine) -> None:
    greedy = solo_text(engine, "for i in", 20)
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        result = client.completions.create(
            model=MODEL, prompt="for i in", max_tokens=20, temperature=1.5, seed=1, extra_body=extra
        )
        assert result.choices[0].text == greedy, extra  # one candidate left: the argmax
    loose = client.completions.create(
        model=MODEL, prompt="for i in", max_tokens=20, temperature=1.5, seed=1, extra_body={"top_k": 0}
    )
    assert loose.choices[0].text == solo_text(engine, "for i in", 20, temperature=1.5, seed=1)


def test_stop_string_across_tokens_never_leaks(client: openai.OpenAI, engine: Engine) -> None:
    prompt = "class Point:"
    ids = engine.generate_tokens([engine.encode(prompt)], max_new_tokens=40, temperature=0)[0]
    pieces = [engine.tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    full = pieces[-1]
    # A stop string made of the end of one token and the start of the next.
    cut = next(
        i
        for i in range(2, len(ids) - 1)
        if len(pieces[i]) - len(pieces[i - 1]) >= 2
        and len(pieces[i + 1]) - len(pieces[i]) >= 2
        and "\ufffd" not in pieces[i + 1][len(pieces[i]) - 2 :]
    )
    stop = pieces[cut][-2:] + pieces[cut + 1][len(pieces[cut]) : len(pieces[cut]) + 2]
    expected = full[: full.find(stop)]
    chunks, streamed = stream_completion(client, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "@@@"])
    assert streamed == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_multibyte_characters_stream_whole(client: openai.OpenAI, engine: Engine) -> None:
    prompt = "naïve café"
    expected = solo_text(engine, prompt, 40)
    assert any(ord(c) > 0x7F and c != "\ufffd" for c in expected), "the case must produce a multi-byte character"
    chunks, streamed = stream_completion(client, prompt=prompt, max_tokens=40, temperature=0)
    assert streamed == expected
    assert sum(c.choices[0].text.count("\ufffd") for c in chunks) == expected.count("\ufffd")


def test_max_completion_tokens_bounds_a_chat_answer(client: openai.OpenAI, engine: Engine) -> None:
    messages: Any = [{"role": "user", "content": "def"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0)
    tokens = engine.generate_tokens([engine.encode("def", chat=True)], max_new_tokens=3, temperature=0)[0]
    assert result.usage is not None and result.usage.completion_tokens == len(tokens)
    assert result.choices[0].finish_reason == ("length" if len(tokens) == 3 else "stop")
    assert result.choices[0].message.content == solo_text(engine, "def", 3, chat=True)


def test_completion_logprobs_legacy_shape(client: openai.OpenAI, tiny_artifact: Path) -> None:
    prompt = "class Point:"
    result = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs and logprobs.top_logprobs
    assert result.usage is not None and len(logprobs.tokens) == result.usage.completion_tokens == 8
    if not any(t.startswith("bytes:") for t in logprobs.tokens):  # no token holds part of a character
        assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(8)]
    free = Engine.load(tiny_artifact)
    free.eos_ids = ()  # as ignore_eos
    reference = free.generate(prompt, max_new_tokens=8, temperature=0.0, logprobs=3)
    assert isinstance(reference, Completion)
    for position, (token, value, top) in enumerate(
        zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)
    ):
        assert len(top) <= 3 and max(top, key=top.__getitem__) == token  # greedy: the top entry
        assert value == pytest.approx(reference.logprobs[position].logprob, abs=1e-3)


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, logprobs=True
    )
    result = client.chat.completions.create(top_logprobs=2, **kwargs)
    content = result.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and result.usage is not None
    eos = result.choices[0].finish_reason == "stop"
    assert len(content) == result.usage.completion_tokens - eos  # the end-of-text token has no entry
    for entry in content:
        raw = bytes(entry.bytes or [])
        if entry.token.startswith("bytes:"):  # part of a character: spelled from its bytes
            assert entry.token == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        else:
            assert raw == entry.token.encode()
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
    streamed = [
        item
        for chunk in client.chat.completions.create(stream=True, top_logprobs=2, **kwargs)
        if chunk.choices and chunk.choices[0].logprobs is not None
        for item in chunk.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def test_n_choices_are_seeded_per_choice_and_all_counted(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, prompt="def", max_tokens=10, temperature=1.0, extra_body={"ignore_eos": True}
    )
    result = client.completions.create(n=3, seed=7, **kwargs)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage is not None and result.usage.completion_tokens == 30
    for index in range(3):
        alone = client.completions.create(seed=7 + index, **kwargs)
        assert alone.choices[0].text == result.choices[index].text
    chunks = list(client.completions.create(n=2, seed=7, stream=True, stream_options={"include_usage": True}, **kwargs))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(2)]
    assert texts == [result.choices[0].text, result.choices[1].text]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
