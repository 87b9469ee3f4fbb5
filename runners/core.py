"""The engine core: one step function over one continuous batch, for everything that generates.

`Engine.generate`, `stream` and `chat` run an `EngineCore` inline, in the caller's thread; the
server and the Triton backend run the same core on an engine thread (`kvforge.runners.serve.scheduler`).
Requests are request records (`kvforge.runners.request`) with an event queue; `step` takes one step
of every running request and hands each its tokens, and the request says when it ends (one stop rule).

Each step runs one decode for every row of the batch, then admits a waiting request and runs at
most one prefill chunk, so a long prompt delays the others by one chunk at most.

The running rows' caches live in one `BatchCache` (`kvforge.runners.cache`), where the session runs:
a left-padded, right-aligned layout at a shared width, compacted as padding builds up; a decode
step feeds every row's pending token at once.

A request is prefilled alone (batch 1: onnxruntime's GroupQueryAttention takes several new tokens
over a non-empty cache only at batch 1) by the runner's own `prefill`, one chunk per step, into a
cache of its own (fixed-size states start from zero); its cache then joins the batch.

With a prefix cache (`kvforge.runners.serve.prefix_cache`), a prefill first copies the longest cached
prefix of its prompt into its buffer and prefills the rest (nothing where the cache held the whole
prompt and its last logits); a finished prefill stores its prompt's blocks once its first token
is out. Decode never sees the cache.

With speculative decoding (`kvforge.runners.speculative`), each row's drafter proposes up to K tokens
before the step. A batch of one row feeds its pending token and drafts in one call (a verify step:
the row's step with k + 1 positions) and cuts the columns of the drafts it rejects. In a batch of
several rows the batch decode runs as before (every row's pending token at the width); a row whose
chosen token equals its first draft then verifies its drafts in a call of its own, at batch 1 over
its row of the batch, and its decoder chooses each position's token in order, as plain decoding
would, while they equal the drafts. A row rejected at the first draft costs no extra call. Rows then
grow by different amounts, which the batch keeps as holes in its mask. There, window-bounded layers
are refused (a hole would count in a window); fixed-size states are refused everywhere (a state
cannot take a draft back).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.runners.cache import BatchCache, Cache, bounded_names, device_of
from kvforge.runners.decoding import Decoder, TokenLogprob
from kvforge.runners.detokenizer import StreamingDetokenizer
from kvforge.runners.errors import GenerationError, KvforgeError
from kvforge.runners.generate import check_length, choose_tokens, forward, invalid_rows, prefill
from kvforge.runners.request import GenerationRequest
from kvforge.runners.session import Session
from kvforge.runners.speculative import (
    ROLLBACK,
    Drafter,
    Speculation,
    SpeculationStats,
    accept_drafts,
    require_all_logits,
)

if TYPE_CHECKING:
    from kvforge.runners.serve.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


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
    incomplete: bool = False  # "length" before the grammar had a whole sentence (`GenerationRequest.cut_short`)


@dataclass(frozen=True)
class Failed:
    message: str
    index: int = 0


Event = Delta | Finished | Failed


@dataclass(eq=False)
class Request(GenerationRequest):
    """One generation in the core: the request record (`kvforge.runners.request`) with its events out
    through `events`. The choices of one request (n > 1) are requests of their own that share
    `events`, told apart by `index`. The core gives it the artifact's eos ids when it has none.
    `speculation`, when given, counts what speculative decoding did for it."""

    events: queue.SimpleQueue[Event] = field(default_factory=queue.SimpleQueue)
    arrival: float = field(default_factory=time.perf_counter)
    index: int = 0
    cancelled: bool = False
    last_token_at: float = 0.0
    released: bool = False
    speculation: SpeculationStats | None = None


class _Instrument:
    """A metric that records nothing."""

    def inc(self, value: Any = None) -> None:
        pass

    def observe(self, value: float) -> None:
        pass

    def set(self, value: float) -> None:
        pass


class NullMetrics:
    """Metrics for a core nobody scrapes (`Engine`'s): every instrument records nothing."""

    _instrument = _Instrument()

    def __getattr__(self, name: str) -> _Instrument:
        return self._instrument


@dataclass(eq=False)
class _Row:
    """A running request; its cache is the batch's row of the same index."""

    request: Request
    next_token: int  # sampled, not yet fed
    drafter: Drafter | None = None  # with speculative decoding
    history: list[int] = field(default_factory=list)  # prompt and generated ids, for the drafter


@dataclass(eq=False)
class _Prefill:
    request: Request
    chunks: Iterator[tuple[int, np.ndarray, Cache]]  # `prefill` over the prompt
    cache: Cache  # the prompt's cache after the chunks run so far


class EngineCore:
    """The batch, its waiting requests and the one step function (`step`). Not thread-safe but for
    the waiting queue and releases, which `_cond` guards (`BatchScheduler` steps it on a thread).

    `metrics` has the server's instruments (`kvforge.runners.serve.metrics.Metrics`), or records
    nothing when None. `prefill_chunk` None prefills a prompt in one call. With `join_first`, the
    running rows decode only once no waiting request can join (`Engine`'s batch, given at once,
    decodes all together from its first step, as a left-padded batch does); otherwise every step
    decodes while a request is prefilled (the server: a long prompt delays the others by a chunk)."""

    def __init__(
        self,
        session: Session,
        *,
        max_positions: int,
        eos_ids: Sequence[int],
        max_num_seqs: int,
        prefill_chunk: int | None,
        metrics: Any = None,
        prefix_cache: PrefixCache | None = None,
        speculation: Speculation | None = None,
        speculative_rows: int = 1,
        join_first: bool = False,
    ) -> None:
        self.session = session
        self.io = session.io
        self.prefix_cache = prefix_cache
        if speculation is not None:
            require_all_logits(self.io)
            if bounded_names(self.io) and max_num_seqs > 1:
                raise KvforgeError(
                    "speculative decoding in the server's continuous batch (--speculative) is not available for "
                    "layers whose cache is bounded by a sliding window (io.layer_windows in the manifest): a draft "
                    "rejected in one row would leave a gap inside the window; serve without --speculative or with "
                    "--max-num-seqs 1, or use `kvforge generate --speculative`"
                )
        self.speculation = speculation
        self.speculative_rows = speculative_rows  # verify steps run while the batch holds at most this many rows
        self.join_first = join_first  # the batch waits for every request a slot is free for (a batch given at once)
        self.max_positions = max_positions
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.metrics: Any = NullMetrics() if metrics is None else metrics  # Metrics' instruments, by name
        self._measured = metrics is not None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._in_system = 0  # accepted and not yet released
        self._rows: list[_Row] = []
        self._batch = BatchCache(self.io, max_rows=max_num_seqs, max_positions=max_positions, device=device_of(session))
        # a window-bounded layer keeps the positions a verify step of a batch of one may take back
        self._rollback = ROLLBACK if speculation is not None and bounded_names(self.io) else 0
        self._prefill: _Prefill | None = None

    def add(self, *requests: Request) -> None:
        """Queue requests for the next steps (the caller has checked they fit)."""
        with self._cond:
            self._in_system += len(requests)
            for request in requests:
                request.eos_ids = request.eos_ids or tuple(sorted(self.eos_ids))
            self._waiting.extend(requests)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()

    @property
    def _admitting(self) -> bool:
        """Whether a request is being prefilled, or waits with a batch slot free for it."""
        return self._prefill is not None or (bool(self._waiting) and len(self._rows) < self.max_num_seqs)

    @property
    def busy(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self._rows or self._prefill or self._waiting)

    # -- the step -----------------------------------------------------------------------

    def step(self) -> None:
        """One step of every request: a decode (or verify) step of the batch's rows, then at most one
        prefill chunk of a request admitted from the queue. Its results are the requests' events."""
        self._drop_cancelled()
        if self._rows and not (self.join_first and self._admitting):
            self._decode()
        if self._prefill is None and len(self._rows) < self.max_num_seqs:
            self._admit()
        if self._prefill is not None:
            self._prefill_step()
        if self._measured:
            self._update_gauges()

    def _admit(self) -> None:
        with self._cond:
            if not self._waiting:
                return
            request = self._waiting.popleft()
            self.metrics.waiting.set(len(self._waiting))
        self.metrics.queue_time.observe(time.perf_counter() - request.arrival)
        cache, start = self._sequence_cache(request)
        ids = np.asarray([request.ids], dtype=np.int64)
        mask = np.ones_like(ids)
        if start < ids.shape[1]:
            chunks = prefill(self.session, ids, mask, cache, chunk=self.prefill_chunk, start=start)
        else:  # the prefix cache held the whole prompt and its last position's logits
            assert self.prefix_cache is not None and self.prefix_cache.logits is not None
            chunks = iter([(start, self.prefix_cache.logits, cache)])
        self._prefill = _Prefill(request, chunks, cache)

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
        batch = self._batch
        drafts = self._propose()
        batch.make_room(1 + max(map(len, drafts), default=0))
        rows, width = self._rows, batch.width
        drafts = [d[: batch.room] for d in drafts]  # columns a verify step may write after the pending token
        n = len(rows)
        if n == 1 and drafts and drafts[0]:
            self._decode_alone(drafts[0])
            return
        ids = np.array([[row.next_token] for row in rows], dtype=np.int64)
        logits = self._forward(ids, batch.open(None, width, width + 1), None, width)
        tokens, entries = self._sample_rows(logits[:, -1, :], [row.request for row in rows])
        growth, ended = [1] * n, [False] * n
        for index, row in enumerate(rows):
            token = int(tokens[index])
            ended[index] = token < 0 or self._deliver(row.request, token, entries[index])
            if self.speculation is None:
                row.next_token = token
                continue
            row.history.append(token)
            first = drafts[index][:1] if drafts else []
            self._verify_step(row.request, len(first) and len(drafts[index]))
            self._produced(row.request, bool(first), bool(first) and token == first[0])
            if not ended[index] and first and token == first[0]:
                token, growth[index], ended[index] = self._verify(index, drafts[index], width + 1)
            row.next_token = token
        # a row that kept fewer positions than the one that kept most leaves the rest out (holes)
        batch.advance(growth, max((g for g, e in zip(growth, ended) if not e), default=1))
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
        ids = np.asarray([drafts], dtype=np.int64)
        logits = self._forward(ids, self._batch.open(index, start, end), index, start, every_position=True)
        token, accepted, ended = self._choose_along(index, logits, drafts[1:])
        accepted += 1  # the first draft, chosen by the batch step
        self._batch.close(index, start + accepted, end)  # the rejected drafts' columns
        return token, 1 + accepted, ended

    def _decode_alone(self, drafts: list[int]) -> None:
        """A batch of one row: its pending token and drafts in one call (batch 1 takes several
        tokens), the rejected drafts' columns cut afterwards (window-bounded layers included)."""
        row, width = self._rows[0], self._batch.width
        self._verify_step(row.request, len(drafts))
        end = width + 1 + len(drafts)
        ids = np.asarray([[row.next_token, *drafts]], dtype=np.int64)
        logits = self._forward(ids, self._batch.open(None, width, end), None, width, every_position=True)
        token, accepted, ended = self._choose_along(0, logits, drafts)
        kept = width + 1 + accepted
        self._batch.close(0, kept, end)
        self._batch.take_back(end - kept)
        row.next_token = token
        self._batch.advance([1 + accepted], 1 + accepted)
        if ended:
            self._remove_row(0)

    def _choose_along(self, index: int, logits: np.ndarray, drafts: list[int]) -> tuple[int, int, bool]:
        """Row `index`'s tokens from each position of `logits` [1, positions, vocab] in turn, while
        they equal `drafts` (the tokens fed after each position). Returns the last token (pending),
        the drafts accepted, and whether the request ended."""
        row = self._rows[index]
        accepted, ended, token = 0, False, -1
        entry: list[TokenLogprob | None] = [None]

        def choose(j: int) -> int:
            tokens, entries = self._sample_rows(logits[:, j, :], [row.request])
            entry[0] = entries[0]
            return int(tokens[0])

        for token, matched in accept_drafts(drafts, choose):
            matched = matched and token >= 0
            accepted += matched
            self._produced(row.request, True, matched)
            ended = token < 0 or self._deliver(row.request, token, entry[0])
            row.history.append(token)
            if ended or not matched:
                break
        return token, accepted, ended

    def _verify_step(self, request: Request, drafted: int) -> None:
        """A speculating request's step, checking `drafted` drafts: counted in its stats and, when it
        checks any, in the server's metrics."""
        stats = request.speculation
        if stats is not None:
            stats.verify_steps += 1
            stats.drafted_tokens += drafted
        if drafted:
            self.metrics.spec_decode_num_drafts.inc()
            self.metrics.spec_decode_num_draft_tokens.inc(drafted)

    def _produced(self, request: Request, checked: bool, accepted: bool) -> None:
        """A token a speculating request's step produced, and whether it was the draft; in the server's
        metrics when the step `checked` a draft."""
        stats = request.speculation
        if stats is not None:
            stats.verified_tokens += 1
            stats.accepted_tokens += accepted
        if checked:
            self.metrics.spec_decode_num_accepted_tokens.inc(int(accepted))

    def _sample_rows(
        self, last: np.ndarray, requests: list[Request]
    ) -> tuple[np.ndarray, tuple[TokenLogprob | None, ...]]:
        """One token per row, each from its own decoder, with its logprob entry when asked for; -1
        where the row failed (and was told)."""
        ok = np.ones(len(requests), dtype=bool)
        for problem, rows in invalid_rows(last):
            for index in np.flatnonzero(rows & ok):
                generated = requests[index].generated
                where = "prefill (step 0)" if generated == 0 else f"decode step {generated}"
                self._fail(
                    requests[index],
                    f"{where}: logits {problem}; the model or session produced invalid output, so no token was "
                    "sampled: check the artifact with `kvforge verify` or try another execution provider",
                )
            ok &= ~rows

        def failed(row: int, error: Exception) -> None:
            self._fail(requests[row], f"sampling failed: {error}")

        return choose_tokens([r.chooser for r in requests], last, ok, -1, failed)

    def _deliver(self, request: Request, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Hand one sampled token to its request; True when the request has finished."""
        if self._measured:
            now = time.perf_counter()
            self.metrics.generation_tokens.inc()
            if request.generated == 0:
                self.metrics.time_to_first_token.observe(now - request.arrival)
            else:
                self.metrics.inter_token_latency.observe(now - request.last_token_at)
            request.last_token_at = now
        try:
            text = request.add(token, logprob)
        except Exception as error:  # one request's detokenizer must not stop the others
            self._fail(request, f"detokenizing failed: {error}")
            return True
        if text:
            request.events.put(Delta(text, request.new_logprobs(), request.index))
        return request.finish_reason is not None and self._finish(request, request.finish_reason)

    # -- prefill ------------------------------------------------------------------------

    def _prefill_step(self) -> None:
        assert self._prefill is not None
        state = self._prefill
        request = state.request
        try:
            done, logits, state.cache = next(state.chunks)
        except Exception as error:  # a prefill is one request's: only that request fails
            self._prefill = None
            if isinstance(error, KvforgeError):  # says what is wrong and what to do
                self._fail(request, f"prefill failed: {error}")
                return
            logger.exception("prefill failed")
            self._fail(request, f"prefill failed: {type(error).__name__}: {error}")
            return
        if done < len(request.ids):
            return
        self._prefill = None
        self.metrics.prompt_tokens.inc(len(request.ids))
        tokens, entries = self._sample_rows(logits[:, -1, :], [request])
        token = int(tokens[0])
        finished = token < 0 or self._deliver(request, token, entries[0])
        if self.prefix_cache is not None:  # after the first token is out: its copies do not delay it
            self.prefix_cache.store(request.ids, state.cache, logits[:, -1:, :])
        if not finished:
            self._join(request, state.cache, token)

    def _sequence_cache(self, request: Request) -> tuple[Cache, int]:
        """A fresh batch-1 cache for `request`'s prefill, with the longest cached prefix of its
        prompt restored: the cache and the positions it already holds (`BatchCache.sequence`)."""
        prefix = self.prefix_cache
        return self._batch.sequence(None if prefix is None else lambda buffers: prefix.restore(request.ids, buffers))

    def _join(self, request: Request, cache: Cache, token: int) -> None:
        """A prefilled request joins the batch: its cache as the batch's next row."""
        length = len(request.ids)
        self._batch.join(cache, length)
        row = _Row(request, token)
        if self.speculation is not None:
            row.history = [*request.ids, token]
            try:
                row.drafter = self.speculation.drafter(length + request.budget)
            except KvforgeError as error:  # a draft model with a shorter context: this row does not speculate
                logger.info("request without speculation: %s", error)
        self._rows.append(row)

    def _forward(
        self, ids: np.ndarray, mask: np.ndarray, row: int | None, width: int, every_position: bool = False
    ) -> np.ndarray:
        """Run the model over the batch (or its row `row`) whose cache fills `width` columns; the
        new positions land in columns [width, width + seq). Returns the logits: the last position's,
        or with `every_position` (a verify step) each new position's."""
        feeds = self._batch.feeds(row, width)
        logits, present = forward(self.session, ids, mask, feeds, self._rollback, every_position=every_position)
        self._batch.store(present, row, width, ids.shape[1])
        return logits

    def _remove_row(self, index: int) -> None:
        self._batch.remove(index)
        last = self._rows.pop()
        if index < len(self._rows):
            self._rows[index] = last

    # -- request endings ----------------------------------------------------------------

    def _finish(self, request: Request, reason: str) -> bool:
        try:
            tail = request.finish()
        except Exception as error:
            self._fail(request, f"detokenizing failed: {error}")
            return True
        entries = request.new_logprobs()
        if tail or entries:
            request.events.put(Delta(tail, entries, request.index))
        request.events.put(
            Finished(reason, len(request.ids), request.generated, request.index, incomplete=request.cut_short)
        )
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
        self._batch.clear()
        for request in pending:
            if not request.released:
                self._fail(request, message)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self._rows) + (self._prefill is not None))
        self.metrics.waiting.set(len(self._waiting))
        cached = sum(self._batch.lengths)
        self.metrics.kv_usage.set(cached / (self.max_num_seqs * self.max_positions))


