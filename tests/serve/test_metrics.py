"""/metrics through prometheus_client: vLLM's names under `kvforge:`, the model's name on every
series, and the values the engine core wrote through the attribute interface."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvforge.runners.serve.metrics import FINISH_REASONS, Metrics


def samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = metrics.render().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_values_written_through_the_attributes_are_exposed_with_the_model_name() -> None:
    metrics = Metrics()
    metrics.model_name = "tiny"
    metrics.request_success.inc(value="stop")
    metrics.request_success.inc(value="abort")  # a reason not declared up front gets its own series
    metrics.prompt_tokens.inc(7)
    metrics.running.set(3)
    for seconds in (0.002, 0.03, 30.0):
        metrics.time_to_first_token.observe(seconds)
    exposed = samples(metrics)
    model = ("model_name", "tiny")

    def value(name: str, **labels: str) -> float:
        return exposed[("kvforge:" + name, frozenset({model, *labels.items()}))]

    assert value("request_success_total", finished_reason="stop") == 1
    assert value("request_success_total", finished_reason="length") == 0
    assert value("request_success_total", finished_reason="abort") == 1
    assert value("prompt_tokens_total") == 7
    assert value("num_requests_running") == 3
    assert value("time_to_first_token_seconds_bucket", le="0.005") == 1
    assert value("time_to_first_token_seconds_bucket", le="0.04") == 2
    assert value("time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert value("time_to_first_token_seconds_count") == 3
    assert abs(value("time_to_first_token_seconds_sum") - 30.032) < 1e-9
    assert not any(name.endswith("_created") for name, _ in exposed)
    assert all(model in labels for _, labels in exposed)


def test_the_readers_see_what_was_written() -> None:
    metrics = Metrics()
    metrics.request_success.inc(2, value="length")
    metrics.prefix_cache_bytes.set(4096)
    metrics.queue_time.observe(0.1)
    assert metrics.request_success.get("length") == 2
    assert metrics.request_success.labels() == FINISH_REASONS
    assert metrics.request_aborted.get() == 0 and metrics.request_aborted.labels() == ("",)
    assert metrics.prefix_cache_bytes.value == 4096
    assert metrics.queue_time.count == 1


def test_each_instance_has_its_own_registry() -> None:
    first, second = Metrics(), Metrics()
    first.generation_tokens.inc(5)
    assert first.generation_tokens.get() == 5 and second.generation_tokens.get() == 0
