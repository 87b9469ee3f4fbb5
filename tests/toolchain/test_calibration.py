"""Calibrated int4 weights (toolchain/calibration.py): GPTQ-style error feedback on a shipped text."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import click
import numpy as np
import pytest
import torch

from kvforge.passes.quantize import WeightQuantization, quantize_blockwise, quantize_free_min, quantize_with_scales
from kvforge.runners.errors import ArtifactError
from kvforge.toolchain import calibration
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain.cli import _calibration
from kvforge.toolchain.export import eager_model, read_spec

# a mix that leaves q/k/v at 4 bits in the layers `more_bits` does not pick (the default keeps
# every layer's at 8 bits), so that calibration meets every kind of projection
INT4 = WeightQuantization(4, mix="attention_down")


def small_text() -> calibration.CalibrationText:
    """The shipped text, cut into few short windows (CI time)."""
    text = calibration.CalibrationText.resolve(calibration.BUILTIN)
    assert text is not None
    return replace(text, windows=4, window=32)


def correlated_inputs(rows: int, features: int, seed: int) -> torch.Tensor:
    """Activations whose features are correlated and not centred, as a layer's inputs are."""
    generator = torch.Generator().manual_seed(seed)
    mixing = torch.randn(features, features, generator=generator) / features**0.5
    mean = torch.randn(features, generator=generator)
    return torch.randn(rows, features, generator=generator) @ mixing + mean


@pytest.mark.parametrize("act_order", [False, True])
def test_error_feedback_beats_round_to_nearest_on_the_calibration_activations(act_order: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 96) * 0.05
    x = correlated_inputs(2048, 96, seed=1)
    dequantized, scales = calibration.gptq(weight, x.T @ x, 32, calibration.DAMPING, torch.float32, act_order)
    nearest = torch.from_numpy(quantize_blockwise(weight.numpy(), 4, 32, True).dequantize())
    exact = x @ weight.T

    def error(w: torch.Tensor) -> float:
        return float(((x @ w.T - exact) ** 2).sum() / (exact**2).sum())

    assert error(dequantized) < 0.7 * error(nearest)
    # each row is rounded on its own: a few rows at a time give the same values
    factor = calibration.inverse_factor(x.T @ x, 32, calibration.DAMPING, act_order)
    halves = [
        calibration.gptq_rows(weight[rows], factor, 32, torch.float32)[0] for rows in (slice(0, 20), slice(20, 48))
    ]
    torch.testing.assert_close(torch.cat(halves), dequantized, rtol=0, atol=1e-6)
    # the values are codes times the scales: rounding against the scales gives the codes back
    q = quantize_with_scales(dequantized.numpy(), scales, 4, 32)
    assert q.codes.min() >= -8 and q.codes.max() <= 7
    np.testing.assert_allclose(q.dequantize(), dequantized.numpy(), rtol=0, atol=1e-7)


@pytest.mark.parametrize("act_order", [False, True])
def test_error_feedback_on_a_free_minimum_grid_beats_its_round_to_nearest(act_order: bool) -> None:
    """GPTQ over `--free-min`'s grid: codes 0..15 times a step plus a minimum per block, fed back as
    the symmetric codes are; the pass's search finds each block's grid again from the values."""
    torch.manual_seed(0)
    weight = torch.randn(48, 96) * 0.05 + 0.02  # not centred: a free minimum has something to hold
    x = correlated_inputs(2048, 96, seed=1)
    factor = calibration.inverse_factor(x.T @ x, 32, calibration.DAMPING, act_order)
    dequantized, _ = calibration.gptq_rows(weight, factor, 32, torch.float32, free_min=True)
    nearest = torch.from_numpy(quantize_free_min(weight.numpy(), 32).dequantize())
    symmetric, _ = calibration.gptq_rows(weight, factor, 32, torch.float32)
    exact = x @ weight.T

    def error(w: torch.Tensor) -> float:
        return float(((x @ w.T - exact) ** 2).sum() / (exact**2).sum())

    assert error(dequantized) < 0.7 * error(nearest)
    assert error(dequantized) < error(symmetric)
    again = quantize_free_min(dequantized.numpy(), 32)
    assert again.codes.min() >= -8 and again.codes.max() <= 7
    np.testing.assert_allclose(again.dequantize(), dequantized.numpy(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="whole blocks"):
        calibration.gptq_rows(
            weight[:, :80],
            calibration.inverse_factor(x[:, :80].T @ x[:, :80], 32, 0.1, False),
            32,
            torch.float32,
            free_min=True,
        )


def test_a_layer_whose_inputs_are_zero_is_rounded_to_zero_where_they_are() -> None:
    weight = torch.randn(8, 64)
    x = correlated_inputs(256, 64, seed=2)
    x[:, 40:] = 0.0  # inputs never active: their weights cannot matter
    dequantized, _ = calibration.gptq(weight, x.T @ x, 32, calibration.DAMPING, torch.float32)
    assert torch.all(dequantized[:, 40:] == 0)
    assert torch.isfinite(dequantized).all()


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint: Callable[..., Path]) -> Callable[[], torch.nn.Module]:
    path = tiny_checkpoint("llama")
    ckpt = checkpoints.load(path)
    spec = read_spec(ckpt)
    return lambda: eager_model(ckpt, spec)