# -- generating in the caller's thread ------------------------------------------------------


def run_inline(
    session: Session,
    requests: Sequence[Request],
    *,
    max_positions: int,
    eos_ids: Sequence[int] = (),
    speculation: Speculation | None = None,
) -> Iterator[list[list[Event]]]:
    """Generate `requests` as one engine core's batch, stepped here (no thread); after each step,
    every request's new events. A failed request raises its message as a GenerationError
    (prefixed with `prompts[i]: ` when there are several).

    The rows share one batch (as many rows as requests), which decodes once every request has
    joined it; with speculation they run one after another, each a batch of one that verifies its
    pending token and drafts in one step."""
    longest = max(len(r.ids) + r.budget for r in requests)
    core = EngineCore(
        session,
        max_positions=min(max_positions, longest),
        eos_ids=eos_ids,
        max_num_seqs=1 if speculation is not None else len(requests),
        prefill_chunk=None,
        speculation=speculation,
        join_first=True,
    )
    core.add(*requests)
    while core.busy:
        core.step()
        events = [_drain(r) for r in requests]
        for row, got in enumerate(events):
            for event in got:
                if isinstance(event, Failed):
                    where = f"prompts[{row}]: " if len(requests) > 1 else ""
                    raise GenerationError(where + event.message)
        yield events


