"""The exported repository in a real tritonserver (2.51, Python backend, on the CPU): HTTP and
gRPC streaming against `kvforge generate`, every input of Triton's OpenAI frontend, a client
that goes away mid-stream, Triton's metrics. Skipped, with the reason, where `.venv-triton`
(made by `.ci/install`) is missing.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from kvforge.runners.engine import Engine
from tests.triton.conftest import KVFORGE, MODEL, TritonInstall, TritonServer, run_client
from tests.triton.frontend import ENGINE_SAMPLING_INPUTS, FRONTEND_INPUTS, frontend_request

pytestmark = pytest.mark.slow
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 24
LONG = 240  # tokens of a request that runs until aborted: "def" generates no eos within them
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Generated:
    text: str
    prompt_tokens: int
    new_tokens: int


def kvforge_generate(artifact: Path, prompt: str, new_tokens: int, *stop: str) -> Generated:
    """`kvforge generate` greedy: the text it streams to stdout, the counts it reports on stderr."""
    command = [str(KVFORGE), "generate", str(artifact), prompt, "--max-new-tokens", str(new_tokens)]
    command += ["--temperature", "0", *(arg for s in stop for arg in ("--stop", s))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    counts = re.search(r"\[(\d+) prompt tokens, (\d+) new tokens", done.stderr)
    assert counts, done.stderr
    assert done.stdout.endswith("\n")
    return Generated(done.stdout[:-1], int(counts.group(1)), int(counts.group(2)))


@pytest.fixture(scope="module")
def greedy(tiny_artifact: Path) -> Generated:
    return kvforge_generate(tiny_artifact, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def pieces(tiny_artifact: Path, greedy: Generated) -> list[str]:
    """The greedy text as `Engine.stream` yields it: one piece per response in a stream."""
    pieces = list(Engine.load(tiny_artifact).stream(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0))
    assert "".join(pieces) == greedy.text and len(pieces) > 1
    return pieces


def streamed_in_pieces(texts: list[str], pieces: list[str]) -> bool:
    """One response per piece, however far the relay fell behind (a last, final one may be empty)."""
    return texts[: len(pieces)] == pieces and "".join(texts[len(pieces) :]) == ""


def generate_stream(server: TritonServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """POST /v2/models/<model>/generate_stream; the server-sent events' JSON objects."""
    request = urllib.request.Request(
        f"{server.http}/v2/models/{server.model}/generate_stream",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for line in response:
            if line.startswith(b"data: "):
                events.append(json.loads(line[len(b"data: ") :]))
    return events


def metrics(server: TritonServer) -> dict[str, float]:
    """Every sample of the model, summed over the other labels: `name` or `name:finished_reason`."""
    with urllib.request.urlopen(server.metrics, timeout=TIMEOUT_S) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"(\w+)\{([^}]*)\} (\S+)$", line)
        if not match or f'model="{server.model}"' not in match.group(2):
            continue
        reason = re.search(r'(?:finished_reason|reason)="(\w+)"', match.group(2))
        key = match.group(1) + (f":{reason.group(1)}" if reason else "")
        values[key] = values.get(key, 0.0) + float(match.group(3))
    return values


def wait_for(server: TritonServer, condition: Callable[[dict[str, float]], bool], what: str) -> dict[str, float]:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        values = metrics(server)
        if condition(values):
            return values
        time.sleep(0.05)
    raise AssertionError(f"{what}: not reached within {TIMEOUT_S}s; metrics {metrics(server)}")


