"""Exact speculative decoding: the same tokens as plain decoding, in fewer target steps.

Every artifact is built with the defaults, whose graph takes `logits_to_keep` (a verify step asks
for every position it feeds, a prefill for the last), except the two that check `--logits all`
(still speculates) and `--logits last` (refused). Every kv mode is covered: `ort-cpu`
(GroupQueryAttention over the shared in-place cache), `onnx` (TensorScatter over the shared
cache) and gemma2 (eager softcapped attention with a sliding window: the concat cache, its
sliding layers bounded by the window, so a rejected draft is taken back out of a bounded cache
too). Each is compared with plain decoding on the same artifact, with both drafters: prompt
lookup, and a draft artifact (the target itself, which accepts nearly everything, and another
tiny model with the same tokenizer, which rejects often).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from kvforge.runners.cache import device_of
from kvforge.runners.decoding import BatchDraws, RowDraws
from kvforge.runners.engine import Completion, Engine
from kvforge.runners.errors import GenerationError
from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.speculative import PromptLookup, parse_speculative, takes_turns
from tests.runners.test_decoding import SCHEMA, check_schema

pytestmark = pytest.mark.slow

# Random weights fall into loops, which prompt lookup then drafts from.
PROMPTS = ["def fibonacci(n):", "import os\nimport os\n", "x = [1, 2, 3]\ny = [1, 2"]
CASES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "ort-cpu": ("llama", "ort-cpu", ()),
    "onnx": ("llama", "onnx", ()),
    "concat": ("gemma2", "ort-cpu", ()),
}
# Built with the options older artifacts had
OLDER = {
    "logits-all": ("llama", "ort-cpu", ("--logits", "all")),
    "logits-last": ("llama", "ort-cpu", ("--logits", "last")),
}


@pytest.fixture(scope="module")
def artifacts(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny artifacts built by `kvforge build`, by case (CASES: defaults; OLDER), once per module."""
    from kvforge.cli import main

    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            model_type, target, options = (CASES | OLDER)[case]
            out = tmp_path_factory.mktemp(f"spec-{case}") / "out"
            args = ["build", str(tiny_checkpoint(model_type)), "-o", str(out), "--target", target, *options]
            result = CliRunner().invoke(main, [*args, "-q"])
            assert result.exit_code == 0, result.output
            built[case] = out
        return built[case]

    return get


@pytest.fixture(scope="module", params=list(CASES))
def engine(request: pytest.FixtureRequest, artifacts: Callable[[str], Path]) -> Engine:
    e = Engine.load(artifacts(request.param))
    e.eos_ids = ()  # random weights may sample eos at any point; these tests want full lengths
    return e


@pytest.fixture(scope="module")
def other_draft(built_artifact: Callable[..., Path]) -> Path:
    """Another tiny model with the same tokenizer, built with the defaults."""
    return built_artifact("qwen2")


@pytest.fixture(scope="module")
def example(example_artifact: Path) -> Engine:
    """examples/model (a trained 4M model) built with the defaults."""
    return Engine.load(example_artifact)


def drafters(engine: Engine, other: Path) -> list[str]:
    return ["prompt-lookup", f"draft:{engine.directory}", f"draft:{other}"]


def test_default_build_takes_logits_to_keep_and_the_flag_is_recorded(
    engine: Engine, artifacts: Callable[[str], Path]
) -> None:
    assert engine.directory is not None
    default = json.loads((engine.directory / "manifest.json").read_text())
    assert default["io"]["logits_positions"] == "keep" and "logits" not in default["flags"]
    assert default["io"]["inputs"][-1] == {"name": "logits_to_keep", "dtype": "int64", "dims": [1]}
    assert default["io"]["outputs"][0]["dims"] == ["batch", "kept", engine.session.io.vocab_size]
    for case, positions in (("logits-all", "all"), ("logits-last", "last")):
        manifest = json.loads((artifacts(case) / "manifest.json").read_text())
        assert manifest["io"]["logits_positions"] == positions and manifest["flags"]["logits"] == positions
        assert "logits_to_keep" not in [t["name"] for t in manifest["io"]["inputs"]]