def _drain(request: Request) -> list[Event]:
    """The events a request has had since the last call."""
    events: list[Event] = []
    while not request.events.empty():
        events.append(request.events.get_nowait())
    return events


class NoText(StreamingDetokenizer):
    """The detokenizer of a request whose caller wants token ids only: no text."""

    def __init__(self) -> None:
        self.stopped = False

    def add(self, token_id: int) -> str:
        return ""

    def finish(self) -> str:
        return ""


def token_requests(
    prompts: Sequence[Sequence[int]], budget: int, decoders: Sequence[Decoder], eos_ids: Sequence[int] = ()
) -> list[Request]:
    """One request of token ids (no text) per prompt, each choosing with its decoder."""
    if len(decoders) != len(prompts):
        raise GenerationError(f"{len(prompts)} prompts need one decoder each, got {len(decoders)}")
    return [
        Request(list(ids), decoder.params, budget, NoText(), tuple(eos_ids), decoder=decoder)
        for ids, decoder in zip(prompts, decoders)
    ]


@dataclass(frozen=True)
class Step:
    """One generated position of a batch: the token chosen per row and the logits it came from."""

    tokens: np.ndarray  # int64 [batch]; 0 for rows that had already finished
    logits: np.ndarray  # [batch, vocab], before sampling; zeros for rows that had already finished
    active: np.ndarray  # bool [batch]: rows still generating when this step was taken


