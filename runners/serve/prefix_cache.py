"""The server's prefix cache: the KV of prompt prefixes already computed, in blocks of 16 tokens.

A block's key is a hash chain: ``key_i = blake2b(key_{i-1} + ids of block i)``, seeded with the
artifact's identity (the digest of its manifest), so a block stands for its whole prefix and no
key can match across artifacts. After a prefill, every full block of the prompt is stored, and
its trailing partial block (its last ``len % 16`` ids) too, under the same chain: a block is a
child of the key before it and holds 1 to 16 ids.

The block a stored prompt ends with keeps that prompt's last logits too.

A request walks its prompt's chain block by block while a full block's key is found; where the
next full block is not found (or not needed whole), it takes the child of the last key found that
shares the longest run of ids with what follows, and copies that many of its columns. So every
cached position is restored, down to a prompt that repeats or extends one seen before, or shares
only part of a block with it; only the rest is prefilled. A prompt restored whole, its last
block's logits kept, needs no prefill (its first token is sampled from them); otherwise at least
its last token is prefilled, whose logits choose the first generated token. A stored partial
block whose ids another child of the same key extends is dropped (the longer child serves both).

Blocks are evicted least recently used within a byte budget (a partial block weighs its columns);
a prefix's first blocks are touched last, so its tail goes first and a lookup never finds a
chain with a hole before it.

A layer bounded by a sliding window or a fixed-size layer state (a convolution) sums up its whole
history in a form that a block prefix cannot rebuild: such artifacts get no prefix cache
(`unsupported`).
"""

from __future__ import annotations

import collections
import dataclasses
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


@dataclasses.dataclass
class _Block:
    """A cached block: the key before it, its 1 to 16 ids, their KV by cache name, and where a
    stored prompt ended with it, that prompt's last logits ([1, 1, vocab])."""

    parent: bytes
    ids: tuple[int, ...]
    kv: dict[str, Any]
    logits: np.ndarray | None = None

    @property
    def size(self) -> int:
        return sum(map(nbytes, self.kv.values())) + (0 if self.logits is None else self.logits.nbytes)


