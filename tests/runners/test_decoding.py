"""The per-request decoding core over a real artifact: logprobs and structured output."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvforge.runners.decoding import Decoder, end_of_row, log_softmax, make_sampler, token_logprob
from kvforge.runners.engine import Completion, Engine
from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.grammar import GrammarError
from kvforge.runners.sampling import SamplingParams

PROMPT = "def fibonacci(n):"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["ok", "count", "color"],
    "additionalProperties": False,
}


def check_schema(value: object) -> None:
    """SCHEMA, checked by hand (no validator is a dependency)."""
    assert isinstance(value, dict) and set(value) == {"ok", "count", "color"}, value
    assert isinstance(value["ok"], bool)
    assert isinstance(value["count"], int) and not isinstance(value["count"], bool) and 0 <= value["count"] <= 9
    assert value["color"] in ("red", "green", "blue")


@pytest.fixture(scope="module")
def engine(built_artifact: Callable[..., Path]) -> Engine:
    e = Engine.load(built_artifact("llama"))
    e.eos_ids = ()  # random weights may sample eos at any point; the logprob tests want full lengths
    return e


@pytest.fixture(scope="module")
def guided(built_artifact: Callable[..., Path]) -> Engine:
    return Engine.load(built_artifact("llama"))  # with its eos: a grammar may end on it


def session_logprobs(engine: Engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """log-softmax of the logits that predicted each of `tokens`, each from a prefill of what precedes it."""
    rows = []
    for end in range(len(tokens)):
        ids = np.asarray([prompt + tokens[:end]], dtype=np.int64)
        logits, _ = forward(engine.session, ids, np.ones_like(ids), empty_cache(engine.session.io, 1, ids.shape[1]))
        rows.append(log_softmax(logits[0, -1]))
    return np.stack(rows)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.5, "top_k": 5, "seed": 3}])
def test_logprobs_are_the_models_log_softmax_whatever_the_sampling(engine: Engine, sampling: dict) -> None:
    result = engine.generate(PROMPT, max_new_tokens=12, logprobs=4, **sampling)
    assert isinstance(result, Completion) and result.finish_reason == "length"
    assert len(result.tokens) == len(result.logprobs) == 12
    expected = session_logprobs(engine, engine.encode(PROMPT), result.tokens)
    for position, entry in enumerate(result.logprobs):
        assert entry.token == result.tokens[position]
        np.testing.assert_allclose(entry.logprob, expected[position, entry.token], atol=2e-4)
        assert len(entry.top) == 4
        top_ids = [i for i, _ in entry.top]
        np.testing.assert_allclose([v for _, v in entry.top], expected[position, top_ids], atol=2e-4)
        assert np.isfinite(entry.logprob) and entry.logprob <= 0
        if sampling["temperature"] == 0:
            assert top_ids[0] == entry.token  # the greedy token is the most likely one


@pytest.mark.slow
def test_stream_logprobs_match_generate(engine: Engine) -> None:
    stream = engine.stream(PROMPT, max_new_tokens=8, logprobs=0, temperature=0.0)
    text = "".join(stream)
    result = engine.generate(PROMPT, max_new_tokens=8, logprobs=0, temperature=0.0)
    assert isinstance(result, Completion) and text == result.text
    assert [e.token for e in stream.logprobs] == result.tokens
    assert all(e.top == () for e in stream.logprobs)


@pytest.mark.slow
def test_json_schema_replies_sampled_at_temperature_1_parse_and_validate(guided: Engine) -> None:
    for seed in range(8):
        text = guided.generate(PROMPT, json_schema=SCHEMA, temperature=1.0, seed=seed, max_new_tokens=64)
        assert isinstance(text, str) and " " not in text  # compact: no free whitespace
        check_schema(json.loads(text))
    stream = guided.stream(PROMPT, json_schema=json.dumps(SCHEMA), temperature=1.0, seed=0, max_new_tokens=64)
    check_schema(json.loads("".join(stream)))
    assert stream.stats.finish_reason == "stop"


@pytest.mark.slow
def test_regex_and_lark_grammar_constrain_the_text(guided: Engine) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    lark = 'start: answer "!"\nanswer: "yes" | "no" | "maybe"'
    for seed in range(4):
        text = guided.generate(PROMPT, regex=pattern, temperature=1.0, seed=seed, max_new_tokens=32)
        assert isinstance(text, str) and re.fullmatch(pattern, text), text
        text = guided.generate(PROMPT, grammar=lark, temperature=1.0, seed=seed, max_new_tokens=32)
        assert text in ("yes!", "no!", "maybe!")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json_schema": {"type": "strin"}}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": "[a-"}, "regex"),
        ({"grammar": "start: missing_rule"}, "grammar"),
        ({"regex": "a", "grammar": 'start: "a"'}, "not regex and grammar"),
    ],
)
def test_constraints_that_do_not_compile_are_one_line_errors(guided: Engine, kwargs: dict, message: str) -> None:
    with pytest.raises(GrammarError) as info:
        guided.generate(PROMPT, max_new_tokens=4, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_token_logprob_ranks_ties_by_id_and_normalises() -> None:
    logits = np.array([0.0, 2.0, 2.0, -1.0])
    entry = token_logprob(logits, 3, top=3)
    assert [i for i, _ in entry.top] == [1, 2, 0]
    np.testing.assert_allclose(np.exp(log_softmax(logits)).sum(), 1.0)
    np.testing.assert_allclose(entry.logprob, -1.0 - np.log(np.exp(logits).sum()))


def test_sampler_chain_keeps_only_what_its_steps_allow() -> None:
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    rng = np.random.default_rng(0)
    assert make_sampler(SamplingParams(temperature=0.0))(logits, rng).tolist() == [0]
    picks = {int(make_sampler(SamplingParams(top_k=2))(logits, rng)[0]) for _ in range(200)}
    assert picks == {0, 1}


def test_decoder_logprobs_ignore_the_penalty_and_the_sampler() -> None:
    logits = np.array([1.0, 3.0, 0.5])
    decoder = Decoder(SamplingParams(temperature=0.0, repetition_penalty=100.0), [1], logprobs=1)
    token, entry = decoder.choose(logits)
    assert token == 0  # the penalty moved the argmax off the seen token
    assert entry is not None and entry.top[0][0] == 1  # the model's own distribution still ranks 1 first
    assert Decoder(SamplingParams(temperature=0.0)).plain_greedy and not decoder.plain_greedy


def test_end_of_row_says_why() -> None:
    assert end_of_row(eos=True, stopped=False, finished=False, generated=1, budget=9) == "stop"
    assert end_of_row(eos=False, stopped=False, finished=True, generated=1, budget=9) == "stop"
    assert end_of_row(eos=False, stopped=False, finished=False, generated=9, budget=9) == "length"
    assert end_of_row(eos=False, stopped=False, finished=False, generated=3, budget=9) is None


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_penalty_that_overflows_a_logit_still_chooses_a_token(temperature: float) -> None:
    decoder = Decoder(SamplingParams(temperature=temperature, repetition_penalty=5e-324, seed=0), [1])
    token, _ = decoder.choose(np.array([1.0, 2.0, 0.5]))
    assert token == 1  # 2 / 5e-324 is +inf: the argmax, and the only token a draw can take
