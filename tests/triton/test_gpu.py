"""Checks that need NGC's Triton container on a GPU machine: `--kind gpu` instances, Triton's
OpenAI-compatible frontend, and the artifact's graph in Triton's ONNX Runtime and TensorRT
backends. pytriton's tritonserver (test_tritonserver.py) has only the Python backend and no
frontend, so elsewhere these skip with the reason; docs/scaling.md says how to run them.

In the container (`nvcr.io/nvidia/tritonserver:<yy.mm>-py3`), with kvforge's repository
mounted: `pip install -e ".[dev]" onnxruntime-gpu /opt/tritonserver/python/triton*.whl` and
`pip install -r /opt/tritonserver/python/openai/requirements.txt`, then
`python -m pytest tests/triton/test_gpu.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvforge.passes.targets import TARGETS
from kvforge.runners.engine import Engine
from kvforge.runners.generate import position_ids
from kvforge.runners.manifest import read_io, read_manifest
from kvforge.toolchain.triton import TritonOptions, export_triton
from tests.triton.conftest import START_TIMEOUT_S, TritonServer, start_triton
from tests.triton.test_tritonserver import NEW_TOKENS, PROMPT, generate_stream

TRITON_HOME = Path("/opt/tritonserver")
FRONTEND = TRITON_HOME / "python" / "openai" / "openai_frontend" / "main.py"


def _missing() -> str | None:
    if shutil.which("tritonserver") is None:
        return "no tritonserver on PATH (run inside NGC's Triton container)"
    if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode:
        return "no CUDA device (nvidia-smi -L fails)"
    return None


_MISSING = _missing()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(_MISSING is not None, reason=f"needs NGC's Triton container and a GPU: {_MISSING}"),
]


def container_server() -> tuple[list[str], dict[str, str]]:
    return [str(shutil.which("tritonserver"))], dict(os.environ)


@pytest.fixture(scope="module")
def greedy(tiny_artifact: Path) -> str:
    return "".join(Engine.load(tiny_artifact).stream(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0))


@pytest.fixture(scope="module")
def gpu_server(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    workdir = tmp_path_factory.mktemp("triton-gpu")
    repository = workdir / "repository"
    export_triton(tiny_artifact, repository, TritonOptions(name="tiny", kind="gpu"))
    server = start_triton(*container_server(), repository, "tiny", workdir)
    yield server
    server.stop()


def test_gpu_instances_stream_the_cpu_greedy_text(gpu_server: TritonServer, greedy: str) -> None:
    events = generate_stream(
        gpu_server, {"text_input": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
    )
    assert "".join(e["text_output"] for e in events) == greedy
    assert "CUDAExecutionProvider" in gpu_server.log_text()


@pytest.mark.skipif(not FRONTEND.is_file(), reason=f"{FRONTEND} is missing (Triton 24.11 or later ships it)")
def test_openai_frontend_streams_completions(tiny_artifact: Path, tmp_path: Path, greedy: str) -> None:
    import openai

    if importlib.util.find_spec("tritonserver") is None:
        pytest.skip(f"Triton's in-process API is not installed: pip install {TRITON_HOME}/python/triton*.whl")

    from tests.triton.conftest import _free_ports, _ready

    repository = tmp_path / "repository"
    export_triton(tiny_artifact, repository, TritonOptions(name="tiny", kind="gpu"))
    [port] = _free_ports(1)
    command = [
        sys.executable,
        str(FRONTEND),
        f"--model-repository={repository}",
        f"--tokenizer={repository / 'tiny' / '1' / 'artifact'}",
        f"--openai-port={port}",
        "--host=127.0.0.1",
    ]
    log = tmp_path / "frontend.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=FRONTEND.parent)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _ready(f"http://127.0.0.1:{port}/health/ready"):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=NEW_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        usage = None
        for chunk in chunks:
            parts.extend(choice.text for choice in chunk.choices)
            usage = chunk.usage or usage
        assert "".join(parts) == greedy
        assert usage is not None and usage.completion_tokens == NEW_TOKENS
        whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
        assert whole.choices[0].text == greedy
    finally:
        process.terminate()
        process.wait(60)


def prefill_feeds(artifact: Path) -> dict[str, np.ndarray]:
    """One prefill of PROMPT over an empty cache, as the artifact's I/O contract takes it."""
    engine = Engine.load(artifact)
    io = read_io(artifact, read_manifest(artifact))
    ids = np.array([engine.encode(PROMPT)], dtype=np.int64)
    mask = np.ones_like(ids)
    length = (io.capacity or ids.shape[1]) if io.shared_kv else 0
    cache = np.zeros((1, io.num_kv_heads, length, io.head_dim), dtype=io.kv_dtype)
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask, ids.shape[1])}
    return feeds | {name: cache.copy() for name in io.past_names}


