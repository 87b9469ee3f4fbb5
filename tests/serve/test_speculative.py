"""Speculative decoding in the server's continuous batch: the same texts as the batch without it,
with verify steps at batch 1 per row, holes where rows kept fewer positions, and the refusals."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from click.testing import CliRunner

from kvforge.runners.engine import Engine
from kvforge.runners.errors import KvforgeError
from kvforge.runners.serve.metrics import Metrics
from kvforge.runners.serve.scheduler import BatchScheduler, Finished, Request
from tests.serve.conftest import KVFORGE, Server
from tests.serve.test_scheduler import PROMPTS, Recording, collect, request

pytestmark = pytest.mark.slow

# Edit-like prompts (the reply copies the prompt) beside open ones: random weights loop, and
# prompt lookup drafts from the loops.
SPEC_PROMPTS = [*PROMPTS, "import os\nimport os\nimport os\n", "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2"]


@pytest.fixture(scope="module")
def default_build(tiny_artifact: Path) -> Path:
    """A tiny artifact built with the defaults: its graph takes logits_to_keep, so it speculates."""
    assert json.loads((tiny_artifact / "manifest.json").read_text())["io"]["logits_positions"] == "keep"
    return tiny_artifact


@pytest.fixture(scope="module")
def last_only(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built with `--logits last`: the last position's logits only, which cannot verify drafts."""
    from kvforge import BuildOptions, build

    out = tmp_path_factory.mktemp("serve-last") / "out"
    return build(tiny_checkpoint("llama"), out, BuildOptions(logits="last")).output


@pytest.fixture(scope="module")
def engine(default_build: Path) -> Engine:
    return Engine.load(default_build)


def scheduler_for(engine: Engine, speculative: str | None, session: Any = None, **options: Any) -> BatchScheduler:
    settings = dict(max_num_seqs=4, max_queued=16, prefill_chunk=8, speculative_rows=8) | options
    if speculative is None:
        settings.pop("speculative_rows")
    draft_tokens = settings.pop("draft_tokens", None)
    scheduler = BatchScheduler(
        session or engine.session,
        max_positions=engine.max_positions,
        eos_ids=engine.eos_ids,
        metrics=Metrics(),
        speculation=engine.speculation(speculative, draft_tokens),
        **settings,
    )
    scheduler.start()
    return scheduler


def run_concurrently(scheduler: BatchScheduler, requests: list[Request]) -> list[tuple[str, Any]]:
    """Submit every request, the later ones while the first ones decode; their texts and endings."""
    for index, req in enumerate(requests):
        scheduler.submit(req)
        if index == 1:
            time.sleep(0.01)
    return [collect(req) for req in requests]


def texts_of(engine: Engine, speculative: str | None, budgets: list[int], **kwargs: Any) -> list[tuple[str, Any]]:
    stop = kwargs.pop("stop", ())
    session = kwargs.pop("session", None)
    scheduler = scheduler_for(engine, speculative, session, **kwargs)
    try:
        requests = [request(engine, p, n, stop=stop) for p, n in zip(SPEC_PROMPTS, budgets)]
        return run_concurrently(scheduler, requests)
    finally:
        scheduler.stop()


BUDGETS = [40, 12, 60, 8, 50, 30, 25, 45, 35]


@pytest.mark.parametrize(("speculative", "rows"), [("prompt-lookup", 8), ("draft:SELF", 8), ("prompt-lookup", 1)])
def test_concurrent_greedy_equals_plain_batch(engine: Engine, speculative: str, rows: int) -> None:
    """Verify steps per row in a batch of up to 4 (rows 8), or only once a row is alone (rows 1)."""
    speculative = speculative.replace("SELF", str(engine.directory))
    expected = texts_of(engine, None, BUDGETS)
    recording = Recording(engine.session)
    got = texts_of(engine, speculative, BUDGETS, session=recording, draft_tokens=5, speculative_rows=rows)
    for (text, end), (want, want_end) in zip(got, expected):
        assert isinstance(end, Finished) and isinstance(want_end, Finished)
        assert text == want
        assert (end.reason, end.completion_tokens) == (want_end.reason, want_end.completion_tokens)
    # several tokens per call only at batch 1 (prefill chunks and verify steps), never in a batch
    assert [shape for shape in recording.calls if shape[0] == 1 and shape[1] > 1]
    assert not [shape for shape in recording.calls if shape[0] > 1 and shape[1] > 1]


def test_stop_strings_and_tight_capacity_equal_plain(engine: Engine) -> None:
    free = texts_of(engine, None, BUDGETS)
    stop = free[7][0][5:8]  # inside a reply that prompt lookup drafts well
    assert stop
    expected = texts_of(engine, None, BUDGETS, stop=(stop,))
    assert len(expected[7][0]) < len(free[7][0])
    got = texts_of(engine, "prompt-lookup", BUDGETS, stop=(stop,), draft_tokens=8)
    assert [text for text, _ in got] == [text for text, _ in expected]
    assert [e.reason for _, e in got] == [e.reason for _, e in expected]


