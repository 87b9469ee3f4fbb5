"""`--kv-dtype int8`: the cache kept as int8 codes by onnxruntime's GroupQueryAttention, with the
per-channel scales a build calibrates on the eager model."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from kvforge import BuildOptions, build
from kvforge.passes.targets import TARGETS
from kvforge.runners.contract import DecoderIO
from kvforge.runners.engine import Engine
from kvforge.runners.errors import ArtifactError
from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.session import OrtSession
from kvforge.toolchain import kv_scales
from tests.serve.test_scheduler import collect, request, scheduler_for, solo


@pytest.fixture(scope="module")
def int8_cache(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tiny_checkpoint("llama"), tmp_path_factory.mktemp("kv") / "out", BuildOptions(kv_dtype="int8")).output


def _prompt(length: int = 24) -> np.ndarray:
    return np.random.default_rng(5).integers(3, 300, size=(1, length), dtype=np.int64)


def _caches(artifact: Path, ids: np.ndarray) -> tuple[DecoderIO, dict[str, np.ndarray]]:
    session = OrtSession(
        artifact / "model.onnx", DecoderIO.from_dict(json.loads((artifact / "manifest.json").read_text())["io"])
    )
    _, cache = forward(session, ids, np.ones_like(ids), empty_cache(session.io, 1, 64))
    return session.io, {name: np.asarray(cache[name]) for name in session.io.cache_names}


@pytest.mark.slow
def test_the_cache_holds_each_position_within_half_a_step_of_the_float_cache(
    int8_cache: Path, built_artifact: Callable[..., Path]
) -> None:
    """The int8 artifact's cache, read back through the scales in its graph, is the float32 artifact's
    cache: layer 0, whose keys and values both compute from the same tokens, to within half a code
    step per channel (the scales reach the kernel in the layout it reads, one per key/value head
    and channel, head-major); later layers, whose inputs already went through an int8 cache, to
    within two steps. Nothing saturates on tokens the calibration did not see (a random prompt)."""
    ids = _prompt()
    io, codes = _caches(int8_cache, ids)
    float_io, floats = _caches(built_artifact("llama"), ids)
    assert io.kv_dtype == "int8" and float_io.kv_dtype == "float32"
    graph = onnx.load(int8_cache / "model.onnx")
    scales = {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer if t.name.endswith(".scale")}
    positions = ids.shape[1]
    for name in io.cache_names:
        step = scales[f"{name}.scale"].reshape(1, io.num_kv_heads, 1, -1)
        held = codes[name][:, :, :positions]
        assert held.dtype == np.int8 and np.abs(held).max() < 127
        assert np.abs(held).max() > 64  # the scales use the codes' range
        error = np.abs(held.astype(np.float32) * step - floats[name][:, :, :positions]) / step
        assert error.max() <= (0.5001 if name.startswith("past_key_values.0.") else 2.0), name


@pytest.mark.slow
def test_an_int8_cache_is_a_quarter_of_the_bytes_judged_by_distributions_and_generates(
    int8_cache: Path, built_artifact: Callable[..., Path]
) -> None:
    manifest = json.loads((int8_cache / "manifest.json").read_text())
    assert manifest["flags"]["kv_dtype"] == "int8"
    assert manifest["parity"]["precision"] == "int8" and manifest["parity"]["passed"]
    float_artifact = built_artifact("llama")
    float_io = DecoderIO.from_dict(json.loads((float_artifact / "manifest.json").read_text())["io"])
    int8_io = DecoderIO.from_dict(manifest["io"])
    assert int8_io.kv_bytes_by_kind(100)["full"] * 4 == float_io.kv_bytes_by_kind(100)["full"]
    graph = onnx.load(int8_cache / "model.onnx", load_external_data=False)
    attention = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) == int8_io.num_layers
    assert all({a.name: a.i for a in n.attribute}["kv_cache_bit_width"] == 8 for n in attention)


@pytest.mark.slow
def test_the_example_model_answers_as_with_a_float_cache(example_artifact: Path, tmp_path: Path) -> None:
    """On a trained model (the bundled example; the tiny random one has no decisive token), greedy
    generation through the int8 cache gives the float32 cache's text."""
    example = Path(__file__).resolve().parents[2] / "examples" / "model"
    int8 = build(example, tmp_path / "out", BuildOptions(kv_dtype="int8")).output
    prompt = "def fibonacci(n):"
    engine = Engine.load(int8)
    quantized = engine.generate(prompt, max_new_tokens=24, temperature=0.0)
    assert quantized == Engine.load(example_artifact).generate(prompt, max_new_tokens=24, temperature=0.0)
    # the server's continuous batch holds int8 rows too: each row as generated alone
    prompts = [prompt, "class Point:", "import os\nimport sys"]
    scheduler = scheduler_for(engine)
    try:
        requests = [request(engine, p, 12) for p in prompts]
        scheduler.submit(*requests)
        assert [collect(r)[0] for r in requests] == [solo(engine, p, 12)[0] for p in prompts]
    finally:
        scheduler.stop()


