"""`Engine`: a compiled artifact, its tokenizer and generation defaults, ready to generate.

    engine = Engine.load("./out")
    for chunk in engine.stream("def fibonacci(n):", max_new_tokens=64):
        print(chunk, end="", flush=True)

Every generation runs the engine core (`kvforge.runners.core`) stepped in the caller's thread: the
same step as the server's, over a batch of the call's rows.

Needs only onnxruntime, tokenizers, jinja2 and numpy: no torch at run time.
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvforge.runners.core import Delta, Event, Finished, Request, run_inline, token_requests
from kvforge.runners.decoding import Decoder, TokenLogprob, batch_decoders
from kvforge.runners.errors import ArtifactError, GenerationError
from kvforge.runners.generate import check_length
from kvforge.runners.manifest import (
    FileHashes,
    check_spec_against_io,
    listed_files,
    read_io,
    read_json_object,
    read_manifest,
    read_max_positions,
)
from kvforge.runners.request import GenerationRequest
from kvforge.runners.runtime import Choice, Environment, choose, open_session
from kvforge.runners.sampling import SamplingParams
from kvforge.runners.session import Session
from kvforge.runners.settings import declared
from kvforge.runners.speculative import (
    PROMPT_LOOKUP,
    DraftModel,
    Speculation,
    SpeculationStats,
    check_same_vocabulary,
    parse_speculative,
    require_all_logits,
)
from kvforge.runners.tokenizer import TokenizerBundle

if TYPE_CHECKING:  # kvforge.runners.grammar imports llguidance, loaded only when a grammar or logprobs are asked for
    from kvforge.runners.grammar import Grammar, GrammarCompiler

GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_s: float = 0.0  # from the call to the first generated token
    total_s: float = 0.0
    finish_reason: str = "length"  # "stop" (eos or stop string) or "length"
    # With speculative decoding: verify steps, drafted and accepted tokens (None without)
    speculation: SpeculationStats | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (prefill excluded)."""
        decode_s = self.total_s - self.first_token_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0


