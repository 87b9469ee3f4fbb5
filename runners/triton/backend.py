"""kvforge's engine in Triton's Python backend: the model class a repository's `1/model.py` hands over.

Each model instance (a stub process of its own) loads the artifact beside `model.py`, checks
it against its manifest and runs the continuous-batching engine of `kvforge serve`
(`BatchScheduler`) on one thread. The model is decoupled: `execute` hands each request to a
thread of its own and returns at once; that thread checks the request, queues it to the
engine and sends its text back through the request's response sender as it comes, the last
response with the final flag. While it waits it asks Triton whether the request was
cancelled (the client went away, or a timeout): then the request is aborted in the engine,
and is answered with a CANCELLED error once the engine has let go of it.

Triton's module `triton_python_backend_utils` exists only inside the stub, so it is handed
to `ServingModel` as an object (`pb`): tests give it a stand-in.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import PREFIX, Counter, Gauge, Histogram, Metrics
from kvforge.runners.serve.scheduler import (
    BatchScheduler,
    Overloaded,
    Request,
    Unavailable,
    choice_requests,
    poll_events,
)
from kvforge.runners.serve.server import prefix_cache_for
from kvforge.runners.settings import serving_settings
from kvforge.runners.triton.contract import ARTIFACT_DIR, AUTO_BUDGET, ENGINE_PARAMETERS, PREFIX_CACHE_PARAMETER
from kvforge.runners.triton.requests import Reply, ReplyStream, TritonRequestError, parse_inputs
from kvforge.runners.units import parse_bytes

logger = logging.getLogger(__name__)

# How often a waiting request thread asks Triton whether its request was cancelled.
POLL_S = 0.05
# How long a cancelled request waits for the engine to drop it (one engine step, normally).
RELEASE_TIMEOUT_S = 30.0
# How often the engine's metrics are copied into Triton's.
METRICS_PERIOD_S = 1.0


class TritonPythonModel:
    """What Triton's Python backend instantiates in each model instance's stub process."""

    def initialize(self, args: dict[str, str]) -> None:
        import triton_python_backend_utils as pb_utils  # only inside Triton's stub

        self._model = ServingModel.load(args, pb_utils)

    def execute(self, requests: Sequence[Any]) -> None:
        return self._model.execute(requests)

    def finalize(self) -> None:
        self._model.finalize()


@dataclass(frozen=True)
class EngineSettings:
    max_num_seqs: int = ENGINE_PARAMETERS["max_num_seqs"]
    max_queued: int = ENGINE_PARAMETERS["max_queued"]
    prefill_chunk: int = ENGINE_PARAMETERS["prefill_chunk"]
    prefix_cache_bytes: int | None = 0  # None: a quarter of the memory available; 0 (or absent): off

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EngineSettings:
        """The engine's knobs from config.pbtxt's `parameters` (string values); absent ones keep defaults."""
        parameters = config.get("parameters") or {}
        values: dict[str, int] = {}
        for declared in serving_settings():
            if not declared.triton_parameter:
                continue
            name = declared.name
            entry = parameters.get(name)
            if entry is None:
                continue
            text = entry.get("string_value") if isinstance(entry, dict) else None
            least = int(declared.minimum or 0)
            try:
                value = int(str(text))
            except ValueError:
                value = least - 1
            if value < least:
                raise KvforgeError(
                    f"config.pbtxt: parameters {name} is {text!r}, not an integer >= {least}; fix it, or export "
                    f"again with `kvforge export-triton --{name.replace('_', '-')} N`"
                )
            values[name] = value
        return cls(**values, prefix_cache_bytes=_budget(parameters.get(PREFIX_CACHE_PARAMETER)))


def _budget(entry: Any) -> int | None:
    """The prefix cache budget of config.pbtxt's parameter: bytes, None for `auto`, 0 when absent."""
    if entry is None:
        return 0
    text = entry.get("string_value") if isinstance(entry, dict) else None
    if str(text).strip().lower() == AUTO_BUDGET:
        return None
    try:
        return parse_bytes(str(text), PREFIX_CACHE_PARAMETER)
    except KvforgeError as error:
        raise KvforgeError(
            f"config.pbtxt: parameters {PREFIX_CACHE_PARAMETER} is {text!r}, not a byte count (such as 0, "
            f"268435456 or 256M) or {AUTO_BUDGET!r}; fix it, or export again with "
            "`kvforge export-triton --prefix-cache-bytes N`"
        ) from error


