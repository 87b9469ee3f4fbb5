"""The server's continuous batch with its cache on a device, checked on the CPU.

As in `tests/runners/test_device_cache.py`, the CPU provider is made to behave as a device does
(every host array bound is copied when bound) and the session keeps its cache in memory
onnxruntime owns (`OrtDevice`): the batch's cache then lives there, its rows join, leave and are
compacted by copies run there, and greedy texts must equal the plain CPU server's. A step moves
the ids, positions and mask up and the logits down, and nothing that grows with the cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from kvforge.runners.cache import OrtDevice
from kvforge.runners.engine import Engine
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.prefix_cache import PrefixCache
from kvforge.runners.serve.scheduler import BatchScheduler, Finished, Request
from tests.runners.test_device_cache import copied_at_bind
from tests.serve.test_scheduler import PROMPTS, collect, request, wait_generating
from tests.serve.test_speculative import SPEC_PROMPTS

pytestmark = pytest.mark.slow


def _engine(artifact: Path, on_device: bool) -> Engine:
    engine = Engine.load(artifact, runtime="ort", huge_pages=False)
    if on_device:
        engine.session.device = OrtDevice("cpu", 0)  # type: ignore[misc]
    return engine


def _scheduler(engine: Engine, **options: Any) -> BatchScheduler:
    settings = dict(max_num_seqs=3, max_queued=16, prefill_chunk=8) | options
    scheduler = BatchScheduler.for_engine(engine, metrics=Metrics(), **settings)
    scheduler.start()
    return scheduler


def _texts(engine: Engine, prompts: list[str], budgets: list[int], **options: Any) -> list[tuple[str, int]]:
    """Every prompt's greedy text and token count, the first running before the others arrive:
    more requests than rows, so rows join and leave mid-flight."""
    scheduler = _scheduler(engine, **options)
    try:
        requests = [request(engine, p, n) for p, n in zip(prompts, budgets)]
        scheduler.submit(requests[0])
        wait_generating(requests[0])
        for req in requests[1:]:
            scheduler.submit(req)
        ended = [collect(req) for req in requests]
        if isinstance(engine.session.device, OrtDevice):  # the batch's cache is the device's
            assert all(isinstance(t, ort.OrtValue) for t in scheduler._batch._kv.values())
    finally:
        scheduler.stop()
    assert all(isinstance(end, Finished) for _, end in ended), ended
    return [(text, end.completion_tokens) for text, end in ended]  # type: ignore[union-attr]


def _both(artifact: Path, run: Callable[[Engine], Any]) -> tuple[Any, Any]:
    on_host = run(_engine(artifact, on_device=False))
    with copied_at_bind():
        on_device = run(_engine(artifact, on_device=True))
    return on_host, on_device


BUDGETS = [30, 10, 25, 12, 20, 16]


# llama: GroupQueryAttention's shared buffer; gemma2: the `concat` cache and a sliding window;
# gemma3_text: layers bounded by a sliding window; qwen3_5_text: fixed-size recurrent states
@pytest.mark.parametrize("kind", ["llama", "gemma2", "gemma3_text", "qwen3_5_text"])
def test_the_servers_batch_on_a_device_generates_the_host_texts(built_artifact: Any, kind: str) -> None:
    on_host, on_device = _both(built_artifact(kind), lambda engine: _texts(engine, PROMPTS, BUDGETS))
    assert on_device == on_host


def test_speculation_on_a_device_generates_the_plain_host_texts(built_artifact: Any) -> None:
    artifact = built_artifact("llama")
    budgets = [40, 12, 60, 8, 50, 30, 25, 45, 35]
    plain = _texts(_engine(artifact, on_device=False), SPEC_PROMPTS, budgets)

    def speculating(engine: Engine) -> list[tuple[str, int]]:
        speculation = engine.speculation("prompt-lookup", 5)
        return _texts(engine, SPEC_PROMPTS, budgets, speculation=speculation, speculative_rows=8, max_num_seqs=4)

    with copied_at_bind():
        on_device = speculating(_engine(artifact, on_device=True))
    assert on_device == plain


def test_prefix_cache_hits_on_a_device_generate_the_host_texts(built_artifact: Any) -> None:
    artifact = built_artifact("llama")

    def in_turn(engine: Engine) -> tuple[list[str], int]:
        io = engine.session.io
        metrics = Metrics()
        names = [name for name in io.past_names if io.window_of(name) is None]
        cache = PrefixCache(1 << 24, b"tiny llama", names, metrics)
        scheduler = BatchScheduler.for_engine(
            engine, metrics=metrics, prefix_cache=cache, max_num_seqs=2, max_queued=4, prefill_chunk=8
        )
        scheduler.start()
        prefix = engine.encode(PROMPTS[3] + PROMPTS[6])
        texts = []
        try:
            for tail in ([7, 8, 9], [7, 8, 10], [11]):
                req = request(engine, [*prefix, *tail], 12)
                scheduler.submit(req)
                texts.append(collect(req)[0])
        finally:
            scheduler.stop()
        return texts, int(metrics.prefix_cache_hit_tokens.get())

    (host_texts, host_hits), (device_texts, device_hits) = _both(artifact, in_turn)
    assert device_hits == host_hits > 0
    assert device_texts == host_texts


# -- what crosses between host and device in a decode step ----------------------------------


class Crossings:
    """Bytes copied between the host and the (simulated) device through onnxruntime's Python API,
    and the addresses each cache input was bound at."""

    def __init__(self) -> None:
        self.bytes = 0
        self.addresses: dict[str, int] = {}


@pytest.fixture
def crossings() -> Iterator[Crossings]:
    seen = Crossings()
    binding, value = ort.IOBinding, ort.OrtValue
    bind_cpu_input, bind_input, bind_output = binding.bind_cpu_input, binding.bind_input, binding.bind_output
    from_numpy, numpy, update = value.ortvalue_from_numpy, value.numpy, value.update_inplace

    def counted_cpu_input(self: Any, name: str, array: np.ndarray) -> None:
        seen.bytes += array.nbytes
        bind_cpu_input(self, name, array)

    def counted_input(self: Any, name: str, *args: Any) -> None:
        if len(args) == 5:  # bound by address: where the cache is
            seen.addresses[name] = args[4]
        bind_input(self, name, *args)

    def counted_output(self: Any, name: str, *args: Any) -> None:
        if name == "logits":  # the logits are bound to a host array
            seen.bytes += math.prod(args[3]) * np.dtype(args[2]).itemsize
        bind_output(self, name, *args)

    def counted_from_numpy(array: np.ndarray, *args: Any) -> Any:
        seen.bytes += np.asarray(array).nbytes
        return from_numpy(array, *args)

    def counted_numpy(self: Any) -> np.ndarray:
        array = numpy(self)
        seen.bytes += array.nbytes
        return array

    def counted_update(self: Any, array: Any) -> None:
        seen.bytes += np.asarray(array).nbytes
        update(self, array)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(binding, "bind_cpu_input", counted_cpu_input)
        patch.setattr(binding, "bind_input", counted_input)
        patch.setattr(binding, "bind_output", counted_output)
        patch.setattr(value, "ortvalue_from_numpy", staticmethod(counted_from_numpy))
        patch.setattr(value, "numpy", counted_numpy)
        patch.setattr(value, "update_inplace", counted_update)
        yield seen


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory: Any) -> Path:
    """The tiny llama with 4,096 positions."""
    from kvforge import BuildOptions, build
    from tests.tiny import make_checkpoint

    checkpoint = make_checkpoint(tmp_path_factory.mktemp("ckpt-long"), "llama", max_position_embeddings=4096)
    return build(checkpoint, tmp_path_factory.mktemp("art-long") / "out", BuildOptions(context=4096)).output


@pytest.mark.parametrize("positions", [256, 4096])
@pytest.mark.parametrize("rows", [1, 8])
def test_a_decode_step_moves_ids_positions_mask_and_logits_only(
    long_artifact: Path, crossings: Crossings, positions: int, rows: int
) -> None:
    engine = _engine(long_artifact, on_device=True)
    io = engine.session.io
    scheduler = BatchScheduler.for_engine(engine, metrics=Metrics(), max_num_seqs=8, max_queued=8, prefill_chunk=512)
    rng = np.random.default_rng(0)
    lengths = [positions - 40] + [int(n) for n in rng.integers(3, 40, rows - 1)]
    for length in lengths:  # not started: the test steps the engine itself
        ids = [int(t) for t in rng.integers(2, io.vocab_size, length)]
        params = engine.sampling(temperature=0.0)
        scheduler.submit(Request(ids, params, 32, engine.tokenizer.detokenizer((), context_ids=ids), ignore_eos=True))
    with copied_at_bind():
        for _ in range(64):  # every row prefilled and joined (each has 32 tokens to go, enough)
            if not (scheduler._waiting or scheduler._prefill is not None):
                break
            scheduler.step()
        steps = []
        for _ in range(2):
            width = scheduler._batch.width
            crossings.bytes, crossings.addresses = 0, {}
            scheduler.step()
            steps.append((width, crossings.bytes, dict(crossings.addresses)))
    assert len(scheduler._rows) == rows
    for width, moved, _ in steps:
        assert width >= positions - 40
        small = rows * (8 + 8 + 8 * (width + 1)) + 8  # ids, positions, mask; logits_to_keep
        logits = rows * io.vocab_size * np.dtype(io.logits_dtype).itemsize
        assert logits + rows * 8 * (width + 1) <= moved <= small + logits, (moved, small, logits)
    # the same addresses at every step: the batch's buffers, allocated once
    (_, _, first), (_, _, second) = steps
    assert set(first) == set(io.past_names) and first == second