@dataclass(frozen=True)
class Completion:
    """What `Engine.generate` returns when logprobs are asked for: the text, the ids of its
    tokens, one logprob entry per token, and why the row ended ("stop" or "length")."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str


@dataclass
class TextStream:
    """Iterator of text chunks; `stats` is complete once iteration ends.

    With `logprobs` asked for, `logprobs` gains one entry per token of the text as it is
    generated (the end-of-text token is not part of the text and has none).
    """

    _chunks: Iterator[str]
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __iter__(self) -> Iterator[str]:
        return self._chunks

    def __next__(self) -> str:
        return next(self._chunks)


class Engine:
    """Generation over one artifact; every request is checked before any model work.

    Prompts, token budget, sampling values and stop strings are refused with a
    GenerationError naming the value, so a bad request never reaches the session.
    """

    def __init__(
        self,
        session: Session,
        tokenizer: TokenizerBundle,
        *,
        max_positions: int,
        eos_ids: Sequence[int],
        pad_id: int,
        defaults: SamplingParams,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.max_positions = max_positions
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.defaults = defaults
        self.max_new_tokens = max_new_tokens
        self._grammars: GrammarCompiler | None = None
        self.directory: Path | None = None  # where `load` found the artifact
        self._drafts: dict[str, DraftModel] = {}

    @classmethod
    def load(
        cls,
        directory: str | Path,
        providers: Sequence[str] | None = None,
        *,
        runtime: str = "auto",
        huge_pages: bool = True,
        stop_spinning: bool = False,
        environment: Environment | None = None,
    ) -> Engine:
        """Open an artifact after checking every file against its manifest.

        The directory must hold exactly the manifest's files before any is opened. The files
        are hashed in threads from then on: the model's external data must name files among
        them, and every other file must match its hash, before onnxruntime opens the model;
        the weights are hashed while onnxruntime loads them, and if they do not match, the
        session is dropped and the mismatch raised: no Engine is returned over a modified
        file. (A TensorRT engine is checked whole before it is deserialized.)

        `runtime` chooses the session (`kvforge.runners.runtime`): "auto" runs the artifact's
        TensorRT engine where TensorRT and a GPU are present, else onnxruntime's CUDA provider
        where onnxruntime-gpu and a GPU are, else the CPU; "ort", "ort-cuda" and "tensorrt"
        ask for one, and one that cannot run here is a RuntimeUnavailable error naming what is
        missing. `providers`, where given, are onnxruntime's as the caller chose them.
        `environment` stands for what is installed (`Environment.detect()` when None).

        `huge_pages` backs the weights onnxruntime loads on the CPU with 2 MiB pages on Linux
        (`kvforge.runners.hugepages`): faster decode for a little more time at load (docs/performance.md);
        pass False when a process loads to generate a few tokens.

        `stop_spinning` makes onnxruntime's CPU threads stop spinning as soon as a run ends,
        for a session that takes turns with another in one process, such as a target model
        with its draft (`speculative="draft:PATH"`; the draft's engine is loaded so): spinning
        on after a run, one session's threads take the cores the other's run needs
        (docs/performance.md, Speculative decoding). A session alone decodes faster spinning.
        """
        directory = Path(directory)
        manifest = read_manifest(directory)
        hashes = FileHashes(directory, listed_files(directory, manifest))
        try:
            engine = cls._open(directory, manifest, hashes, providers, runtime, huge_pages, stop_spinning, environment)
        except Exception:
            hashes.wait()  # a modified file is the error to report, whatever it made fail
            raise
        failure = hashes.failure()
        if failure is not None:
            del engine  # not even the traceback keeps a session over a modified file
            raise failure
        return engine

    @classmethod
    def _open(
        cls,
        directory: Path,
        manifest: dict[str, Any],
        hashes: FileHashes,
        providers: Sequence[str] | None,
        runtime: str,
        huge_pages: bool,
        stop_spinning: bool,
        environment: Environment | None,
    ) -> Engine:
        io = read_io(directory, manifest)
        check_spec_against_io(directory, manifest, io)
        # A graph with a fixed cache (target tensorrt) holds at most io.capacity positions.
        max_positions = min(read_max_positions(directory, manifest), io.capacity or 1 << 62)
        config = directory / GENERATION_CONFIG
        settings = generation_settings(
            read_json_object(config, missing_ok=True), manifest.get("spec"), source=str(config)
        )
        if providers is not None and runtime != "auto":
            raise GenerationError(f"pass providers or runtime {runtime!r}, not both")
        choice = (
            Choice("ort")
            if providers is not None
            else choose(runtime, manifest, environment or Environment.detect(), str(directory))
        )
        engine = cls(
            open_session(
                directory,
                manifest,
                io,
                choice,
                huge_pages=huge_pages,
                stop_spinning=stop_spinning,
                providers=providers,
                hashes=hashes,
            ),
            TokenizerBundle.load(directory),
            max_positions=max_positions,
            eos_ids=settings.eos_ids,
            pad_id=settings.pad_id,
            defaults=settings.defaults,
            max_new_tokens=settings.max_new_tokens,
        )
        engine.directory = directory
        return engine

    def sampling(self, **overrides: Any) -> SamplingParams:
        """Generation defaults of the artifact with the given fields replaced (None = keep)."""
        unknown = sorted(set(overrides) - _SAMPLING_FIELDS)
        if unknown:
            raise GenerationError(
                f"unknown sampling option {unknown[0]!r}; use one of {', '.join(sorted(_SAMPLING_FIELDS))}"
            )
        params = replace(self.defaults, **{k: v for k, v in overrides.items() if v is not None})
        params.validate()
        return params

    def budget(self, max_new_tokens: int | None, prompts: Sequence[Sequence[int]] = ()) -> int:
        """The number of new tokens to allow: the artifact's default when None, cut to what the
        context leaves after the longest of `prompts` (as the server does); a budget asked for
        is kept, and one that does not fit is refused by `check_length`."""
        budget = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:
            raise GenerationError(f"max_new_tokens must be an integer >= 1 (None for the default), got {budget!r}")
        left = self.max_positions - max((len(p) for p in prompts), default=0)
        if max_new_tokens is None and left >= 1:
            return min(int(budget), left)
        return int(budget)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of a prompt; an empty prompt, or one with no tokens, is refused."""
        if not isinstance(prompt, str):
            raise GenerationError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise GenerationError(
                "prompt is empty; pass some text (for unconditional generation, call generate_tokens with [bos_id])"
            )
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise GenerationError(f"prompt {_preview(prompt)} encodes to no tokens; pass text the tokenizer keeps")
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation (`{"role": ..., "content": ...}` messages) rendered with the
        artifact's chat template, ending with the header of the assistant's turn."""
        text = self.tokenizer.apply_chat_template(messages)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise GenerationError(f"chat prompt {_preview(text)} encodes to no tokens; pass text the tokenizer keeps")
        return ids

    def compile_grammar(
        self,
        *,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
    ) -> Grammar | None:
        """A structured-output constraint compiled for this artifact's tokenizer (None when none is given);
        GrammarError names what does not compile."""
        if json_schema is None and regex is None and grammar is None:
            return None
        return self._compiler().compile(json_schema=json_schema, regex=regex, grammar=grammar)

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token stands for (a byte-level token may hold part of a character)."""
        return self._compiler().tokenizer.decode_bytes([int(token)])

    def _compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            from kvforge.runners.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.session.io.vocab_size, self.eos_ids)
        return self._grammars

    def decoder(
        self, params: SamplingParams, prompt: Sequence[int], grammar: Grammar | None = None, logprobs: int | None = None
    ) -> Decoder:
        """One request's (or one choice's) token chooser: repetition penalty, grammar mask, sampler."""
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, numbers.Integral)):
            raise GenerationError(f"logprobs must be an integer number of top tokens (or None), got {logprobs!r}")
        masks = []
        if grammar is not None:
            assert self._grammars is not None  # compile_grammar made it
            masks.append(self._grammars.mask(grammar))
        return Decoder(params, prompt, processors=masks, logprobs=None if logprobs is None else int(logprobs))

    def _encode_row(self, row: int, prompt: str | Sequence[Mapping[str, str]], chat: bool, single: bool) -> list[int]:
        conversation = isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes, bytearray))
        try:
            return self.encode_chat(prompt) if conversation else self.encode(prompt, chat)  # type: ignore[arg-type]
        except GenerationError as e:
            if single:
                raise
            raise GenerationError(f"prompts[{row}]: {e}") from e

    def request(self, prompt: str | Sequence[Mapping[str, str]], **options: Any) -> GenerationRequest:
        """The request record of one prompt (`kvforge.runners.request`), every value checked: what `stream`
        runs, as the server builds one for each choice. Unset options take the artifact's defaults:

        `prompt` is text, or a conversation (a list of `{"role": ..., "content": ...}` messages)
        that the artifact's chat template renders, as `chat=True` renders one user message.
        `max_new_tokens` bounds the new tokens (default: the artifact's budget, cut to what the
        context leaves after the prompt); `stop` strings end the text (never part of it);
        `chat` formats the prompt with the tokenizer's chat template. `logprobs` = k records each
        token's log-probability under the model (before temperature, top-k/top-p and masks) and its
        k most likely alternatives. `json_schema`, `regex` or `grammar` (Lark) constrain the text
        to that language, and the text ends when it is complete. `sampling`: temperature, top_k,
        top_p, min_p, repetition_penalty, seed (`SamplingParams`)."""
        return self._requests([prompt], True, **options)[0]

    def _requests(
        self,
        prompts: Sequence[str | Sequence[Mapping[str, str]]],
        single: bool,
        *,
        batch: bool = False,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        chat: bool = False,
        logprobs: int | None = None,
        json_schema: Mapping[str, Any] | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        **sampling: Any,
    ) -> list[Request]:
        """One record per prompt, each check made once. With `batch`, rows without a grammar or
        logprobs draw from one generator (`batch_decoders`: the same seed, the same tokens whatever
        the rows are run as)."""
        params = self.sampling(**sampling)
        encoded = [self._encode_row(row, p, chat, single) for row, p in enumerate(prompts)]
        budget = self.budget(max_new_tokens, encoded)
        check_length(encoded, budget, self.max_positions)
        detoks = [self.tokenizer.detokenizer(stop, context_ids=ids) for ids in encoded]  # refuses bad stop strings
        compiled = self.compile_grammar(json_schema=json_schema, regex=regex, grammar=grammar)
        if batch and compiled is None and logprobs is None:
            decoders = batch_decoders(params, encoded)
        else:
            decoders = [self.decoder(params, ids, compiled, logprobs) for ids in encoded]
        return [
            Request(ids, params, budget, detok, eos_ids=self.eos_ids, decoder=decoder)
            for ids, detok, decoder in zip(encoded, detoks, decoders)
        ]

    def stream(
        self,
        prompt: str | Sequence[Mapping[str, str]] | GenerationRequest,
        *,
        speculative: str | None = None,
        draft_tokens: int | None = None,
        **options: Any,
    ) -> TextStream:
        """Stream the generated text (not the prompt) as it is produced.

        `prompt` is text or a conversation with the `options` of `request`, or a record `request`
        made, run as it is. With logprobs asked for, the stream's `logprobs` gains an entry per token of the text.

        `speculative` ("prompt-lookup" or "draft:PATH") generates with exact speculative
        decoding (`kvforge.runners.speculative`), up to `draft_tokens` drafted tokens per target step
        (default 8): the same tokens as without, fewer target steps; the stream's
        `stats.speculation` says how many drafts were accepted.

        Everything about the request is checked here, before the first chunk is asked for.
        """
        speculation = self.speculation(speculative, draft_tokens)
        if isinstance(prompt, GenerationRequest):
            if options:
                raise GenerationError(f"a request record carries its own options; got {', '.join(sorted(options))} too")
            request = prompt
        else:
            request = self.request(prompt, **options)
        stream = TextStream(iter(()), GenerationStats(prompt_tokens=len(request.ids)), request.logprobs)
        if speculation is not None:
            stream.stats.speculation = SpeculationStats()
        stream._chunks = self._stream_chunks(request, stream.stats, speculation)
        return stream

    def _stream_chunks(
        self, request: GenerationRequest, stats: GenerationStats, speculation: Speculation | None
    ) -> Iterator[str]:
        start = time.perf_counter()
        record = request if isinstance(request, Request) else _as_request(request)
        record.speculation = stats.speculation
        for events in self._run([record], speculation):
            if stats.new_tokens == 0 and record.generated:
                stats.first_token_s = time.perf_counter() - start
            stats.new_tokens = record.generated
            for event in events[0]:
                if isinstance(event, Delta) and event.text:
                    yield event.text
                elif isinstance(event, Finished):
                    stats.finish_reason = event.reason
        stats.total_s = time.perf_counter() - start

    def _run(self, requests: list[Request], speculation: Speculation | None = None) -> Iterator[list[list[Event]]]:
        """Generate `requests` as the engine core's batch, stepped here (`run_inline`)."""
        return run_inline(
            self.session, requests, max_positions=self.max_positions, eos_ids=self.eos_ids, speculation=speculation
        )

    def speculation(self, speculative: str | None, draft_tokens: int | None) -> Speculation | None:
        """What `speculative` and `draft_tokens` ask for, checked against this artifact (None: plain decoding);
        a draft artifact is loaded (once) and its tokenizer compared with this one's."""
        kind, k = parse_speculative(speculative, draft_tokens)
        if kind is None:
            return None
        require_all_logits(self.session.io, self.directory)
        if kind == PROMPT_LOOKUP:
            return Speculation(k)
        path = kind.removeprefix("draft:")
        if path not in self._drafts:
            draft = Engine.load(path, huge_pages=False, stop_spinning=True)
            check_same_vocabulary(
                self.tokenizer.tokenizer.get_vocab(with_added_tokens=True),
                draft.tokenizer.tokenizer.get_vocab(with_added_tokens=True),
                path,
            )
            if draft.session.io.vocab_size != self.session.io.vocab_size:
                raise GenerationError(
                    f"draft model {path}: its logits have {draft.session.io.vocab_size} entries and the target's "
                    f"{self.session.io.vocab_size}; use a draft artifact with the target's vocabulary"
                )
            self._drafts[path] = DraftModel(draft.session, draft.max_positions, path)
        return Speculation(k, self._drafts[path])

    def generate_tokens(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None, **sampling: Any
    ) -> list[list[int]]:
        """Token ids in, new token ids out (an eos id ends a row and is included), as one batch."""
        params = self.sampling(**sampling)
        batch = [self._checked_ids(row, p) for row, p in enumerate(prompts)]
        budget = self.budget(max_new_tokens, batch)
        check_length(batch, budget, self.max_positions)
        requests = token_requests(batch, budget, batch_decoders(params, batch), self.eos_ids)
        for _ in self._run(requests):
            pass
        return [r.tokens + ([] if r.ending_eos is None else [r.ending_eos]) for r in requests]

    def _checked_ids(self, row: int, prompt: Sequence[int]) -> list[int]:
        """Prompt ids as ints inside the vocabulary: an id outside it would index past the embedding."""
        vocab = self.session.io.vocab_size
        ids: list[int] = []
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < vocab:
                raise GenerationError(f"prompt {row} holds token id {token!r}, outside the vocabulary [0, {vocab})")
            ids.append(int(token))
        return ids

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        speculative: str | None = None,
        draft_tokens: int | None = None,
        **options: Any,
    ) -> str | list[str] | Completion | list[Completion]:
        """Generate for one prompt, or for several as one batch (each prompt prefilled alone, then decoded together).

        Returns the text (a list of texts for a list of prompts); with `logprobs` = k, a
        `Completion` per prompt instead, with the text's tokens, their log-probabilities
        under the model and the k most likely alternatives of each. `options` are those of
        `request`, for every row; `speculative` and `draft_tokens` ask for speculative decoding
        as in `stream` (rows then run one after another).
        """
        single = isinstance(prompts, str)
        if not single and (isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence)):
            raise GenerationError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        speculation = self.speculation(speculative, draft_tokens)
        requests = self._requests(batch, single, batch=True, **options)
        texts = [""] * len(batch)
        for events in self._run(requests, speculation):
            for row, got in enumerate(events):
                texts[row] += "".join(event.text for event in got if isinstance(event, Delta))
        if options.get("logprobs") is None:
            return texts[0] if single else texts
        results = [
            Completion(text, r.tokens, r.logprobs, r.finish_reason or "length") for text, r in zip(texts, requests)
        ]
        return results[0] if single else results


