"""The command line: output streams, errors are one line with exit status 2."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.runners import cli as runtime_cli
from kvforge.runners.cli import EXIT_GATE_REFUSED
from kvforge.runners.engine import Engine


def kvforge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvforge", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_missing_checkpoint_is_one_line_error(tmp_path: Path) -> None:
    result = kvforge("build", str(tmp_path / "nope"), "-o", str(tmp_path / "out"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvforge: error: ") and "nope" in lines[0]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_unsupported_architecture_lists_supported(tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "model_type": "llama_x"}))
    result = CliRunner().invoke(main, ["build", str(ckpt), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "'llama_x'" in result.output and "transformers has no such model_type" in result.output
    assert "gpt_neox" in result.output and "deepseek_v3" in result.output  # the families the tests prove


def test_a_model_without_a_context_length_says_to_pass_context(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint("bloom")), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    lines = result.output.strip().splitlines()  # the stages' progress lines, then the error's one line
    assert lines[-1].startswith("kvforge: error: ") and "pass --context N" in lines[-1]
    assert sum("error" in line for line in lines) == 1 and "Traceback" not in result.output
    llama = str(tiny_checkpoint("llama"))  # max_position_embeddings 256
    result = CliRunner().invoke(main, ["build", llama, "-o", str(tmp_path / "out"), "--context", "257"])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert "--context 257 is beyond the model's context" in result.output


@pytest.mark.slow
def test_generate_streams_only_the_new_text_and_reports_timing(built_artifact: Callable[..., Path]) -> None:
    artifact = built_artifact("llama")
    result = kvforge("generate", str(artifact), "def f(", "--max-new-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    engine = Engine.load(artifact)
    assert result.stdout == engine.generate("def f(", max_new_tokens=12, temperature=0.0) + "\n"
    assert "first token" in result.stderr and "tokens/s" in result.stderr


@pytest.mark.slow
def test_generate_several_prompts_prints_one_json_line_each(built_artifact: Callable[..., Path]) -> None:
    import json

    artifact = built_artifact("llama")
    result = CliRunner().invoke(
        main, ["generate", str(artifact), "a", "bcd", "--max-new-tokens", "5", "--temperature", "0"]
    )
    assert result.exit_code == 0, result.output
    engine = Engine.load(artifact)
    assert [json.loads(line) for line in result.stdout.splitlines()] == engine.generate(
        ["a", "bcd"], max_new_tokens=5, temperature=0.0
    )


@pytest.mark.slow
def test_inspect_prints_exact_kv_bytes(tiny_checkpoint: Callable[..., Path]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(tiny_checkpoint("llama")), "--batch", "8", "--seq", "200"])
    assert result.exit_code == 0, result.output
    # 2 (K and V) * 2 layers * 2 kv heads * 16 head dim * 4 bytes * 8 * 200 tokens
    assert f"{2 * 2 * 2 * 16 * 4 * 8 * 200:,}" in result.output


def test_a_build_that_would_not_fit_the_device_is_refused_before_any_work(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """The refusal names the figures it compared; the same request fits once quantized or given room."""
    from kvforge.toolchain import checkpoint as checkpoints
    from kvforge.toolchain.footprint import footprint
    from kvforge.toolchain.spec import DecoderSpec

    ckpt = tiny_checkpoint("llama")
    loaded = checkpoints.load(ckpt)
    fp = footprint(loaded, DecoderSpec.from_config(loaded.config), batch=4, seq=64)
    need = fp.weight_bytes_at["fp32"] + fp.kv_bytes_total["fp32"]
    args = ("build", str(ckpt), "-o", str(tmp_path / "out"), "--batch", "4", "--seq", "64")
    result = CliRunner().invoke(main, [*args, "--device-memory", str(need - 1)])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert all(part in result.output for part in ("fp32 weights", "batch 4 × 64 tokens", "--weights int4"))
    quantized = fp.weight_bytes_at["int4"] + fp.kv_bytes_total["fp32"]
    assert quantized < need  # the suggestion helps: int4 fits where fp32 did not
    result = CliRunner().invoke(main, [*args, "--device-memory", "12 parsecs"])
    assert result.exit_code == 2 and "memory size '12 parsecs'" in result.output
    # an int8 cache (--kv-dtype int8) is counted at a byte per element: a quarter of fp32's
    from kvforge.toolchain.footprint import format_bytes

    assert fp.kv_bytes_total["int8"] * 4 == fp.kv_bytes_total["fp32"] > 0
    need = fp.weight_bytes_at["fp32"] + fp.kv_bytes_total["int8"]
    result = CliRunner().invoke(main, [*args, "--kv-dtype", "int8", "--device-memory", str(need - 1)])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert f"int8 KV cache {format_bytes(fp.kv_bytes_total['int8'])}" in result.output, result.output
    # --free-min's minimums are counted: room for symmetric int4 is not room for it
    from kvforge.toolchain.footprint import QuantLayout, quantized_weight_bytes

    spec = DecoderSpec.from_config(loaded.config)
    free_min = quantized_weight_bytes(loaded, spec, QuantLayout(4, free_min=True))
    assert free_min > fp.weight_bytes_at["int4"]
    room = fp.weight_bytes_at["int4"] + fp.kv_bytes_total["fp32"]
    result = CliRunner().invoke(main, [*args, "--weights", "int4", "--free-min", "--device-memory", str(room)])
    assert result.exit_code == 2 and not (tmp_path / "out").exists(), result.output
    assert f"int4 weights {format_bytes(free_min)}" in result.output, result.output


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--weights", "int8", "--tolerance", "1e-3"], "a --weights build is judged by its next-token distributions"),
        (["--tolerance", "2"], "must be a fraction of each output's scale between 0 and 1"),
    ],
)
def test_a_tolerance_the_gate_cannot_use_is_refused_before_any_work(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path], extra: list[str], message: str
) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint("llama")), "-o", str(out), *extra])
    assert result.exit_code == 2 and message in result.stderr and not out.exists()


def test_verify_takes_a_tolerance_in_place_of_the_recorded_one(
    tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    from kvforge import BuildOptions
    from kvforge.toolchain.build import verify as run_verify

    assert BuildOptions(tolerance=1e-3).flags()["tolerance"] == 1e-3
    assert BuildOptions().flags()["tolerance"] is None
    report = run_verify(built_artifact("llama"), tiny_checkpoint("llama"), tolerance=0.5)
    assert report.passed and report.tolerance.relative == 0.5
    args = ["verify", str(built_artifact("llama")), "--checkpoint", str(tiny_checkpoint("llama")), "--tolerance", "0.5"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0 and "tolerance 0.5 of each output's scale" in result.stdout


@pytest.mark.parametrize("set_by_user", [None, "ACTIVE"])
def test_the_command_as_a_process_sleeps_idle_openmp_threads_and_marks_its_context(
    monkeypatch: pytest.MonkeyPatch, set_by_user: str | None
) -> None:
    if set_by_user is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", set_by_user)
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(runtime_cli, "main", lambda **kwargs: calls.append(kwargs))
    threshold = gc.get_threshold()
    try:
        runtime_cli.run()
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
    assert os.environ["OMP_WAIT_POLICY"] == (set_by_user or "PASSIVE")
    assert calls == [{"obj": {"own_process": True}}]


@pytest.mark.slow
def test_quiet_gate_refusal_prints_only_the_error_line(tmp_path: Path) -> None:
    """A NaN weight fails the gate for the stamped graph (6 layers: stamped from 2) and then for the
    whole stack: with -q, the error line is all that is printed (no log line about the stamped
    graph's refusal first)."""
    from safetensors.torch import load_file, save_file

    from tests.tiny import ARCH_CONFIGS, make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", arch=dict(ARCH_CONFIGS["llama"], num_hidden_layers=6))
    weights = {name: tensor.clone() for name, tensor in load_file(str(ckpt / "model.safetensors")).items()}
    weights["model.layers.0.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    result = kvforge("build", str(ckpt), "-o", str(tmp_path / "out"), "-q")
    assert result.returncode == EXIT_GATE_REFUSED
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvforge: error: ") and "NaN or Inf" in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_inspect_takes_the_context_a_config_without_one_needs(tiny_checkpoint: Callable[..., Path]) -> None:
    """bloom's config names no context: inspect reads it from --context, as build does."""
    ckpt = str(tiny_checkpoint("bloom"))
    result = CliRunner().invoke(main, ["inspect", ckpt, "--context", "96", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["footprint"]["seq"] == 96
