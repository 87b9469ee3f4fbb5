"""Prometheus metrics of the server, in the text exposition format, with vLLM's names.

Dashboards built for vLLM read `vllm:<name>`; the same names under `kvforge:` let them be
pointed at this server by changing the prefix. No client library is needed for a handful
of counters, gauges and histograms, so none is used.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

PREFIX = "kvforge:"
# Buckets as vLLM chooses them for each quantity (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length")


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    escaped = (f'{k}="{_escape(v)}"' for k, v in pairs.items())
    return "{" + ",".join(escaped) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return repr(float(value)) if value != int(value) else f"{int(value)}.0"


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        self.name, self.help, self.buckets = PREFIX + name, help, tuple(buckets)
        self._counts = [0] * (len(self.buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        return sum(self._counts)

    def render(self, labels: dict[str, str]) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else _number(bound)
            lines.append(f"{self.name}_bucket{_labels({**labels, 'le': le})} {cumulative}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_number(total)}")
        lines.append(f"{self.name}_count{_labels(labels)} {cumulative}")
        return lines


class Counter:
    """A counter, optionally split by one label (values are created at zero up front)."""

    def __init__(self, name: str, help: str, label: str | None = None, values: Sequence[str] = ()) -> None:
        self.name, self.help, self.label = PREFIX + name, help, label
        self._values: dict[str, float] = {v: 0.0 for v in values} if label else {"": 0.0}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, value: str = "") -> None:
        with self._lock:
            self._values[value] = self._values.get(value, 0.0) + amount

    def labels(self) -> tuple[str, ...]:
        """The values of its label ("" alone when it has none)."""
        with self._lock:
            return tuple(self._values)

    def get(self, value: str = "") -> float:
        with self._lock:
            return self._values.get(value, 0.0)

    def render(self, labels: dict[str, str]) -> list[str]:
        with self._lock:
            values = dict(self._values)
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for value, amount in values.items():
            extra = {self.label: value} if self.label else {}
            lines.append(f"{self.name}_total{_labels({**labels, **extra})} {_number(amount)}")
        return lines


class Gauge:
    def __init__(self, name: str, help: str) -> None:
        self.name, self.help = PREFIX + name, help
        self.value = 0.0  # written by the engine thread only; a float store is atomic

    def set(self, value: float) -> None:
        self.value = float(value)

    def render(self, labels: dict[str, str]) -> list[str]:
        return [
            f"# HELP {self.name} {self.help}",
            f"# TYPE {self.name} gauge",
            f"{self.name}{_labels(labels)} {_number(self.value)}",
        ]


class Metrics:
    """Every metric the server exports; `render()` gives the /metrics body."""

    def __init__(self) -> None:
        self.model_name = ""
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS
        )
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds", "Time between two consecutive generated tokens.", ITL_BUCKETS
        )
        self.queue_time = Histogram(
            "request_queue_time_seconds", "Time a request waited before its prefill began.", REQUEST_BUCKETS
        )
        self.e2e_latency = Histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last token.", REQUEST_BUCKETS
        )
        self.running = Gauge("num_requests_running", "Requests in the batch (prefilling or decoding).")
        self.waiting = Gauge("num_requests_waiting", "Requests accepted and waiting for a batch slot.")
        self.kv_usage = Gauge(
            "kv_cache_usage_perc", "Fraction of the KV cache (max-num-seqs x context positions) holding tokens."
        )
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens prefilled.")
        self.generation_tokens = Counter("generation_tokens", "Tokens generated.")
        self.request_success = Counter(
            "request_success", "Requests finished, by finish reason.", "finished_reason", FINISH_REASONS
        )
        self.request_aborted = Counter("request_aborted", "Requests aborted by a client disconnect or shutdown.")
        self.request_rejected = Counter("request_rejected", "Requests refused with 429 (queue full) or 503.")
        self.request_failed = Counter("request_failed", "Requests ended by an engine error.")
        self.prefix_cache_queries = Counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = Counter("prefix_cache_hits", "Requests that found a cached prefix.")
        self.prefix_cache_hit_tokens = Counter(
            "prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache instead of prefilled."
        )
        self.prefix_cache_evictions = Counter("prefix_cache_evictions", "Prefix cache blocks evicted.")
        self.prefix_cache_bytes = Gauge("prefix_cache_bytes", "Bytes the prefix cache holds.")
        self.spec_decode_num_drafts = Counter(
            "spec_decode_num_drafts", "Decode steps in which a row had drafted tokens (--speculative)."
        )
        self.spec_decode_num_draft_tokens = Counter("spec_decode_num_draft_tokens", "Tokens drafted.")
        self.spec_decode_num_accepted_tokens = Counter(
            "spec_decode_num_accepted_tokens", "Drafted tokens the target model's own choice agreed with."
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

    def render(self) -> str:
        labels = {"model_name": self.model_name}
        lines: list[str] = []
        for metric in self.families():
            lines.extend(metric.render(labels))
        return "\n".join(lines) + "\n"