_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class GenerationSettings:
    """What the artifact's generation_config.json says, checked."""

    eos_ids: tuple[int, ...]
    pad_id: int
    defaults: SamplingParams
    max_new_tokens: int


def generation_settings(
    generation: Mapping[str, Any], spec: object = None, source: str = GENERATION_CONFIG
) -> GenerationSettings:
    """Read eos/pad ids, sampling defaults and the token budget; ArtifactError names a bad field.

    The file comes with the artifact, which may be untrusted: a wrong type must be a clear
    error at load, not a TypeError in the middle of a request.
    """
    eos = generation.get("eos_token_id")
    if eos is None and isinstance(spec, Mapping):
        eos = spec.get("eos_token_ids")
    eos_ids = _id_list(eos, "eos_token_id", source)
    pad = generation.get("pad_token_id")
    pad_id = _token_id(pad, "pad_token_id", source) if pad is not None else (eos_ids[0] if eos_ids else 0)
    try:
        defaults = sampling_defaults(generation)
        defaults.validate()
    except (GenerationError, TypeError, ValueError, OverflowError) as e:
        raise ArtifactError(f"{source}: invalid sampling defaults ({e}); fix the file or rebuild the artifact") from e
    budget = generation.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ArtifactError(
            f"{source}: max_new_tokens must be a positive integer, got {_preview(budget)}; "
            "fix the file or rebuild the artifact"
        )
    return GenerationSettings(tuple(eos_ids), pad_id, defaults, budget)