def test_holes_are_gathered_by_compaction(engine: Engine) -> None:
    """Many rows of different acceptance over long budgets: the width outgrows the rows and the
    batch is compacted by gathering around holes; the texts stay those of the plain batch."""
    budgets = [90] * len(SPEC_PROMPTS)
    expected = texts_of(engine, None, budgets, max_num_seqs=6)
    scheduler = scheduler_for(engine, "prompt-lookup", max_num_seqs=6, draft_tokens=8)
    try:
        requests = [request(engine, p, n) for p, n in zip(SPEC_PROMPTS, budgets)]
        got = run_concurrently(scheduler, requests)
        assert scheduler.compactions > 0
        metrics = scheduler.metrics
        drafted = metrics.spec_decode_num_draft_tokens.get()
        accepted = metrics.spec_decode_num_accepted_tokens.get()
        assert 0 < accepted <= drafted and metrics.spec_decode_num_drafts.get() > 0
    finally:
        scheduler.stop()
    assert [text for text, _ in got] == [text for text, _ in expected]


def test_sampled_requests_equal_plain_per_seed(engine: Engine) -> None:
    def run(speculative: str | None) -> tuple[list[str], float]:
        scheduler = scheduler_for(engine, speculative)
        try:
            requests = [
                request(engine, p, 30, temperature=0.8, top_p=0.95, seed=3 + i) for i, p in enumerate(SPEC_PROMPTS[:5])
            ]
            return [text for text, _ in run_concurrently(scheduler, requests)]
        finally:
            scheduler.stop()

    assert run("prompt-lookup") == run(None)


def test_refusals_name_the_option(tiny_artifact: Path, last_only: Path) -> None:
    plain = Engine.load(last_only)  # last-position logits only
    with pytest.raises(KvforgeError, match="io.logits_positions 'last'.*rebuild it with `kvforge build CHECKPOINT"):
        scheduler_for(plain, "prompt-lookup")
    from kvforge.cli import main

    result = CliRunner().invoke(main, ["serve", str(tiny_artifact), "--port", "0", "--draft-tokens", "3"])
    assert result.exit_code != 0 and "--speculative" in result.output
    result = CliRunner().invoke(main, ["serve", str(tiny_artifact), "--port", "0", "--speculative", "ngram"])
    assert result.exit_code != 0 and "--speculative" in result.output and "prompt-lookup" in result.output


def test_window_bounded_layers_are_refused_naming_the_option(engine: Engine) -> None:
    io = engine.session.io
    windowed = replace(io, layer_windows=tuple(8 if i % 2 else None for i in range(io.num_layers)))
    session = SimpleNamespace(io=windowed, run=engine.session.run)
    with pytest.raises(KvforgeError, match=r"--speculative.*sliding window"):
        scheduler_for(engine, "prompt-lookup", session)


def test_server_refuses_an_artifact_built_with_logits_last(last_only: Path, tmp_path: Path) -> None:
    command = [str(KVFORGE), "serve", str(last_only), "--port", "0", "--speculative", "prompt-lookup"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--speculative prompt-lookup" in done.stderr and "io.logits_positions 'last'" in done.stderr


def test_server_metrics_and_texts(default_build: Path, launch: Callable[..., Server]) -> None:
    spec = launch(default_build, "--speculative", "prompt-lookup", "--draft-tokens", "4", "--prefix-cache-bytes", "0")
    plain = launch(default_build, "--prefix-cache-bytes", "0")

    def complete(server: Server, prompt: str) -> str:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": default_build.name, "prompt": prompt, "max_tokens": 40, "temperature": 0}
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        reply = json.loads(connection.getresponse().read())
        return str(reply["choices"][0]["text"])

    for prompt in SPEC_PROMPTS[-2:]:
        assert complete(spec, prompt) == complete(plain, prompt)
    host, port = spec.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    values = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvforge:spec_decode")
    }
    drafted = values["kvforge:spec_decode_num_draft_tokens_total"]
    accepted = values["kvforge:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted and values["kvforge:spec_decode_num_drafts_total"] > 0


def test_grammar_masks_apply_to_drafted_tokens(engine: Engine) -> None:
    """A regex-constrained reply through the speculating batch equals the plain batch's and
    matches the expression (the mask decides every position a verify step yields too)."""
    pytest.importorskip("llguidance")
    grammar = engine.compile_grammar(regex="(ab|cd){2,12}")

    def run(speculative: str | None) -> tuple[list[str], float]:
        scheduler = scheduler_for(engine, speculative)
        try:
            requests = []
            for prompt in ("abababab", "cdcdabab", SPEC_PROMPTS[0]):
                ids = engine.encode(prompt)
                params = engine.sampling(temperature=0.0)
                requests.append(
                    Request(
                        ids,
                        params,
                        40,
                        engine.tokenizer.detokenizer((), context_ids=ids),
                        decoder=engine.decoder(params, ids, grammar),
                    )
                )
            texts = [text for text, _ in run_concurrently(scheduler, requests)]
            return texts, scheduler.metrics.spec_decode_num_accepted_tokens.get()
        finally:
            scheduler.stop()

    texts, accepted = run("prompt-lookup")
    assert texts == run(None)[0] and accepted > 0
    assert all(re.fullmatch("(ab|cd){2,12}", text) for text in texts), texts
