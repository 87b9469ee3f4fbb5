"""The OpenAI API's request fields and response shapes, as vLLM and llama.cpp's server serve them.

`parse_request` checks everything about a request before any work is queued, and raises
`ApiError` carrying OpenAI's error shape: the message names the field and value and says
what to do. A field is either implemented, harmless to ignore (`user`, `metadata`, ...), or
refused with a 400 naming it: a request is never answered as if a field it sent had been
honoured when it was not.
"""

from __future__ import annotations

import json
import numbers
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvforge.runners.decoding import MAX_TOP_LOGPROBS, TokenLogprob
from kvforge.runners.engine import Engine
from kvforge.runners.errors import GenerationError
from kvforge.runners.sampling import SamplingParams
from kvforge.runners.settings import sampling_settings

if TYPE_CHECKING:
    from kvforge.runners.grammar import Grammar

_MAX_STOP_STRINGS = 16
# Limits on a request's shape, checked before anything is compiled or queued: Python's JSON
# decoder and repr recurse, and llguidance's schema compiler takes time that grows with the
# schema (and refuses, mid-sampling, an object whose properties make one parser row of more
# than 2,000 items). Each is far beyond what a real request needs.
MAX_BODY_DEPTH = 64
MAX_SCHEMA_NODES = 2_000
MAX_SCHEMA_MEMBERS = 256
# OpenAI fields whose effect this server does not implement: refused unless absent, null
# or the neutral value listed (the value that asks for nothing).
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "best_of": (1,),
    "echo": (False,),
    "logit_bias": ({},),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "reasoning_effort": (),
    "web_search_options": (),
}
# Fields that describe the caller, not the generation: accepted and not acted on.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Implemented too: every field SamplingParams declares (`kvforge.runners.settings`).
_IMPLEMENTED = frozenset(
    {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "stream",
        "stream_options",
        "ignore_eos",
        "logprobs",
        "top_logprobs",
        "response_format",
        "n",
    }
)


