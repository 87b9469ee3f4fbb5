"""The `ort-cuda` target: onnxruntime's CUDA provider's fused forms, fp16 unless asked
otherwise, verified on the first of its providers this machine's onnxruntime offers (the CPU
here, computing the half-precision graph in float32) and saying so in the manifest."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.passes.targets import CPU_PROVIDER, CUDA_PROVIDER, TARGETS
from kvforge.toolchain.verify import gate_provider


def test_the_gate_runs_on_the_first_provider_onnxruntime_offers(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime

    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [CUDA_PROVIDER, CPU_PROVIDER])
    assert gate_provider(TARGETS["ort-cuda"].providers) == CUDA_PROVIDER
    assert gate_provider(TARGETS["ort-cpu"].providers) == CPU_PROVIDER  # a CPU target stays on the CPU
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: [CPU_PROVIDER])
    assert gate_provider(TARGETS["ort-cuda"].providers) == CPU_PROVIDER


@pytest.mark.slow  # one tiny build (export, passes, gate)
def test_build_target_ort_cuda_is_fp16_fused_and_records_where_it_was_verified(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint("llama")), "-o", str(out), "--target", "ort-cuda"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["flags"]["target"] == "ort-cuda"
    assert manifest["flags"]["dtype"] == "float16"  # the target's default, no --dtype given
    assert manifest["io"]["kv_dtype"] == "float16" and manifest["io"]["kv_mode"] == "shared"
    parity = manifest["parity"]
    assert parity["passed"] is True
    assert parity["verified_on"] == gate_provider(TARGETS["ort-cuda"].providers)
    assert parity["computed_in"] == ("float16" if parity["verified_on"] == CUDA_PROVIDER else "float32")
    ops = manifest["passes"]["histogram_after"]
    layers = manifest["spec"]["num_layers"]
    assert ops["com.microsoft::GroupQueryAttention"] == layers
    # every residual Add + RMSNorm but the first layer's input norm (no residual before it)
    assert ops["com.microsoft::SkipSimplifiedLayerNormalization"] == 2 * layers
    assert "RMSNormalization" in ops and ops["RMSNormalization"] == 1
    assert "norm_ort" not in manifest["passes"]["missed"]
