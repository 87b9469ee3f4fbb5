"""Continuous batching: one engine thread owns the session and steps every request together.

Each step runs one decode for every row of the batch, then admits a waiting request and
runs at most one prefill chunk, so a long prompt delays the others by one chunk at most.

The batch lives in one KV buffer per past tensor, ``[slots, kv_heads, capacity, head_dim]``,
and one attention mask ``[slots, capacity]``. Every row is right-aligned at a shared
width ``W`` (the mask's length): row ``i`` holds its ``length_i`` cached positions in
columns ``[W - length_i, W)``, the columns before it are left padding (mask 0), and a decode
step writes every row's new position at column ``W``. This is exactly a left-padded batch,
so each row attends to what it would alone, and position ids count real tokens only.

- A request is prefilled alone (batch 1: onnxruntime's GroupQueryAttention takes several
  new tokens over a non-empty cache only at batch 1), chunk by chunk, into a buffer of its
  own; its KV is then copied into the next free row of the batch buffer, right-aligned at
  ``W`` (a prompt longer than ``W`` first shifts the batch right to make room).
- A finished or cancelled row leaves at once: the last row is moved into its slot.
- A layer bounded by a sliding window (`DecoderIO.layer_windows`) keeps no column of the
  buffer: its cache is one array ``[rows, kv_heads, min(W, window - 1), head_dim]`` holding the
  last columns before ``W``, in the same right-aligned layout, renewed by every step (the
  graph returns it with the new positions; the runner keeps the last ``window - 1``).
- ``W`` grows by one per step while rows come and go, so padding accumulates: when the
  padding every row shares (``W`` minus the longest row) reaches the longest row, or
  ``W`` reaches the capacity, the batch is shifted left by that amount (compaction). A row
  never holds more than the model's context, so the capacity stays bounded.

A model whose layers keep fixed-size states (lfm2's convolution layers) has one more buffer per
state, ``[slots, ...]`` with no column axis: a request's prefill starts from a zeroed state of
its own, which joins the batch in the row its KV goes to and moves with it; padding columns
never reach a state.

With a prefix cache (`runners.serve.prefix_cache`), a prefill first copies the longest cached
block prefix of its prompt into its buffer and prefills the rest; a finished prefill stores its
prompt's full blocks. Decode never sees the cache.

With speculative decoding (`runners.speculative`), each row's drafter proposes up to K tokens
before the step. The batch decode runs as before (every row's pending token at column ``W``); a
row whose chosen token equals its first draft then verifies its drafts in a call of its own, at
batch 1 over its row of the buffer (columns ``[W + 1, W + 1 + k)``: GroupQueryAttention takes
several new tokens over a cache only at batch 1), and its decoder chooses each position's token
in order, as plain decoding would, while they equal the drafts. A row rejected at the first
draft costs no extra call. Rows then grow by different amounts: the width grows by the largest
growth ``G``, and a row that kept fewer positions leaves the rest of its ``G`` columns masked
out (holes, mask 0). The mask alone says what a row attends to and position ids count its real
tokens, so holes change nothing; compaction gathers each row's real columns when holes are in
the way of a plain shift. Window-bounded layers and fixed-size states are refused (a hole would
count in a window; a state cannot take a draft back).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from runners.decoding import Decoder, TokenLogprob, end_of_row
from runners.detokenizer import StreamingDetokenizer
from runners.engine import Engine, Speculation
from runners.errors import KvforgeError
from runners.generate import choose_tokens, empty_states, forward, invalid_rows
from runners.sampling import SamplingParams
from runners.serve.metrics import Metrics
from runners.serve.prefix_cache import PrefixCache, unsupported
from runners.serve.protocol import ParsedRequest
from runners.session import Session
from runners.speculative import Drafter, require_all_logits

logger = logging.getLogger(__name__)

# Shared padding below this many columns is not worth a copy of the batch's cache.
_MIN_COMPACTION = 16


@dataclass(frozen=True)
class Delta:
    """Text newly safe to show, with the logprob entries of the tokens generated since the last
    Delta (when asked for); `index` is the choice of the request (n > 1)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (eos, stop string or grammar end) or "length"
    prompt_tokens: int
    completion_tokens: int
    index: int = 0