def infer_logits(server: TritonServer, model: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """POST /v2/models/<model>/infer with JSON tensors; the logits."""
    types = {"int64": "INT64", "float32": "FP32", "float16": "FP16"}
    body = {
        "inputs": [
            {"name": n, "shape": list(a.shape), "datatype": types[a.dtype.name], "data": a.reshape(-1).tolist()}
            for n, a in feeds.items()
        ],
        "outputs": [{"name": "logits"}],
    }
    request = urllib.request.Request(f"{server.http}/v2/models/{model}/infer", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        [output] = json.loads(response.read())["outputs"]
    return np.array(output["data"], dtype=np.float32).reshape(output["shape"])


def _raw_repository(directory: Path, files: dict[str, Path], platform: str) -> Path:
    model = directory / "graph"
    (model / "1").mkdir(parents=True)
    for name, source in files.items():
        shutil.copyfile(source, model / "1" / name)
    (model / "config.pbtxt").write_text(f'platform: "{platform}"\nmax_batch_size: 0\n')  # Triton completes the rest
    return directory


def test_onnxruntime_backend_runs_the_artifacts_graph(tiny_artifact: Path, tmp_path: Path) -> None:
    if not (TRITON_HOME / "backends" / "onnxruntime").is_dir():
        pytest.skip("this Triton has no onnxruntime backend")
    files = {"model.onnx": tiny_artifact / "model.onnx", "model.onnx.data": tiny_artifact / "model.onnx.data"}
    repository = _raw_repository(tmp_path / "repository", files, "onnxruntime_onnx")
    feeds = prefill_feeds(tiny_artifact)
    expected = Engine.load(tiny_artifact).session.run({k: v.copy() for k, v in feeds.items()})["logits"]
    server = start_triton(*container_server(), repository, "graph", tmp_path)
    try:
        np.testing.assert_allclose(infer_logits(server, "graph", feeds), expected, atol=1e-3, rtol=1e-3)
    finally:
        server.stop()


def test_tensorrt_backend_runs_the_artifacts_engine(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    from kvforge import BuildOptions, build
    from kvforge.toolchain.emit import tensorrt as engine_build

    if engine_build.unavailable() is not None or not (TRITON_HOME / "backends" / "tensorrt").is_dir():
        pytest.skip(f"needs TensorRT here and Triton's tensorrt backend: {engine_build.unavailable()}")
    artifact = tmp_path / "trt"
    build(tiny_checkpoint("llama"), artifact, BuildOptions(target=TARGETS["tensorrt"], capacity=64))
    engine_build.add_engine(artifact, engine_build.EngineOptions(max_batch=1, timing_cache_dir=tmp_path / "cache"))
    engine_file = read_manifest(artifact)["engine"]["file"]
    repository = _raw_repository(tmp_path / "repository", {"model.plan": artifact / engine_file}, "tensorrt_plan")
    feeds = prefill_feeds(artifact)
    expected = Engine.load(artifact).session.run({k: v.copy() for k, v in feeds.items()})["logits"]
    server = start_triton(*container_server(), repository, "graph", tmp_path)
    try:
        np.testing.assert_allclose(infer_logits(server, "graph", feeds), expected, atol=2e-2, rtol=2e-2)
    finally:
        server.stop()