class ApiError(Exception):
    """An error response: status, and OpenAI's `{"error": {message, type, param, code}}` body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class ParsedRequest:
    chat: bool
    ids: list[int]
    params: SamplingParams
    budget: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    grammar: Grammar | None = None
    n: int = 1


def parse_request(raw: bytes, *, chat: bool, engine: Engine, served_name: str) -> ParsedRequest:
    """Check a /v1/completions (or, with `chat`, /v1/chat/completions) body and encode its prompt."""
    body = _json_object(raw)
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string naming the served model ({served_name!r})", "model")
    if model != served_name:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {served_name!r} (see GET /v1/models)",
            "model",
            "model_not_found",
        )
    _refuse_unsupported(body, chat)
    stream, include_usage = _stream_fields(body)
    params = _sampling(body, engine)
    stop = _stop(body.get("stop"))
    ids, where = (_chat_ids(body, engine), "messages") if chat else (_prompt_ids(body, engine), "prompt")
    budget = _budget(body, len(ids), engine.max_positions, where)
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise ApiError(400, f"ignore_eos must be true or false, got {_preview(ignore_eos)}", "ignore_eos")
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body)
    grammar = _response_format(body.get("response_format"), engine)
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or n < 1:
        raise ApiError(400, f"n must be an integer >= 1, got {_preview(n)}", "n")
    return ParsedRequest(
        chat, ids, params, budget, stop, stream, include_usage, bool(ignore_eos), logprobs, grammar, int(n)
    )


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Legacy completions: `logprobs` is the number of alternatives per token (0: the chosen one only)."""
    value = body.get("logprobs")
    if body.get("top_logprobs") is not None:
        raise ApiError(400, "top_logprobs is a chat field; on completions, logprobs is the count", "top_logprobs")
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400, f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_preview(value)}", "logprobs"
        )
    return int(value)


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: `logprobs: true` asks for them, `top_logprobs: k` for k alternatives per token."""
    flag, top = body.get("logprobs"), body.get("top_logprobs")
    if flag is not None and not isinstance(flag, bool):
        raise ApiError(400, f"logprobs must be true or false, got {_preview(flag)}", "logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400, f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_preview(top)}", "top_logprobs"
            )
        if not flag:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return (int(top) if top is not None else 0) if flag else None


def _json_schema_member(value: dict[str, Any]) -> dict[str, Any]:
    """response_format.json_schema {schema: object, name: string, strict: boolean | null}: its schema."""
    spec = value.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(schema, dict):
        raise ApiError(
            400,
            f"response_format.json_schema.schema must be a JSON schema object, got {_preview(schema)}",
            "response_format.json_schema.schema",
        )
    if "name" in spec and not isinstance(spec["name"], str):
        raise ApiError(
            400,
            f"response_format.json_schema.name must be a string, got {_preview(spec['name'])}",
            "response_format.json_schema.name",
        )
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ApiError(
            400,
            f"response_format.json_schema.strict must be true, false or null, got {_preview(spec['strict'])}",
            "response_format.json_schema.strict",
        )
    where = "response_format.json_schema.schema"
    depth, nodes, members = _shape(schema)
    if nodes > MAX_SCHEMA_NODES:
        raise ApiError(400, f"{where} has {nodes} values; at most {MAX_SCHEMA_NODES} are allowed", where)
    if members > MAX_SCHEMA_MEMBERS:
        raise ApiError(
            400,
            f"{where} has an object or list of {members} members; at most {MAX_SCHEMA_MEMBERS} are allowed "
            "(split the schema or use fewer properties)",
            where,
        )
    return schema


def _shape(value: object) -> tuple[int, int, int]:
    """(nesting depth, number of values, most members of one object or list) of a JSON value,
    walked with an explicit stack: the value may nest deeper than Python recurses."""
    depth = nodes = members = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        nodes += 1
        depth = max(depth, level)
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        members = max(members, len(children))
        stack.extend((child, level + 1) for child in children)
    return depth, nodes, members


def _response_format(value: object, engine: Engine) -> Grammar | None:
    """OpenAI's response_format: text (nothing), json_object, or json_schema {name, schema, strict}.
    A `json_schema` member is checked whatever the type, as the API's schema declares it."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(
            400,
            f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema'}}, got {_preview(value)}",
            "response_format",
        )
    assert isinstance(value, dict)
    schema = _json_schema_member(value) if "json_schema" in value or kind == "json_schema" else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = {"type": "object"}
    try:
        return engine.compile_grammar(json_schema=schema)
    except GenerationError as error:
        raise ApiError(400, f"response_format: {error}", "response_format") from error


def _refuse_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    """A 400 naming the first field the server would otherwise have to drop."""
    implemented = _IMPLEMENTED | {"messages" if chat else "prompt"} | {s.name for s in sampling_settings()}
    for name, value in body.items():
        if name in implemented or name in _IGNORED or value is None:
            continue
        if name in _NEUTRAL:
            neutral = _NEUTRAL[name]
            if any(_same(value, v) for v in neutral):
                continue
            hint = f"leave it out or set it to {_preview(neutral[0])}" if neutral else "leave it out"
            raise ApiError(400, f"{name}={_preview(value)} is not supported by this server; {hint}", name)
        raise ApiError(400, f"unknown field {name!r}; this server does not implement it, so leave it out", name)


def _same(value: object, neutral: object) -> bool:
    """Equal and of the same kind: 0 == False in Python, but not here."""
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _json_object(raw: bytes) -> dict[str, Any]:
    too_deep = ApiError(400, f"the request body nests deeper than {MAX_BODY_DEPTH} levels; send a flatter one")
    try:
        body = json.loads(raw)
    except RecursionError as error:  # the decoder recurses once per level
        raise too_deep from error
    except (UnicodeDecodeError, ValueError) as error:
        raise ApiError(400, f"the request body is not valid JSON ({error}); send a JSON object") from error
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if _shape(body)[0] > MAX_BODY_DEPTH:  # before anything recursive (dumps, repr) walks it
        raise too_deep
    try:  # JSON may spell lone UTF-16 surrogates (\ud800), which no tokenizer can take
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise ApiError(
            400, f"the request holds an unpaired surrogate ({error.reason}); send valid Unicode text"
        ) from error
    return body


