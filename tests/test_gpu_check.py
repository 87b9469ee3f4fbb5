"""benchmarks/gpu_check.py: its judgement of where two runtimes' greedy tokens part, and its
`--cpu-dry-run` mode end to end (the same code as on a GPU, the device side a second CPU session)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    from benchmarks import gpu_check

    return gpu_check


def _run(tokens: list[list[int]], logits: list[np.ndarray]) -> tuple[list[list[int]], list[np.ndarray]]:
    return tokens, logits


def test_a_part_is_judged_on_the_cpu_logits_scale(gpu_check: ModuleType) -> None:
    rng = np.random.default_rng(0)
    step0 = rng.standard_normal((2, 50))
    step1 = rng.standard_normal((2, 50))
    scale = float(step1[1].std())
    step1[1, 7], step1[1, 9] = 10.0, 10.0 - 0.05 * scale  # the CPU's pick 7, token 9 a near tie
    cpu = _run([[3, 4], [5, 7]], [step0, step1])
    near = _run([[3, 4], [5, 9]], [step0, step1])
    (part,) = gpu_check.parting(cpu, near, relative=0.1)  # within 2 x 0.1 of the scale
    assert part["row"] == 1 and part["step"] == 1 and part["near_tie"]
    (part,) = gpu_check.parting(cpu, near, relative=2e-4)  # fp32's tolerance: a real difference
    assert not part["near_tie"]
    assert gpu_check.parting(cpu, cpu, relative=2e-4) == []


@pytest.mark.slow  # two tiny builds, generation on two CPU sessions, a tiny decode benchmark
def test_cpu_dry_run_writes_a_report_of_the_matrix_and_the_benchmark(gpu_check: ModuleType, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = [str(report), "--workdir", str(tmp_path / "work"), "--cpu-dry-run", "--budget", "3600"]
    assert gpu_check.main(args) == 0
    found = json.loads(report.read_text())
    assert found["machine"]["dry_run"] is True
    assert [row["name"] for row in found["matrix"]] == [row.name for row in gpu_check.DRY_MATRIX]
    for row in found["matrix"]:  # one CPU against another: the same tokens, row by row and batched
        assert row["passed"] and row["batch"]["equal"] and row["one by one"]["equal"], row
        assert row["verified_on"] == "CPUExecutionProvider"
    bench = found["bench"]
    assert bench["bandwidth"]["bytes_per_s"] is None  # no roofline on the CPU
    artifact = tmp_path / "work" / "artifacts" / "llama_fp32"  # the matrix's, measured again
    ort, eager = bench["ort fp32"], bench["transformers float32 eager"]
    assert "error" not in ort and "error" not in eager, (ort, eager)
    assert ort["weight_bytes"] == sum(p.stat().st_size for p in artifact.glob("model.onnx*"))
    assert eager["weight_bytes"] > 0 and eager["batch 1"] > 0 and eager["batch 8"] > 0
    # a tiny model's decode on a busy CPU may time below noise: None then, never a negative rate
    assert all(ort[key] is None or ort[key] > 0 for key in ("batch 1", "batch 8"))
    assert not any(key.endswith("fraction") for key in {**ort, **eager})


def test_rows_not_started_within_the_budget_are_reported_not_run(gpu_check: ModuleType, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = [str(report), "--workdir", str(tmp_path / "work"), "--cpu-dry-run", "--only", "matrix", "--budget", "0"]
    assert gpu_check.main(args) == 1  # a row not run is not a row passed
    rows = json.loads(report.read_text())["matrix"]
    assert [row["name"] for row in rows] == [row.name for row in gpu_check.DRY_MATRIX]
    assert all(not row["passed"] and "budget" in row["error"] for row in rows)
    assert not (tmp_path / "work" / "artifacts").exists()  # nothing was built