def test_calibration_is_deterministic_and_the_weights_hold_their_codes(
    tiny: Callable[[], torch.nn.Module], tiny_checkpoint: Callable[..., Path]
) -> None:
    first, second = tiny(), tiny()
    scales = calibration.calibrate(first, small_text(), tiny_checkpoint("llama"), INT4)
    again = calibration.calibrate(second, small_text(), tiny_checkpoint("llama"), INT4)
    assert scales.keys() == again.keys() and scales
    for name in scales:
        np.testing.assert_array_equal(scales[name], again[name])
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert q_proj in scales
    weight = dict(first.named_parameters())[q_proj].detach().numpy()
    codes = quantize_with_scales(weight, scales[q_proj], 4, 32)
    np.testing.assert_allclose(codes.dequantize(), weight, rtol=0, atol=1e-6)


def test_calibrated_weights_leave_kept_and_8_bit_ones_alone(
    tiny: Callable[[], torch.nn.Module], tiny_checkpoint: Callable[..., Path]
) -> None:
    model = tiny()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    recipe = WeightQuantization(4, keep=("lm_head",), int8=("*down_proj*",))
    scales = calibration.calibrate(model, small_text(), tiny_checkpoint("llama"), recipe)
    after = dict(model.named_parameters())
    assert "lm_head.weight" not in scales and torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    assert not any("down_proj" in name for name in scales)
    assert torch.equal(after["model.layers.0.mlp.down_proj.weight"], before["model.layers.0.mlp.down_proj.weight"])
    assert not torch.equal(after["model.layers.0.mlp.up_proj.weight"], before["model.layers.0.mlp.up_proj.weight"])


def test_statistics_are_held_a_group_at_a_time_within_the_budget(
    tiny: Callable[[], torch.nn.Module], tiny_checkpoint: Callable[..., Path]
) -> None:
    model = tiny()
    windows = small_text().token_windows(tiny_checkpoint("llama"))
    inputs = calibration._inputs(model, windows[:1, :8], INT4)
    # q/k/v read one input, gate/up another: one statistic each
    shared = [[name.rsplit(".", 1)[-1] for name, _ in found.modules] for found in inputs[:4]]
    assert shared[0] == ["q_proj", "k_proj", "v_proj"] and ["gate_proj", "up_proj"] in shared
    one = inputs[0].features ** 2 * 4
    groups = calibration._groups(inputs, budget_bytes=2 * one)
    assert len(groups) > 1
    assert all(sum(f.features**2 * 4 for f in group) <= 2 * one or len(group) == 1 for group in groups)
    calibration._collect(model, windows, groups[0])
    assert all(found.hessian is not None for found in groups[0])
    assert all(found.hessian is None for group in groups[1:] for found in group)  # not yet allocated


