"""The toolchain's dependency floor: pyproject's bounds, the import-time check, and the
fallbacks that keep the oldest allowed releases working."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kvforge.toolchain import emit
from kvforge.toolchain.requirements import MINIMUM, DependencyError, check_versions, release

ROOT = Path(__file__).resolve().parents[2]


def test_minimum_releases_are_pyprojects_bounds() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    # the runtime's dependencies and the extras' ([build] holds the compiler's)
    dependencies = text[text.index("dependencies = [") : text.index("[project.scripts]")]
    bounds = dict(re.findall(r'"([\w-]+)>=([\d.]+)"', dependencies))
    assert {package: bounds[package] for package in MINIMUM} == MINIMUM


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2.13.0+cpu", (2, 13, 0)),
        ("1.0.0rc1", (1, 0, 0)),
        ("0.7.2", (0, 7, 2)),
        ("5.0", (5, 0)),
        ("2.11.0a0+git1", (2, 11, 0)),
    ],
)
def test_release(text: str, expected: tuple[int, ...]) -> None:
    assert release(text) == expected


def test_an_old_release_is_one_line_naming_package_and_version() -> None:
    versions = {package: minimum for package, minimum in MINIMUM.items()} | {"onnxscript": "0.5.3"}
    with pytest.raises(DependencyError) as exc:
        check_versions(versions.__getitem__)
    assert (
        str(exc.value)
        == "onnxscript 0.5.3 is installed; kvforge needs onnxscript>=0.7.2 (pip install 'onnxscript>=0.7.2')"
    )
    check_versions({**versions, "onnxscript": "0.7.2"}.__getitem__)  # the floor itself is accepted


def test_a_library_the_runtime_install_leaves_out_is_no_error_at_import() -> None:
    """`pip install kvforge` has onnxruntime and no torch: importing the CLI must work for generate."""
    from importlib.metadata import PackageNotFoundError

    def version(name: str) -> str:
        if name != "onnxruntime":
            raise PackageNotFoundError(name)
        return MINIMUM["onnxruntime"]

    check_versions(version)


def test_the_gpu_build_of_onnxruntime_counts() -> None:
    versions = {package: minimum for package, minimum in MINIMUM.items() if package != "onnxruntime"}
    versions["onnxruntime-gpu"] = "1.31.1"

    def version(name: str) -> str:
        if name not in versions:
            from importlib.metadata import PackageNotFoundError

            raise PackageNotFoundError(name)
        return versions[name]

    check_versions(version)


def test_the_command_line_prints_one_line_for_a_too_old_library(tmp_path: Path) -> None:
    """A fake onnx-ir 0.1.10 ahead on the path: `kvforge` stops with one line and exit 2."""
    info = tmp_path / "onnx_ir-0.1.10.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: onnx-ir\nVersion: 0.1.10\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    result = subprocess.run(
        [sys.executable, "-m", "kvforge", "--help"], capture_output=True, text=True, env=env, check=False
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "kvforge: error: onnx-ir 0.1.10 is installed; kvforge needs onnx-ir>=1.0 (pip install 'onnx-ir>=1.0')"
    ]


def test_write_onnx_on_an_onnx_ir_without_the_write_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """onnx-ir 1.0's save() has no max_in_flight_bytes: the model is written all the same."""
    real_save = ir.save
    calls: list[set[str]] = []

    def save(model: ir.Model, path: Path, external_data: str | None = None, size_threshold_bytes: int = 256) -> None:
        calls.append({"external_data", "size_threshold_bytes"})
        real_save(model, path, external_data=external_data, size_threshold_bytes=size_threshold_bytes)

    assert "max_in_flight_bytes" not in inspect.signature(save).parameters
    monkeypatch.setattr(ir, "save", save)
    weight = ir.Value(name="w", const_value=ir.tensor(np.arange(1024, dtype=np.float32)))
    x = ir.Value(name="x", shape=ir.Shape([1024]), type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node("Add", [x, weight], outputs=[ir.Value(name="y")])
    node.outputs[0].shape, node.outputs[0].type = ir.Shape([1024]), ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[weight], opset_imports={"": 21})
    path = emit.write_onnx(ir.Model(graph, ir_version=10), tmp_path)
    assert calls and (tmp_path / emit.DATA_FILE).stat().st_size == 4096
    assert np.array_equal(ir.load(path).graph.initializers["w"].const_value.numpy(), np.arange(1024, dtype=np.float32))