def test_http_generate_stream_equals_kvforge_generate(
    triton_server: TritonServer, greedy: Generated, pieces: list[str]
) -> None:
    body = {"text_input": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": True}
    events = generate_stream(triton_server, {**body, "return_num_input_tokens": True, "return_num_output_tokens": True})
    assert not [e for e in events if "error" in e], events
    assert streamed_in_pieces([e["text_output"] for e in events], pieces), events
    assert {e["num_input_tokens"] for e in events} == {greedy.prompt_tokens}
    assert sum(e["num_output_tokens"] for e in events) == greedy.new_tokens

    [whole] = generate_stream(triton_server, {**body, "stream": False})  # one response, no counts unless asked
    assert whole["text_output"] == greedy.text and "num_output_tokens" not in whole


def test_grpc_stream_equals_kvforge_generate(
    triton_install: TritonInstall, triton_server: TritonServer, pieces: list[str]
) -> None:
    request = {
        "text_input": ["BYTES", [[PROMPT]]],
        "stream": ["BOOL", [[True]]],
        "max_tokens": ["INT32", [[NEW_TOKENS]]],
        "temperature": ["FP32", [[0.0]]],
    }
    [result] = run_client(triton_install, "stream", triton_server.grpc, MODEL, stdin=[request])
    assert result["error"] is None
    responses = result["responses"]
    assert streamed_in_pieces([r["text"] for r in responses], pieces), responses
    assert [r["final"] for r in responses] == [False] * (len(responses) - 1) + [True]


def test_every_input_of_the_openai_frontend_is_accepted(
    triton_install: TritonInstall, triton_server: TritonServer, tiny_artifact: Path, greedy: Generated
) -> None:
    stop = greedy.text[6:9]
    expected = kvforge_generate(tiny_artifact, PROMPT, NEW_TOKENS, stop)
    assert stop and len(expected.text) < len(greedy.text), "the stop string must end the text early"
    streamed = frontend_request(PROMPT, stream=True, max_tokens=NEW_TOKENS, stop=[stop, "never seen"])
    assert set(streamed) | {"guided_decoding_guide_type", "guided_decoding_guide"} == set(FRONTEND_INPUTS)
    whole = frontend_request(PROMPT, stream=False, max_tokens=NEW_TOKENS, stop=[stop])
    guided = frontend_request(PROMPT, stream=True, max_tokens=NEW_TOKENS, guided=("json_schema", '{"type": "object"}'))
    streamed_result, whole_result, guided_result = run_client(
        triton_install, "stream", triton_server.grpc, MODEL, stdin=[streamed, whole, guided]
    )

    assert streamed_result["error"] is None, streamed_result["error"]
    responses = streamed_result["responses"]
    assert "".join(r["text"] for r in responses) == expected.text
    assert {r["num_input_tokens"] for r in responses} == {expected.prompt_tokens}
    assert sum(r["num_output_tokens"] for r in responses) == expected.new_tokens

    assert whole_result["error"] is None, whole_result["error"]
    [response] = whole_result["responses"]  # not streamed: one final response, as the frontend expects
    assert response["final"] and response["text"] == expected.text
    assert (response["num_input_tokens"], response["num_output_tokens"]) == (
        expected.prompt_tokens,
        expected.new_tokens,
    )

    assert guided_result["error"] is None, guided_result["error"]  # guided decoding under a JSON schema
    guided_text = "".join(r["text"] for r in guided_result["responses"])
    assert guided_text.startswith("{") and guided_text != expected.text


def test_an_undeclared_input_is_refused_by_triton(triton_install: TritonInstall, triton_server: TritonServer) -> None:
    """What a missing declaration would cost: Triton refuses the request before the model sees it."""
    request = {**frontend_request(PROMPT, stream=True, max_tokens=4), "exclude_input_in_output": ["BOOL", [[True]]]}
    [result] = run_client(triton_install, "stream", triton_server.grpc, MODEL, stdin=[request])
    assert "unexpected inference input 'exclude_input_in_output'" in result["error"]


def test_disconnect_aborts_the_request_in_the_engine(triton_server: TritonServer, tiny_artifact: Path) -> None:
    engine = Engine.load(tiny_artifact)
    assert len(engine.generate_tokens([engine.encode("def")], max_new_tokens=LONG, temperature=0)[0]) == LONG
    before = metrics(triton_server)
    parts = urlsplit(triton_server.http)
    assert parts.hostname is not None and parts.port is not None
    body = json.dumps({"text_input": "def", "max_tokens": LONG, "temperature": 0, "stream": True}).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S) as sock:
        head = (
            f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, f"closed before the first event: {received!r}"
            received += chunk
    aborted = before.get("kvforge_request_aborted_total", 0) + 1
    finished = before["kvforge_request_success_total:length"] + 1
    # Wait for the request to end, either way, rather than for one outcome until a timeout:
    # a request that ran to its budget because Triton never flagged it cancelled fails here at
    # once, and says so, instead of after TIMEOUT_S.
    after = wait_for(
        triton_server,
        lambda m: (
            m.get("kvforge_request_aborted_total", 0) >= aborted
            or m["kvforge_request_success_total:length"] >= finished
        ),
        "request ended in the engine",
    )
    assert after.get("kvforge_request_aborted_total", 0) == aborted, (
        f"the request was not aborted: Triton did not report it cancelled before it ended; metrics {after}"
    )
    after = wait_for(triton_server, lambda m: m["kvforge_num_requests_running"] == 0, "no request running")
    assert after["kvforge_generation_tokens_total"] - before["kvforge_generation_tokens_total"] < LONG
    assert after["kvforge_request_success_total:length"] == before["kvforge_request_success_total:length"]
    logged = re.findall(r"cancelled: aborted in the engine after (\d+) of (\d+) tokens", triton_server.log_text())
    assert logged and int(logged[-1][0]) < int(logged[-1][1]) == LONG


def test_triton_metrics_count_the_models_requests(triton_server: TritonServer, greedy: Generated) -> None:
    before = metrics(triton_server)
    events = generate_stream(triton_server, {"text_input": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0})
    assert "".join(e["text_output"] for e in events) == greedy.text
    after = wait_for(
        triton_server,
        lambda m: m["kvforge_request_success_total:length"] == before["kvforge_request_success_total:length"] + 1,
        "request counted by the engine",
    )
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count"):
        assert after[name] == before[name] + 1, name
    assert after["nv_inference_request_duration_us"] > before["nv_inference_request_duration_us"]
    assert after["kvforge_generation_tokens_total"] == before["kvforge_generation_tokens_total"] + greedy.new_tokens
    assert after["kvforge_prompt_tokens_total"] == before["kvforge_prompt_tokens_total"] + greedy.prompt_tokens


def test_config_parses_with_tritons_own_schema(triton_install: TritonInstall, triton_server: TritonServer) -> None:
    config = run_client(triton_install, "config", str(triton_server.repository / MODEL / "config.pbtxt"))
    assert config["name"] == MODEL and config["backend"] == "python"
    assert config.get("max_batch_size", 0) == 0 and config["model_transaction_policy"]["decoupled"] is True
    assert {i["name"] for i in config["input"]} == set(FRONTEND_INPUTS) | ENGINE_SAMPLING_INPUTS
    assert [i["name"] for i in config["input"] if not i.get("optional")] == ["text_input"]
    assert config["instance_group"] == [{"count": 2, "kind": "KIND_CPU"}]
