"""The Python-backend model (`kvforge.runners.triton.backend`) with a stand-in for Triton's
`triton_python_backend_utils`: streaming through the response sender, errors, cancellation,
the engine's settings and metrics. The real stub runs it in test_tritonserver.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.prefix_cache import BLOCK
from kvforge.runners.triton.backend import (
    EngineSettings,
    MetricsMirror,
    ServingModel,
    _TritonLog,
    providers_for,
)
from kvforge.toolchain.triton import TritonOptions, export_triton
from tests.tiny import CORPUS
from tests.triton.frontend import frontend_request
from tests.triton.test_requests import _NUMPY

FINAL = 1
TIMEOUT_S = 30.0
LONG = 240  # "def" generates no eos within this many tokens (tests/serve/test_faults.py checks it)


class FakeTritonError:
    INTERNAL, INVALID_ARG, UNSUPPORTED, UNAVAILABLE, CANCELLED = (
        "INTERNAL",
        "INVALID_ARG",
        "UNSUPPORTED",
        "UNAVAILABLE",
        "CANCELLED",
    )

    def __init__(self, message: str, code: str = "INTERNAL") -> None:
        self.message, self.code = message, code


class FakeResponse:
    def __init__(self, output_tensors: list[Any] | None = None, error: FakeTritonError | None = None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors or []}
        self.error = error

    def text(self) -> str:
        return str(self.outputs["text_output"][0, 0].decode())


class FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[tuple[FakeResponse, int]] = []
        self.first = threading.Event()
        self.final = threading.Event()

    def send(self, response: FakeResponse, flags: int = 0) -> None:
        assert not self.final.is_set(), "a response after the final one"
        self.sent.append((response, flags))
        self.first.set()
        if flags & FINAL:
            self.final.set()

    def wait(self) -> list[FakeResponse]:
        assert self.final.wait(TIMEOUT_S), "no final response"
        assert [flags for _, flags in self.sent] == [0] * (len(self.sent) - 1) + [FINAL]
        return [response for response, _ in self.sent]


class FakeRequest:
    def __init__(self, request: dict[str, list[Any]]) -> None:
        self.inputs = {
            name: np.array([[v.encode() for v in row] for row in values], object)
            if datatype == "BYTES"
            else np.array(values, dtype=_NUMPY[datatype])
            for name, (datatype, values) in request.items()
        }
        self.sender = FakeSender()
        self.cancelled = False

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancelled

    def request_id(self) -> str:
        return ""


class FakeMetric:
    def __init__(self) -> None:
        self.value = 0.0

    def increment(self, value: float) -> None:
        assert value > 0
        self.value += value

    def set(self, value: float) -> None:
        self.value = value


def fake_pb() -> SimpleNamespace:
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], FakeMetric] = {}
    logged: list[tuple[str, str]] = []

    class FakeFamily:
        COUNTER, GAUGE = "counter", "gauge"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name

        def Metric(self, labels: dict[str, str]) -> FakeMetric:  # noqa: N802 - Triton's name
            return metrics.setdefault((self.name, tuple(sorted(labels.items()))), FakeMetric())

    class FakeLogger:
        log_info = staticmethod(lambda message: logged.append(("info", message)))
        log_warn = staticmethod(lambda message: logged.append(("warn", message)))
        log_error = staticmethod(lambda message: logged.append(("error", message)))
        log_verbose = staticmethod(lambda message: logged.append(("verbose", message)))

    return SimpleNamespace(
        Tensor=FakeTensor,
        InferenceResponse=FakeResponse,
        TritonError=FakeTritonError,
        TRITONSERVER_RESPONSE_COMPLETE_FINAL=FINAL,
        get_input_tensor_by_name=lambda request, name: (
            FakeTensor(name, request.inputs[name]) if name in request.inputs else None
        ),
        MetricFamily=FakeFamily,
        Logger=FakeLogger,
        metrics=metrics,
        logged=logged,
    )


def metric(pb: SimpleNamespace, name: str, **labels: str) -> float:
    return sum(m.value for (n, ls), m in pb.metrics.items() if n == name and set(labels.items()) <= set(ls))


@pytest.fixture(scope="module")
def repository(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("backend") / "repo"
    export_triton(tiny_artifact, out, TritonOptions(name="tiny", max_num_seqs=2))
    return out


def load(repository: Path, pb: SimpleNamespace, **parameters: str) -> ServingModel:
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}}
    args = {
        "model_config": json.dumps(config),
        "model_repository": str(repository / "tiny"),
        "model_version": "1",
        "model_name": "tiny",
        "model_instance_kind": "CPU",
        "model_instance_device_id": "0",
        "model_instance_name": "tiny_0_0",
    }
    return ServingModel.load(args, pb)


@pytest.fixture
def served(repository: Path) -> Iterator[tuple[ServingModel, SimpleNamespace]]:
    pb = fake_pb()
    runners_log = logging.getLogger("kvforge.runners")
    handlers, level = list(runners_log.handlers), runners_log.level
    model = load(repository, pb, max_num_seqs="2")
    yield model, pb
    model.finalize()
    runners_log.handlers[:] = handlers
    runners_log.setLevel(level)


def test_a_streamed_request_is_sent_piece_by_piece(
    served: tuple[ServingModel, SimpleNamespace], tiny_artifact: Path
) -> None:
    model, pb = served
    pieces = list(Engine.load(tiny_artifact).stream("def f(x):", max_new_tokens=16, temperature=0))
    request = FakeRequest(frontend_request("def f(x):", stream=True, max_tokens=16))
    model.execute([request])  # decoupled: returns at once, the answer goes through the sender
    responses = request.sender.wait()
    assert all(r.error is None for r in responses)
    # one response per piece, however far the relay falls behind the engine (the last may be empty)
    texts = [r.text() for r in responses]
    assert texts[: len(pieces)] == pieces and "".join(texts[len(pieces) :]) == ""
    assert sum(int(r.outputs["num_output_tokens"][0, 0]) for r in responses) == 16
    model.mirror.sync()
    assert metric(pb, "kvforge_request_success_total", finished_reason="length") == 1
    assert metric(pb, "kvforge_generation_tokens_total", model="tiny", instance="tiny_0_0") == 16


def test_requests_run_concurrently_and_each_gets_its_own_text(
    served: tuple[ServingModel, SimpleNamespace], tiny_artifact: Path
) -> None:
    model, _ = served
    engine = Engine.load(tiny_artifact)
    prompts = ["import os", "class A:", "for i in range(3):"]
    requests = [FakeRequest(frontend_request(p, stream=False, max_tokens=10)) for p in prompts]
    model.execute(requests)
    for prompt, request in zip(prompts, requests):
        [response] = request.sender.wait()
        assert response.text() == "".join(engine.stream(prompt, max_new_tokens=10, temperature=0))


def test_a_bad_request_gets_one_final_error(served: tuple[ServingModel, SimpleNamespace]) -> None:
    model, _ = served
    request = FakeRequest(frontend_request("def", stream=True, max_tokens=0))
    model.execute([request])
    [response] = request.sender.wait()
    assert response.error is not None and response.error.code == "INVALID_ARG"
    assert "max_tokens must be an integer >= 1, got 0" in response.error.message
    guided = FakeRequest(frontend_request("def", stream=True, max_tokens=4, guided=("ebnf_grammar", "root ::= x")))
    model.execute([guided])
    [response] = guided.sender.wait()
    assert response.error is not None and response.error.code == "UNSUPPORTED"
    guided = FakeRequest(frontend_request("def", stream=True, max_tokens=4, guided=("regex", "[a-")))
    model.execute([guided])
    [response] = guided.sender.wait()
    assert response.error is not None and response.error.code == "INVALID_ARG"
    assert "guided_decoding_guide" in response.error.message


def test_guided_decoding_json_schema_and_regex(served: tuple[ServingModel, SimpleNamespace]) -> None:
    model, _ = served
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    cases = [("json_schema", json.dumps(schema)), ("regex", "[0-9]{3}"), ("json", "")]
    requests = [FakeRequest(frontend_request("def", stream=False, max_tokens=32, guided=g)) for g in cases]
    model.execute(requests)
    texts = []
    for request in requests:
        [response] = request.sender.wait()
        assert response.error is None, response.error
        texts.append(response.text())
    assert json.loads(texts[0]) in ({"ok": True}, {"ok": False})
    assert len(texts[1]) == 3 and texts[1].isdigit()
    assert texts[2].startswith("{")


def test_a_cancelled_request_is_aborted_in_the_engine(
    served: tuple[ServingModel, SimpleNamespace], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, pb = served
    # 5 ms more per model step, as a larger model would take: the tiny model alone generates the
    # LONG tokens in about 25 ms, faster than the backend looks for a cancellation (every POLL_S)
    session = model.scheduler.session
    run = session.run
    monkeypatch.setattr(session, "run", lambda feeds: time.sleep(0.005) or run(feeds))
    request = FakeRequest(frontend_request("def", stream=True, max_tokens=LONG))
    model.execute([request])
    assert request.sender.first.wait(TIMEOUT_S)
    request.cancelled = True  # what Triton reports once the client is gone
    responses = request.sender.wait()
    last = responses[-1]
    assert last.error is not None and last.error.code == "CANCELLED"
    assert model.scheduler.metrics.request_aborted.get() == 1
    assert model.scheduler.in_system == 0
    assert model.scheduler.metrics.generation_tokens.get() < LONG
    assert metric(pb, "kvforge_request_aborted_total") == 1
    assert any("cancelled: aborted in the engine after" in message for _, message in pb.logged)


def test_after_finalize_requests_are_refused_as_unavailable(repository: Path) -> None:
    model = load(repository, fake_pb())
    model.finalize()
    request = FakeRequest(frontend_request("def", stream=True, max_tokens=4))
    model.execute([request])
    [response] = request.sender.wait()
    assert response.error is not None and response.error.code == "UNAVAILABLE"
    assert "shutting down" in response.error.message


def test_engine_settings_from_the_config_parameters() -> None:
    assert EngineSettings.from_config({}) == EngineSettings(8, 64, 256)
    settings = EngineSettings.from_config({"parameters": {"max_queued": {"string_value": "0"}}})
    assert settings == EngineSettings(8, 0, 256)
    for name, value in (("max_num_seqs", "0"), ("prefill_chunk", "many"), ("max_queued", "-1")):
        with pytest.raises(KvforgeError, match=f"parameters {name} is '{value}'.*--{name.replace('_', '-')}"):
            EngineSettings.from_config({"parameters": {name: {"string_value": value}}})


def test_the_prefix_cache_budget_from_the_config_parameters(repository: Path) -> None:
    assert EngineSettings.from_config({}).prefix_cache_bytes == 0  # a config without it: no cache
    for text, budget in (("auto", None), ("64M", 64 << 20), ("0", 0), ("1048576", 1 << 20)):
        parameters = {"parameters": {"prefix_cache_bytes": {"string_value": text}}}
        assert EngineSettings.from_config(parameters).prefix_cache_bytes == budget
    with pytest.raises(KvforgeError, match="parameters prefix_cache_bytes is 'lots'.*--prefix-cache-bytes"):
        EngineSettings.from_config({"parameters": {"prefix_cache_bytes": {"string_value": "lots"}}})
    config = (repository / "tiny" / "config.pbtxt").read_text()
    assert 'key: "prefix_cache_bytes"\n  value: { string_value: "auto" }' in config


def test_the_prefix_cache_hits_and_leaves_the_texts_alone(repository: Path, tiny_artifact: Path) -> None:
    engine = Engine.load(tiny_artifact)
    prefix = CORPUS[0] + CORPUS[1] + CORPUS[2]
    assert len(engine.encode(prefix)) >= 4 * BLOCK
    prompts = [prefix + " and then", prefix + " but later, x = ", prefix + " and then"]
    expected = ["".join(engine.stream(p, max_new_tokens=12, temperature=0)) for p in prompts]
    for budget, hits in (("64M", 2), ("0", 0)):
        pb = fake_pb()
        model = load(repository, pb, max_num_seqs="2", prefix_cache_bytes=budget)
        try:
            texts = []
            for prompt in prompts:  # one after the other: each finds what the ones before stored
                request = FakeRequest(frontend_request(prompt, stream=False, max_tokens=12))
                model.execute([request])
                [response] = request.sender.wait()
                assert response.error is None, response.error
                texts.append(response.text())
            assert texts == expected
            model.mirror.sync()
            assert metric(pb, "kvforge_prefix_cache_hits_total", instance="tiny_0_0") == hits
            hit_tokens = metric(pb, "kvforge_prefix_cache_hit_tokens_total")
            held = metric(pb, "kvforge_prefix_cache_bytes")
            assert (hit_tokens >= 2 * 4 * BLOCK and 0 < held <= 64 << 20) if hits else hit_tokens == held == 0
            assert metric(pb, "kvforge_prefix_cache_queries_total") == (
                sum(map(len, map(engine.encode, prompts))) if hits else 0
            )
        finally:
            model.finalize()


def test_providers_follow_the_instance_kind() -> None:
    assert providers_for("CPU", "0", ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    gpu = providers_for("GPU", "3", ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert gpu == [("CUDAExecutionProvider", {"device_id": "3"}), "CPUExecutionProvider"]
    with pytest.raises(KvforgeError, match="KIND_GPU needs onnxruntime's CUDAExecutionProvider.*onnxruntime-gpu"):
        providers_for("GPU", "0", ["CPUExecutionProvider"])


def test_metrics_are_copied_as_increments_and_values() -> None:
    metrics, pb = Metrics(), fake_pb()
    mirror = MetricsMirror(metrics, pb, {"model": "m", "version": "1", "instance": "m_0_0"})
    metrics.generation_tokens.inc(5)
    metrics.running.set(2)
    mirror.sync()
    metrics.generation_tokens.inc(3)
    metrics.request_success.inc(value="stop")
    mirror.sync()
    mirror.sync()
    assert metric(pb, "kvforge_generation_tokens_total") == 8
    assert metric(pb, "kvforge_num_requests_running") == 2
    assert metric(pb, "kvforge_request_success_total", finished_reason="stop") == 1
    assert metric(pb, "kvforge_request_success_total", finished_reason="length") == 0


def test_a_triton_without_custom_metrics_still_serves() -> None:
    pb = fake_pb()
    del pb.MetricFamily
    mirror = MetricsMirror(Metrics(), pb, {})
    mirror.sync()  # nothing to copy to, no error


def test_log_records_go_to_tritons_log() -> None:
    pb = fake_pb()
    log = logging.getLogger("kvforge.runners.triton.test")
    handler = _TritonLog(pb.Logger)
    log.addHandler(handler)
    try:
        log.warning("careful %d", 1)
        log.error("broken")
    finally:
        log.removeHandler(handler)
    assert pb.logged == [("warn", "careful 1"), ("error", "broken")]


def test_min_p_and_repetition_penalty_reach_the_engine(
    served: tuple[ServingModel, SimpleNamespace], tiny_artifact: Path
) -> None:
    """The inputs the frontend does not send but the contract declares change the text as they
    change `kvforge generate`'s (values exact in float32, as Triton carries them)."""
    model, _ = served
    engine = Engine.load(tiny_artifact)
    cases = (
        {"temperature": 0.0, "repetition_penalty": 2.0},
        {"temperature": 1.5, "seed": 3, "min_p": 0.75},
    )
    for sampling in cases:
        tensors = frontend_request("def f(x):", stream=False, max_tokens=24)
        for name, value in sampling.items():
            tensors[name] = ["UINT64" if name == "seed" else "FP32", [[value]]]
        request = FakeRequest(tensors)
        model.execute([request])
        [response] = request.sender.wait()
        assert response.error is None
        expected = "".join(engine.stream("def f(x):", max_new_tokens=24, **sampling))
        plain = {k: v for k, v in sampling.items() if k in ("temperature", "seed")}
        assert response.text() == expected != "".join(engine.stream("def f(x):", max_new_tokens=24, **plain))
    bad = frontend_request("def", stream=True, max_tokens=4)
    bad["min_p"] = ["FP32", [[1.5]]]
    request = FakeRequest(bad)
    model.execute([request])
    [response] = request.sender.wait()
    assert response.error is not None and response.error.code == "INVALID_ARG"
    assert "min_p must be in [0, 1] (0 turns it off), got 1.5" in response.error.message
