"""Prometheus metrics of the server through prometheus_client, with vLLM's names.

Dashboards built for vLLM read `vllm:<name>`; the same names under `kvforge:` let them be
pointed at this server by changing the prefix. Each `Metrics` has a registry of its own (a
process may hold several engines, and tests make many), and every series carries the served
model's name as `model_name`, which is known only once the server has named its model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import prometheus_client
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector, CollectorRegistry

PREFIX = "kvforge:"
# Buckets as vLLM chooses them for each quantity (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length")
# The classic text format, which generate_latest writes and every Prometheus reads.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


def _value(metric: Collector, suffix: str, labels: dict[str, str]) -> float:
    """A sample's value as the metric reports it (0 when it has no such sample yet)."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix) and sample.labels == labels:
                return float(sample.value)
    return 0.0


class Histogram:
    def __init__(self, registry: CollectorRegistry, name: str, help: str, buckets: Sequence[float]) -> None:
        self.name, self.help, self.buckets = PREFIX + name, help, tuple(buckets)
        self._metric = prometheus_client.Histogram(self.name, help, buckets=self.buckets, registry=registry)
        self.observe = self._metric.observe

    @property
    def count(self) -> int:
        return int(_value(self._metric, "_count", {}))


class Counter:
    """A counter, optionally split by one label (values are created at zero up front)."""

    def __init__(
        self, registry: CollectorRegistry, name: str, help: str, label: str | None = None, values: Sequence[str] = ()
    ) -> None:
        self.name, self.help, self.label = PREFIX + name, help, label
        self._metric = prometheus_client.Counter(self.name, help, [label] if label else [], registry=registry)
        self._values = list(values) if label else [""]
        for value in values if label else ():
            self._metric.labels(value)

    def inc(self, amount: float = 1.0, value: str = "") -> None:
        if self.label is None:
            self._metric.inc(amount)
            return
        if value not in self._values:
            self._values.append(value)
        self._metric.labels(value).inc(amount)

    def labels(self) -> tuple[str, ...]:
        """The values of its label ("" alone when it has none)."""
        return tuple(self._values)

    def get(self, value: str = "") -> float:
        return _value(self._metric, "_total", {self.label: value} if self.label else {})


class Gauge:
    def __init__(self, registry: CollectorRegistry, name: str, help: str) -> None:
        self.name, self.help = PREFIX + name, help
        self._metric = prometheus_client.Gauge(self.name, help, registry=registry)
        self.set = self._metric.set

    @property
    def value(self) -> float:
        return _value(self._metric, "", {})


class _Named(Collector):
    """The metrics of one registry with the served model's name as a label, without the
    `_created` series (a counter's start time, which vLLM's dashboards do not read)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[prometheus_client.Metric]:
        name = {"model_name": self.metrics.model_name}
        for family in self.metrics.registry.collect():
            family.samples = [
                sample._replace(labels={**name, **sample.labels})
                for sample in family.samples
                if not sample.name.endswith("_created")
            ]
            yield family


class Metrics:
    """Every metric the server exports; `render()` gives the /metrics body."""

    def __init__(self) -> None:
        self.model_name = ""
        self.registry = CollectorRegistry(auto_describe=False)
        self._exposed = CollectorRegistry(auto_describe=False)
        self._exposed.register(_Named(self))
        self.time_to_first_token = Histogram(
            self.registry,
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            self.registry, "inter_token_latency_seconds", "Time between two consecutive generated tokens.", ITL_BUCKETS
        )
        self.queue_time = Histogram(
            self.registry,
            "request_queue_time_seconds",
            "Time a request waited before its prefill began.",
            REQUEST_BUCKETS,
        )
        self.e2e_latency = Histogram(
            self.registry, "e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS
        )
        self.running = Gauge(self.registry, "num_requests_running", "Requests in the batch (prefilling or decoding).")
        self.waiting = Gauge(self.registry, "num_requests_waiting", "Requests accepted and waiting for a batch slot.")
        self.kv_usage = Gauge(
            self.registry,
            "kv_cache_usage_perc",
            "Fraction of the KV cache (max-num-seqs x context positions) holding tokens.",
        )
        self.prompt_tokens = Counter(self.registry, "prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = Counter(self.registry, "generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            self.registry, "request_success", "Requests finished, by finish reason.", "finished_reason", FINISH_REASONS
        )
        self.request_aborted = Counter(
            self.registry, "request_aborted", "Requests aborted by a client disconnect or shutdown."
        )
        self.request_rejected = Counter(
            self.registry, "request_rejected", "Requests refused with 429 (queue full) or 503."
        )
        self.request_failed = Counter(self.registry, "request_failed", "Requests ended by an engine error.")
        self.prefix_cache_queries = Counter(
            self.registry, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = Counter(self.registry, "prefix_cache_hits", "Requests that found a cached prefix.")
        self.prefix_cache_hit_tokens = Counter(
            self.registry, "prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache instead of prefilled."
        )
        self.prefix_cache_evictions = Counter(self.registry, "prefix_cache_evictions", "Prefix cache blocks evicted.")
        self.prefix_cache_bytes = Gauge(self.registry, "prefix_cache_bytes", "Bytes the prefix cache holds.")
        self.spec_decode_num_drafts = Counter(
            self.registry, "spec_decode_num_drafts", "Decode steps in which a row had drafted tokens (--speculative)."
        )
        self.spec_decode_num_draft_tokens = Counter(self.registry, "spec_decode_num_draft_tokens", "Tokens drafted.")
        self.spec_decode_num_accepted_tokens = Counter(
            self.registry,
            "spec_decode_num_accepted_tokens",
            "Drafted tokens the target model's own choice agreed with.",
        )

    def families(self) -> tuple[Histogram | Counter | Gauge, ...]:
        """Every metric, in the order /metrics lists them: the one table the server and Triton export."""
        return (
            self.time_to_first_token,
            self.inter_token_latency,
            self.queue_time,
            self.e2e_latency,
            self.running,
            self.waiting,
            self.kv_usage,
            self.prompt_tokens,
            self.generation_tokens,
            self.request_success,
            self.request_aborted,
            self.request_rejected,
            self.request_failed,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.prefix_cache_hit_tokens,
            self.prefix_cache_evictions,
            self.prefix_cache_bytes,
            self.spec_decode_num_drafts,
            self.spec_decode_num_draft_tokens,
            self.spec_decode_num_accepted_tokens,
        )

    def render(self) -> bytes:
        """The /metrics body, in the text format of `CONTENT_TYPE`."""
        return prometheus_client.generate_latest(self._exposed)
