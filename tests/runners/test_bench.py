"""kvforge bench: the byte accounting behind the roofline, and which configurations run.

No assertion here is about speed (machines are shared and noisy); speeds are only checked
to be measured at all, the arithmetic around them exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.runners.bench import (
    BenchResult,
    Round,
    bench,
    kv_bytes_per_step,
    measure_round,
    ratios,
    weight_bytes_per_step,
)
from kvforge.runners.engine import Engine
from kvforge.runners.generate import empty_cache, forward, left_pad
from kvforge.runners.manifest import read_manifest

pytestmark = pytest.mark.slow


def test_kv_bytes_equal_the_present_tensors_a_step_returns(built_artifact: Callable[..., Path]) -> None:
    engine = Engine.load(built_artifact("llama"))
    io = engine.session.io
    ids, mask = left_pad([[5, 6, 7, 8, 9], [3, 4, 5, 6, 7]], pad_id=0)
    _, cache = forward(engine.session, ids, mask, empty_cache(io, 2, capacity=5))
    assert sum(a.nbytes for a in cache.values()) == kv_bytes_per_step(io, context=5, batch=2)


def test_weight_bytes_are_every_external_weight_but_the_untied_input_embedding(
    built_artifact: Callable[..., Path],
) -> None:
    artifact = built_artifact("llama")  # the tiny llama has untied embeddings
    model = onnx.load(artifact / "model.onnx", load_external_data=False)
    external = {t.name: int(np.prod(t.dims)) * 4 for t in model.graph.initializer if t.data_location == 1}
    expected = sum(external.values()) - external["model.embed_tokens.weight"]
    assert weight_bytes_per_step(artifact, read_manifest(artifact)) == expected


def test_configurations_beyond_the_context_are_skipped_and_the_roofline_is_batch_times_bandwidth_over_bytes(
    built_artifact: Callable[..., Path],
) -> None:
    artifact = built_artifact("llama")  # context 256
    results, skipped, bandwidth = bench(
        artifact, prompts=(8, 300), batches=(1, 2), new_tokens=4, repeats=2, bandwidth=1e9
    )
    assert bandwidth == 1e9
    assert [(r.prompt, r.batch) for r in results] == [(8, 1), (8, 2)]
    assert all(len(r.rounds) == 2 and {x.bandwidth for x in r.rounds} == {1e9} for r in results)
    assert skipped == ["prompt 300: + 4 new tokens exceeds the context of 256"]
    io = Engine.load(artifact).session.io
    weights = weight_bytes_per_step(artifact, read_manifest(artifact))
    for r in results:
        assert r.bytes_per_step == weights + kv_bytes_per_step(io, 8 + 2, r.batch)
        assert r.roofline_tokens_per_s == pytest.approx(r.batch * 1e9 / r.bytes_per_step)
        assert r.first_token_ms > 0 and r.decode_tokens_per_s > 0


def test_a_round_prefills_every_configuration_then_takes_their_decode_steps_in_turn(
    built_artifact: Callable[..., Path],
) -> None:
    engine = Engine.load(built_artifact("llama"))
    calls = []
    run = engine.session.run

    def recorded(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(feeds["input_ids"].shape)
        return run(feeds)

    engine.session.run = recorded  # type: ignore[method-assign]
    batches = [[[5, 6, 7, 8]], [[3, 4, 5], [6, 7, 8]]]
    measured = measure_round(engine, batches, new_tokens=3)
    # (rows, new positions) per call: every prompt prefilled alone (the engine core's prefills), then
    # one decode step of each configuration's batch in turn
    assert calls == [(1, 4), (1, 3), (1, 3), (1, 1), (2, 1), (1, 1), (2, 1)]
    assert len(measured) == 2 and all(first > 0 and speed > 0 for first, speed in measured)


def test_cli_json_output(built_artifact: Callable[..., Path]) -> None:
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(built_artifact("llama")),
            "--prompt",
            "8",
            "--batch",
            "1",
            "--new-tokens",
            "3",
            "--repeats",
            "1",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["bandwidth_bytes_per_s"] > 0 and data["peak_memory_bytes"] > 0
    (row,) = data["results"]
    assert (row["prompt"], row["batch"], row["new_tokens"]) == (8, 1, 3)
    assert row["roofline_fraction"] == pytest.approx(row["decode_tokens_per_s"] / row["roofline_tokens_per_s"])
    assert data["ratios"] == []  # one configuration: nothing to compare


def test_figures_are_medians_over_rounds_and_ratios_are_taken_within_a_round() -> None:
    """A round disturbed for every configuration moves each one's speed, not their ratio."""

    def result(prompt: int, batch: int, speeds: list[float], bandwidths: list[float]) -> BenchResult:
        rounds = tuple(Round(10.0 * i, speed, bw) for i, (speed, bw) in enumerate(zip(speeds, bandwidths)))
        return BenchResult(prompt, batch, 4, 1000, rounds)

    bandwidths = [4000.0, 2000.0, 3000.0]  # round 2 is disturbed: half the read bandwidth...
    short = result(128, 1, [40.0, 20.0, 30.0], bandwidths)  # ...and half the decode speed
    long = result(1024, 1, [20.0, 19.0, 36.0], bandwidths)
    batched = result(128, 8, [200.0, 100.0, 150.0], bandwidths)
    assert short.decode_tokens_per_s == 30.0 and short.first_token_ms == 10.0
    assert short.roofline_tokens_per_s == 3.0  # batch 1 × median bandwidth 3000 / 1000 bytes
    assert short.roofline_fraction == pytest.approx(10.0)  # every round: speed = 10 × its own roofline
    found = {(r.config, r.base): r.ratio for r in ratios([short, long, batched])}
    # within rounds 0.5, 0.95, 1.2 -> 0.95 (the ratio of the medians, 20 / 30, mixes rounds); batch 8 / 1: 5.0
    assert found == {((1024, 1), (128, 1)): pytest.approx(0.95), ((128, 8), (128, 1)): pytest.approx(5.0)}
    assert ratios([long]) == []