def providers_for(kind: str, device_id: str, available: Sequence[str]) -> list[Any]:
    """onnxruntime's execution providers for a Triton instance of `kind` (CPU or GPU) on `device_id`."""
    if kind != "GPU":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in available:
        raise KvforgeError(
            "instance_group kind KIND_GPU needs onnxruntime's CUDAExecutionProvider, which this Python "
            f"environment lacks (it has {', '.join(available) or 'none'}); install onnxruntime-gpu in the "
            "Python backend's environment, or export with `kvforge export-triton --kind cpu`"
        )
    return [("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"]


class ServingModel:
    """One model instance: the engine thread, a thread per request, the metrics copied to Triton."""

    def __init__(self, engine: Engine, scheduler: BatchScheduler, name: str, pb: Any, mirror: MetricsMirror) -> None:
        self.engine, self.scheduler, self.name, self.pb, self.mirror = engine, scheduler, name, pb, mirror
        self._counter = 0
        self._lock = threading.Lock()

    @classmethod
    def load(cls, args: dict[str, str], pb: Any) -> ServingModel:
        import onnxruntime

        forward_logs(pb)
        config = json.loads(args["model_config"])
        settings = EngineSettings.from_config(config)
        name = args["model_name"]
        directory = Path(args["model_repository"]) / args["model_version"] / ARTIFACT_DIR
        providers = providers_for(
            args.get("model_instance_kind", "CPU"),
            args.get("model_instance_device_id", "0"),
            onnxruntime.get_available_providers(),
        )
        # Engine.load passes the providers to onnxruntime as they are; a (name, options) pair is
        # onnxruntime's way to choose the device.
        engine = Engine.load(directory, providers=cast(Sequence[str], providers))
        metrics = Metrics()
        metrics.model_name = name
        scheduler = BatchScheduler.for_engine(
            engine,
            max_num_seqs=settings.max_num_seqs,
            max_queued=settings.max_queued,
            prefill_chunk=settings.prefill_chunk,
            metrics=metrics,
            prefix_cache=prefix_cache_for(engine, directory, settings.prefix_cache_bytes, metrics, logger.info),
        )
        scheduler.start()
        labels = {"model": name, "version": args["model_version"], "instance": args.get("model_instance_name", "")}
        mirror = MetricsMirror(metrics, pb, labels)
        mirror.start()
        logger.info(
            "kvforge model %r ready: %s, context %d, max %d sequences, providers %s",
            name,
            directory,
            engine.max_positions,
            settings.max_num_seqs,
            [p if isinstance(p, str) else p[0] for p in providers],
        )
        return cls(engine, scheduler, name, pb, mirror)

    def execute(self, requests: Sequence[Any]) -> None:
        for triton_request in requests:
            with self._lock:
                self._counter += 1
                number = self._counter
            label = triton_request.request_id() or f"#{number}"
            thread = threading.Thread(
                target=self.serve, args=(triton_request, label), name=f"kvforge-request-{number}", daemon=True
            )
            thread.start()
        return None  # decoupled: every response goes through the request's response sender

    def finalize(self) -> None:
        self.scheduler.stop()  # requests still in flight end with an error
        self.mirror.stop()

    # -- one request --------------------------------------------------------------------

    def serve(self, triton_request: Any, label: str) -> None:
        """Run one request to its end; never raises (a failure is the request's error response)."""
        sender = triton_request.get_response_sender()
        try:
            request, stream = self._submit(triton_request)
        except TritonRequestError as error:
            self._send(sender, Reply(final=True, error=error))
            return
        try:
            self._relay(triton_request, sender, request, stream, label)
        except Exception as error:  # a bug or a failed send must cost this request only
            logger.exception("request %s failed", label)
            self.scheduler.cancel(request)
            failure = TritonRequestError(f"internal error: {type(error).__name__}: {error}", "INTERNAL")
            self._send(sender, Reply(final=True, error=failure))
        finally:
            self.mirror.sync()

    def _submit(self, triton_request: Any) -> tuple[Request, ReplyStream]:
        def read(name: str) -> Any:
            tensor = self.pb.get_input_tensor_by_name(triton_request, name)
            return None if tensor is None else tensor.as_numpy()

        arrival = time.perf_counter()
        generation = parse_inputs(read, self.engine, self.name)
        try:  # the same path as kvforge serve's: one request (n is 1 here), its arrival kept for the metrics
            (request,) = choice_requests(self.engine, generation.parsed, arrival)
        except KvforgeError as error:
            raise TritonRequestError(f"input stop_words: {error}") from error
        try:
            self.scheduler.submit(request)
        except (Overloaded, Unavailable) as error:
            self.scheduler.metrics.request_rejected.inc()
            raise TritonRequestError(str(error), "UNAVAILABLE") from error
        return request, ReplyStream(generation, request)

    def _relay(self, triton_request: Any, sender: Any, request: Request, stream: ReplyStream, label: str) -> None:
        """Send the request's events as they come, until it ends or Triton cancels it."""
        for event in poll_events(request.events, triton_request.is_cancelled, POLL_S):
            # One response per piece, even when the relay fell behind: clients that time
            # tokens (genai-perf's inter-token latency) count responses.
            for reply in stream.replies([event]):
                self._send(sender, reply)
            if stream.done:
                return
        self._abort(sender, request, label)

    def _abort(self, sender: Any, request: Request, label: str) -> None:
        self.scheduler.cancel(request)
        if self.scheduler.wait_released(request, RELEASE_TIMEOUT_S):
            logger.info(
                "request %s cancelled: aborted in the engine after %d of %d tokens",
                label,
                request.generated,
                request.budget,
            )
        else:
            logger.warning("request %s cancelled, but the engine did not drop it within %gs", label, RELEASE_TIMEOUT_S)
        self._send(sender, Reply(final=True, error=TritonRequestError("the request was cancelled", "CANCELLED")))

    def _send(self, sender: Any, reply: Reply) -> None:
        pb = self.pb
        if reply.error is not None:
            code = getattr(pb.TritonError, reply.error.code, pb.TritonError.INTERNAL)
            response = pb.InferenceResponse(error=pb.TritonError(str(reply.error), code))
        else:
            tensors = [pb.Tensor(name, array) for name, array in reply.outputs().items()]
            response = pb.InferenceResponse(output_tensors=tensors)
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if reply.final else 0
        try:
            sender.send(response, flags=flags)
        except Exception as error:  # the request is gone on Triton's side: nothing more to tell it
            if not reply.final:
                raise
            logger.info("could not send the final response: %s", error)


# -- logs and metrics ---------------------------------------------------------------------


class _TritonLog(logging.Handler):
    """Our log records, written to Triton's log by the stub's Logger."""

    def __init__(self, triton_logger: Any) -> None:
        super().__init__()
        self.triton_logger = triton_logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            if record.levelno >= logging.ERROR:
                self.triton_logger.log_error(message)
            elif record.levelno >= logging.WARNING:
                self.triton_logger.log_warn(message)
            elif record.levelno >= logging.INFO:
                self.triton_logger.log_info(message)
            else:
                self.triton_logger.log_verbose(message)
        except Exception:
            self.handleError(record)


def forward_logs(pb: Any) -> None:
    """Send the `kvforge.runners` loggers' INFO and above to Triton's log (once per process)."""
    root = logging.getLogger("kvforge.runners")
    if not any(isinstance(h, _TritonLog) for h in root.handlers):
        handler = _TritonLog(pb.Logger)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        root.addHandler(handler)
    root.setLevel(logging.INFO)


class MetricsMirror:
    """The engine's metrics as Triton custom metrics, beside Triton's own `nv_inference_*`.

    Names are `kvforge serve`'s with `kvforge_` for `kvforge:`, labelled with model, version and
    instance. Counters are copied by increments, gauges by value, after each request and every
    `METRICS_PERIOD_S`.
    """

    def __init__(self, metrics: Metrics, pb: Any, labels: dict[str, str]) -> None:
        self.metrics = metrics
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._copied: dict[tuple[str, str], float] = {}
        self._targets: dict[tuple[str, str], tuple[Counter | Gauge, Any]] = {}
        self._families: dict[str, Any] = {}  # a family must outlive its metrics
        try:
            self._create(pb, labels)
        except Exception as error:  # a Triton without custom metrics still serves
            logger.warning("Triton custom metrics are not available (%s); kvforge_* metrics are not exported", error)
            self._targets = {}

    def _create(self, pb: Any, labels: dict[str, str]) -> None:
        for metric in self.metrics.families():
            if isinstance(metric, Histogram):  # Triton's own nv_inference_* cover latency
                continue
            counter = isinstance(metric, Counter)
            name = triton_name(metric)
            kind = pb.MetricFamily.COUNTER if counter else pb.MetricFamily.GAUGE
            family = self._families[name] = pb.MetricFamily(name=name, description=metric.help, kind=kind)
            for value in metric.labels() if isinstance(metric, Counter) else ("",):
                extra = {metric.label: value} if isinstance(metric, Counter) and metric.label else {}
                self._targets[(name, value)] = (metric, family.Metric(labels={**labels, **extra}))

    def values(self) -> dict[tuple[str, str], float]:
        """(Triton metric name, label value) -> the engine's value now."""
        return {
            key: metric.get(key[1]) if isinstance(metric, Counter) else metric.value
            for key, (metric, _) in self._targets.items()
        }

    def sync(self) -> None:
        with self._lock:
            for key, value in self.values().items():
                metric, target = self._targets[key]
                if isinstance(metric, Gauge):
                    target.set(value)
                elif value > self._copied.get(key, 0.0):
                    target.increment(value - self._copied.get(key, 0.0))
                    self._copied[key] = value

    def start(self) -> None:
        threading.Thread(target=self._loop, name="kvforge-metrics", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self.sync()

    def _loop(self) -> None:
        while not self._stop.wait(METRICS_PERIOD_S):
            try:
                self.sync()
            except Exception:  # metrics must never take the model down
                logger.exception("copying metrics to Triton failed")


def triton_name(metric: Counter | Gauge) -> str:
    """`kvforge serve`'s metric name as Triton takes it: `kvforge_` for `kvforge:`, counters with `_total`."""
    base = "kvforge_" + metric.name.removeprefix(PREFIX)
    return base + "_total" if isinstance(metric, Counter) else base
