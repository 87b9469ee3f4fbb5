"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize takes a `prompt` (encoded as /v1/completions encodes it) or chat `messages`
(rendered with the model's chat template as /v1/chat/completions renders them) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; /detokenize takes `tokens` and answers
`{"prompt"}`. `model` is optional; when given it must name the served model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvforge.runners.engine import Engine
from kvforge.runners.errors import GenerationError
from kvforge.runners.serve.protocol import ApiError, _is_int, _json_object, _message, _preview

_PROMPT_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "add_special_tokens", "return_token_strs"})
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _check_fields(body: Mapping[str, Any], fields: frozenset[str], served_name: str) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        message = f"unknown field {unknown[0]!r}; this request reads {', '.join(sorted(fields))}"
        raise ApiError(400, message, unknown[0])
    if "model" not in body:
        return
    model = body["model"]
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string naming the served model ({served_name!r})", "model")
    if model != served_name:
        message = f"the model {model!r} does not exist; this server serves {served_name!r} (see GET /v1/models)"
        raise ApiError(404, message, "model", "model_not_found")


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {_preview(value)}", name)
    return value


def tokenize(raw: bytes, engine: Engine, served_name: str) -> dict[str, Any]:
    body = _json_object(raw)
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise ApiError(400, "send exactly one of prompt (text) and messages (a conversation)", "prompt")
    _check_fields(body, _PROMPT_FIELDS if has_prompt else _CHAT_FIELDS, served_name)
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise ApiError(400, f"prompt must be a string, got {_preview(prompt)}", "prompt")
        ids = engine.tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, f"messages must be a non-empty list of messages, got {_preview(messages)}", "messages")
        plain = [_message(index, m) for index, m in enumerate(messages)]
        try:
            text = engine.tokenizer.apply_chat_template(plain, _flag(body, "add_generation_prompt", True))
        except GenerationError as error:
            raise ApiError(400, str(error), "messages") from error
        ids = engine.tokenizer.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    strs = None
    if _flag(body, "return_token_strs", False):
        strs = [engine.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    return {"count": len(ids), "max_model_len": engine.max_positions, "tokens": ids, "token_strs": strs}


def detokenize(raw: bytes, engine: Engine, served_name: str) -> dict[str, Any]:
    body = _json_object(raw)
    _check_fields(body, _DETOKENIZE_FIELDS, served_name)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise ApiError(400, f"tokens must be a list of token ids, got {_preview(tokens)}", "tokens")
    vocab = engine.session.io.vocab_size
    for token in tokens:
        if not 0 <= token < vocab:
            raise ApiError(400, f"tokens holds token id {token}, outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": engine.tokenizer.decode([int(t) for t in tokens])}
