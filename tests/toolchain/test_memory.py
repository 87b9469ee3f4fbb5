"""A build frees each weight once the graph no longer reads it: the bounded-memory build depends on it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from kvforge.passes import pipeline
from kvforge.passes.pack_matmul import pack_gate_up
from kvforge.runners.contract import DecoderIO
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain.export import eager_model, export_decoder
from kvforge.toolchain.lower import to_onnx
from kvforge.toolchain.spec import DecoderSpec

pytestmark = pytest.mark.slow


def test_a_packed_weight_is_freed_once_the_eager_model_and_program_are_gone(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    ckpt = checkpoints.load(tiny_checkpoint("llama"))
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    io = DecoderIO.for_spec(spec)
    model = eager_model(ckpt, spec)
    gate = weakref.ref(model.model.layers[0].mlp.gate_proj.weight)  # type: ignore[union-attr]
    down = weakref.ref(model.model.layers[0].mlp.down_proj.weight)  # type: ignore[union-attr]
    program = export_decoder(model, spec, io)
    graph = to_onnx(program, io)
    del model, program
    gc.collect()
    assert gate() is not None  # the graph's initializer holds it, without a copy
    for passes in (pipeline.canonicalize(), pipeline.fuse()):
        for p in passes:
            p(graph)
    pack = pack_gate_up()
    pack(graph)
    assert pack.counts and sum(pack.counts.values()) == spec.num_layers
    gc.collect()
    assert gate() is None, "the gate projection outlived its packed replacement"
    assert down() is not None  # still read by the graph


@pytest.mark.parametrize("calibrated", [False, True])
def test_the_build_holds_no_eager_model_once_it_is_lowered(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, calibrated: bool
) -> None:
    """The lowering takes the last reference to the eager model (its weights then live in the
    graph, freed as the passes replace them); a calibrated build keeps no reference either."""
    from kvforge.passes.quantize import WeightQuantization
    from kvforge.toolchain import build as build_module
    from tests.toolchain.test_calibration import small_text

    loaded: list[weakref.ref[object]] = []
    alive_after_lowering: list[bool] = []
    real_load, real_moe_layers = build_module.eager_model, build_module.moe_graph.moe_layers

    def load(*args: object, **kwargs: object) -> object:
        model = real_load(*args, **kwargs)  # type: ignore[arg-type]
        loaded.append(weakref.ref(model))
        return model

    def after_lowering(*args: object, **kwargs: object) -> object:  # the first thing after it
        gc.collect()
        alive_after_lowering.extend(ref() is not None for ref in loaded)
        return real_moe_layers(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(build_module, "eager_model", load)
    monkeypatch.setattr(build_module.moe_graph, "moe_layers", after_lowering)
    options = build_module.BuildOptions(weights=WeightQuantization(4), calibration=small_text() if calibrated else None)
    result = build_module.build(tiny_checkpoint("llama"), tmp_path / "out", options)
    assert result.parity.passed
    assert alive_after_lowering == [False]