def test_default_prefill_computes_the_lm_head_on_one_position(engine: Engine) -> None:
    """A 16-token prefill returns [1, 1, vocab]; the same step asking for every position (a verify
    step) returns [1, 16, vocab], whose last row is the prefill's."""
    session = engine.session
    ids = np.asarray([engine.encode("def fibonacci(n): return n if n < 2 else fib")[:16]], dtype=np.int64)
    assert ids.shape == (1, 16)
    mask = np.ones_like(ids)
    last, _ = forward(session, ids, mask, empty_cache(session.io, 1, 32, device_of(session)))
    every, _ = forward(session, ids, mask, empty_cache(session.io, 1, 32, device_of(session)), every_position=True)
    assert last.shape == (1, 1, session.io.vocab_size) and every.shape == (1, 16, session.io.vocab_size)
    np.testing.assert_allclose(last[:, -1], every[:, -1], rtol=1e-4, atol=1e-5 * float(np.abs(every).max()))


def test_logits_all_artifact_still_speculates(artifacts: Callable[[str], Path]) -> None:
    older = Engine.load(artifacts("logits-all"))
    older.eos_ids = ()
    for prompt in PROMPTS:
        plain = older.generate(prompt, max_new_tokens=30, temperature=0.0)
        assert older.generate(prompt, max_new_tokens=30, temperature=0.0, speculative="prompt-lookup") == plain


def test_greedy_equals_plain_greedy_for_every_drafter(engine: Engine, other_draft: Path) -> None:
    for prompt in PROMPTS:
        plain = engine.stream(prompt, max_new_tokens=40, temperature=0.0)
        expected = "".join(plain)
        for drafter in drafters(engine, other_draft):
            stream = engine.stream(prompt, max_new_tokens=40, temperature=0.0, speculative=drafter, draft_tokens=5)
            assert "".join(stream) == expected, (prompt, drafter)
            stats = stream.stats
            assert stats.new_tokens == 40 and stats.finish_reason == "length"
            spec = stats.speculation
            assert spec is not None and spec.verified_tokens == 39
            if drafter == f"draft:{engine.directory}":  # the target drafting for itself agrees with itself
                assert spec.acceptance_rate > 0.9 and spec.tokens_per_step > 3


def test_prompt_lookup_accepts_on_a_repeating_prompt(engine: Engine) -> None:
    stream = engine.stream(PROMPTS[1] * 3, max_new_tokens=40, temperature=0.0, speculative="prompt-lookup")
    list(stream)
    spec = stream.stats.speculation
    assert spec is not None and spec.accepted_tokens > 0 and spec.tokens_per_step > 1.0


def test_batch_with_stop_strings_equals_plain(engine: Engine, other_draft: Path) -> None:
    free = engine.generate(PROMPTS, max_new_tokens=30, temperature=0.0)
    assert isinstance(free, list)
    stop = free[0][12:15]  # a stop string inside the first row's text
    expected = engine.generate(PROMPTS, max_new_tokens=30, temperature=0.0, stop=[stop])
    assert isinstance(expected, list) and len(expected[0]) < len(free[0])
    for drafter in drafters(engine, other_draft):
        got = engine.generate(PROMPTS, max_new_tokens=30, temperature=0.0, stop=[stop], speculative=drafter)
        assert got == expected, drafter