def _key(parent: bytes, ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share."""
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


class PrefixCache:
    """Blocks of prompt KV keyed by hash chain, LRU-evicted within `budget` bytes.

    Used by the engine thread only. `restore` copies the longest cached prefix into a prefill
    buffer; `store` copies a prefilled prompt's blocks (the last one partial) out of it.
    """

    def __init__(self, budget: int, identity: bytes, names: Sequence[str], metrics: Metrics) -> None:
        if budget < 0:
            raise KvforgeError(f"prefix cache budget must be >= 0 bytes, got {budget}")
        self.budget = budget
        self.identity = identity
        self.names = tuple(names)
        self.metrics = metrics
        self.bytes = 0
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()
        # parent key -> first id -> the keys of its children starting with that id
        self._children: dict[bytes, dict[int, set[bytes]]] = {}
        self.logits: np.ndarray | None = None  # the last `restore`'s, where it restored a whole prompt

    def _chain(self, ids: Sequence[int]) -> list[tuple[bytes, bytes, tuple[int, ...]]]:
        """(parent, key, ids) of each block of `ids`, the last one partial when len % 16."""
        chain, parent = [], self.identity
        for start in range(0, len(ids), BLOCK):
            chunk = tuple(int(i) for i in ids[start : start + BLOCK])
            key = _key(parent, chunk)
            chain.append((parent, key, chunk))
            parent = key
        return chain

    def _best_child(self, parent: bytes, wanted: Sequence[int]) -> tuple[bytes | None, int]:
        """The child of `parent` sharing the longest run of leading ids with `wanted`, and that run."""
        best, most = None, 0
        for key in self._children.get(parent, {}).get(int(wanted[0]), ()):
            shared = _shared(self._blocks[key].ids, wanted)
            if shared > most:
                best, most = key, shared
        return best, most

    def restore(self, ids: Sequence[int], cache: Cache) -> int:
        """Copy the longest cached prefix of `ids` into columns [0, n) of `cache`'s [1, heads,
        positions, dim] buffers, where it lives; returns n. n is the whole prompt only where the
        prompt was stored whole before, its last logits with it (then `logits`); otherwise at
        least the last token is left to prefill, whose logits choose the first token."""
        hit, parent = 0, self.identity
        used: list[bytes] = []
        self.logits = None
        while hit < len(ids):
            wanted = ids[hit : hit + BLOCK]
            key: bytes | None = _key(parent, wanted) if len(wanted) == BLOCK else None
            count = BLOCK
            if key not in self._blocks:
                key, count = self._best_child(parent, wanted)
            if key is None:
                break
            block = self._blocks[key]
            for name in self.names:
                kv = block.kv[name] if count == len(block.ids) else columns(cache.device, block.kv[name], 0, count)
                write_columns(cache, name, kv, hit)
            used.append(key)
            hit += count
            if hit == len(ids) and count == len(block.ids) and block.logits is not None:
                self.logits = block.logits.copy()  # a copy: sampling may change what it is given
            if count < BLOCK:
                break
            parent = key
        if hit == len(ids) and self.logits is None:  # the last token is prefilled over what was written
            hit -= 1
        for key in reversed(used):  # the prefix's first blocks the most recently used
            self._blocks.move_to_end(key)
        if hit:
            self.metrics.prefix_cache_hits.inc()
            self.metrics.prefix_cache_hit_tokens.inc(hit)
        self.metrics.prefix_cache_queries.inc(len(ids))
        return hit

    def store(self, ids: Sequence[int], cache: Cache, logits: np.ndarray | None = None) -> None:
        """Keep every block of a prefilled prompt (its KV in columns [0, len(ids)) of `cache`), its
        last one partial when len % 16, copied where the cache lives; with `logits` (its last
        position's, [1, 1, vocab]) the last block keeps them, so the same prompt again needs no
        prefill at all."""
        chain = self._chain(ids)
        for index in reversed(range(len(chain))):
            parent, key, chunk = chain[index]
            final = None if logits is None or index < len(chain) - 1 else np.array(logits)
            kept = self._blocks.get(key)
            if kept is None:
                longer = self._extending(parent, chunk)
                if longer is not None:  # a longer block serves these ids (not the logits)
                    self._blocks.move_to_end(longer)
                    continue
                kv = {name: columns(cache.device, cache[name], index * BLOCK, len(chunk)) for name in self.names}
                block = _Block(parent, chunk, kv, final)
            elif final is None or kept.logits is not None:
                self._blocks.move_to_end(key)
                continue
            else:  # a block stored before gains the logits of a prompt that ends with it
                block = _Block(parent, chunk, kept.kv, final)
            if block.size > self.budget:
                break
            if kept is not None:
                self._drop(key)
            for shorter in self._extended(parent, chunk):
                self._drop(shorter)
            while self.bytes + block.size > self.budget:
                self._drop(next(iter(self._blocks)))
                self.metrics.prefix_cache_evictions.inc()
            self._blocks[key] = block
            self._children.setdefault(parent, {}).setdefault(chunk[0], set()).add(key)
            self.bytes += block.size
        self.metrics.prefix_cache_bytes.set(self.bytes)

    def _extending(self, parent: bytes, chunk: tuple[int, ...]) -> bytes | None:
        """A child of `parent` whose ids start with `chunk` (so it serves `chunk` too), if any."""
        key, shared = self._best_child(parent, chunk)
        return key if shared == len(chunk) else None

    def _extended(self, parent: bytes, chunk: tuple[int, ...]) -> list[bytes]:
        """The children of `parent` whose ids are a shorter start of `chunk` (`chunk` serves them)."""
        siblings = self._children.get(parent, {}).get(chunk[0], ())
        return [key for key in siblings if chunk[: len(self._blocks[key].ids)] == self._blocks[key].ids]

    def _drop(self, key: bytes) -> None:
        block = self._blocks.pop(key)
        self.bytes -= block.size
        siblings = self._children[block.parent]
        siblings[block.ids[0]].discard(key)
        if not siblings[block.ids[0]]:
            del siblings[block.ids[0]]
            if not siblings:
                del self._children[block.parent]

    def __len__(self) -> int:
        return len(self._blocks)