def _id_list(value: object, field: str, source: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [_token_id(v, field, source) for v in value]
    return [_token_id(value, field, source)]


def _token_id(value: object, field: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ArtifactError(
            f"{source}: {field} must be a token id (an integer >= 0) or a list of them, got "
            f"{_preview(value)}; fix the file or rebuild the artifact"
        )
    return value


def sampling_defaults(generation: Mapping[str, Any]) -> SamplingParams:
    """HF generation_config semantics: greedy unless do_sample is true; null means the default.

    Every field is type-checked whether or not do_sample uses it: a file that says
    `temperature: "hot"` is broken, not merely unused.
    """

    def get(key: str, default: Any, integral: bool = False) -> Any:
        value = generation.get(key)
        if value is None:
            return default
        kind = numbers.Integral if integral else numbers.Real
        if isinstance(value, bool) or not isinstance(value, kind):
            raise GenerationError(f"{key} must be {'an integer' if integral else 'a number'}, got {_preview(value)}")
        return value

    do_sample = generation.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise GenerationError(f"do_sample must be true or false, got {_preview(do_sample)}")
    read = [s for s in declared(SamplingParams) if s.generation_config]  # kvforge.runners.settings
    given = {s.name: s.kind(get(s.name, s.default, s.kind is int)) for s in read}
    kept = {s.name: given[s.name] for s in read if s.kept_when_greedy}  # logits processors, not samplers
    return SamplingParams(**given) if do_sample else SamplingParams(temperature=0.0, **kept)


def _preview(value: object, limit: int = 60) -> str:
    """repr for a message, cut short: prompts and hostile config values can be long."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_request(record: GenerationRequest) -> Request:
    """A record made elsewhere as the core's request, its state carried over."""
    request = Request(**{f.name: getattr(record, f.name) for f in fields(GenerationRequest)})
    return request
