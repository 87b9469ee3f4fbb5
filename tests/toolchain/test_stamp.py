"""Stamped lowering: each distinct layer kind traced once, the stack stamped out from it,
equal to the whole stack's graph on onnxruntime; families it cannot prove fall back."""

from __future__ import annotations

import hashlib
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

from kvforge.runners.contract import DecoderIO
from kvforge.toolchain import build as build_module
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain import stamp
from kvforge.toolchain.build import BuildOptions, build, read_spec
from kvforge.toolchain.export import eager_model, export_decoder, layer_windows
from kvforge.toolchain.lower import to_onnx
from tests.tiny import make_checkpoint

SLIDING, FULL = "sliding_attention", "full_attention"


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, model_type: str, layers: int, **fields: Any) -> Path:
    directory = tmp_path_factory.mktemp(f"ckpt-{model_type}-{layers}")
    return make_checkpoint(directory, model_type, num_hidden_layers=layers, **fields)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _checkpoint(tmp_path_factory, "llama", 4)


def _both(checkpoint: Path, bounded: bool = False) -> tuple[ir.Model, stamp.Lowering, ir.Model, DecoderIO]:
    """The stamped graph, how it was made, and the whole stack's graph, of one eager model;
    `bounded`: its sliding layers' caches bounded by their window, as on `ort-cpu`."""
    ckpt = checkpoints.load(checkpoint)
    spec = read_spec(ckpt)
    io = DecoderIO.for_spec(spec)
    if bounded:
        io = replace(io, layer_windows=layer_windows(ckpt.config, spec))
        assert io.layer_windows is not None and None in io.layer_windows
    model = eager_model(ckpt, spec)
    stamped, lowering = stamp.lower(stamp.export(model, spec, io), model, io)
    whole = to_onnx(export_decoder(model, spec, io), io)
    return stamped, lowering, whole, io


def _run(model: ir.Model, io: DecoderIO, past: int) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(past)
    batch, seq = 2, 3
    feed = {
        "input_ids": rng.integers(0, io.vocab_size, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, past + seq), np.int64),
        "position_ids": np.arange(past, past + seq, dtype=np.int64)[None].repeat(batch, 0),
    }
    for name in io.past_names:
        feed[name] = rng.standard_normal(io.kv_shape(name, batch, past)).astype(np.float32)
    names = [output.name for output in session.get_outputs()]
    return dict(zip(names, session.run(None, feed), strict=True))


def _assert_same_graph_and_outputs(stamped: ir.Model, whole: ir.Model, io: DecoderIO) -> None:
    # node for node the same graph but for names: the same ops, the same weights
    assert Counter(n.op_type for n in stamped.graph) == Counter(n.op_type for n in whole.graph)
    assert set(stamped.graph.initializers) == set(whole.graph.initializers)
    for name, value in whole.graph.initializers.items():
        np.testing.assert_array_equal(stamped.graph.initializers[name].const_value.numpy(), value.const_value.numpy())
    for past in (0, 4):
        ours, theirs = _run(stamped, io, past), _run(whole, io, past)
        assert list(ours) == list(theirs) == ["logits", *io.present_names]
        for name in theirs:
            np.testing.assert_allclose(ours[name], theirs[name], rtol=0, atol=1e-6, err_msg=name)


def test_stamped_llama_equals_the_whole_stack(llama4: Path) -> None:
    stamped, lowering, whole, io = _both(llama4)
    assert (lowering.stamped, lowering.layers, lowering.traced, lowering.kinds) == (True, 4, 2, 1)
    _assert_same_graph_and_outputs(stamped, whole, io)
    # every layer's nodes are scoped in their own layer, reading their own weights
    scopes = {n.metadata_props.get("pkg.torch.onnx.name_scopes", "") for n in stamped.graph}
    assert all(any(f"'model.model.layers.{i}'" in s for s in scopes) for i in range(4))
    matmuls = [n for n in stamped.graph if n.op_type == "Transpose" and n.inputs[0].name.startswith("model.layers.3.")]
    assert len(matmuls) == 7  # q, k, v, o, gate, up, down of the last layer


def test_gemma3_alternating_kinds_stamped_and_equal(tmp_path_factory: pytest.TempPathFactory) -> None:
    checkpoint = _checkpoint(tmp_path_factory, "gemma3_text", 6, layer_types=[SLIDING, SLIDING, FULL] * 2)
    ckpt = checkpoints.load(checkpoint)
    model = eager_model(ckpt, read_spec(ckpt))
    chosen = stamp.plan(model, read_spec(ckpt))
    assert chosen.selected == (0, 1, 2, 5) and chosen.template == (0, 1, 2, 1, 1, 3)
    for bounded in (False, True):
        stamped, lowering, whole, io = _both(checkpoint, bounded)
        assert (lowering.stamped, lowering.traced, lowering.kinds) == (True, 4, 2)
        _assert_same_graph_and_outputs(stamped, whole, io)


def test_cut_down_model_is_restored(llama4: Path) -> None:
    ckpt = checkpoints.load(llama4)
    model = eager_model(ckpt, read_spec(ckpt))
    layers = list(model.model.layers)
    chosen = stamp.plan(model, read_spec(ckpt))
    with stamp.cut_down(model, chosen):
        assert len(model.model.layers) == model.config.num_hidden_layers == 2
        assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1]
    assert list(model.model.layers) == layers and model.config.num_hidden_layers == 4
    assert [layer.self_attn.layer_idx for layer in layers] == list(range(4))


