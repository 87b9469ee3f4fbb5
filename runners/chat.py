"""Render a model's chat template in a sandbox, the way transformers does.

The template is Jinja code that ships inside a checkpoint, so it is untrusted input:
it runs in jinja2's immutable sandbox, with multiplication and powers bounded, the
output size capped and the rendering time limited, and every failure becomes a
GenerationError that says what to do.

The time limit is a deadline checked wherever a template can spend time: every output
chunk, every function or macro call, attribute or item lookup and ``*``/``**``, and
every iteration of every ``{% for %}`` loop (each loop's iterable is wrapped when the
template is compiled), so even a loop that neither calls nor outputs anything stops.

The environment mirrors transformers' (trim_blocks, lstrip_blocks, loop controls,
``raise_exception``, a ``tojson`` that does not escape HTML, ``strftime_now`` and the
``{% generation %}`` block) so that templates written for transformers render the
same prompt here.

`Conversation` keeps a multi-turn chat (`kvforge chat`) within a model's context.
"""

from __future__ import annotations

import json
import math
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvforge.runners.errors import GenerationError, KvforgeError

_MAX_POWER_BITS = 1 << 16
_FIX_HINT = "fix or replace chat_template in the artifact's tokenizer_config.json"
# The render in progress (in this thread or task): its deadline and time limit. The compiled
# template is shared between renders, so the deadline cannot live on the environment.
_DEADLINE: ContextVar[tuple[float, float] | None] = ContextVar("kvforge_chat_deadline", default=None)


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, str]],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    max_output_chars: int = 1_000_000,
    max_render_seconds: float = 2.0,
) -> str:
    """Render ``messages`` into a prompt string with the model's chat template.

    ``add_generation_prompt`` asks the template to end with the header of an assistant
    turn, so that the model continues as the assistant. ``tools`` and ``documents`` are
    passed as None, as transformers does when there are none. A render that outputs more
    than ``max_output_chars`` or runs longer than ``max_render_seconds`` is stopped.
    """
    if isinstance(max_output_chars, bool) or not isinstance(max_output_chars, int):
        raise GenerationError(f"max_output_chars must be an integer, got {max_output_chars!r}")
    if max_output_chars <= 0:
        raise GenerationError(f"max_output_chars must be > 0, got {max_output_chars}")
    seconds_ok = isinstance(max_render_seconds, (int, float)) and not isinstance(max_render_seconds, bool)
    if not seconds_ok or not math.isfinite(max_render_seconds) or max_render_seconds <= 0:
        raise GenerationError(f"max_render_seconds must be a finite number > 0, got {max_render_seconds!r}")
    compiled = _compile(template, max_output_chars)
    variables = {
        "messages": _plain_messages(messages),
        "bos_token": bos_token,
        "eos_token": eos_token,
        "add_generation_prompt": add_generation_prompt,
        "tools": None,
        "documents": None,
    }
    token = _DEADLINE.set((time.monotonic() + max_render_seconds, max_render_seconds))
    try:
        return _collect(compiled.generate(variables), max_output_chars)
    finally:
        _DEADLINE.reset(token)


def _check_deadline() -> None:
    """Stop the render in progress once its time is up."""
    deadline = _DEADLINE.get()
    if deadline is not None and time.monotonic() > deadline[0]:
        raise GenerationError(
            f"chat template rendering ran past max_render_seconds={deadline[1]:g} (a loop or recursion that "
            f"does not end in time); {_FIX_HINT}"
        )


