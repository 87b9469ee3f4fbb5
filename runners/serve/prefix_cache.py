"""The server's prefix cache: the KV of prompt prefixes already computed, in blocks of 16 tokens.

A block's key is a hash chain: ``key_i = blake2b(key_{i-1} + ids of block i)``, seeded with the
artifact's identity (the digest of its manifest), so a block stands for its whole prefix and no
key can match across artifacts. A request looks up its prompt's blocks in order and stops at the
first miss; the blocks found are copied into its prefill buffer and only the rest of the prompt
is prefilled (always at least its last token, whose logits choose the first generated token).
After a prefill, every full block of the prompt is stored. Blocks are evicted least recently
used within a byte budget; a prefix's first blocks are touched last, so its tail goes first and
a lookup never finds a chain with a hole before it.

A layer bounded by a sliding window or a fixed-size layer state (a convolution) sums up its whole
history in a form that a block prefix cannot rebuild: such artifacts get no prefix cache
(`unsupported`).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvforge.runners.cache import Cache, bounded_names, columns, nbytes, write_columns
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import Metrics

BLOCK = 16


def default_budget() -> int:
    """A quarter of the memory available now (MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 4
    except OSError:
        pass
    import os

    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError):
        return 0


def unsupported(io: DecoderIO) -> str | None:
    """Why an artifact cannot have a prefix cache, or None when it can."""
    if bounded_names(io):
        return "its layers bounded by a sliding window cannot be rebuilt from a block prefix"
    if io.state_names:
        return "its fixed-size layer states (convolutions) cannot be rebuilt from a block prefix"
    return None


class PrefixCache:
    """Blocks of prompt KV keyed by hash chain, LRU-evicted within `budget` bytes.

    Used by the engine thread only. `restore` copies the longest cached prefix into a prefill
    buffer; `store` copies a prefilled prompt's full blocks out of it.
    """

    def __init__(self, budget: int, identity: bytes, names: Sequence[str], metrics: Metrics) -> None:
        if budget < 0:
            raise KvforgeError(f"prefix cache budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.identity = identity
        self.names = tuple(names)
        self.metrics = metrics
        self.bytes = 0
        self._blocks: collections.OrderedDict[bytes, dict[str, Any]] = collections.OrderedDict()

    def _keys(self, ids: Sequence[int], blocks: int) -> list[bytes]:
        keys, key = [], self.identity
        for block in range(blocks):
            chunk = np.asarray(ids[block * BLOCK : (block + 1) * BLOCK], dtype=np.int64).tobytes()
            key = hashlib.blake2b(key + chunk, digest_size=16).digest()
            keys.append(key)
        return keys

    def restore(self, ids: Sequence[int], cache: Cache) -> int:
        """Copy the longest cached block prefix of `ids` (leaving at least one token) into
        columns [0, n) of `cache`'s [1, heads, positions, dim] buffers, where it lives; returns n."""
        found: list[dict[str, Any]] = []
        for key in self._keys(ids, (len(ids) - 1) // BLOCK):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        for index, block in enumerate(found):
            for name in self.names:
                write_columns(cache, name, block[name], index * BLOCK)
        keys = self._keys(ids, len(found))
        for key in reversed(keys):  # the prefix's first blocks the most recently used
            self._blocks.move_to_end(key)
        hit = len(found) * BLOCK
        if hit:
            self.metrics.prefix_cache_hits.inc()
            self.metrics.prefix_cache_hit_tokens.inc(hit)
        self.metrics.prefix_cache_queries.inc(len(ids))
        return hit

    def store(self, ids: Sequence[int], cache: Cache) -> None:
        """Keep every full block of a prefilled prompt (its KV in columns [0, len(ids)) of `cache`),
        copied where the cache lives."""
        keys = self._keys(ids, len(ids) // BLOCK)
        for index in reversed(range(len(keys))):
            key = keys[index]
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            block = {name: columns(cache.device, cache[name], index * BLOCK, BLOCK) for name in self.names}
            size = sum(map(nbytes, block.values()))
            if size > self.budget:
                break
            while self.bytes + size > self.budget:
                _, evicted = self._blocks.popitem(last=False)
                self.bytes -= sum(map(nbytes, evicted.values()))
                self.metrics.prefix_cache_evictions.inc()
            self._blocks[key] = block
            self.bytes += size
        self.metrics.prefix_cache_bytes.set(self.bytes)

    def __len__(self) -> int:
        return len(self._blocks)
