"""A real `tritonserver` (the one PyPI's nvidia-pytriton bundles, Python backend, CPU) serving an
exported repository of the tiny llama artifact, on free loopback ports.

The server and its Python backend run in `.venv-triton` (made by `.ci/install`): pytriton
needs numpy < 2, which the main environment does not have. The stub that runs `model.py` is
pytriton's build for that environment's Python, copied into a backend directory of our own, as
pytriton itself does when it starts a server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON_VENV = ROOT / ".venv-triton"
CLIENT = Path(__file__).with_name("triton_client.py")
KVFORGE = Path(sys.executable).with_name("kvforge")
START_TIMEOUT_S = 120.0
MODEL = "tiny"

_QUERY = """
import json, sys, sysconfig
print(json.dumps({
    "purelib": sysconfig.get_paths()["purelib"],
    "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
    "libdir": sysconfig.get_config_var("LIBDIR") or "",
}))
"""


@dataclass(frozen=True)
class TritonInstall:
    python: Path
    server: Path  # the tritonserver binary
    libs: Path  # the shared libraries it was bundled with
    backend: Path  # pytriton's python backend directory
    stub: Path  # triton_python_backend_stub for the environment's Python
    libdir: str  # where that Python's libpython lives


def find_install() -> TritonInstall | str:
    """The Triton environment, or why there is none (the tests skip with it)."""
    python = TRITON_VENV / "bin" / "python"
    if not python.is_file():
        return f"{TRITON_VENV} is missing; run `bash .ci/install` to create it (nvidia-pytriton 0.7.0)"
    found = subprocess.run([str(python), "-c", _QUERY], capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        return f"{python} does not run: {found.stderr.strip()[-300:]}"
    info = json.loads(found.stdout)
    site = Path(info["purelib"])
    dist = site / "pytriton" / "tritonserver"
    install = TritonInstall(
        python=python,
        server=dist / "bin" / "tritonserver",
        libs=site / "nvidia_pytriton.libs",
        backend=dist / "backends" / "python",
        stub=dist / "python_backend_stubs" / info["python"] / "triton_python_backend_stub",
        libdir=info["libdir"],
    )
    for path in (install.server, install.libs, install.backend, install.stub):
        if not path.exists():
            return f"{path} is missing: nvidia-pytriton 0.7.0 is not installed in {TRITON_VENV}; run `bash .ci/install`"
    return install


@pytest.fixture(scope="session")
def triton_install() -> TritonInstall:
    found = find_install()
    if isinstance(found, str):
        pytest.skip(found)
    return found


def run_client(install: TritonInstall, *args: str, stdin: Any = None) -> Any:
    """triton_client.py under the Triton environment's Python; its JSON output."""
    done = subprocess.run(
        [str(install.python), str(CLIENT), *args],
        input=None if stdin is None else json.dumps(stdin),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, f"triton_client.py {args[0]} failed: {done.stderr[-2000:]}"
    return json.loads(done.stdout)


@dataclass
class TritonServer:
    http: str
    grpc: str
    metrics: str
    model: str
    repository: Path
    process: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def pytriton_command(install: TritonInstall, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """pytriton's tritonserver, with a backend directory holding the stub for the environment's Python."""
    backends = workdir / "backends"
    (backends / "python").mkdir(parents=True, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy(install.backend / name, backends / "python" / name)
    shutil.copy(install.stub, backends / "python" / "triton_python_backend_stub")
    env = dict(os.environ)
    libraries = (str(install.libs), install.libdir, env.get("LD_LIBRARY_PATH"))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in libraries if p)
    env["PATH"] = f"{install.python.parent}{os.pathsep}{env['PATH']}"  # the stub's packages: that environment's
    return [str(install.server), f"--backend-directory={backends}"], env


def start_triton(server: list[str], env: dict[str, str], repository: Path, model: str, workdir: Path) -> TritonServer:
    """Start tritonserver (`server`: the binary and its own options) on the repository, on free
    loopback ports, and wait (bounded) until the model is ready."""
    http, grpc, metrics = _free_ports(3)
    command = [
        *server,
        f"--model-repository={repository}",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
        "--exit-timeout-secs=10",
    ]
    log = workdir / "tritonserver.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    started = TritonServer(
        f"http://127.0.0.1:{http}",
        f"127.0.0.1:{grpc}",
        f"http://127.0.0.1:{metrics}/metrics",
        model,
        repository,
        process,
        log,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if _ready(f"{started.http}/v2/models/{model}/ready"):
            return started
        if process.poll() is not None:
            raise AssertionError(f"tritonserver exited with {process.returncode}:\n{started.log_text()[-4000:]}")
        time.sleep(0.2)
    started.stop()
    raise AssertionError(f"tritonserver was not ready within {START_TIMEOUT_S}s:\n{started.log_text()[-4000:]}")


@pytest.fixture(scope="session")
def tiny_artifact(built_artifact: Callable[..., Path]) -> Path:
    return built_artifact("llama")


@pytest.fixture(scope="module")
def triton_server(
    triton_install: TritonInstall, tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """One server per module: two CPU instances of the tiny llama, 4 sequences each."""
    from kvforge.toolchain.triton import TritonOptions, export_triton

    workdir = tmp_path_factory.mktemp("triton")
    repository = workdir / "repository"
    export_triton(tiny_artifact, repository, TritonOptions(name=MODEL, instances=2, max_num_seqs=4))
    server = start_triton(*pytriton_command(triton_install, workdir), repository, MODEL, workdir)
    yield server
    server.stop()
