"""A `kvforge serve` subprocess on a free loopback port, over the tiny llama artifact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 60.0
LONG = 240  # tokens of a long request: "def" generates no eos within them (`long_request_has_no_eos`)
STOP_TIMEOUT_S = 30.0
KVFORGE = Path(sys.executable).with_name("kvforge")


@dataclass
class Server:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
            raise


def start_server(artifact: Path, log: Path, *args: str) -> Server:
    """Start the server with --port 0 and wait (bounded) until it says it is ready."""
    command = [str(KVFORGE), "serve", str(artifact), "--port", "0", *args]
    with open(log, "wb") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ})
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "ready:" in text:
            url = text.split("listening on ", 1)[1].split(",", 1)[0]
            return Server(url, process, log)
        if process.poll() is not None:
            raise AssertionError(f"kvforge serve exited with {process.returncode}: {text}")
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"kvforge serve was not ready within {START_TIMEOUT_S}s: {log.read_text()}")


@pytest.fixture(scope="session")
def tiny_artifact(built_artifact: Callable[..., Path]) -> Path:
    return built_artifact("llama")


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    """Start servers for one test; each is stopped (SIGTERM, then kill) afterwards."""
    started: list[Server] = []

    def start(artifact: Path, *args: str) -> Server:
        server = start_server(artifact, tmp_path / f"serve-{len(started)}.log", *args)
        started.append(server)
        return server

    yield start
    for server in started:
        try:
            server.terminate()
        except subprocess.TimeoutExpired:
            pass


@pytest.fixture(scope="module")
def shared_server(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the conformance tests of a module: 4 sequences, chunked prefill."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = start_server(tiny_artifact, log, "--max-num-seqs", "4", "--prefill-chunk", "16")
    yield server
    server.terminate()


@pytest.fixture(scope="module")
def long_request_has_no_eos(tiny_artifact: Path) -> None:
    from kvforge.runners.engine import Engine

    engine = Engine.load(tiny_artifact)
    tokens = engine.generate_tokens([engine.encode("def")], max_new_tokens=LONG, temperature=0)[0]
    assert len(tokens) == LONG, "the long request must run its whole budget"


@pytest.fixture
def slow_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers started after this take 5 ms more per model step (tests/serve/slow_steps): a
    long request then runs for more than a second, however fast the machine."""
    hook = Path(__file__).parent / "slow_steps"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("KVFORGE_TEST_STEP_S", "0.005")
