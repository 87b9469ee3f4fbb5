"""The pieces of a step over a `Session` (`forward`, `prefill`, the length and logits checks,
`choose_tokens`), which the engine core (`kvforge.runners.core`) puts together for everything
that generates.

Prompts of different lengths are left-padded into one batch (`left_pad`); the attention mask
marks padding, and position ids count only real tokens, so each row sees exactly what it would
see alone. Each step's present tensors are fed back as the next step's past: in the
contract's `shared` mode they are the same preallocated buffers, written in place; a layer
bounded by a sliding window keeps only its present's last window - 1 positions.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from kvforge.runners.cache import HOST, Cache, Device, on_host, shape_of
from kvforge.runners.contract import KEEP_INPUT, DecoderIO
from kvforge.runners.decoding import Decoder, TokenLogprob
from kvforge.runners.errors import GenerationError
from kvforge.runners.session import Session


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Input ids and attention mask for a left-padded batch."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise GenerationError("every prompt must encode to at least one token; got an empty prompt")
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def position_ids(mask: np.ndarray, seq: int) -> np.ndarray:
    """Positions of the last `seq` columns: the count of real tokens before each (pads get 0)."""
    positions = np.cumsum(mask, axis=1) - 1
    return np.maximum(positions[:, -seq:], 0).astype(np.int64)


def empty_cache(io: DecoderIO, batch: int, capacity: int, device: Device = HOST) -> Cache:
    """The cache before the first step (`Cache.empty`) on `device`, with room for `capacity` positions:
    the prompt and every token to be generated. A graph with a fixed capacity (`io.capacity`) holds
    at most that many."""
    return Cache.empty(io, batch, capacity, device)


def forward(
    session: Session,
    input_ids: np.ndarray,
    mask: np.ndarray,
    cache: Mapping[str, Any],
    extra: int = 0,
    every_position: bool = False,
) -> tuple[np.ndarray, Cache]:
    """Run one step; returns the logits and the cache for the next step (`Cache.after`: a layer
    bounded by its window keeps its present's last window - 1 positions, and `extra` more), on
    the cache's device (a plain mapping of numpy arrays: the host). The logits are the last
    position's, or with `every_position` every position's (a speculative verify step), where the
    graph takes `logits_to_keep`; a graph without it returns what its contract says."""
    feeds = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids(mask, input_ids.shape[1])}
    if session.io.keeps_logits:
        feeds[KEEP_INPUT] = np.array([input_ids.shape[1] if every_position else 1], dtype=np.int64)
    feeds.update(cache)
    outputs = session.run(feeds)
    check_logits(outputs["logits"], input_ids.shape[0], session.io.vocab_size)
    # a plain mapping is a cache its caller holds on the host: it comes back there
    current = cache if isinstance(cache, Cache) else Cache(session.io, cache, HOST)
    return outputs["logits"], current.after(outputs, extra)


def check_length(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_positions: int) -> None:
    """Refuse a request that cannot fit, before any work: every check the model would fail late.

    The KV cache holds at most ``max_positions`` positions (prompt plus generated tokens),
    so a prompt that fills it, or a budget that would overflow it, is an error rather
    than a silent truncation.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise GenerationError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if len(prompts) == 0:
        raise GenerationError("no prompts given; pass at least one prompt")
    for row, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise GenerationError(
                f"prompt {row} is empty (it encodes to no tokens); pass some text, or token ids such as [bos_id]"
            )
    longest = max(len(p) for p in prompts)
    if longest >= max_positions:
        raise GenerationError(
            f"prompt of {longest} tokens exceeds the model's context of {max_positions} positions, which must also "
            "hold at least one new token; shorten the prompt"
        )
    if longest + max_new_tokens > max_positions:
        raise GenerationError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} exceeds the "
            f"model's context of {max_positions} positions (the KV cache's capacity); shorten the prompt or lower "
            "--max-new-tokens"
        )


def check_logits(logits: Any, rows: int, vocab_size: int) -> None:
    """Refuse logits that are not [rows, positions, vocab] floats: an artifact that does not match its manifest."""
    shape = shape_of(logits)
    floats = not on_host(logits) or np.issubdtype(logits.dtype, np.floating)
    if len(shape) != 3 or shape[0] != rows or shape[1] == 0 or shape[2] != vocab_size or not floats:
        dtype = f" and dtype {logits.dtype}" if on_host(logits) else ""
        raise GenerationError(
            f"the session returned logits of shape {shape}{dtype}, expected [{rows}, positions, {vocab_size}] floats; "
            "the artifact does not match its manifest, rebuild it"
        )


def invalid_rows(last: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """What is wrong with which rows of [batch, vocab] logits no token may be sampled from:
    (problem, bool [batch]) pairs, none when every row is fine. A -inf logit alone is fine
    (that token cannot be chosen); NaN, +inf, or a row of -inf only is not."""
    # One pass when all is well (a sum is NaN or infinite if any logit is), the details only
    # on failure; a sum that merely overflows finds no problem below and passes.
    if np.isfinite(last.sum()):
        return []
    problems = (
        ("contain NaN", np.asarray(np.isnan(last).any(axis=-1))),
        ("contain +inf", np.asarray(np.isposinf(last).any(axis=-1))),
        ("are all -inf", np.asarray(np.isneginf(last).all(axis=-1))),
    )
    return [(problem, rows) for problem, rows in problems if rows.any()]


def prefill(
    session: Session,
    ids: np.ndarray,
    mask: np.ndarray,
    cache: Mapping[str, Any],
    *,
    chunk: int | None = None,
    start: int = 0,
) -> Iterator[tuple[int, np.ndarray, Cache]]:
    """Feed columns [start, width) of a left-padded batch into `cache`, `chunk` columns per call
    (all in one call when None); yields after each call the columns fed so far, that call's
    logits and the cache after it. `start` > 0 continues a cache that already holds the first
    `start` columns (a restored prefix). The caller may stop between chunks.

    onnxruntime's GroupQueryAttention takes several new tokens over a non-empty cache only at
    batch 1: chunks after the first need a batch of one on the ort-cpu target.
    """
    width = ids.shape[1]
    if chunk is not None and chunk < 1:
        raise GenerationError(f"prefill chunk must be at least 1 token, got {chunk}")
    if not 0 <= start < width:
        raise GenerationError(f"prefill must feed at least one of the prompt's {width} columns, asked from {start}")
    size = width - start if chunk is None else chunk
    for begin in range(start, width, size):
        end = min(begin + size, width)
        logits, cache = forward(session, np.ascontiguousarray(ids[:, begin:end]), mask[:, :end], cache)
        yield end, logits, cache


def choose_tokens(
    decoders: Sequence[Decoder],
    last: np.ndarray,
    active: np.ndarray,
    pad_id: int,
    on_error: Callable[[int, Exception], None] | None = None,
) -> tuple[np.ndarray, tuple[TokenLogprob | None, ...]]:
    """Each active row's token from its decoder, handed back to it; `pad_id` for the others.

    A row whose decoder fails raises, or with `on_error` is reported to it and gets `pad_id`,
    so that one request's sampler or grammar cannot stop the others.
    """
    tokens = np.full(len(decoders), pad_id, dtype=np.int64)
    entries: list[TokenLogprob | None] = [None] * len(decoders)
    for row in map(int, np.flatnonzero(active)):
        decoder = decoders[row]
        try:
            tokens[row], entries[row] = decoder.take(last[row])
        except Exception as error:
            if on_error is None:
                raise
            tokens[row], entries[row] = pad_id, None
            on_error(row, error)
    return tokens, tuple(entries)