def test_max_new_tokens_is_exact_and_logprobs_match(engine: Engine) -> None:
    for budget in (1, 2, 3, 9):
        plain = engine.generate(PROMPTS[1], max_new_tokens=budget, temperature=0.0, logprobs=2)
        spec = engine.generate(
            PROMPTS[1], max_new_tokens=budget, temperature=0.0, logprobs=2, speculative=f"draft:{engine.directory}"
        )
        assert isinstance(plain, Completion) and isinstance(spec, Completion)
        assert spec.tokens == plain.tokens and len(spec.tokens) == budget and spec.finish_reason == "length"
        for a, b in zip(spec.logprobs, plain.logprobs):
            assert a.token == b.token and [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-4)


def test_eos_inside_accepted_drafts_ends_the_row(engine: Engine) -> None:
    prompt = [int(t) for t in engine.encode(PROMPTS[1])]
    free = engine.generate_tokens([prompt], max_new_tokens=30, temperature=0.0)[0]
    plain_engine_eos = engine.eos_ids
    engine.eos_ids = (free[6],)
    try:
        expected = engine.generate(PROMPTS[1], max_new_tokens=30, temperature=0.0, logprobs=0)
        got = engine.generate(
            PROMPTS[1], max_new_tokens=30, temperature=0.0, logprobs=0, speculative=f"draft:{engine.directory}"
        )
    finally:
        engine.eos_ids = plain_engine_eos
    assert isinstance(got, Completion) and isinstance(expected, Completion)
    assert got.tokens == expected.tokens and got.finish_reason == "stop" == expected.finish_reason
    assert len(got.tokens) <= 6


@pytest.mark.parametrize("sampling", [{"temperature": 0.9, "top_k": 40, "top_p": 0.95}, {"temperature": 1.3}])
def test_seeded_sampling_equals_plain_seeded_sampling(engine: Engine, sampling: dict) -> None:
    for seed in (0, 7):
        single = engine.generate(PROMPTS[1], max_new_tokens=30, seed=seed, **sampling)
        assert engine.generate(PROMPTS[1], max_new_tokens=30, seed=seed, speculative="prompt-lookup", **sampling) == (
            single
        )
        assert (
            engine.generate(
                PROMPTS[1], max_new_tokens=30, seed=seed, speculative=f"draft:{engine.directory}", **sampling
            )
            == single
        )
        # a batch draws from one generator, row after row at each step: a row alone gets the same draws
        batch = engine.generate(PROMPTS, max_new_tokens=20, seed=seed, repetition_penalty=1.2, **sampling)
        assert engine.generate(
            PROMPTS, max_new_tokens=20, seed=seed, repetition_penalty=1.2, speculative="prompt-lookup", **sampling
        ) == (batch)


def test_json_schema_stays_valid_and_equal(artifacts: Callable[[str], Path]) -> None:
    guided = Engine.load(artifacts("ort-cpu"))  # with its eos: a grammar may end on it
    for seed in range(4):
        plain = guided.generate(PROMPTS[0], json_schema=SCHEMA, temperature=1.0, seed=seed, max_new_tokens=64)
        for drafter in ("prompt-lookup", f"draft:{guided.directory}"):
            text = guided.generate(
                PROMPTS[0], json_schema=SCHEMA, temperature=1.0, seed=seed, max_new_tokens=64, speculative=drafter
            )
            assert text == plain
            check_schema(json.loads(text))
    stream = guided.stream(
        PROMPTS[0], json_schema=SCHEMA, temperature=0.0, max_new_tokens=64, speculative="prompt-lookup"
    )
    check_schema(json.loads("".join(stream)))
    assert stream.stats.finish_reason == "stop"


def test_last_only_artifact_is_refused_naming_the_rebuild(artifacts: Callable[[str], Path]) -> None:
    engine = Engine.load(artifacts("logits-last"))
    rebuild = r"io.logits_positions 'last'.*rebuild it with `kvforge build CHECKPOINT -o OUT`"
    with pytest.raises(GenerationError, match=rebuild):
        engine.generate(PROMPTS[0], max_new_tokens=4, speculative="prompt-lookup")
    with pytest.raises(GenerationError, match=rebuild):
        engine.stream(PROMPTS[0], max_new_tokens=4, speculative="prompt-lookup")


