"""The static scales of an int8 KV cache (`--kv-dtype int8`), calibrated on the eager model.

onnxruntime's `GroupQueryAttention` quantizes each new key and value with a scale fixed in the
graph, one per key/value head and channel (`kvforge.passes.kv_cache`). The build runs the eager model
(the gate's reference, still loaded) over windows of the calibration text kvforge ships
(`toolchain/data/calibration.txt`) and of tokens drawn from the vocabulary, and reads each layer's
cache:

- values: the channel's largest magnitude over the windows, over 127;
- keys: the cache holds them after the rotary embedding, which turns channel i and its partner
  (i + head_dim / 2) together through an angle that grows with the position. A key's magnitude
  in either channel is at most the norm of the pair, which the rotation does not change: so each
  channel's scale is the largest pair norm over the windows, over 127, and a position later than
  any the windows reach is not clipped for being rotated differently. (For a partial or
  interleaved rotary this bound is looser than it needs to be, never smaller.)

A position whose key or value is larger than any calibrated saturates at ±127. The gate judges the
result on its own texts, which calibration never reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.session import Session

WINDOW = 256  # tokens per calibration window
WINDOWS = 4
_CODE_MAX = 127
# Scales hold a key or value this much larger than the largest calibrated one without clipping
# (a context or token the windows did not reach), at this much coarser a step.
HEADROOM = 1.25


def calibrate(reference: Session, texts: Sequence[list[int]]) -> dict[str, np.ndarray]:
    """Each cache input's scale (`past_key_values.{i}.key|value` -> float32 [kv heads * channels]),
    from the reference's cache after a prefill of each token window in `texts`."""
    io = reference.io
    largest: dict[str, np.ndarray] = {}
    for ids in texts:
        tokens = np.asarray([ids], dtype=np.int64)
        _, cache = forward(reference, tokens, np.ones_like(tokens), empty_cache(io, 1, tokens.shape[1]))
        for name in io.cache_names:
            tensor = np.asarray(cache[name], dtype=np.float32)  # [1, kv heads, positions, channels]
            size = _pair_norms(tensor) if name.endswith(".key") else np.abs(tensor)
            peak = size.max(axis=(0, 2))  # [kv heads, channels]
            largest[name] = peak if name not in largest else np.maximum(largest[name], peak)
    tiny = np.finfo(np.float32).tiny
    return {
        name: (np.maximum(peak * HEADROOM, tiny) / _CODE_MAX).reshape(-1).astype(np.float32)
        for name, peak in largest.items()
    }


def _pair_norms(keys: np.ndarray) -> np.ndarray:
    """|(k_i, k_{i + d/2})| in both channels of each pair (a rotary embedding's rotation plane)."""
    half = keys.shape[-1] // 2
    first, second = keys[..., :half], keys[..., half : 2 * half]
    norms = np.sqrt(first * first + second * second)
    pairs = np.concatenate([norms, norms], axis=-1)
    if keys.shape[-1] % 2:  # an odd channel rotates with no partner
        pairs = np.concatenate([pairs, np.abs(keys[..., -1:])], axis=-1)
    return pairs


def windows(encoded: Sequence[int], vocab_size: int, count: int = WINDOWS, length: int = WINDOW) -> list[list[int]]:
    """Up to `count` windows of `length` tokens from the calibration text's ids, evenly spread, and
    as many of tokens drawn uniformly from the vocabulary (seeded): a text reaches only the tokens
    it holds, and a token it never holds may carry a larger key or value than any it does."""
    if len(encoded) <= length:
        text = [list(encoded)]
    else:
        starts = np.linspace(0, len(encoded) - length, num=count).astype(int)
        text = [list(encoded[s : s + length]) for s in dict.fromkeys(starts.tolist())]
    rng = np.random.default_rng(0)
    return text + [rng.integers(0, vocab_size, size=length).tolist() for _ in range(count)]
