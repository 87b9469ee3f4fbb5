"""The gate stays sharp on a real trained checkpoint (SmolLM2-135M-Instruct): it fails the
build on the small bugs that matter, naming the first output they reach.

The cases reuse the one `--exact-activations` artifact (the file's quantized matrices imported
exactly, computed in float32, judged by the float gate): each bug is put into the eager model (a weight, the
rotary base, the norms' epsilon) or into what the compiled model is fed (its positions, where
its cache is written), and the gate is run again. The gate compares the two sides
symmetrically, so a bug on either side is the same difference to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvforge.runners.errors import ParityError
from kvforge.runners.session import Session
from tests.real.models import xdist_group

NAME = "smollm2"
pytestmark = [pytest.mark.slow, xdist_group(NAME)]


# --- the gate stays sharp ---------------------------------------------------------------------------


@dataclass
class GateSides:
    model: Any  # the eager torch model
    eager: Session
    compiled: Session
    max_positions: int
    good: Any  # the eager side's recorded run, unperturbed


@pytest.fixture(scope="module")
def gate_sides(real_checkpoint: Callable[[str], Path], real_artifact: Callable[..., Path]) -> GateSides:
    from kvforge.runners.contract import DecoderIO
    from kvforge.runners.manifest import read_manifest
    from kvforge.runners.session import OrtSession
    from kvforge.toolchain import checkpoint as checkpoints
    from kvforge.toolchain.export import eager_model
    from kvforge.toolchain.gate import eager_session
    from kvforge.toolchain.spec import DecoderSpec
    from kvforge.toolchain.verify import record_reference

    artifact = real_artifact(NAME, exact=True)
    ckpt = checkpoints.load(real_checkpoint(NAME))
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    io = DecoderIO.from_dict(read_manifest(artifact)["io"])
    assert io.kv_mode == "shared"  # the cache bug below is one of a shared buffer
    model = eager_model(ckpt, spec)
    eager = eager_session(model, spec, replace(io, kv_mode="concat", capacity=None))
    compiled = OrtSession(artifact / "model.onnx", io, prepack=False)
    good = record_reference(eager, max_positions=spec.max_positions)
    return GateSides(model, eager, compiled, spec.max_positions, good)


@contextmanager
def corrupted_weight(model: Any) -> Iterator[None]:
    """One element of layer 1's down_proj, 0.5 larger (the weights' std is 0.18)."""
    import torch

    weight = model.model.layers[1].mlp.down_proj.weight
    original = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] += 0.5
    try:
        yield
    finally:
        with torch.no_grad():
            weight[0, 0] = original


@contextmanager
def rotary_base_off(model: Any, factor: float = 1.01) -> Iterator[None]:
    """Every rotary table as if the base were `factor` times the config's: inv_freq = base^(-2i/d),
    so raising it to the power log(factor * base) / log(base) moves the base."""
    import math

    import torch

    base = model.config.rope_parameters["rope_theta"]
    exponent = math.log(factor * base) / math.log(base)
    modules = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    saved = [m.inv_freq.clone() for m in modules]
    for m in modules:
        m.inv_freq.copy_(m.inv_freq.double().pow(exponent).float())
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.inv_freq.copy_(original)


@contextmanager
def norm_epsilon_times_ten(model: Any) -> Iterator[None]:
    modules = [m for m in model.modules() if hasattr(m, "variance_epsilon")]
    saved = [m.variance_epsilon for m in modules]
    for m in modules:
        m.variance_epsilon *= 10
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.variance_epsilon = original


class Fed:
    """The compiled session, fed through `change` (a bug in what the runner passes it)."""

    def __init__(self, inner: Session, change: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> None:
        self.inner, self.change, self.io = inner, change, inner.io

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.inner.run(self.change(dict(feeds)))


def positions_shifted(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every position one too far: rotary attention scores depend on the positions' differences
    only, so the logits barely move; the keys, rotated by the positions themselves, do."""
    feeds["position_ids"] = feeds["position_ids"] + 1
    return feeds


def decode_positions_shifted(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The prefill right, every generated token one position ahead of its cache."""
    if feeds["input_ids"].shape[1] == 1:
        feeds["position_ids"] = feeds["position_ids"] + 1
    return feeds


def cache_written_one_slot_late() -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """From the first decode step on, the mask claims one more cache slot before the new
    tokens than there is: the graph writes each new key and value one slot later in the
    shared buffer than it should, and attends to the never-written slot it skipped."""
    prompt_width: list[int] = []

    def change(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        mask = feeds["attention_mask"]
        if feeds["input_ids"].shape[1] > 1:
            prompt_width[:] = [mask.shape[1]]
            return feeds
        width = prompt_width[0]
        skipped = np.ones((len(mask), 1), dtype=mask.dtype)
        feeds["attention_mask"] = np.concatenate([mask[:, :width], skipped, mask[:, width:]], axis=1)
        return feeds

    return change


EAGER_BUGS = {
    "one corrupted weight": (corrupted_weight, "present.2.key"),  # layer 1's MLP feeds layer 2 first
    "rotary base 1% off": (rotary_base_off, "present.0.key"),
    "norm epsilon x10": (norm_epsilon_times_ten, "present.0.key"),
}
FED_BUGS = {
    "positions shifted by one": (lambda: positions_shifted, "present.0.key"),
    "decode positions shifted by one": (lambda: decode_positions_shifted, "decode step 1 logits"),
    "KV cache written one slot late": (cache_written_one_slot_late, "decode step 1 logits"),
}


def _fails_naming(report: Any, first: str) -> None:
    from kvforge.toolchain.verify import require_parity

    with pytest.raises(ParityError) as failure:
        require_parity(report, NAME)
    assert f"first diverging output {first}: " in str(failure.value), str(failure.value)


def test_the_unperturbed_sides_pass(gate_sides: GateSides) -> None:
    from kvforge.toolchain.verify import compare_with_reference

    report = compare_with_reference(gate_sides.good, gate_sides.compiled, max_positions=gate_sides.max_positions)
    assert report.passed, report.failures()


@pytest.mark.parametrize("bug", list(EAGER_BUGS))
def test_the_gate_fails_on_a_bug_in_the_model(gate_sides: GateSides, bug: str) -> None:
    from kvforge.toolchain.verify import compare_with_reference, record_reference

    perturb, first = EAGER_BUGS[bug]
    with perturb(gate_sides.model):
        reference = record_reference(gate_sides.eager, max_positions=gate_sides.max_positions)
    report = compare_with_reference(reference, gate_sides.compiled, max_positions=gate_sides.max_positions)
    _fails_naming(report, first)


@pytest.mark.parametrize("bug", list(FED_BUGS))
def test_the_gate_fails_on_a_bug_in_what_the_graph_is_fed(gate_sides: GateSides, bug: str) -> None:
    from kvforge.toolchain.verify import compare_with_reference

    make, first = FED_BUGS[bug]
    candidate = Fed(gate_sides.compiled, make())
    report = compare_with_reference(gate_sides.good, candidate, max_positions=gate_sides.max_positions)
    _fails_naming(report, first)