def test_a_target_without_groupqueryattention_is_refused_before_loading(tmp_path: Path) -> None:
    options = BuildOptions(kv_dtype="int8", target=TARGETS["onnx"])
    with pytest.raises(ArtifactError, match=r"--kv-dtype int8: --target onnx .*--target ort-cpu"):
        build(tmp_path / "never-read", tmp_path / "out", options)
    with pytest.raises(ArtifactError, match="--kv-dtype 'fp8'"):
        build(tmp_path / "never-read", tmp_path / "out", BuildOptions(kv_dtype="fp8"))


def test_key_scales_hold_every_rotation_of_the_calibrated_keys() -> None:
    """A key's scale is its rotation plane's largest norm: the same keys rotated to any other
    position quantize without clipping, where each channel's own largest magnitude would clip."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((1, 2, 40, 8)).astype(np.float32)
    bound = kv_scales._pair_norms(keys).max(axis=(0, 2))
    own = np.abs(keys).max(axis=(0, 2))
    assert np.all(bound >= own - 1e-6)
    half = 4
    for angle in np.linspace(0, 2 * np.pi, 13):
        cos, sin = np.cos(angle), np.sin(angle)
        first, second = keys[..., :half], keys[..., half:]
        rotated = np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
        assert np.all(np.abs(rotated).max(axis=(0, 2)) <= bound + 1e-5)
    quarter = np.array([[[[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]]]], dtype=np.float32)  # all in channel 4
    assert kv_scales._pair_norms(quarter)[0, 0, 0, 0] == pytest.approx(1.0)  # its partner, channel 0, may turn to 1


def test_windows_spread_over_the_text_and_cover_a_short_one() -> None:
    short = kv_scales.windows(list(range(10)), 50, count=4, length=256)
    assert short[0] == list(range(10)) and len(short) == 5
    spread = kv_scales.windows(list(range(1000, 2000)), 50, count=4, length=100)
    assert [w[0] for w in spread[:4]] == [1000, 1300, 1600, 1900] and all(len(w) == 100 for w in spread)
    drawn = [t for w in spread[4:] for t in w]
    assert len(drawn) == 400 and min(drawn) >= 0 and max(drawn) < 50 and len(set(drawn)) == 50  # the whole vocabulary
    assert spread == kv_scales.windows(list(range(1000, 2000)), 50, count=4, length=100)  # deterministic


def test_only_the_cache_may_be_int8_in_a_manifest(built_artifact: Callable[..., Path]) -> None:
    io = DecoderIO.from_dict(json.loads((built_artifact("llama") / "manifest.json").read_text())["io"])
    assert DecoderIO.from_dict(replace(io, kv_dtype="int8").to_dict()).kv_dtype == "int8"
    with pytest.raises(ArtifactError, match="io.logits_dtype 'int8' is not one of float32, float16, bfloat16"):
        DecoderIO.from_dict(replace(io, logits_dtype="int8").to_dict())
