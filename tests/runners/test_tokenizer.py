"""TokenizerBundle: loading an artifact's tokenizer files in the shapes transformers writes."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvforge.runners.detokenizer import StreamingDetokenizer
from kvforge.runners.errors import ArtifactError, GenerationError
from kvforge.runners.tokenizer import TokenizerBundle

CORPUS = ["héllo wörld 日本語 🙂", "hello world, hello there", "the quick brown fox"] * 20
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BOS_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE with <s> prepended by the post-processor, like Llama 3."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tokenizer


def write_artifact(directory: Path, config: Any | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


# --- loading ------------------------------------------------------------------------------


def test_load_reads_string_fields(tmp_path: Path) -> None:
    config = {
        "chat_template": CHATML,
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
    }
    bundle = TokenizerBundle.load(write_artifact(tmp_path, config))
    assert bundle.chat_template == CHATML
    assert bundle.bos_token == "<s>"
    assert bundle.eos_token == "<|im_end|>"
    assert bundle.pad_token_id == bundle.tokenizer.token_to_id("<pad>") == 2


def test_load_reads_added_token_dicts(tmp_path: Path) -> None:
    def added(content: str) -> dict[str, Any]:
        return {
            "__type": "AddedToken",
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }

    config = {"bos_token": added("<s>"), "eos_token": added("</s>"), "pad_token": added("</s>")}
    bundle = TokenizerBundle.load(write_artifact(tmp_path, config))
    assert (bundle.bos_token, bundle.eos_token) == ("<s>", "</s>")
    assert bundle.pad_token_id == 1


def test_load_without_config_has_no_template_or_tokens(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path))
    assert bundle.chat_template is None
    assert bundle.bos_token is None and bundle.eos_token is None and bundle.pad_token_id is None
    assert bundle.decode(bundle.encode("hello world")) == "hello world"


def test_load_accepts_a_str_path(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(str(write_artifact(tmp_path)))  # type: ignore[arg-type]
    assert bundle.encode("hello", add_special_tokens=False)


def test_null_token_fields_and_unknown_pad_token(tmp_path: Path) -> None:
    config = {"bos_token": None, "eos_token": "</s>", "pad_token": "<not-in-vocab>"}
    bundle = TokenizerBundle.load(write_artifact(tmp_path, config))
    assert bundle.bos_token is None and bundle.eos_token == "</s>"
    assert bundle.pad_token_id is None


def test_list_of_named_templates_takes_default(tmp_path: Path) -> None:
    config = {
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": CHATML},
        ]
    }
    assert TokenizerBundle.load(write_artifact(tmp_path, config)).chat_template == CHATML


def test_list_without_default_disables_chat_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = {"chat_template": [{"name": "rag", "template": "R"}, {"name": "tool_use", "template": "T"}]}
    with caplog.at_level(logging.WARNING, logger="kvforge.runners.tokenizer"):
        bundle = TokenizerBundle.load(write_artifact(tmp_path, config))
    assert bundle.chat_template is None
    assert "no 'default' entry (found rag, tool_use)" in caplog.text


def test_chat_template_jinja_file_wins_over_config(tmp_path: Path) -> None:
    directory = write_artifact(tmp_path, {"chat_template": "FROM CONFIG"})
    (directory / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    assert TokenizerBundle.load(directory).chat_template == CHATML


# --- broken artifacts ---------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"tokenizer\.json: missing.*rebuild") as error:
        TokenizerBundle.load(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(error.value)


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0"}', "[]", ""])
def test_invalid_tokenizer_json_names_the_path(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content, encoding="utf-8")
    with pytest.raises(ArtifactError, match="not a valid tokenizers file") as error:
        TokenizerBundle.load(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(error.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{oops", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"eos_token": 7}), "eos_token must be a string or an object"),
        (json.dumps({"bos_token": {"text": "<s>"}}), "bos_token must be a string or an object"),
        (json.dumps({"chat_template": 3}), "chat_template must be a string or a list"),
        (json.dumps({"chat_template": [{"name": "default"}]}), "chat_template must be a string or a list"),
    ],
)
def test_invalid_config_names_the_file_and_field(tmp_path: Path, content: str, message: str) -> None:
    directory = write_artifact(tmp_path)
    (directory / "tokenizer_config.json").write_text(content, encoding="utf-8")
    with pytest.raises(ArtifactError, match=message) as error:
        TokenizerBundle.load(directory)
    assert str(directory / "tokenizer_config.json") in str(error.value)


def test_config_that_is_not_utf8_is_an_artifact_error(tmp_path: Path) -> None:
    directory = write_artifact(tmp_path)
    (directory / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xff"}')
    with pytest.raises(ArtifactError, match="tokenizer_config.json: not valid JSON"):
        TokenizerBundle.load(directory)


# --- encode / decode -------------------------------------------------------------------------


def test_encode_adds_special_tokens_only_when_asked(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path))
    bos = bundle.tokenizer.token_to_id("<s>")
    with_bos = bundle.encode("héllo wörld 日本語 🙂")
    plain = bundle.encode("héllo wörld 日本語 🙂", add_special_tokens=False)
    assert with_bos == [bos, *plain]
    assert all(isinstance(i, int) for i in with_bos)


def test_decode_round_trips_and_skips_specials_by_default(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path))
    ids = bundle.encode("héllo wörld 日本語 🙂")
    assert bundle.decode(ids) == "héllo wörld 日本語 🙂"
    assert bundle.decode(ids, skip_special_tokens=False) == "<s>héllo wörld 日本語 🙂"
    assert bundle.decode(tuple(ids)) == "héllo wörld 日本語 🙂"


def test_decode_refuses_negative_ids(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path))
    with pytest.raises(GenerationError, match="token ids must be >= 0, got -5"):
        bundle.decode([1, -5])


# --- chat and streaming ------------------------------------------------------------------


def test_apply_chat_template_renders_with_the_bundle_tokens(tmp_path: Path) -> None:
    config = {"chat_template": BOS_TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}
    bundle = TokenizerBundle.load(write_artifact(tmp_path, config))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert bundle.apply_chat_template(messages) == "<s>hi</s>yo</s>"


def test_apply_chat_template_chatml_and_generation_prompt(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path, {"chat_template": CHATML}))
    messages = [{"role": "user", "content": "héllo"}]
    prompt = bundle.apply_chat_template(messages)
    assert prompt == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    assert bundle.apply_chat_template(messages, add_generation_prompt=False) == ("<|im_start|>user\nhéllo<|im_end|>\n")
    ids = bundle.encode(prompt, add_special_tokens=False)
    assert ids[0] == bundle.tokenizer.token_to_id("<|im_start|>")  # special tokens are atomic
    assert bundle.decode(ids, skip_special_tokens=False) == prompt


def test_missing_tokens_render_as_empty_strings(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path, {"chat_template": BOS_TEMPLATE}))
    assert bundle.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


def test_apply_chat_template_without_a_template_says_what_to_do(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path, {"eos_token": "</s>"}))
    with pytest.raises(GenerationError, match="no chat template.*pass a plain prompt"):
        bundle.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_errors_surface_as_generation_errors(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path, {"chat_template": "{% for %}"}))
    with pytest.raises(GenerationError, match="chat template has a syntax error"):
        bundle.apply_chat_template([{"role": "user", "content": "hi"}])


def test_detokenizer_streams_the_bundle_tokenizer_with_stops(tmp_path: Path) -> None:
    bundle = TokenizerBundle.load(write_artifact(tmp_path))
    ids = bundle.encode("hello world 日本語 🙂 the end", add_special_tokens=False)
    detokenizer = bundle.detokenizer()
    assert isinstance(detokenizer, StreamingDetokenizer)
    text = "".join(detokenizer.add(i) for i in ids) + detokenizer.finish()
    assert text == bundle.decode(ids)
    stopping = bundle.detokenizer(stop=["🙂"])
    assert "".join(stopping.add(i) for i in ids) + stopping.finish() == "hello world 日本語 "
    assert stopping.stopped
    assert bundle.detokenizer() is not bundle.detokenizer()  # one per sequence
