"""Bad requests through `Engine` are refused with a GenerationError before any model work.

The engine here wraps a session that counts its calls and a tokenizer built in code, so
every check runs in milliseconds; test_engine.py repeats the key ones on a real artifact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from kvforge.runners.contract import DecoderIO
from kvforge.runners.engine import Engine
from kvforge.runners.errors import GenerationError
from kvforge.runners.sampling import SamplingParams
from kvforge.runners.tokenizer import TokenizerBundle

CONTEXT = 32
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


def _tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Strip()  # so a blank prompt encodes to no tokens
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(["hello world, the quick brown fox"] * 10, trainer)
    return tokenizer


class CountingSession:
    """Greedy always picks token 72; counts calls to run."""

    def __init__(self, vocab_size: int) -> None:
        self.io = DecoderIO(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=vocab_size)
        self.calls = 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        batch, total = feeds["attention_mask"].shape
        logits = np.zeros((batch, feeds["input_ids"].shape[1], self.io.vocab_size), np.float32)
        logits[..., 72] = 1.0
        present = np.zeros((batch, 1, total, 2), np.float32)
        return {"logits": logits, **{name: present for name in self.io.present_names}}


@pytest.fixture()
def engine() -> Engine:
    tokenizer = _tokenizer()
    bundle = TokenizerBundle(tokenizer, chat_template=TEMPLATE, bos_token=None, eos_token=None, pad_token_id=None)
    session = CountingSession(tokenizer.get_vocab_size())
    return Engine(
        session,
        bundle,
        max_positions=CONTEXT,
        eos_ids=(),
        pad_id=0,
        defaults=SamplingParams(temperature=0.0),
        max_new_tokens=4,
    )


def calls(engine: Engine) -> int:
    session = engine.session
    assert isinstance(session, CountingSession)
    return session.calls


def refused(engine: Engine, message: str, prompt: Any = "hello", **request: Any) -> None:
    """The request fails with `message` in stream (at the call), generate and a batch, unrun."""
    with pytest.raises(GenerationError, match=message):
        engine.stream(prompt, **request)  # raises here, not at the first next()
    with pytest.raises(GenerationError, match=message):
        engine.generate(prompt, **request)
    with pytest.raises(GenerationError, match=message):
        engine.generate(["hello", prompt], **request)
    assert calls(engine) == 0


def test_a_good_request_runs(engine: Engine) -> None:
    assert engine.generate("hello", max_new_tokens=3) == engine.tokenizer.decode([72] * 3)
    assert "".join(engine.stream("hello")) == engine.tokenizer.decode([72] * 4)
    assert calls(engine) == 7


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("temperature", -0.5, r"temperature must be >= 0 .*got -0\.5"),
        ("temperature", float("nan"), "temperature must be finite, got nan"),
        ("temperature", float("inf"), "temperature must be finite, got inf"),
        ("temperature", "hot", "temperature must be a number, got 'hot'"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\] .*got 0\.0"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\] .*got 1\.5"),
        ("top_p", -0.1, r"top_p must be in \(0, 1\]"),
        ("top_p", float("nan"), "top_p must be finite"),
        ("top_k", -1, "top_k must be >= 0 .*got -1"),
        ("top_k", 2.5, "top_k must be an integer, got 2.5"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0 .*got 0.0"),
        ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
        ("seed", -1, "seed must be >= 0 or None, got -1"),
        ("seed", 1.5, "seed must be an integer"),
        ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1 .*got 0"),
        ("max_new_tokens", -4, "max_new_tokens must be an integer >= 1 .*got -4"),
        ("max_new_tokens", 2.0, "max_new_tokens must be an integer >= 1 .*got 2.0"),
        ("top_n", 3, "unknown sampling option 'top_n'; use one of"),
    ],
)
def test_bad_values_are_refused_before_any_work(engine: Engine, option: str, value: Any, message: str) -> None:
    refused(engine, message, **{option: value})
    if option != "max_new_tokens":
        with pytest.raises(GenerationError, match=message):
            engine.generate_tokens([[72, 73]], **{option: value})
        assert calls(engine) == 0


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "prompt is empty; pass some text"), ("   \n ", "prompt '   \\\\n ' encodes to no tokens")],
)
def test_empty_prompts_are_refused(engine: Engine, prompt: str, message: str) -> None:
    refused(engine, message, prompt=prompt)
    with pytest.raises(GenerationError, match=rf"^prompts\[2\]: {message}"):  # a batch names the row
        engine.generate(["hello", "world", prompt])


def test_an_empty_chat_message_is_refused_though_the_template_adds_text(engine: Engine) -> None:
    with pytest.raises(GenerationError, match="prompt is empty"):
        engine.stream("", chat=True)
    assert calls(engine) == 0


@pytest.mark.parametrize("prompt", [None, 7, b"hello"])
def test_prompts_must_be_text(engine: Engine, prompt: Any) -> None:
    with pytest.raises(GenerationError, match="prompt must be a string, got"):
        engine.stream(prompt)
    with pytest.raises(GenerationError, match="prompt must be a string, got"):
        engine.generate(["hello", prompt])
    with pytest.raises(GenerationError, match="prompts must be a string or a list of strings"):
        engine.generate(prompt)
    assert calls(engine) == 0


def test_an_empty_batch_or_empty_token_rows_are_refused(engine: Engine) -> None:
    with pytest.raises(GenerationError, match="no prompts given"):
        engine.generate([])
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        engine.generate_tokens([[72], []])
    with pytest.raises(GenerationError, match="no prompts given"):
        engine.generate_tokens([])
    assert calls(engine) == 0


@pytest.mark.parametrize("token", [-1, 10_000, 2.0, True])
def test_token_ids_outside_the_vocabulary_are_refused(engine: Engine, token: Any) -> None:
    vocab = engine.session.io.vocab_size
    with pytest.raises(
        GenerationError, match=rf"prompt 1 holds token id {token!r}, outside the vocabulary \[0, {vocab}\)"
    ):
        engine.generate_tokens([[72], [72, token]])
    assert calls(engine) == 0


def test_prompts_beyond_the_context_are_refused(engine: Engine) -> None:
    long = "hello world " * 40
    assert len(engine.encode(long)) > CONTEXT
    refused(engine, f"exceeds the model's context of {CONTEXT} positions, which must also hold", prompt=long)
    fits = "hello world " * 4
    budget = CONTEXT - len(engine.encode(fits)) + 1
    refused(engine, rf"\+ max_new_tokens {budget} = {CONTEXT + 1} exceeds", prompt=fits, max_new_tokens=budget)


@pytest.mark.parametrize(("stop", "message"), [(["ok", ""], r"stop\[1\] must be a non-empty string"), ("END", "wrap")])
def test_bad_stop_strings_are_refused_at_the_call(engine: Engine, stop: Any, message: str) -> None:
    refused(engine, message, stop=stop)


def test_a_failing_chat_template_is_refused_before_any_work(engine: Engine) -> None:
    engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    refused(engine, "chat template rejected the messages: roles must alternate", chat=True)
    engine.tokenizer.chat_template = None
    refused(engine, "has no chat template", chat=True)


def test_invalid_artifact_defaults_are_not_silently_used(engine: Engine) -> None:
    engine.defaults = SamplingParams(temperature=0.0, top_p=2.0)
    refused(engine, "top_p must be in")
    assert engine.generate("hello", max_new_tokens=2, top_p=0.5) == engine.tokenizer.decode([72] * 2)