def _plain_messages(messages: Sequence[Mapping[str, str]]) -> list[dict[str, Any]]:
    """Copy messages into plain dicts, which is what templates index into."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise GenerationError(
            f"messages must be a list of {{'role': ..., 'content': ...}} mappings, got {type(messages).__name__}"
        )
    plain = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise GenerationError(
                f"messages[{index}] must be a mapping like {{'role': 'user', 'content': ...}}, "
                f"got {type(message).__name__}"
            )
        plain.append(dict(message))
    return plain


def _collect(chunks: Iterator[str], max_output_chars: int) -> str:
    """Join the rendered chunks, stopping as soon as the output grows past the limit."""
    parts: list[str] = []
    total = 0
    try:
        for chunk in chunks:
            _check_deadline()
            total += len(chunk)
            if total > max_output_chars:
                raise GenerationError(
                    f"chat template output exceeds max_output_chars={max_output_chars}; "
                    "shorten the messages or raise the limit"
                )
            parts.append(chunk)
    except KvforgeError:
        raise
    except jinja2.exceptions.SecurityError as error:
        raise _unsafe(error) from error
    except jinja2.exceptions.TemplateError as error:
        raise GenerationError(
            f"chat template failed: {error}; check that the messages have the fields the "
            f"template expects, or {_FIX_HINT}"
        ) from error
    except Exception as error:  # the template is code: any error in it is a template bug
        raise GenerationError(
            f"chat template failed while rendering: {type(error).__name__}: {error}; {_FIX_HINT}"
        ) from error
    return "".join(parts)


def _unsafe(error: jinja2.exceptions.SecurityError) -> GenerationError:
    return GenerationError(
        f"chat template attempted an unsafe operation ({error}); the sandbox refuses it: "
        f"use a trusted chat template ({_FIX_HINT})"
    )


@lru_cache(maxsize=16)
def _compile(template: str, max_output_chars: int) -> jinja2.Template:
    """Parse once per template: a server renders the same template for every request."""
    if not isinstance(template, str):
        raise GenerationError(f"chat template must be a string, got {type(template).__name__}")
    environment = _ChatSandbox(max_output_chars)
    try:
        return environment.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise GenerationError(
            f"chat template has a syntax error at line {error.lineno}: {error.message}; {_FIX_HINT}"
        ) from error
    except jinja2.exceptions.SecurityError as error:
        raise _unsafe(error) from error
    except jinja2.exceptions.TemplateError as error:
        raise GenerationError(f"chat template could not be compiled: {error}; {_FIX_HINT}") from error


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it.

    Only training code uses the marks; for a prompt the block renders its body as is.
    """

    tags = {"generation"}  # noqa: RUF012 - jinja declares it a plain class attribute

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus bounds on ``*`` and ``**`` and the render deadline.

    The sandbox already blocks attribute escapes and caps ``range``; repetition like
    ``'x' * 10**12`` or a huge power would still exhaust memory before the output
    limit could be checked, and nested loops or recursion can run for hours without
    output, so calls, lookups, operators and loop iterations check the deadline.
    """

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_output_chars: int) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
        )
        self._max_output_chars = max_output_chars
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """Wrap every ``{% for %}`` iterable so that each iteration checks the deadline."""
        template = super()._parse(source, name, filename)
        for loop in template.find_all(nodes.For):
            wrapped = nodes.Call(nodes.EnvironmentAttribute("iterate_with_deadline"), [loop.iter], [], None, None)
            loop.iter = wrapped.set_lineno(loop.lineno).set_environment(self)
        return template

    def iterate_with_deadline(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            _check_deadline()
            yield item

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)

    def call_binop(self, context: Context, operator_name: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator_name == "*":
            self._check_repetition(left, right)
            return operator.mul(left, right)
        if operator_name == "**":
            _check_power(left, right)
            return operator.pow(left, right)
        return super().call_binop(context, operator_name, left, right)

    def _check_repetition(self, left: Any, right: Any) -> None:
        for sequence, count in ((left, right), (right, left)):
            repeats = isinstance(sequence, (str, list, tuple)) and isinstance(count, int)
            if repeats and len(sequence) * count > self._max_output_chars:
                raise GenerationError(
                    f"chat template repeats a value {count} times, past "
                    f"max_output_chars={self._max_output_chars}; {_FIX_HINT}"
                )


class _TemplateDict:
    """``dict(...)`` for templates without handing them the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, as transformers' does.

    Storing ``_``-prefixed attributes on a namespace is a path to CPython internals.
    """

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature: 'self' may be a key
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with an underscore, got {name!r}")


def _check_power(base: Any, exponent: Any) -> None:
    """Refuse integer powers whose result would need more than 64 Kibit."""
    integers = isinstance(base, int) and isinstance(exponent, int) and exponent > 0
    if integers and abs(base) > 1 and abs(base).bit_length() * exponent > _MAX_POWER_BITS:
        raise GenerationError(f"chat template computes {base} ** {exponent}, which is too large; {_FIX_HINT}")


def _raise_exception(message: str) -> NoReturn:
    """Templates call this to reject a conversation (e.g. roles not alternating)."""
    raise GenerationError(f"chat template rejected the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' tojson: plain json.dumps, without Jinja's HTML escaping."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format_string: str) -> str:
    """Templates (Llama 3.x) stamp the current date into the system prompt."""
    return datetime.now().strftime(format_string)


@dataclass
class Conversation:
    """A multi-turn chat whose prompt stays within `limit` tokens.

    `count` gives the length in tokens of the prompt a list of messages renders to (the chat
    template's, ending with the assistant's header). Asking drops the oldest turns (a user
    message with the reply to it) until the prompt fits; the system message is always kept.
    """

    count: Callable[[Sequence[Mapping[str, str]]], int]
    limit: int
    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self) -> list[dict[str, str]]:
        opening = [] if self.system is None else [{"role": "system", "content": self.system}]
        return opening + self.turns

    def ask(self, text: str) -> tuple[list[dict[str, str]], int]:
        """The messages to answer `text` from, and how many earlier turns were dropped to fit them.

        A message that does not fit even alone is refused (GenerationError), and the
        conversation is left as it was.
        """
        kept = list(self.turns)
        self.turns.append({"role": "user", "content": text})
        dropped = 0
        while (length := self.count(self.messages())) > self.limit:
            if len(self.turns) == 1:
                self.turns = kept
                raise GenerationError(
                    f"the message makes a prompt of {length} tokens, past the {self.limit} this chat leaves for "
                    "it within the model's context; send a shorter one, or lower --max-new-tokens"
                )
            del self.turns[: 2 if self.turns[1]["role"] == "assistant" else 1]
            dropped += 1
        return self.messages(), dropped

    def answer(self, text: str) -> None:
        """Record the assistant's reply to the last message."""
        self.turns.append({"role": "assistant", "content": text})

    def reset(self) -> None:
        """Forget every turn; the system message stays."""
        self.turns.clear()