def test_the_calibration_choice_is_resolved_and_refused_where_it_means_nothing(tmp_path: Path) -> None:
    assert _calibration(None, INT4) is None  # round to nearest unless asked: calibrating takes minutes
    builtin = _calibration("builtin", INT4)
    assert builtin is not None and builtin.builtin
    assert builtin.sha256 == hashlib.sha256(calibration.builtin_text().read_bytes()).hexdigest()
    assert _calibration("none", INT4) is None
    assert _calibration(None, WeightQuantization(4, symmetric=False)) is None  # asymmetric rounds to nearest
    assert _calibration(None, WeightQuantization(8)) is None
    own = tmp_path / "mine.txt"
    own.write_text("def f(x):\n    return x\n" * 100, encoding="utf-8")
    chosen = _calibration(str(own), INT4)
    assert chosen is not None and chosen.to_dict()["text"] == "mine.txt"
    with pytest.raises(click.BadParameter, match="int8"):
        _calibration(str(own), WeightQuantization(8))
    with pytest.raises(ArtifactError, match="cannot read"):
        _calibration(str(tmp_path / "absent.txt"), INT4)
    (tmp_path / "bytes.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ArtifactError, match="not UTF-8"):
        _calibration(str(tmp_path / "bytes.bin"), INT4)


def test_the_shipped_text_is_mixed_and_stays_small() -> None:
    text = calibration.builtin_text().read_text(encoding="utf-8")
    assert 200_000 < len(text.encode()) <= 400_000
    assert "def " in text and "statement" in text  # code and prose
    assert (calibration.builtin_text().parent / "calibration.LICENSE.txt").is_file()


@pytest.mark.slow
def test_a_calibrated_build_records_its_text_and_rounding_to_nearest_does_not(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from kvforge import BuildOptions, build

    path = tiny_checkpoint("llama")
    text = small_text()
    calibrated = build(path, tmp_path / "cal", BuildOptions(weights=INT4, calibration=text))
    nearest = build(path, tmp_path / "rtn", BuildOptions(weights=INT4))
    manifest = json.loads((calibrated.output / "manifest.json").read_text())
    assert manifest["flags"]["calibration"] == text.to_dict()
    assert manifest["flags"]["calibration"]["text_sha256"] == text.sha256
    counts = {p.name: p.fusions for p in calibrated.passes.passes}
    assert counts["QuantizeWeights"]["calibrated"] > 0
    plain = json.loads((nearest.output / "manifest.json").read_text())
    assert "calibration" not in plain["flags"]
    assert "calibrated" not in {p.name: p.fusions for p in nearest.passes.passes}["QuantizeWeights"]
    assert calibrated.parity.passed and nearest.parity.passed


def test_the_weights_a_mix_keeps_at_8_bits_are_not_calibrated(tiny: Callable[[], torch.nn.Module]) -> None:
    """The default mix keeps every layer's q/k/v and the down projection of the layers `more_bits`
    picks at 8 bits (`attention_down`: q/k/v of those layers and every down projection):
    calibration leaves them (their codes are rounded to nearest at 8 bits) and calibrates every
    other projection."""
    from kvforge.passes.storage import more_bits

    model = tiny()
    everything = set(calibration._candidates(model, WeightQuantization(4, mix="none")).values())
    layers = model.config.num_hidden_layers
    chosen = [i for i in range(layers) if more_bits(i, layers)]
    default = {f"model.layers.{i}.self_attn.{p}_proj" for i in range(layers) for p in "qkv"}
    default |= {f"model.layers.{i}.mlp.down_proj" for i in chosen}
    down = {f"model.layers.{i}.self_attn.{p}_proj" for i in chosen for p in "qkv"}
    down |= {f"model.layers.{i}.mlp.down_proj" for i in range(layers)}
    for recipe, picked in ((WeightQuantization(4), default), (INT4, down)):
        assert picked and picked <= everything
        assert set(calibration._candidates(model, recipe).values()) == everything - picked


def test_each_statistic_is_freed_once_its_weights_are_rounded(
    tiny: Callable[[], torch.nn.Module], tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    found: list[calibration._Input] = []
    alive: list[int] = []
    inputs, factor = calibration._inputs, calibration.inverse_factor

    def spy_inputs(*args: object) -> list[calibration._Input]:
        found.extend(inputs(*args))  # type: ignore[arg-type]
        return found

    def spy_factor(*args: object) -> calibration.Factor:
        alive.append(sum(f.hessian is not None for f in found))
        return factor(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(calibration, "_inputs", spy_inputs)
    monkeypatch.setattr(calibration, "inverse_factor", spy_factor)
    one = 64 * 64 * 4  # the tiny model's hidden size: one attention input's statistic
    calibration.calibrate(tiny(), small_text(), tiny_checkpoint("llama"), INT4, budget_bytes=2 * one)
    assert len(alive) == len(found) > 2
    assert max(alive) <= 2  # never more than one group's statistics at once
    assert all(f.hessian is None for f in found)
