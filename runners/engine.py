"""`Engine`: a compiled artifact, its tokenizer and generation defaults, ready to generate.

    engine = Engine.load("./out")
    for chunk in engine.stream("def fibonacci(n):", max_new_tokens=64):
        print(chunk, end="", flush=True)

Needs only onnxruntime, tokenizers, jinja2 and numpy: no torch at run time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from runners.contract import DecoderIO
from runners.errors import ArtifactError
from runners.generate import Step, check_length, generate_steps
from runners.manifest import read_manifest, verify_files
from runners.sampling import SamplingParams, make_rng
from runners.session import OrtSession, Session
from runners.tokenizer import TokenizerBundle

MODEL_FILE = "model.onnx"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_s: float = 0.0  # from the call to the first generated token
    total_s: float = 0.0
    finish_reason: str = "length"  # "stop" (eos or stop string) or "length"

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second of decoding (prefill excluded)."""
        decode_s = self.total_s - self.first_token_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0


@dataclass
class TextStream:
    """Iterator of text chunks; `stats` is complete once iteration ends."""

    _chunks: Iterator[str]
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __iter__(self) -> Iterator[str]:
        return self._chunks

    def __next__(self) -> str:
        return next(self._chunks)


class Engine:
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

    @classmethod
    def load(cls, directory: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",)) -> Engine:
        """Open an artifact after checking every file against its manifest."""
        directory = Path(directory)
        manifest = read_manifest(directory)
        verify_files(directory, manifest)
        io = DecoderIO.from_dict(manifest["io"])
        spec = manifest.get("spec", {})
        generation = _read_json(directory / GENERATION_CONFIG)
        eos = generation.get("eos_token_id", spec.get("eos_token_ids", []))
        pad = generation.get("pad_token_id")
        return cls(
            OrtSession(directory / MODEL_FILE, io, providers),
            TokenizerBundle.load(directory),
            max_positions=int(spec["max_positions"]),
            eos_ids=[eos] if isinstance(eos, int) else list(eos or []),
            pad_id=int(pad) if pad is not None else (int(eos[0]) if isinstance(eos, list) and eos else 0),
            defaults=sampling_defaults(generation),
            max_new_tokens=int(generation.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
        )

    def sampling(self, **overrides: Any) -> SamplingParams:
        """Generation defaults of the artifact with the given fields replaced (None = keep)."""
        params = replace(self.defaults, **{k: v for k, v in overrides.items() if v is not None})
        params.validate()
        return params

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def stream(
        self,
        prompt: str,
        *,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        chat: bool = False,
        **sampling: Any,
    ) -> TextStream:
        """Stream the generated text (not the prompt) as it is produced."""
        params = self.sampling(**sampling)
        ids = self.encode(prompt, chat)
        budget = max_new_tokens or self.max_new_tokens
        check_length([ids], budget, self.max_positions)  # before any work
        stats = GenerationStats(prompt_tokens=len(ids))
        return TextStream(self._stream_chunks(ids, budget, stop, params, stats), stats)

    def _stream_chunks(
        self, ids: list[int], budget: int, stop: Sequence[str], params: SamplingParams, stats: GenerationStats
    ) -> Iterator[str]:
        start = time.perf_counter()
        detok = self.tokenizer.detokenizer(stop, context_ids=ids)
        done = np.zeros(1, dtype=bool)
        for step in self._steps([ids], budget, params, done):
            token = int(step.tokens[0])
            stats.new_tokens += 1
            if stats.new_tokens == 1:
                stats.first_token_s = time.perf_counter() - start
            if token in self.eos_ids:
                stats.finish_reason = "stop"
                break
            chunk = detok.add(token)
            if chunk:
                yield chunk
            if detok.stopped:
                stats.finish_reason = "stop"
                done[0] = True
        tail = detok.finish()
        stats.total_s = time.perf_counter() - start
        if tail:
            yield tail

    def _steps(self, prompts: list[list[int]], budget: int, params: SamplingParams, done: np.ndarray) -> Iterator[Step]:
        return generate_steps(
            self.session,
            prompts,
            max_new_tokens=budget,
            max_positions=self.max_positions,
            params=params,
            rng=make_rng(params.seed),
            eos_ids=self.eos_ids,
            pad_id=self.pad_id,
            done=done,
        )

    def generate_tokens(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None, **sampling: Any
    ) -> list[list[int]]:
        """Token ids in, new token ids out (an eos id ends a row and is included), as one batch."""
        params = self.sampling(**sampling)
        rows: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), dtype=bool)
        for step in self._steps([list(p) for p in prompts], max_new_tokens or self.max_new_tokens, params, done):
            for row in np.flatnonzero(step.active):
                rows[row].append(int(step.tokens[row]))
        return rows

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        max_new_tokens: int | None = None,
        stop: Sequence[str] = (),
        chat: bool = False,
        **sampling: Any,
    ) -> str | list[str]:
        """Generate for one prompt, or for several as one left-padded batch."""
        single = isinstance(prompts, str)
        batch = [prompts] if isinstance(prompts, str) else list(prompts)
        params = self.sampling(**sampling)
        encoded = [self.encode(p, chat) for p in batch]
        budget = max_new_tokens or self.max_new_tokens
        check_length(encoded, budget, self.max_positions)
        detoks = [self.tokenizer.detokenizer(stop, context_ids=ids) for ids in encoded]
        texts = [""] * len(batch)
        done = np.zeros(len(batch), dtype=bool)
        for step in self._steps(encoded, budget, params, done):
            for row in np.flatnonzero(step.active):
                token = int(step.tokens[row])
                if token in self.eos_ids:
                    continue
                texts[row] += detoks[row].add(token)
                done[row] |= detoks[row].stopped
        texts = [t + d.finish() for t, d in zip(texts, detoks)]
        return texts[0] if single else texts


def sampling_defaults(generation: Mapping[str, Any]) -> SamplingParams:
    """HF generation_config semantics: greedy unless do_sample is true."""
    if not generation.get("do_sample", False):
        return SamplingParams(temperature=0.0, repetition_penalty=float(generation.get("repetition_penalty", 1.0)))
    return SamplingParams(
        temperature=float(generation.get("temperature", 1.0)),
        top_k=int(generation.get("top_k") or 0),
        top_p=float(generation.get("top_p", 1.0)),
        min_p=float(generation.get("min_p") or 0.0),
        repetition_penalty=float(generation.get("repetition_penalty", 1.0)),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}); rebuild the artifact") from e
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: expected a JSON object; rebuild the artifact")
    return data
