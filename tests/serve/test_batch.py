"""`BatchCache`, the continuous batch's cache layout, on its own (NumPy on the host).

A scripted session writes each token id into the cache as that position's keys and values, so
a row's cache must read back as exactly its own tokens, in order, through any sequence of
joins, steps, verify steps that keep some drafts (holes), removals and compactions.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvforge.runners.cache import BatchCache
from kvforge.runners.contract import DecoderIO, LayerState
from kvforge.runners.generate import empty_cache, forward, prefill

CONTEXT = 48


class TokenSession:
    """Each new position's keys and values are its token id; a state adds up the ids fed."""

    def __init__(self, io: DecoderIO) -> None:
        self.io = io

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = feeds["input_ids"]
        batch, seq = ids.shape
        total = feeds["attention_mask"].shape[1]
        new = np.broadcast_to(ids[:, None, :, None], (batch, self.io.num_kv_heads, seq, self.io.head_dim))
        outputs = {"logits": np.zeros((batch, seq, self.io.vocab_size), np.float32)}
        for past, present in zip(self.io.past_names, self.io.present_names):
            buffer = feeds[past]
            if self.io.shared_kv and self.io.window_of(past) is None:
                buffer[:, :, total - seq : total] = new  # in place, where the mask's length says
                outputs[present] = buffer
            else:
                outputs[present] = np.concatenate([buffer, new.astype(buffer.dtype)], axis=2)
        for past, present in zip(self.io.state_names, self.io.state_present_names):
            outputs[present] = feeds[past] + ids.sum(axis=1).reshape(-1, *[1] * (feeds[past].ndim - 1))
        return outputs


def _io(kind: str) -> DecoderIO:
    if kind == "shared":
        return DecoderIO(2, 1, 2, 8, kv_mode="shared")
    if kind == "concat":
        return DecoderIO(2, 1, 2, 8)
    if kind == "window":  # layer 0 keeps its last 4 positions
        return DecoderIO(2, 1, 2, 8, kv_mode="shared", layer_windows=(5, None))
    layers = (LayerState("attention"), LayerState("conv", ((3, 2),)))  # a fixed-size state
    return DecoderIO(2, 1, 2, 8, layers=layers)


def _check(batch: BatchCache, io: DecoderIO, rows: list[list[int]]) -> None:
    width = batch.width
    assert batch.rows == len(rows) and batch.lengths == [len(r) for r in rows]
    feeds = batch.feeds(None, width)
    for index, tokens in enumerate(rows):
        columns = np.flatnonzero(batch.mask[index, :width])
        assert len(columns) == len(tokens) and (not tokens or columns[-1] < width)
        assert not batch.mask[index, width:].any()
        for name in io.past_names:
            window = io.window_of(name)
            if window is None:
                np.testing.assert_array_equal(feeds[name][index, 0, columns, 0], tokens)
            else:  # the last min(width, window - 1) columns before the width
                held = feeds[name].shape[2]
                assert held == min(width, window - 1)
                tail = batch.mask[index, width - held : width] == 1
                np.testing.assert_array_equal(feeds[name][index, 0, tail, 0], tokens[len(tokens) - tail.sum() :])
        for name in io.state_names:
            assert (feeds[name][index] == sum(tokens)).all()


@pytest.mark.parametrize("kind", ["shared", "concat", "window", "states"])
def test_every_row_reads_back_its_own_tokens_through_joins_steps_removals_and_compactions(kind: str) -> None:
    io = _io(kind)
    session = TokenSession(io)
    batch = BatchCache(io, max_rows=4, max_positions=CONTEXT)
    holes = kind in ("shared", "concat")  # speculation refuses window-bounded layers and states
    rng = np.random.default_rng(7)
    rows: list[list[int]] = []
    tag = 0
    for _ in range(300):
        if len(rows) < 4 and (not rows or rng.random() < 0.25):
            tag += 1
            prompt = [tag * 100 + i for i in range(int(rng.integers(1, 30)))]
            ids = np.asarray([prompt])
            cache = empty_cache(io, 1, CONTEXT)
            *_, (_, _, cache) = prefill(session, ids, np.ones_like(ids), cache, chunk=int(rng.integers(1, 8)))
            batch.join(cache, len(prompt))
            rows.append(prompt)
        else:
            drafts = int(rng.integers(0, 4)) if holes else 0
            batch.make_room(1 + drafts)
            width, n = batch.width, len(rows)
            ids = np.asarray([[r[0] // 100 * 100 + len(r)] for r in rows])
            _, present = forward(session, ids, batch.open(None, width, width + 1), batch.feeds(None, width))
            batch.store(present, None, width, 1)
            growth = [1] * n
            for index, row in enumerate(rows):
                row.append(int(ids[index, 0]))
            verify = min(drafts, batch.room)
            if verify:  # one row feeds drafts after its token and keeps some of them
                index = int(rng.integers(n))
                start = width + 1
                fed = [rows[index][0] // 100 * 100 + len(rows[index]) + j for j in range(verify)]
                mask = batch.open(index, start, start + verify)
                _, present = forward(session, np.asarray([fed]), mask, batch.feeds(index, start))
                batch.store(present, index, start, verify)
                kept = int(rng.integers(0, verify + 1))
                batch.close(index, start + kept, start + verify)
                rows[index].extend(fed[:kept])
                growth[index] += kept
            batch.advance(growth, max(growth))
        for index in reversed(range(len(rows))):
            if len(rows[index]) + 4 >= CONTEXT or rng.random() < 0.04:
                batch.remove(index)
                rows[index] = rows[-1]
                rows.pop()
        _check(batch, io, rows)
    assert batch.compactions > 0
    assert batch.mask.shape[1] <= batch.capacity_limit