def _stream_fields(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false, got {_preview(stream)}", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise ApiError(400, f"stream_options must be an object, got {_preview(options)}", "stream_options")
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise ApiError(
            400,
            f"stream_options.include_usage must be true or false, got {_preview(include)}",
            "stream_options.include_usage",
        )
    return stream, bool(include)


def _sampling(body: Mapping[str, Any], engine: Engine) -> SamplingParams:
    """Given fields (each one `SamplingParams` declares) replace the artifact's generation
    defaults; each is checked on its own so that the error names it."""
    given: dict[str, Any] = {}
    for declared in sampling_settings():
        name, value = declared.name, body.get(declared.name)
        if value is None:
            continue
        if value == declared.off_alias and not isinstance(value, bool):
            value = declared.default  # another API's spelling of "off" (vLLM's top_k -1)
        try:
            declared.check(value, GenerationError)
        except GenerationError as error:
            raise ApiError(400, str(error), name) from error
        given[name] = value
    try:
        return engine.sampling(**given)
    except GenerationError as error:  # pragma: no cover - every field was checked above
        raise ApiError(400, str(error)) from error


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of them, got {_preview(value)}", "stop")
    if len(stops) > _MAX_STOP_STRINGS:
        raise ApiError(400, f"stop holds {len(stops)} strings; at most {_MAX_STOP_STRINGS} are allowed", "stop")
    return tuple(stops)


def _prompt_ids(body: Mapping[str, Any], engine: Engine) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty; pass some text", "prompt")
        ids = engine.tokenizer.encode(prompt)
        if not ids:
            raise ApiError(
                400, f"prompt {_preview(prompt)} encodes to no tokens; pass text the tokenizer keeps", "prompt"
            )
        return ids
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        vocab = engine.session.io.vocab_size
        for token in prompt:
            if not 0 <= token < vocab:
                raise ApiError(400, f"prompt holds token id {token}, outside the vocabulary [0, {vocab})", "prompt")
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1:
        raise ApiError(400, "prompt holds several prompts; send one prompt per request", "prompt")
    raise ApiError(400, f"prompt must be a string or a list of token ids, got {_preview(prompt)}", "prompt")


def _chat_ids(body: Mapping[str, Any], engine: Engine) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, f"messages must be a non-empty list of messages, got {_preview(messages)}", "messages")
    plain = [_message(index, m) for index, m in enumerate(messages)]
    try:
        text = engine.tokenizer.apply_chat_template(plain)
    except GenerationError as error:
        raise ApiError(400, str(error), "messages") from error
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ApiError(400, "messages render to a prompt with no tokens; add some content", "messages")
    return ids


def _message(index: int, message: object) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object with role and content, got {_preview(message)}", where)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ApiError(400, f"{where}.role must be a non-empty string, got {_preview(role)}", f"{where}.role")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(f"{where}.content[{i}]", part) for i, part in enumerate(content))
    elif not isinstance(content, str):
        raise ApiError(
            400,
            f"{where}.content must be a string or a list of text parts, got {_preview(content)}",
            f"{where}.content",
        )
    return {"role": role, "content": content}


def _text_part(where: str, part: object) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return str(part["text"])
    raise ApiError(400, f"{where} must be {{'type': 'text', 'text': ...}}: only text content is supported", where)