def test_bad_requests_are_refused(engine: Engine, tmp_path: Path) -> None:
    for value, match in (("ngram", "prompt-lookup"), ("draft:", "prompt-lookup"), (3, "prompt-lookup")):
        with pytest.raises(GenerationError, match=match):
            engine.generate(PROMPTS[0], max_new_tokens=4, speculative=value)  # type: ignore[arg-type]
    for k in (0, 65, 2.5, True):
        with pytest.raises(GenerationError, match="draft_tokens"):
            engine.generate(PROMPTS[0], max_new_tokens=4, speculative="prompt-lookup", draft_tokens=k)  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match="speculative is not"):
        engine.generate(PROMPTS[0], max_new_tokens=4, draft_tokens=4)
    with pytest.raises(Exception, match=str(tmp_path / "missing")):
        engine.generate(PROMPTS[0], max_new_tokens=4, speculative=f"draft:{tmp_path / 'missing'}")


def test_draft_with_another_tokenizer_is_refused(engine: Engine, example: Engine) -> None:
    with pytest.raises(GenerationError, match="tokenizer differs"):
        engine.generate(PROMPTS[0], max_new_tokens=4, speculative=f"draft:{example.directory}")


def test_cli_generate_speculative_prints_the_same_text_and_its_stats(engine: Engine) -> None:
    from kvforge.cli import main

    assert engine.directory is not None
    base = ["generate", str(engine.directory), PROMPTS[1], "--max-new-tokens", "24", "--temperature", "0"]
    plain = CliRunner().invoke(main, base)
    spec = CliRunner().invoke(main, [*base, "--speculative", "prompt-lookup", "--draft-tokens", "4"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "verify steps" in spec.stderr and "tokens/step" in spec.stderr and "acceptance" in spec.stderr
    bad = CliRunner().invoke(main, [*base, "--speculative", "lookup"])
    assert bad.exit_code != 0 and "prompt-lookup" in bad.output


def stops_spinning(session: object) -> bool:
    """Whether an OrtSession's threads stop spinning when a run ends (force_spinning_stop)."""
    options = session._session.get_session_options()  # type: ignore[attr-defined]
    try:
        return bool(options.get_session_config_entry("session.force_spinning_stop") == "1")
    except RuntimeError:  # onnxruntime raises for a key that was never set
        return False


def test_a_draft_and_its_target_stop_spinning_between_their_turns(
    engine: Engine, other_draft: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert takes_turns(f"draft:{other_draft}") and not takes_turns("prompt-lookup") and not takes_turns(None)
    assert not stops_spinning(engine.session)  # alone, a session spins: faster decode
    speculation = engine.speculation(f"draft:{other_draft}", 4)
    assert speculation is not None and speculation.draft is not None
    assert stops_spinning(speculation.draft.session)

    # the CLI loads the target of a draft the same way, and only then
    from kvforge import cli

    loaded: list[bool] = []
    real_load = Engine.load

    def load(*args: object, **kwargs: object) -> Engine:
        loaded.append(bool(kwargs.get("stop_spinning")))
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "load", load)
    assert engine.directory is not None
    base = ["generate", str(engine.directory), PROMPTS[1], "--max-new-tokens", "4", "--temperature", "0"]
    for extra in ([], ["--speculative", f"draft:{other_draft}"]):
        result = CliRunner().invoke(cli.main, [*base, *extra])
        assert result.exit_code == 0, result.output
    assert loaded[0] is False and loaded[1:] == [True, True]  # plain; then the target and its draft


def test_example_model_edit_prompt_accepts_and_equals_plain(example: Engine) -> None:
    """The trained example model rewriting code in its prompt: drafts are mostly right."""
    engine = example
    code = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
    prompt = f"# Copy this code:\n{code}\n# Copy:\n{code[:14]}"
    expected = engine.generate(prompt, max_new_tokens=60, temperature=0.0)
    stream = engine.stream(prompt, max_new_tokens=60, temperature=0.0, speculative="prompt-lookup")
    assert "".join(stream) == expected
    spec = stream.stats.speculation
    assert spec is not None and spec.acceptance_rate > 0.3 and spec.tokens_per_step > 1.5


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match() -> None:
    lookup = PromptLookup()
    assert lookup.propose([5, 6, 7, 8, 9, 5, 6, 7], 3) == [8, 9, 5]
    assert lookup.propose([5, 6, 7, 8, 1, 6, 7, 9, 6, 7], 2) == [9, 6]  # the latest of two matches
    assert lookup.propose([1, 2, 3, 9, 2, 3, 4, 1, 2, 3], 1) == [9]  # 3 tokens match before 2 do
    assert lookup.propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert lookup.propose([4, 5, 4], 4) == [5, 4]  # one token matches; as many as there are
    # the latest match has 3 tokens after it of the 4 asked: an earlier one with 4 after it wins
    assert lookup.propose([1, 2, 3, 4, 5, 1, 2, 6, 1, 2], 4) == [3, 4, 5, 1]
    assert lookup.propose([1, 2, 3, 1, 2, 7, 1, 2], 4) == [3, 1, 2, 7]  # none has 4 after it: the earliest


def test_row_draws_are_the_batch_generators_draws() -> None:
    rng = np.random.default_rng(11)
    expected = rng.random((300, 3))  # step t of a 3-row batch draws row 0, 1, 2
    draws = BatchDraws(np.random.default_rng(11), 3)
    for row in (2, 0, 1):
        got = RowDraws(draws, row)
        assert np.array_equal(np.concatenate([got.random(1) for _ in range(300)]), expected[:, row])


def test_parse_speculative_defaults() -> None:
    assert parse_speculative(None, None) == (None, 8)
    assert parse_speculative("prompt-lookup", 3) == ("prompt-lookup", 3)
    assert parse_speculative("draft:/x", None) == ("draft:/x", 8)


def test_a_server_batch_of_one_speculates_over_window_bounded_layers(engine: Engine) -> None:
    """gemma2's sliding layers in the server's core at --max-num-seqs 1: each verify step takes its
    rejected drafts back out of the window too, and the texts equal plain decoding's."""
    from kvforge.runners.cache import bounded_names
    from kvforge.runners.serve.metrics import Metrics
    from kvforge.runners.serve.scheduler import BatchScheduler, Delta, Request
    from kvforge.runners.speculative import SpeculationStats

    if not bounded_names(engine.session.io):
        pytest.skip("no window-bounded layers in this case")
    speculation = engine.speculation("prompt-lookup", 4)
    scheduler = BatchScheduler.for_engine(
        engine, metrics=Metrics(), max_num_seqs=1, max_queued=8, prefill_chunk=8, speculation=speculation
    )
    scheduler.start()
    drafted = accepted = 0
    try:
        for prompt in [p * 2 for p in PROMPTS]:
            expected = engine.generate(prompt, max_new_tokens=30, temperature=0.0)
            ids, params = engine.encode(prompt), engine.sampling(temperature=0.0)
            detokenizer = engine.tokenizer.detokenizer((), context_ids=ids)
            request = Request(ids, params, 30, detokenizer, speculation=SpeculationStats())
            scheduler.submit(request)
            assert scheduler.wait_released(request, 120)
            events = []
            while not request.events.empty():
                events.append(request.events.get_nowait())
            assert "".join(e.text for e in events if isinstance(e, Delta)) == expected, prompt
            assert request.speculation is not None
            drafted += request.speculation.drafted_tokens
            accepted += request.speculation.accepted_tokens
    finally:
        scheduler.stop()
    assert 0 < accepted < drafted  # drafts were accepted, and some were taken back