@dataclass(frozen=True)
class Failed:
    message: str
    index: int = 0


Event = Delta | Finished | Failed


class Overloaded(KvforgeError):
    """Every batch slot and queue place is taken; the client should retry later."""


class Unavailable(KvforgeError):
    """The engine is shutting down or has failed."""


@dataclass(eq=False)
class Request:
    """One generation: prompt ids, budget and decoder in; events out through `events`.

    Without a `decoder`, one is built from `params` (no grammar, no logprobs). The choices
    of one request (n > 1) are requests of their own that share `events`, told apart by `index`.
    """

    ids: list[int]
    params: SamplingParams
    budget: int
    detokenizer: StreamingDetokenizer
    events: queue.SimpleQueue[Event] = field(default_factory=queue.SimpleQueue)
    arrival: float = field(default_factory=time.perf_counter)
    ignore_eos: bool = False  # generate the whole budget (vLLM's field, for load tests)
    decoder: Decoder | None = None
    index: int = 0
    cancelled: bool = False
    generated: int = 0
    last_token_at: float = 0.0
    released: bool = False

    def __post_init__(self) -> None:
        if self.decoder is None:
            self.decoder = Decoder(self.params, self.ids)
        self.pending_logprobs: list[TokenLogprob] = []

    @property
    def chooser(self) -> Decoder:
        assert self.decoder is not None  # made in __post_init__
        return self.decoder


@dataclass(eq=False)
class _Row:
    request: Request
    length: int  # positions cached
    next_token: int  # sampled, not yet fed
    span: int = 0  # columns from its first cached position to the width (length plus holes)
    drafter: Drafter | None = None  # with speculative decoding
    history: list[int] = field(default_factory=list)  # prompt and generated ids, for the drafter


@dataclass(eq=False)
class _Prefill:
    request: Request
    done: int = 0  # prompt tokens prefilled so far
    bounded: dict[str, np.ndarray] = field(default_factory=dict)  # its window-bounded layers' caches


def choice_requests(engine: Engine, parsed: ParsedRequest, arrival: float) -> list[Request]:
    """The engine requests of one checked API request: one per choice, sharing one event queue,
    choice i seeded with seed + i (unseeded choices draw independently). A bad stop string
    raises the detokenizer's KvforgeError."""
    events: queue.SimpleQueue[Event] = queue.SimpleQueue()
    requests = []
    for index in range(parsed.n):
        params = (
            parsed.params if parsed.params.seed is None else replace(parsed.params, seed=parsed.params.seed + index)
        )
        requests.append(
            Request(
                parsed.ids,
                params,
                parsed.budget,
                engine.tokenizer.detokenizer(parsed.stop, context_ids=parsed.ids),
                events=events,
                arrival=arrival,
                ignore_eos=parsed.ignore_eos,
                decoder=engine.decoder(params, parsed.ids, parsed.grammar, parsed.logprobs),
                index=index,
            )
        )
    return requests


