"""The continuous batch's cache: one right-aligned, left-padded layout of every running row.

The batch lives in one KV buffer per past tensor, ``[slots, kv_heads, capacity, head_dim]``,
and one attention mask ``[slots, capacity]``. Every row is right-aligned at a shared width
``W``: row ``i`` holds its ``length_i`` cached positions in columns ``[W - length_i, W)``, the
columns before it are left padding (mask 0), and a decode step writes every row's new
position at column ``W``. This is exactly a left-padded batch, so each row attends to what it
would alone, and position ids count real tokens only.

- A row joins from a batch-1 cache (its prefill), copied in right-aligned at ``W`` (a prompt
  longer than ``W`` first shifts the batch right to make room); a row that leaves has the
  last row moved into its slot.
- A layer bounded by a sliding window (`DecoderIO.layer_windows`) keeps no column of the
  buffer: its cache is one array ``[rows, kv_heads, min(W, window - 1), head_dim]`` holding the
  last columns before ``W``, in the same layout, renewed by every step.
- Fixed-size layer states have one buffer ``[slots, ...]`` with no column axis; a row's state
  joins with it and moves with it; padding columns never reach a state.
- ``W`` grows with every step while rows come and go, so padding accumulates: when the padding
  every row shares (``W`` minus the longest row) reaches the longest row, or ``W`` reaches the
  capacity, the batch is shifted left by that amount (compaction). A row never holds more than
  the model's context, so the capacity stays bounded.
- Rows may grow by different amounts in one step (speculative decoding): the width grows by the
  largest growth, and a row that kept fewer positions leaves the rest of those columns masked
  out (holes). The mask alone says what a row attends to, so holes change nothing; compaction
  gathers each row's real columns when holes are in the way of a plain shift.

NumPy only: the scheduler runs the session over `feeds` and hands its outputs to `store`.
"""

from __future__ import annotations

import numpy as np

from kvforge.runners.cache import bounded_names, columns_fed, full_names, keep_columns
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import KvforgeError
from kvforge.runners.generate import empty_states

# Shared padding below this many columns is not worth a copy of the batch's cache.
MIN_COMPACTION = 16