def _budget(body: Mapping[str, Any], prompt_tokens: int, context: int, where: str) -> int:
    """max_completion_tokens, else max_tokens, else what the context has left; refused past it.
    Each of the two that is given must be an integer >= 1, the one not used too."""
    for field in ("max_completion_tokens", "max_tokens"):
        given = body.get(field)
        if given is not None and (not _is_int(given) or given < 1):
            raise ApiError(400, f"{field} must be an integer >= 1, got {_preview(given)}", field)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if prompt_tokens >= context:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens, but the model's context of {context} positions must also "
            "hold at least one new token; shorten the prompt",
            where,
            "context_length_exceeded",
        )
    if value is None:
        return context - prompt_tokens
    if prompt_tokens + value > context:
        raise ApiError(
            400,
            f"prompt of {prompt_tokens} tokens + {name} {value} = {prompt_tokens + value} exceeds the model's "
            f"context of {context} positions; shorten the prompt or lower {name} to at most "
            f"{context - prompt_tokens}",
            name,
            "context_length_exceeded",
        )
    return int(value)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _preview(value: object, limit: int = 60) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- responses --------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What every response body of one request shares."""

    chat: bool
    model: str
    id: str
    created: int

    @classmethod
    def new(cls, chat: bool, model: str) -> Reply:
        prefix = "chatcmpl" if chat else "cmpl"
        return cls(chat, model, f"{prefix}-{uuid.uuid4().hex}", int(time.time()))

    def _head(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def complete(self, choices: list[Choice], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The whole response; `completion_tokens` counts the tokens of every choice."""
        body = self._head(chunk=False)
        body.update(choices=[self._choice(c) for c in choices], usage=usage(prompt_tokens, completion_tokens))
        return body

    def _choice(self, choice: Choice) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": choice.index}
        if self.chat:
            entry["message"] = {"role": "assistant", "content": choice.text}
        else:
            entry["text"] = choice.text
        entry.update(logprobs=choice.logprobs, finish_reason=choice.reason)
        if choice.incomplete:
            entry[EXTENSION] = {"finish_reason": "incomplete"}
        return entry

    def chunk(
        self,
        text: str,
        *,
        index: int = 0,
        first: bool = False,
        reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        include_usage: bool,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            delta: dict[str, str] = {"role": "assistant"} if first else {}
            if text or first:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=reason)
        if incomplete:
            choice[EXTENSION] = {"finish_reason": "incomplete"}
        body = self._head(chunk=True)
        body["choices"] = [choice]
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self._head(chunk=True)
        body.update(choices=[], usage=usage(prompt_tokens, completion_tokens))
        return body


# A choice's field outside OpenAI's schema: {"finish_reason": "incomplete"} where finish_reason is
# "length" and the text stops short of its response_format (a JSON schema, regex or grammar), so it
# does not match it; OpenAI's finish_reason has no value that says so. Absent otherwise.
EXTENSION = "kvforge"


@dataclass(frozen=True)
class Choice:
    index: int
    text: str
    reason: str
    logprobs: dict[str, Any] | None
    incomplete: bool = False  # cut by its budget before its response_format was complete


class LogprobsWriter:
    """One choice's logprob entries in OpenAI's shape: chat `{"content": [...]}`, or the legacy
    completions `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; offsets run on
    across the chunks of a stream. A token that holds part of a UTF-8 character is spelled as
    OpenAI does, `bytes:\\xe2\\x80`; chat's `bytes` are always the token's exact bytes."""

    def __init__(self, engine: Engine, chat: bool) -> None:
        self.engine, self.chat, self.offset = engine, chat, 0

    def token(self, token: int) -> str:
        return token_text(self.engine.token_bytes(token))

    def _item(self, token: int, logprob: float) -> dict[str, Any]:
        raw = self.engine.token_bytes(token)
        return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

    def render(self, entries: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> dict[str, Any]:
        if self.chat:
            content = [
                {**self._item(e.token, e.logprob), "top_logprobs": [self._item(t, v) for t, v in e.top]}
                for e in entries
            ]
            return {"content": content}
        tokens = [self.token(e.token) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token(t): v for t, v in e.top} for e in entries],
            "text_offset": offsets,
        }


def token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def model_list(name: str, context: int, created: int) -> dict[str, Any]:
    entry = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "kvforge",
        "root": name,
        "max_model_len": context,
    }
    return {"object": "list", "data": [entry]}


def dumps(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