def test_no_repeated_kind_is_unstampable(tmp_path_factory: pytest.TempPathFactory) -> None:
    checkpoint = _checkpoint(tmp_path_factory, "llama", 2)
    ckpt = checkpoints.load(checkpoint)
    with pytest.raises(stamp.Unstampable, match="nothing repeats"):
        stamp.plan(eager_model(ckpt, read_spec(ckpt)), read_spec(ckpt))


def _tree_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.slow
def test_stamped_build_passes_the_gate_and_rebuilds_byte_identical(llama4: Path, tmp_path: Path) -> None:
    first = build(llama4, tmp_path / "a")
    build(llama4, tmp_path / "b")
    assert first.lowering is not None and first.lowering.stamped and first.parity.passed
    assert "4 layers stamped from 2 traced" in first.lowering.summary()
    assert _tree_hashes(tmp_path / "a") == _tree_hashes(tmp_path / "b")
    whole = build(llama4, tmp_path / "w", BuildOptions(stamp=False))
    assert whole.lowering is not None and not whole.lowering.stamped
    assert whole.manifest["flags"]["stamp"] is False and "stamp" not in first.manifest["flags"]


@pytest.mark.slow
def test_family_that_cannot_be_proven_falls_back_and_says_so(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    # deepseek_v3 hands a value computed in one layer to later ones besides its hidden state
    checkpoint = _checkpoint(tmp_path_factory, "deepseek_v3", 4)
    result = build(checkpoint, tmp_path / "out")
    assert result.lowering is not None and not result.lowering.stamped
    assert result.lowering.reason is not None and "passes 2 values" in result.lowering.reason
    assert "whole stack of 4 layers" in result.lowering.summary()
    assert result.parity.passed


@pytest.mark.slow
def test_stamped_graph_refused_by_the_gate_is_rebuilt_from_the_whole_stack(
    llama4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = stamp.torch_tensor

    def wrong(tensor: torch.Tensor, name: str) -> ir.TensorProtocol:  # every stamped weight off by half
        return real(tensor * 1.5, name)

    monkeypatch.setattr(stamp, "torch_tensor", wrong)
    # the refused attempt's gate session (and the graph behind it) is gone before the reload
    sessions: list[weakref.ref[Any]] = []
    alive_at_each_load: list[list[bool]] = []
    real_verifiable, real_eager_model = build_module.verifiable, build_module.eager_model

    @contextmanager
    def recorded(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with real_verifiable(*args, **kwargs) as session:
            sessions.append(weakref.ref(session))
            yield session

    def loading(*args: Any, **kwargs: Any) -> Any:
        alive_at_each_load.append([ref() is not None for ref in sessions])
        return real_eager_model(*args, **kwargs)

    monkeypatch.setattr(build_module, "verifiable", recorded)
    monkeypatch.setattr(build_module, "eager_model", loading)
    result = build(llama4, tmp_path / "out")
    assert result.lowering is not None and not result.lowering.stamped
    assert result.lowering.reason == "the stamped graph failed the parity gate"
    assert result.parity.passed
    assert alive_at_each_load == [[], [False]]


@pytest.mark.slow
def test_a_calibrated_build_refused_stamped_calibrates_once(
    llama4: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole stack's compilation after a refused stamped graph reads the calibrated weights
    back instead of calibrating again, and quantizes them to the codes a whole-stack build
    calibrates to; nothing of the kept weights stays beside the output."""
    from kvforge.passes.quantize import WeightQuantization
    from tests.toolchain.test_calibration import small_text

    options = BuildOptions(weights=WeightQuantization(4), calibration=small_text())
    whole = build(llama4, tmp_path / "whole", replace(options, stamp=False))
    real_compile, real_calibrate = build_module._compile, build_module.calibrating.calibrate
    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real_calibrate(*args, **kwargs)

    def refused_when_stamped(models: list[torch.nn.Module], *, stamping: bool, **kwargs: Any) -> Any:
        if stamping:  # as the gate refuses a stamped graph: its model's weights already lowered, and gone
            models.clear()
            raise build_module._StampedGraphRefused("refused")
        return real_compile(models, stamping=stamping, **kwargs)

    monkeypatch.setattr(build_module, "_compile", refused_when_stamped)
    monkeypatch.setattr(build_module.calibrating, "calibrate", counted)
    result = build(llama4, tmp_path / "out", options)
    assert result.lowering is not None and result.lowering.reason == "the stamped graph failed the parity gate"
    assert calls == [1] and result.parity.passed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "whole"]

    def codes(artifact: Path) -> dict[str, bytes]:
        graph = ir.load(artifact / "model.onnx").graph
        return {
            value.name: value.const_value.numpy().tobytes()
            for value in graph.initializers.values()
            if value.const_value is not None and value.const_value.dtype == ir.DataType.UINT8
        }

    calibrated = codes(result.output)
    assert calibrated and calibrated == codes(whole.output)


@pytest.mark.parametrize("error", [KeyError(1234), StopIteration()])
def test_a_lowering_the_proof_does_not_follow_is_unstampable(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """Another torch/onnxscript release can lower the cut-down layers differently (onnxscript 0.7.2
    with torch 2.11 gave a KeyError while stamping): the build gets Unstampable and lowers the whole stack."""

    class Stamper:
        def __init__(self, *args: Any) -> None:
            pass

        def stamp(self) -> ir.Model:
            raise error

    monkeypatch.setattr(stamp, "to_onnx", lambda program, io: None)
    monkeypatch.setattr(stamp, "_Stamper", Stamper)
    cut = stamp.CutProgram(program=object(), io=None, plan=None)  # type: ignore[arg-type]
    with pytest.raises(stamp.Unstampable, match=f"structure stamping expects \\({type(error).__name__}\\)"):
        stamp.lower(cut, torch.nn.Module(), None)  # type: ignore[arg-type]