class KVBatch:
    """The layout of every running row's cache, its mask and width; rows are indexed 0..rows-1."""

    def __init__(self, io: DecoderIO, *, max_rows: int, max_positions: int) -> None:
        self.io = io
        self.max_rows = max_rows
        # A graph with a fixed cache length takes buffers of exactly that length; otherwise
        # leave room past the context for the padding that builds up between compactions.
        self.fixed_capacity: int | None = io.capacity
        self.capacity_limit = self.fixed_capacity or max_positions + max(MIN_COMPACTION, max_positions // 4)
        self.full_names = full_names(io)
        self.lengths: list[int] = []  # positions cached, per row
        self.spans: list[int] = []  # columns from a row's first cached position to the width (length plus holes)
        self.width = 0
        self.compactions = 0  # times the batch was shifted left over shared padding
        self.mask = np.zeros((0, 0), dtype=np.int64)
        self._kv: dict[str, np.ndarray] = {}  # the layers that keep their whole history
        self._states: dict[str, np.ndarray] = {}  # [slots, ...] per fixed-size state
        self._bounded = self.empty_bounded()  # the window-bounded layers' last columns of every row
        self._views: tuple[int, dict[str, np.ndarray]] | None = None

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def room(self) -> int:
        """Columns a step may write after the one at the width."""
        return self.mask.shape[1] - self.width - 1

    def empty_bounded(self, rows: int = 0) -> dict[str, np.ndarray]:
        """The window-bounded layers' caches of `rows` rows holding no position."""
        return {
            name: np.zeros(self.io.kv_shape(name, rows, 0), dtype=self.io.kv_dtype) for name in bounded_names(self.io)
        }

    # -- a step -------------------------------------------------------------------------

    def open(self, row: int | None, start: int, end: int) -> np.ndarray:
        """Unmask columns [start, end) of `row` (every row when None) for a step that feeds them;
        returns the step's mask, columns [0, end) of those rows."""
        rows = slice(0, self.rows) if row is None else slice(row, row + 1)
        self.mask[rows, start:end] = 1
        return np.ascontiguousarray(self.mask[rows, :end])

    def close(self, row: int, start: int, end: int) -> None:
        """Mask columns [start, end) of `row` out again (drafts a verify step rejected)."""
        self.mask[row, start:end] = 0

    def feeds(self, row: int | None, width: int) -> dict[str, np.ndarray]:
        """The past of `row` (every row when None) over the first `width` columns, to feed a step
        that writes at column `width`. In the contract's `shared` mode the buffers themselves (the
        graph writes the new positions in place; the same arrays while the row count stays, so the
        session keeps its binding); otherwise copies of the columns in use."""
        if row is None:
            cache = self._whole(self.rows)
            states = {name: cache[name] for name in self._states}
            bounded = self._bounded
        else:  # one row's verify step: no states, no bounded layers (speculation refuses them)
            cache = {name: buffer[row : row + 1] for name, buffer in self._kv.items()}
            states, bounded = {}, {}
        full = {name: columns_fed(self.io, cache[name], width) for name in self._kv}
        return full | bounded | states

    def store(self, present: dict[str, np.ndarray], row: int | None, width: int, seq: int) -> None:
        """Keep what a step over `feeds(row, width)` returned for its `seq` new positions: their
        keys and values (already in place in `shared` mode), the rows' next states and, for a
        whole-batch step, the window-bounded layers' next caches."""
        rows = slice(0, self.rows) if row is None else slice(row, row + 1)
        for name, buffer in self._kv.items():
            keep_columns(self.io, buffer, present[name], rows, width, seq)
        if row is None:
            for name, state in self._states.items():
                state[rows] = present[name]
            self._bounded = {name: present[name] for name in self._bounded}

    def advance(self, growth: list[int], grown: int) -> None:
        """After a step: row i keeps `growth[i]` more positions; the width moves `grown` columns."""
        for index, kept in enumerate(growth):
            self.lengths[index] += kept
            self.spans[index] += grown
        self.width += grown

    # -- rows coming and going ----------------------------------------------------------

    def join(self, cache: dict[str, np.ndarray], length: int) -> None:
        """Append a row from a batch-1 cache holding `length` positions (its first `length`
        columns, a window-bounded layer's last ones), right-aligned at the width."""
        n = self.rows
        self._compact(force=max(self.width, length) + 1 > self.mask.shape[1])
        width = max(self.width, length)
        self.reserve(n + 1, width + 1)
        shift = width - self.width
        if shift and n:  # a prompt longer than the batch's width: shift every row right
            for buffer in self._kv.values():
                buffer[:n, :, shift:width] = buffer[:n, :, : self.width]
            self.mask[:n, shift:width] = self.mask[:n, : self.width]
            self.mask[:n, :shift] = 0
        for name, buffer in self._kv.items():
            buffer[n, :, width - length : width] = cache[name][0, :, :length]
        for name, state in self._states.items():
            state[n] = cache[name][0]
        held = {name: self.io.kept_positions(name, width) for name in self._bounded}
        self._bounded = {
            name: np.concatenate([last_columns(rows, held[name]), last_columns(cache[name], held[name])])
            for name, rows in self._bounded.items()
        }
        self.mask[n] = 0
        self.mask[n, width - length : width] = 1
        self.width = width
        self.lengths.append(length)
        self.spans.append(length)
        self._views = None

    def remove(self, index: int) -> None:
        """Row `index` leaves; the last row moves into its slot (the caller moves its own record
        of the rows the same way)."""
        last = self.rows - 1
        width = self.width
        if index != last:
            for buffer in self._kv.values():
                buffer[index, :, :width] = buffer[last, :, :width]
            for state in self._states.values():
                state[index] = state[last]
            self.mask[index] = self.mask[last]  # whole: a verify step may have written past the width
            self.lengths[index], self.spans[index] = self.lengths[last], self.spans[last]
            for rows in self._bounded.values():
                rows[index] = rows[last]
        self.lengths.pop()
        self.spans.pop()
        self.mask[last] = 0
        self._bounded = {name: rows[:last] for name, rows in self._bounded.items()}
        self._views = None
        if not self.lengths:
            self.width = 0
            self._bounded = self.empty_bounded()

    def clear(self) -> None:
        """Every row leaves at once."""
        while self.rows:
            self.remove(self.rows - 1)

    # -- room ---------------------------------------------------------------------------

    def make_room(self, columns: int = 1) -> None:
        """Before a step: compact wasted padding, and make room for `columns` more columns
        (one at least; more as far as the capacity allows)."""
        self._compact(force=self.width + columns > self.mask.shape[1])
        self.reserve(self.rows, max(self.width + 1, min(self.width + columns, self.capacity_limit)))

    def reserve(self, rows: int, columns: int) -> None:
        """Grow the buffers (doubling, up to the bounds) to hold `rows` x `columns`."""
        slots, capacity = self.mask.shape
        if rows <= slots and columns <= capacity:
            return
        new_slots = min(max(rows, 2 * slots, 1), self.max_rows)
        new_capacity = self.fixed_capacity or min(max(columns, 2 * capacity, 64), self.capacity_limit)
        if columns > new_capacity or rows > new_slots:  # unreachable while requests fit the context
            raise KvforgeError(f"batch buffer of {rows} x {columns} exceeds {new_slots} x {new_capacity}")
        n, width = self.rows, self.width
        kv = {
            name: np.zeros(self.io.kv_shape(name, new_slots, new_capacity), dtype=self.io.kv_dtype)
            for name in self.full_names
        }
        for name, buffer in self._kv.items():
            kv[name][:n, :, :width] = buffer[:n, :, :width]
        states = empty_states(self.io, new_slots)
        for name, state in self._states.items():
            states[name][:n] = state[:n]
        mask = np.zeros((new_slots, new_capacity), dtype=np.int64)
        mask[:n, :width] = self.mask[:n, :width]
        self._kv, self._states, self.mask, self._views = kv, states, mask, None

    def _compact(self, force: bool) -> None:
        """Shift the batch left over the padding every row shares, when it is wasteful or `force`."""
        if not self.lengths:
            return
        n = self.rows
        longest = max(self.lengths)
        waste = self.width - longest
        if waste > 0 and (force or waste >= max(longest, MIN_COMPACTION)):
            if max(self.spans) > longest:  # holes in the way of a shift: gather
                self._gather(longest)
                return
            for buffer in self._kv.values():
                buffer[:n, :, :longest] = buffer[:n, :, waste : self.width]
            self.mask[:n, :longest] = self.mask[:n, waste : self.width]
            self.mask[:n, longest:] = 0
            self._bounded = {
                name: last_columns(rows, self.io.kept_positions(name, longest)) for name, rows in self._bounded.items()
            }
            self.width = longest
            self.compactions += 1

    def _gather(self, longest: int) -> None:
        """Compaction with holes (speculation only: no bounded layers, no states): each row's cached
        columns, in order, right-aligned at the new width `longest`."""
        for index, length in enumerate(self.lengths):
            columns = np.flatnonzero(self.mask[index, : self.width])
            start = longest - length
            for buffer in self._kv.values():
                buffer[index, :, start:longest] = buffer[index][:, columns]
            self.mask[index] = 0
            self.mask[index, start:longest] = 1
            self.spans[index] = length
        self.width = longest
        self.compactions += 1

    def _whole(self, rows: int) -> dict[str, np.ndarray]:
        """Views of the first `rows` rows, kept while the row count stays: the session keeps
        its binding while it is given the same arrays."""
        if self._views is None or self._views[0] != rows:
            buffers = self._kv | self._states
            self._views = (rows, {name: buffer[:rows] for name, buffer in buffers.items()})
        return self._views[1]


def last_columns(cache: np.ndarray, held: int) -> np.ndarray:
    """`cache` [rows, heads, positions, dim] as its last `held` columns: cut on the left, or
    padded there with zeros (columns every row's mask leaves out)."""
    positions = cache.shape[2]
    if positions >= held:
        return np.ascontiguousarray(cache[:, :, positions - held :])
    pad = np.zeros((*cache.shape[:2], held - positions, cache.shape[3]), dtype=cache.dtype)
    return np.concatenate([pad, cache], axis=2)