class BatchScheduler:
    """The engine thread and its bounded queue; `submit` and `cancel` are thread-safe."""

    def __init__(
        self,
        session: Session,
        *,
        max_positions: int,
        eos_ids: Sequence[int],
        max_num_seqs: int,
        max_queued: int,
        prefill_chunk: int,
        metrics: Metrics,
        prefix_cache: PrefixCache | None = None,
        speculation: Speculation | None = None,
        speculative_rows: int = 1,
    ) -> None:
        self.session = session
        self.io = session.io
        reason = None if prefix_cache is None else unsupported(self.io)
        if reason is not None:
            raise KvforgeError(f"this artifact cannot have a prefix cache: {reason}; run without one")
        self.prefix_cache = prefix_cache
        if speculation is not None:
            require_all_logits(self.io)
            if self.io.layer_windows and any(self.io.window_of(name) is not None for name in self.io.past_names):
                raise KvforgeError(
                    "speculative decoding in the server's continuous batch (--speculative) is not available for "
                    "layers whose cache is bounded by a sliding window (io.layer_windows in the manifest): a draft "
                    "rejected in one row would leave a gap inside the window; serve without --speculative, or use "
                    "`kvforge generate --speculative`"
                )
        self.speculation = speculation
        self.speculative_rows = speculative_rows  # verify steps run while the batch holds at most this many rows
        self.max_positions = max_positions
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.max_num_seqs = max_num_seqs
        self.max_queued = max_queued
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics
        self.failure: str | None = None
        self.compactions = 0  # times the batch was shifted left over shared padding
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._in_system = 0  # accepted and not yet released
        self._stopping = False
        self._rows: list[_Row] = []
        self._prefill: _Prefill | None = None
        self._width = 0
        self._kv: dict[str, np.ndarray] = {}  # the layers that keep their whole history
        self._states: dict[str, np.ndarray] = {}  # [slots, ...] per fixed-size state
        # the window-bounded layers, the last min(width, window - 1) columns of every row
        self._full_names = [name for name in self.io.past_names if self.io.window_of(name) is None]
        self._bounded: dict[str, np.ndarray] = self._no_rows()
        self._mask = np.zeros((0, 0), dtype=np.int64)
        self._views: tuple[int, dict[str, np.ndarray]] | None = None
        self._prefill_kv: dict[str, np.ndarray] = {}  # the request being prefilled: its KV and states
        # A graph with a fixed cache length takes buffers of exactly that length; otherwise
        # leave room past the context for the padding that builds up between compactions.
        self._fixed_capacity: int | None = getattr(self.io, "capacity", None)
        self._capacity_limit = self._fixed_capacity or max_positions + max(_MIN_COMPACTION, max_positions // 4)
        self._thread = threading.Thread(target=self._run, name="kvforge-engine", daemon=True)

    # -- called from request threads ---------------------------------------------------

    @classmethod
    def for_engine(
        cls,
        engine: Engine,
        *,
        max_num_seqs: int,
        max_queued: int,
        prefill_chunk: int,
        metrics: Metrics,
        prefix_cache: PrefixCache | None = None,
        speculation: Speculation | None = None,
        speculative_rows: int = 1,
    ) -> BatchScheduler:
        """A scheduler over a loaded engine's session, with its context and end-of-text ids."""
        return cls(
            engine.session,
            max_positions=engine.max_positions,
            eos_ids=engine.eos_ids,
            max_num_seqs=max_num_seqs,
            max_queued=max_queued,
            prefill_chunk=prefill_chunk,
            metrics=metrics,
            prefix_cache=prefix_cache,
            speculation=speculation,
            speculative_rows=speculative_rows,
        )

    def start(self) -> None:
        self._thread.start()

    def submit(self, *requests: Request) -> None:
        """Queue requests (the choices of one, all or none), or raise Overloaded (429) /
        Unavailable (503) at once."""
        with self._cond:
            if self.failure is not None:
                raise Unavailable(f"the engine failed ({self.failure}); restart the server")
            if self._stopping:
                raise Unavailable("the server is shutting down; retry on another instance")
            if self._in_system + len(requests) > self.max_num_seqs + self.max_queued:
                raise Overloaded(
                    f"server at capacity: {self.max_num_seqs} requests running (--max-num-seqs) and "
                    f"{self.max_queued} waiting (--max-queued); retry later"
                )
            self._in_system += len(requests)
            self._waiting.extend(requests)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()

    def cancel(self, request: Request) -> None:
        """Abort a request: a waiting one leaves the queue now, a running one at the next step."""
        with self._cond:
            if request.released:
                return
            request.cancelled = True
            if request in self._waiting:
                self._waiting.remove(request)
                self.metrics.waiting.set(len(self._waiting))
                self._release(request)
                self.metrics.request_aborted.inc()
            self._cond.notify_all()

    def wait_released(self, request: Request, timeout: float) -> bool:
        """Wait until the engine has let go of `request` (finished, failed or aborted after
        `cancel`); False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: request.released, timeout)

    @property
    def in_system(self) -> int:
        return self._in_system

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is waiting or running; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_system, timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread after its current step; requests still in flight fail."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all("the server is shutting down")

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (self._rows or self._prefill or self._waiting or self._stopping):
                        self._cond.wait()
                    if self._stopping:
                        return
                self._step()
        except Exception as error:  # the session itself failed: no request can go on
            logger.exception("engine step failed")
            with self._cond:
                self.failure = f"{type(error).__name__}: {error}"
            self._fail_all(f"the engine failed ({self.failure}); the server must be restarted")

    def _step(self) -> None:
        self._drop_cancelled()
        if self._rows:
            self._decode()
        if self._prefill is None and len(self._rows) < self.max_num_seqs:
            self._admit()
        if self._prefill is not None:
            self._prefill_step()
        self._update_gauges()

    def _admit(self) -> None:
        with self._cond:
            if not self._waiting:
                return
            request = self._waiting.popleft()
            self.metrics.waiting.set(len(self._waiting))
        self.metrics.queue_time.observe(time.perf_counter() - request.arrival)
        self._prefill = _Prefill(request, bounded=self._no_rows(1))

    def _drop_cancelled(self) -> None:
        for index in reversed(range(len(self._rows))):
            request = self._rows[index].request
            if request.cancelled:
                self._remove_row(index)
                self._abort(request)
        if self._prefill is not None and self._prefill.request.cancelled:
            self._abort(self._prefill.request)
            self._prefill = None

    # -- decode -------------------------------------------------------------------------

    def _decode(self) -> None:
        drafts = self._propose()
        self._make_room(1 + max(map(len, drafts), default=0))
        rows, width = self._rows, self._width
        room = self._mask.shape[1] - width - 1  # columns a verify step may write after the pending token
        drafts = [d[:room] for d in drafts]
        n = len(rows)
        if n == 1 and drafts and drafts[0]:
            self._decode_alone(drafts[0])
            return
        ids = np.array([[row.next_token] for row in rows], dtype=np.int64)
        self._mask[:n, width] = 1
        mask = np.ascontiguousarray(self._mask[:n, : width + 1])
        logits, self._bounded = self._forward(ids, mask, self._batch_cache(n) | self._bounded, n, width)
        tokens = self._sample_rows(logits[:, -1, :], [row.request for row in rows])
        growth, ended = [1] * n, [False] * n
        for index, row in enumerate(rows):
            token = int(tokens[index])
            ended[index] = token < 0 or self._deliver(row.request, token)
            if self.speculation is None:
                row.next_token = token
                continue
            row.history.append(token)
            first = drafts[index][:1] if drafts else []
            if first:
                self.metrics.spec_decode_num_drafts.inc()
                self.metrics.spec_decode_num_draft_tokens.inc(len(drafts[index]))
                self.metrics.spec_decode_num_accepted_tokens.inc(int(token == first[0]))
            if not ended[index] and first and token == first[0]:
                token, growth[index], ended[index] = self._verify(index, drafts[index], width + 1)
            row.next_token = token
        # a row that kept fewer positions than the one that kept most leaves the rest out (holes)
        grown = max((g for g, e in zip(growth, ended) if not e), default=1)
        for index, row in enumerate(rows):
            row.length += growth[index]
            row.span += grown
        self._width = width + grown
        for index in reversed(range(n)):
            if ended[index]:
                self._remove_row(index)

    def _propose(self) -> list[list[int]]:
        """Each row's drafts for this step (none without speculation): at most K, and no more than
        the tokens its budget still allows after the pending one."""
        if self.speculation is None or len(self._rows) > self.speculative_rows:
            return []
        k = self.speculation.draft_tokens
        drafts = []
        for row in self._rows:
            left = min(k, row.request.budget - row.request.generated - 1)
            drafts.append(row.drafter.propose(row.history, left) if row.drafter is not None and left > 0 else [])
        return drafts

    def _verify(self, index: int, drafts: list[int], start: int) -> tuple[int, int, bool]:
        """Row `index` chose its first draft: feed its drafts at columns [start, start + k) in a call
        of its own, and choose each next token from them while they equal the drafts. Returns the
        pending token, the positions the row keeps of this step, and whether the request ended."""
        end = start + len(drafts)
        self._mask[index, start:end] = 1
        mask = np.ascontiguousarray(self._mask[index : index + 1, :end])
        row_cache = {name: buffer[index : index + 1] for name, buffer in self._kv.items()}
        ids = np.asarray([drafts], dtype=np.int64)
        logits, _ = self._forward(ids, mask, row_cache, 1, start)
        token, accepted, ended = self._choose_along(index, logits, drafts[1:])
        accepted += 1  # the first draft, chosen by the batch step
        self._mask[index, start + accepted : end] = 0  # the rejected drafts' columns
        return token, 1 + accepted, ended

    def _decode_alone(self, drafts: list[int]) -> None:
        """A batch of one row: its pending token and drafts in one call (batch 1 takes several
        tokens), as `Engine`'s speculative decoding does."""
        row, width = self._rows[0], self._width
        self.metrics.spec_decode_num_drafts.inc()
        self.metrics.spec_decode_num_draft_tokens.inc(len(drafts))
        end = width + 1 + len(drafts)
        self._mask[0, width:end] = 1
        ids = np.asarray([[row.next_token, *drafts]], dtype=np.int64)
        logits, _ = self._forward(ids, np.ascontiguousarray(self._mask[:1, :end]), self._batch_cache(1), 1, width)
        token, accepted, ended = self._choose_along(0, logits, drafts)
        self._mask[0, width + 1 + accepted : end] = 0
        row.next_token = token
        row.length += 1 + accepted
        row.span += 1 + accepted
        self._width = width + 1 + accepted
        if ended:
            self._remove_row(0)

    def _choose_along(self, index: int, logits: np.ndarray, drafts: list[int]) -> tuple[int, int, bool]:
        """Row `index`'s tokens from each position of `logits` [1, positions, vocab] in turn, while
        they equal `drafts` (the tokens fed after each position). Returns the last token (pending),
        the drafts accepted, and whether the request ended."""
        row = self._rows[index]
        accepted, ended, token = 0, False, -1
        for j in range(logits.shape[1]):
            token = int(self._sample_rows(logits[:, j, :], [row.request])[0])
            matched = token >= 0 and j < len(drafts) and token == drafts[j]
            accepted += matched
            self.metrics.spec_decode_num_accepted_tokens.inc(int(matched))
            ended = token < 0 or self._deliver(row.request, token)
            row.history.append(token)
            if ended or not matched:
                break
        return token, accepted, ended

    def _sample_rows(self, last: np.ndarray, requests: list[Request]) -> np.ndarray:
        """One token per row, each from its own decoder; -1 where the row failed (and was told)."""
        ok = np.ones(len(requests), dtype=bool)
        for _, rows in invalid_rows(last):
            ok &= ~rows
        for index in np.flatnonzero(~ok):
            self._fail(requests[index], "the model produced invalid logits (NaN or inf) for this request")

        def failed(row: int, error: Exception) -> None:
            self._fail(requests[row], f"sampling failed: {error}")

        tokens, entries = choose_tokens([r.chooser for r in requests], last, ok, -1, failed)
        for request, token, entry in zip(requests, tokens, entries):
            if entry is not None and int(token) not in self.eos_ids:
                request.pending_logprobs.append(entry)
        return tokens

    def _deliver(self, request: Request, token: int) -> bool:
        """Hand one sampled token to its request; True when the request has finished."""
        now = time.perf_counter()
        request.generated += 1
        self.metrics.generation_tokens.inc()
        if request.generated == 1:
            self.metrics.time_to_first_token.observe(now - request.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - request.last_token_at)
        request.last_token_at = now
        eos = token in self.eos_ids and not request.ignore_eos
        if not eos:
            try:
                text = request.detokenizer.add(token)
            except Exception as error:  # one request's detokenizer must not stop the others
                self._fail(request, f"detokenizing failed: {error}")
                return True
            if text:
                request.events.put(Delta(text, self._take_logprobs(request), request.index))
        reason = end_of_row(
            eos=eos,
            stopped=request.detokenizer.stopped,
            finished=request.chooser.finished,
            generated=request.generated,
            budget=request.budget,
        )
        return False if reason is None else self._finish(request, reason)

    @staticmethod
    def _take_logprobs(request: Request) -> tuple[TokenLogprob, ...]:
        entries = tuple(request.pending_logprobs)
        request.pending_logprobs.clear()
        return entries

    # -- prefill ------------------------------------------------------------------------

    def _prefill_step(self) -> None:
        assert self._prefill is not None
        state = self._prefill
        request = state.request
        cache = self._prefill_cache()
        if state.done == 0:  # a fresh sequence: no state of the previous request may leak into it
            for name in self.io.state_names:
                cache[name].fill(0)
            if self.prefix_cache is not None:
                state.done = self.prefix_cache.restore(request.ids, cache)
        end = min(state.done + self.prefill_chunk, len(request.ids))
        ids = np.asarray(request.ids[state.done : end], dtype=np.int64)[None, :]
        mask = np.ones((1, end), dtype=np.int64)
        try:
            logits, state.bounded = self._forward(ids, mask, cache | state.bounded, 1, state.done)
        except Exception as error:  # a prefill is one request's: only that request fails
            logger.exception("prefill failed")
            self._prefill = None
            self._fail(request, f"prefill failed: {type(error).__name__}: {error}")
            return
        state.done = end
        if end < len(request.ids):
            return
        self._prefill = None
        self.metrics.prompt_tokens.inc(len(request.ids))
        if self.prefix_cache is not None:
            self.prefix_cache.store(request.ids, cache)
        token = int(self._sample_rows(logits[:, -1, :], [request])[0])
        if token >= 0 and not self._deliver(request, token):
            self._join(request, cache | state.bounded, token)

    def _prefill_cache(self) -> dict[str, np.ndarray]:
        if not self._prefill_kv:
            length = self._fixed_capacity or self.max_positions
            self._prefill_kv = {
                name: np.zeros(self.io.kv_shape(name, 1, length), dtype=self.io.kv_dtype) for name in self._full_names
            } | empty_states(self.io, 1)
        return self._prefill_kv

    def _join(self, request: Request, cache: dict[str, np.ndarray], token: int) -> None:
        """Copy a prefilled request's KV into the next free row, right-aligned at the width."""
        length = len(request.ids)
        n = len(self._rows)
        self._compact(force=max(self._width, length) + 1 > self._mask.shape[1])
        width = max(self._width, length)
        self._reserve(n + 1, width + 1)
        shift = width - self._width
        if shift and n:  # a prompt longer than the batch's width: shift every row right
            for buffer in self._kv.values():
                buffer[:n, :, shift:width] = buffer[:n, :, : self._width]
            self._mask[:n, shift:width] = self._mask[:n, : self._width]
            self._mask[:n, :shift] = 0
        for name, buffer in self._kv.items():
            buffer[n, :, width - length : width] = cache[name][0, :, :length]
        for name, state in self._states.items():
            state[n] = cache[name][0]
        held = {name: self.io.kept_positions(name, width) for name in self._bounded}
        self._bounded = {
            name: np.concatenate([_last_columns(rows, held[name]), _last_columns(cache[name], held[name])])
            for name, rows in self._bounded.items()
        }
        self._mask[n] = 0
        self._mask[n, width - length : width] = 1
        self._width = width
        row = _Row(request, length, token, span=length)
        if self.speculation is not None:
            row.history = [*request.ids, token]
            try:
                row.drafter = self.speculation.drafter(length + request.budget)
            except KvforgeError as error:  # a draft model with a shorter context: this row does not speculate
                logger.info("request without speculation: %s", error)
        self._rows.append(row)
        self._views = None

    # -- the batch buffer ---------------------------------------------------------------

    def _forward(
        self, ids: np.ndarray, mask: np.ndarray, cache: dict[str, np.ndarray], rows: int, width: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Run the model on `rows` rows whose cache fills `width` columns; the new positions'
        keys and values land in columns [width, width + seq) of `cache`'s buffers, the rows' next
        fixed-size states in its state buffers. Returns the logits and the window-bounded layers'
        next caches (the last columns before width + seq)."""
        bounded = [name for name in cache if self.io.window_of(name) is not None]
        states = {name: np.ascontiguousarray(cache[name][:rows]) for name in self.io.state_names}
        full = [name for name in cache if name not in states and name not in bounded]
        if self.io.shared_kv:
            logits, present = forward(self.session, ids, mask, {n: cache[n] for n in full + bounded} | states)
        else:
            past = {name: np.ascontiguousarray(cache[name][:rows, :, :width]) for name in full}
            logits, present = forward(self.session, ids, mask, past | {n: cache[n] for n in bounded} | states)
            end = width + ids.shape[1]
            for name in full:
                cache[name][:rows, :, width:end] = present[name][:, :, width:end]
        for name in self.io.state_names:
            cache[name][:rows] = present[name]
        return logits, {name: present[name] for name in bounded}

    def _batch_cache(self, rows: int) -> dict[str, np.ndarray]:
        """Views of the first `rows` rows, kept while the row count stays: the session keeps
        its binding while it is given the same arrays."""
        if self._views is None or self._views[0] != rows:
            buffers = self._kv | self._states
            self._views = (rows, {name: buffer[:rows] for name, buffer in buffers.items()})
        return self._views[1]

    def _make_room(self, columns: int = 1) -> None:
        """Before a decode step: compact wasted padding, and make room for `columns` more columns
        (one at least; more as far as the capacity allows)."""
        self._compact(force=self._width + columns > self._mask.shape[1])
        self._reserve(len(self._rows), max(self._width + 1, min(self._width + columns, self._capacity_limit)))

    def _compact(self, force: bool) -> None:
        """Shift the batch left over the padding every row shares, when it is wasteful or `force`."""
        if not self._rows:
            return
        n = len(self._rows)
        longest = max(row.length for row in self._rows)
        waste = self._width - longest
        if waste > 0 and (force or waste >= max(longest, _MIN_COMPACTION)):
            if max(row.span for row in self._rows) > longest:  # holes in the way of a shift: gather
                self._gather(longest)
                return
            for buffer in self._kv.values():
                buffer[:n, :, :longest] = buffer[:n, :, waste : self._width]
            self._mask[:n, :longest] = self._mask[:n, waste : self._width]
            self._mask[:n, longest:] = 0
            self._bounded = {
                name: _last_columns(rows, self.io.kept_positions(name, longest)) for name, rows in self._bounded.items()
            }
            self._width = longest
            self.compactions += 1

    def _gather(self, longest: int) -> None:
        """Compaction with holes (speculation only: no bounded layers, no states): each row's cached
        columns, in order, right-aligned at the new width `longest`."""
        for index, row in enumerate(self._rows):
            columns = np.flatnonzero(self._mask[index, : self._width])
            start = longest - row.length
            for buffer in self._kv.values():
                buffer[index, :, start:longest] = buffer[index][:, columns]
            self._mask[index] = 0
            self._mask[index, start:longest] = 1
            row.span = row.length
        self._width = longest
        self.compactions += 1

    def _reserve(self, rows: int, columns: int) -> None:
        """Grow the batch buffer (doubling, up to the bounds) to hold `rows` x `columns`."""
        slots, capacity = self._mask.shape
        if rows <= slots and columns <= capacity:
            return
        new_slots = min(max(rows, 2 * slots, 1), self.max_num_seqs)
        new_capacity = self._fixed_capacity or min(max(columns, 2 * capacity, 64), self._capacity_limit)
        if columns > new_capacity or rows > new_slots:  # unreachable while requests fit the context
            raise KvforgeError(f"batch buffer of {rows} x {columns} exceeds {new_slots} x {new_capacity}")
        n, width = len(self._rows), self._width
        kv = {
            name: np.zeros(self.io.kv_shape(name, new_slots, new_capacity), dtype=self.io.kv_dtype)
            for name in self._full_names
        }
        for name, buffer in self._kv.items():
            kv[name][:n, :, :width] = buffer[:n, :, :width]
        states = empty_states(self.io, new_slots)
        for name, state in self._states.items():
            states[name][:n] = state[:n]
        mask = np.zeros((new_slots, new_capacity), dtype=np.int64)
        mask[:n, :width] = self._mask[:n, :width]
        self._kv, self._states, self._mask, self._views = kv, states, mask, None

    def _remove_row(self, index: int) -> None:
        last = len(self._rows) - 1
        width = self._width
        if index != last:
            for buffer in self._kv.values():
                buffer[index, :, :width] = buffer[last, :, :width]
            for state in self._states.values():
                state[index] = state[last]
            self._mask[index] = self._mask[last]  # whole: a verify step may have written past the width
            self._rows[index] = self._rows[last]
            for rows in self._bounded.values():
                rows[index] = rows[last]
        self._rows.pop()
        self._mask[last] = 0
        self._bounded = {name: rows[:last] for name, rows in self._bounded.items()}
        self._views = None
        if not self._rows:
            self._width = 0
            self._bounded = self._no_rows()

    def _no_rows(self, rows: int = 0) -> dict[str, np.ndarray]:
        """The window-bounded layers' caches of `rows` rows holding no position."""
        return {
            name: np.zeros(self.io.kv_shape(name, rows, 0), dtype=self.io.kv_dtype)
            for name in self.io.past_names
            if self.io.window_of(name) is not None
        }

    # -- request endings ----------------------------------------------------------------

    def _finish(self, request: Request, reason: str) -> bool:
        try:
            tail = request.detokenizer.finish()
        except Exception as error:
            self._fail(request, f"detokenizing failed: {error}")
            return True
        if tail or request.pending_logprobs:
            request.events.put(Delta(tail, self._take_logprobs(request), request.index))
        request.events.put(Finished(reason, len(request.ids), request.generated, request.index))
        self.metrics.request_success.inc(value=reason)
        self.metrics.e2e_latency.observe(time.perf_counter() - request.arrival)
        self._release_locked(request)
        return True

    def _fail(self, request: Request, message: str) -> None:
        request.events.put(Failed(message, request.index))
        self.metrics.request_failed.inc()
        self._release_locked(request)

    def _abort(self, request: Request) -> None:
        self.metrics.request_aborted.inc()
        self._release_locked(request)

    def _release_locked(self, request: Request) -> None:
        with self._cond:
            self._release(request)

    def _release(self, request: Request) -> None:
        if not request.released:
            request.released = True
            self._in_system -= 1
            self._cond.notify_all()

    def _fail_all(self, message: str) -> None:
        with self._cond:
            pending = [*self._waiting, *(row.request for row in self._rows)]
            if self._prefill is not None:
                pending.append(self._prefill.request)
            self._waiting.clear()
        self._rows, self._prefill = [], None
        for request in pending:
            if not request.released:
                self._fail(request, message)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._rows) + (self._prefill is not None))
        self.metrics.waiting.set(len(self._waiting))
        cached = sum(row.length for row in self._rows)
        self.metrics.kv_usage.set(cached / (self.max_num_seqs * self.max_positions))


def _last_columns(cache: np.ndarray, held: int) -> np.ndarray:
    """`cache` [rows, heads, positions, dim] as its last `held` columns: cut on the left, or
    padded there with zeros (columns every row's mask leaves out)."""
    positions = cache.shape[2]
    if positions >= held:
        return np.ascontiguousarray(cache[:, :, positions - held :])
    pad = np.zeros((*cache.shape[:2], held - positions, cache.shape[3]), dtype=cache.dtype)
    return np.concatenate([pad, cache], axis=2)
