"""Choosing the runtime: from the manifest and what is installed, with fakes for GPU machines."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvforge.runners import runtime
from kvforge.runners.runtime import Choice, Environment, RuntimeUnavailable, choose

CPU_ONLY = Environment(providers=("CPUExecutionProvider",), tensorrt=False, gpus=0)
GPU_ORT = Environment(providers=("CUDAExecutionProvider", "CPUExecutionProvider"), tensorrt=False, gpus=1)
GPU_ALL = Environment(providers=("CUDAExecutionProvider", "CPUExecutionProvider"), tensorrt=True, gpus=1)
WITH_ENGINE: dict[str, Any] = {"engine": {"file": "engine.plan"}}


@pytest.mark.parametrize(
    ("manifest", "env", "expected"),
    [
        ({}, CPU_ONLY, "ort"),
        (WITH_ENGINE, CPU_ONLY, "ort"),  # an engine, but nothing here to run it
        ({}, GPU_ORT, "ort-cuda"),
        (WITH_ENGINE, GPU_ORT, "ort-cuda"),  # an engine, no TensorRT: onnxruntime on the GPU
        ({}, GPU_ALL, "ort-cuda"),  # TensorRT, but the artifact has no engine
        (WITH_ENGINE, GPU_ALL, "tensorrt"),
        (WITH_ENGINE, Environment(GPU_ALL.providers, True, 0), "ort"),  # packages without a GPU
    ],
)
def test_auto_takes_the_fastest_runtime_present(manifest: dict[str, Any], env: Environment, expected: str) -> None:
    assert choose("auto", manifest, env).runtime == expected


def test_cuda_puts_the_cpu_provider_behind_the_gpu() -> None:
    assert choose("ort-cuda", {}, GPU_ORT).providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert choose("ort", WITH_ENGINE, GPU_ALL) == Choice("ort")  # asked for by name: the CPU, whatever is here


@pytest.mark.parametrize(
    ("asked", "manifest", "env", "missing"),
    [
        ("tensorrt", {}, GPU_ALL, "no TensorRT engine; add one with `kvforge build-engine"),
        ("tensorrt", WITH_ENGINE, GPU_ORT, "tensorrt and cuda-python packages are not installed"),
        ("tensorrt", WITH_ENGINE, Environment((), True, 0), "no CUDA GPU found"),
        ("ort-cuda", {}, CPU_ONLY, "onnxruntime has no CUDAExecutionProvider .*install onnxruntime-gpu"),
        ("ort-cuda", {}, Environment(GPU_ORT.providers, False, 0), "no CUDA GPU found"),
        ("cuda", {}, GPU_ALL, "'cuda' is not one of auto, ort, ort-cuda, tensorrt"),
    ],
)
def test_a_runtime_asked_for_that_cannot_run_is_one_line_naming_what_is_missing(
    asked: str, manifest: dict[str, Any], env: Environment, missing: str
) -> None:
    with pytest.raises(RuntimeUnavailable, match=missing) as error:
        choose(asked, manifest, env)
    assert "\n" not in str(error.value)


def test_detect_reads_this_machine() -> None:
    env = Environment.detect()
    import onnxruntime

    assert env.providers == tuple(onnxruntime.get_available_providers())
    assert env.gpus >= 0


# --- Engine.load opens the session it chose ------------------------------------------------


class FakeSession:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture
def artifact_with_engine(built_artifact: Callable[..., Path], tmp_path: Path) -> Path:
    """The tiny llama artifact, its manifest claiming an engine (the fake TensorRT session opens it)."""
    copy = tmp_path / "art"
    shutil.copytree(built_artifact("llama"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["engine"] = {"file": "engine.plan"}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "asked", "expected"),
    [
        (CPU_ONLY, "auto", ("ort", ("CPUExecutionProvider",))),
        (GPU_ORT, "auto", ("ort", ("CUDAExecutionProvider", "CPUExecutionProvider"))),
        (GPU_ALL, "auto", ("trt", None)),
        (GPU_ALL, "ort", ("ort", ("CPUExecutionProvider",))),
    ],
)
def test_engine_load_opens_the_session_chosen(
    artifact_with_engine: Path, monkeypatch: pytest.MonkeyPatch, env: Environment, asked: str, expected: tuple
) -> None:
    from kvforge.runners import trt_session
    from kvforge.runners.engine import Engine

    opened: list[tuple[str, Any]] = []

    def fake_ort(model_path: Path, io: Any, providers: Any, **kwargs: Any) -> Any:
        opened.append(("ort", tuple(providers)))
        return FakeSession(io=io)

    def fake_trt(directory: Path, **kwargs: Any) -> Any:
        opened.append(("trt", None))
        return FakeSession()

    monkeypatch.setattr(runtime, "OrtSession", fake_ort)
    monkeypatch.setattr(trt_session, "TrtSession", fake_trt)
    Engine.load(artifact_with_engine, runtime=asked, environment=env)
    assert opened == [expected]


@pytest.mark.slow
def test_engine_load_refuses_a_forced_runtime_that_is_missing_before_opening_anything(
    built_artifact: Callable[..., Path],
) -> None:
    from kvforge.runners.engine import Engine

    with pytest.raises(RuntimeUnavailable, match="no TensorRT engine"):
        Engine.load(built_artifact("llama"), runtime="tensorrt", environment=GPU_ALL)
    with pytest.raises(RuntimeUnavailable, match="onnxruntime-gpu"):
        Engine.load(built_artifact("llama"), runtime="ort-cuda", environment=CPU_ONLY)
    engine = Engine.load(built_artifact("llama"), runtime="ort", huge_pages=False)  # the real CPU session
    assert engine.generate_tokens([[5, 6, 7]], max_new_tokens=2, temperature=0)[0]


@pytest.mark.parametrize(
    ("built_with", "advice"),
    [
        ("999.0.0", "it was built on onnxruntime 999.0.0 and this is {installed}: install 'onnxruntime>=999.0.0'"),
        ("1.0.0", "; rebuild the artifact"),
        (None, "; rebuild the artifact"),
    ],
)
def test_a_graph_onnxruntime_cannot_load_names_the_release_it_was_built_on(
    built_with: str | None, advice: str, tmp_path: Path
) -> None:
    """A build uses the ops of its own onnxruntime (GroupQueryAttention's query_seqlens from 1.32):
    where the one loading the artifact is older, the error says which release to install."""
    import onnx
    import onnxruntime as ort

    from kvforge.runners.contract import DecoderIO
    from kvforge.runners.errors import ArtifactError
    from kvforge.runners.session import OrtSession

    model = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("NoSuchOp", ["x"], ["y"], domain="com.microsoft")],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
        ),
        opset_imports=[onnx.helper.make_opsetid("", 23), onnx.helper.make_opsetid("com.microsoft", 1)],
    )
    onnx.save(model, tmp_path / "model.onnx")
    io = DecoderIO(num_layers=1, num_kv_heads=1, head_dim=4, vocab_size=8)
    with pytest.raises(ArtifactError, match="onnxruntime could not load the model") as refused:
        OrtSession(tmp_path / "model.onnx", io, built_with=built_with)
    assert advice.format(installed=ort.__version__) in str(refused.value)


# --- the CLI's --runtime -------------------------------------------------------------------


@pytest.mark.slow
def test_cli_refuses_a_forced_runtime_in_one_line_and_runs_the_cpu_one(built_artifact: Callable[..., Path]) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    artifact = str(built_artifact("llama"))
    refused = CliRunner().invoke(main, ["generate", artifact, "def", "--runtime", "tensorrt"])
    assert refused.exit_code == 2
    assert refused.stderr.strip().splitlines() == [
        f"kvforge: error: --runtime tensorrt: {artifact} has no TensorRT engine; add one with "
        f"`kvforge build-engine {artifact}` on a GPU machine"
    ]
    ran = CliRunner().invoke(main, ["generate", artifact, "def", "--runtime", "ort", "--max-new-tokens", "3"])
    assert ran.exit_code == 0 and "3 new tokens" in ran.stderr


@pytest.mark.parametrize(
    ("args", "kind"),
    [([], "cpu"), (["--kind", "gpu"], "gpu"), (["--runtime", "ort-cuda"], "gpu"), (["--runtime", "ort"], "cpu")],
)
def test_export_triton_runtime_picks_the_instance_kind(
    args: list[str], kind: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    import kvforge.toolchain.triton
    from kvforge.cli import main

    seen: list[str] = []

    def fake_export(artifact: Path, output: Path, options: Any) -> Any:
        seen.append(options.kind)
        raise RuntimeUnavailable("stop here")

    monkeypatch.setattr(kvforge.toolchain.triton, "export_triton", fake_export)
    result = CliRunner().invoke(main, ["export-triton", str(tmp_path), "-o", str(tmp_path / "repo"), *args])
    assert result.exit_code == 2 and seen == [kind]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--runtime", "tensorrt"], "runs kvforge's engine on onnxruntime only"),
        (["--runtime", "ort-cuda", "--kind", "cpu"], "--runtime ort-cuda runs Triton instances of --kind gpu"),
    ],
)
def test_export_triton_refuses_a_runtime_it_cannot_serve(args: list[str], message: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    result = CliRunner().invoke(main, ["export-triton", str(tmp_path), "-o", str(tmp_path / "repo"), *args])
    assert result.exit_code == 2 and message in result.stderr