class _Recording(Decoder):
    """`inner`, keeping the logits of each choice it makes."""

    def __init__(self, inner: Decoder) -> None:  # what the request reads of it is inner's
        self.inner, self.params, self.processors, self.logprobs = inner, inner.params, inner.processors, inner.logprobs
        self.seen: list[np.ndarray] = []

    def take(self, logits: Any) -> tuple[int, TokenLogprob | None]:
        self.seen.append(np.array(logits, copy=True))
        return self.inner.take(logits)


def logit_steps(
    session: Session,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    max_positions: int,
    decoders: Sequence[Decoder],
    eos_ids: Sequence[int] = (),
) -> Iterator[Step]:
    """The engine core's generation of `prompts` (`run_inline`), one `Step` per generated position
    with the logits each row's token was chosen from: what the verification gate compares, step
    by step. A row is done after it chooses an eos id; the steps go on while any row generates.
    A step is yielded as soon as every row has taken it (or finished), so the steps before a
    failure are seen before its GenerationError."""
    check_length(prompts, max_new_tokens, max_positions)
    recording = [_Recording(d) for d in decoders]
    requests = token_requests(prompts, max_new_tokens, recording, eos_ids)
    taken = 0
    for _ in run_inline(session, requests, max_positions=max_positions, eos_ids=eos_ids):
        while all(len(d.seen) > taken or r.finished for d, r in zip(recording, requests)):
            rows = [d.seen[taken] if len(d.seen) > taken else None for d in recording]
            if all(row is None for row in rows):
                return
            width = next(row for row in rows if row is not None).shape[-1]
            active = np.array([row is not None for row in rows])
            logits = np.stack([np.zeros(width, np.float32) if row is None else row for row in rows])
            tokens = np.array([_token(r, taken) if on else 0 for r, on in zip(requests, active)], dtype=np.int64)
            yield Step(tokens, logits, active)
            taken += 1


def _token(request: Request, index: int) -> int:
    """The `index`-th token `request` took (an ending eos included)."""
    return request.tokens[index] if index < len(request.tokens) else int(request.ending_eos or 0)
