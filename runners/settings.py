"""Settings declared once: each sampling and serving setting is a dataclass field carrying its
declaration (`setting`): its type, range, default, what its neutral value means, its help text,
and how the surfaces that take it spell it. Everything that takes a setting derives it from
here: `SamplingParams.validate`, the CLI options (`kvforge.runners.cli`), the HTTP parser
(`kvforge.runners.serve.protocol`), the OpenAPI document (`kvforge.runners.serve.openapi`), the
Triton contract (`kvforge.runners.triton.contract`), the artifact's generation defaults
(`kvforge.runners.engine.sampling_defaults`) and `genai_config.json`
(`kvforge.toolchain.emit.genai`). A new field of `SamplingParams` reaches all of them; what it
does to the logits is `kvforge.runners.decoding`'s to say.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any

from kvforge.runners.errors import GenerationError, KvforgeError

_KEY = "kvforge.setting"
_TRITON_TYPES = {int: "TYPE_INT32", float: "TYPE_FP32", str: "TYPE_STRING"}
_JSON_TYPES = {int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class Setting:
    """One setting as every surface sees it. `name` is the field's, and the API's (the OpenAI
    body, Triton's input, generation_config.json's key); the CLI flag is `--name-with-dashes`."""

    name: str
    kind: type  # int, float or str
    default: Any
    help: str  # the CLI option's help
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    nullable: bool = False  # None is a value (seed: a fresh draw each time)
    note: str = ""  # what the neutral value means, for error messages: "0 turns it off"
    off_alias: int | None = None  # a value the HTTP API also takes for off (vLLM's top_k -1)
    triton_type: str | None = None  # Triton's type of the input; None: from `kind`
    generation_config: bool = True  # read from the artifact's generation_config.json
    genai: str | None = None  # onnxruntime-genai's `search` key; None: not written there
    kept_when_greedy: bool = False  # a logits processor that greedy decoding applies too
    metavar: str | None = None  # the CLI's name for the value
    triton_parameter: bool = False  # an engine parameter of config.pbtxt (an integer)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def triton(self) -> str:
        return self.triton_type or _TRITON_TYPES[self.kind]

    def range_text(self) -> str:
        """'>= 0', '> 0', 'in (0, 1]', 'in [0, 1]': the accepted range as messages say it."""
        low = self.minimum
        if self.maximum is not None:
            opening = "(" if self.exclusive_minimum else "["
            return f"in {opening}{_number(low)}, {_number(self.maximum)}]"
        if low is None:
            return "any value"
        return f"{'>' if self.exclusive_minimum else '>='} {_number(low)}"

    def check(self, value: object, error: type[KvforgeError] = KvforgeError) -> None:
        """Raise `error` naming the setting when `value` is of the wrong type or out of range."""
        if value is None and self.nullable:
            return
        if self.kind is str:
            if not isinstance(value, str):
                raise error(f"{self.name} must be a string, got {value!r}")
            return
        if self.kind is int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
            raise error(f"{self.name} must be an integer, got {value!r}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise error(f"{self.name} must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise error(f"{self.name} must be finite, got {value}")
        low, high, number = self.minimum, self.maximum, float(value)
        below = low is not None and (number <= low if self.exclusive_minimum else number < low)
        if below or (high is not None and number > high):
            none = " or None" if self.nullable else ""
            note = f" ({self.note})" if self.note else ""
            raise error(f"{self.name} must be {self.range_text()}{none}{note}, got {value}")

    def json_schema(self) -> dict[str, Any]:
        """The OpenAPI 3.0 schema of the field in a request body (null: the default)."""
        schema: dict[str, Any] = {"type": _JSON_TYPES[self.kind]}
        low = self.minimum
        if self.off_alias is not None and low is not None:
            low = min(low, self.off_alias)
        if low is not None:
            schema["minimum"] = _number(low)
            if self.exclusive_minimum and low == self.minimum:
                schema["exclusiveMinimum"] = True
        if self.maximum is not None:
            schema["maximum"] = _number(self.maximum)
        return {**schema, "nullable": True}


def setting(kind: type, default: Any, help: str, **declaration: Any) -> Any:
    """A dataclass field declaring a setting (see `Setting` for the keywords)."""
    return field(default=default, metadata={_KEY: dict(kind=kind, default=default, help=help, **declaration)})


def declared(cls: type) -> tuple[Setting, ...]:
    """The settings a dataclass declares with `setting`, in field order."""
    found = _DECLARED.get(cls)
    if found is None:
        found = tuple(Setting(name=f.name, **f.metadata[_KEY]) for f in fields(cls) if _KEY in f.metadata)
        _DECLARED[cls] = found
    return found


_DECLARED: dict[type, tuple[Setting, ...]] = {}


def _number(value: float | None) -> float | int | None:
    """1.0 -> 1: ranges read as people write them."""
    return int(value) if value is not None and float(value).is_integer() else value


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; the neutral value of each field turns it off.

    ``temperature == 0`` means greedy decoding (argmax after the repetition penalty).
    ``repetition_penalty`` follows Hugging Face: for every token already seen (prompt and
    generated), a positive logit is divided by the penalty and a negative one multiplied.
    """

    temperature: float = setting(
        float,
        1.0,
        "0 is greedy. Default: the artifact's generation config.",
        minimum=0,
        note="0 means greedy",
        genai="temperature",
    )
    top_k: int = setting(
        int, 0, "Keep the k most likely tokens (0: off).", minimum=0, note="0 turns it off", off_alias=-1, genai="top_k"
    )
    top_p: float = setting(
        float,
        1.0,
        "Keep the smallest set of tokens with this total probability.",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        note="1 turns it off",
        genai="top_p",
    )
    min_p: float = setting(
        float,
        0.0,
        "Drop tokens below this fraction of the top probability.",
        minimum=0,
        maximum=1,
        note="0 turns it off",
    )
    repetition_penalty: float = setting(
        float,
        1.0,
        "Penalize tokens already seen (1: off).",
        minimum=0,
        exclusive_minimum=True,
        note="1 turns it off",
        genai="repetition_penalty",
        kept_when_greedy=True,
    )
    seed: int | None = setting(
        int,
        None,
        "Same seed, same text.",
        minimum=0,
        nullable=True,
        triton_type="TYPE_UINT64",
        generation_config=False,
    )

    def validate(self) -> None:
        """Raise GenerationError naming the first field whose value is out of range."""
        for declaration in declared(type(self)):
            declaration.check(getattr(self, declaration.name), GenerationError)

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax: top-k/top-p/min-p never remove the argmax."""
        return self.temperature == 0


def sampling_settings() -> tuple[Setting, ...]:
    """The settings `SamplingParams` declares: what the CLI, the HTTP API, the OpenAPI document and
    the Triton contract take."""
    return declared(SamplingParams)


@dataclass(frozen=True)
class ServingParams:
    """The batching engine's settings, shared by `kvforge serve` and the Triton backend (whose
    config.pbtxt carries the `triton` ones as parameters)."""

    max_num_seqs: int = setting(int, 8, "Requests generating at once.", minimum=1, triton_parameter=True)
    max_queued: int = setting(int, 64, "Requests waiting", minimum=0, triton_parameter=True)
    prefill_chunk: int = setting(int, 256, "Prompt tokens prefilled per engine step.", minimum=1, triton_parameter=True)
    # a size (kvforge.runners.units), parsed where it is read; None: a quarter of the memory available
    prefix_cache_bytes: str | None = setting(
        str,
        None,
        "Memory for the KV of prompt prefixes reused across requests (e.g. 512M, 2G; 0: off). "
        "Default: a quarter of the memory available at start.",
        nullable=True,
        metavar="BYTES",
    )
    speculative: str | None = setting(
        str,
        None,
        "Exact speculative decoding: drafts from n-grams of the prompt and output (prompt-lookup) or from a "
        "smaller artifact with the same tokenizer (draft:PATH), checked in one target step; the same text as "
        "without.",
        nullable=True,
        metavar="prompt-lookup|draft:PATH",
    )
    # kvforge.runners.speculative's MAX_DRAFT_TOKENS and DEFAULT_DRAFT_TOKENS (None) bound and fill it
    draft_tokens: int | None = setting(
        int,
        None,
        "Tokens drafted per target step, with --speculative. Default: 8.",
        minimum=1,
        maximum=64,
        nullable=True,
    )


def serving_settings() -> tuple[Setting, ...]:
    """The settings `ServingParams` declares: the options of `kvforge serve` (and of
    `kvforge generate` and `kvforge export-triton` where they take them) and config.pbtxt's
    engine parameters (`triton_parameter`)."""
    return declared(ServingParams)


def serving_setting(name: str) -> Setting:
    return next(s for s in serving_settings() if s.name == name)
