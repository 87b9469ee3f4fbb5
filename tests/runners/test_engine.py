"""The runner over a real artifact: streaming, stop strings, sampling, limits, tampering, no torch."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvforge.runners.engine as engine_module
import kvforge.runners.manifest as manifest_module
from kvforge.runners.core import Step, logit_steps
from kvforge.runners.decoding import batch_decoders
from kvforge.runners.engine import Engine
from kvforge.runners.errors import ArtifactError, GenerationError
from kvforge.runners.generate import empty_cache, forward, left_pad
from kvforge.runners.sampling import SamplingParams
from kvforge.runners.session import OrtSession, Session

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def artifact(built_artifact: Callable[..., Path]) -> Path:
    return built_artifact("llama")


@pytest.fixture()
def engine(artifact: Path) -> Engine:
    e = Engine.load(artifact)
    e.eos_ids = ()  # random weights may sample eos at any point; these tests want full lengths
    return e


def test_stream_chunks_concatenate_to_generate(engine: Engine) -> None:
    stream = engine.stream(PROMPT, max_new_tokens=40, temperature=0.0)
    chunks = list(stream)
    assert "".join(chunks) == engine.generate(PROMPT, max_new_tokens=40, temperature=0.0)
    ids = engine.generate_tokens([engine.encode(PROMPT)], max_new_tokens=40, temperature=0.0)[0]
    assert "".join(chunks) == engine.tokenizer.decode(ids)
    assert stream.stats.new_tokens == 40 and stream.stats.prompt_tokens == len(engine.encode(PROMPT))
    assert stream.stats.finish_reason == "length" and stream.stats.first_token_s > 0


def test_stop_string_ends_text_before_it(engine: Engine) -> None:
    full = engine.generate(PROMPT, max_new_tokens=40, temperature=0.0)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    expected = full[: full.index(stop)]
    stream = engine.stream(PROMPT, max_new_tokens=40, temperature=0.0, stop=[stop])
    assert "".join(stream) == expected
    assert stream.stats.finish_reason == "stop"
    assert engine.generate(PROMPT, max_new_tokens=40, temperature=0.0, stop=[stop]) == expected


def test_eos_ends_generation(artifact: Path) -> None:
    engine = Engine.load(artifact)
    free = engine.generate_tokens([engine.encode(PROMPT)], max_new_tokens=30, temperature=0.0)[0]
    engine.eos_ids = (free[5],)  # pretend the sixth token is the end of text
    first = free.index(free[5])
    assert engine.generate_tokens([engine.encode(PROMPT)], max_new_tokens=30, temperature=0.0)[0] == free[: first + 1]
    stream = engine.stream(PROMPT, max_new_tokens=30, temperature=0.0)
    assert "".join(stream) == engine.tokenizer.decode(free[:first]) and stream.stats.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    def run(seed: int) -> str:
        return engine.generate(PROMPT, max_new_tokens=30, temperature=0.9, top_p=0.95, top_k=50, seed=seed)

    assert run(1) == run(1)
    assert len({run(1), run(2), run(3)}) > 1


def test_batch_generation_matches_single_prompts(engine: Engine) -> None:
    prompts = ["import os", PROMPT, "x"]
    assert engine.generate(prompts, max_new_tokens=12, temperature=0.0) == [
        engine.generate(p, max_new_tokens=12, temperature=0.0) for p in prompts
    ]


def test_a_batch_is_prefilled_row_by_row_then_decoded_together(engine: Engine) -> None:
    """A batch runs through the engine core: each prompt prefilled alone, then one call per new token
    for every row at once (the decode steps a left-padded batch takes), not a decode per prefill."""
    calls = []
    run = engine.session.run
    engine.session.run = lambda feeds: calls.append(feeds["input_ids"].shape) or run(feeds)  # type: ignore[method-assign]
    prompts = [engine.encode(p) for p in ("import os", PROMPT, "x")]
    rows = engine.generate_tokens(prompts, max_new_tokens=5, temperature=0.0)
    assert [len(row) for row in rows] == [5, 5, 5]
    assert calls == [(1, len(p)) for p in prompts] + [(3, 1)] * 4


def test_prompt_beyond_context_is_refused_before_any_work(engine: Engine) -> None:
    calls = []
    run = engine.session.run
    engine.session.run = lambda feeds: calls.append(1) or run(feeds)  # type: ignore[method-assign]
    with pytest.raises(GenerationError, match="exceeds the model's context of 256"):
        engine.stream(PROMPT, max_new_tokens=256)
    with pytest.raises(GenerationError, match="exceeds"):
        engine.generate([PROMPT, "x"], max_new_tokens=255)
    assert calls == []


def test_invalid_sampling_values_are_refused(engine: Engine) -> None:
    with pytest.raises(GenerationError, match="top_p"):
        engine.stream(PROMPT, top_p=1.5)


def test_chat_prompt_uses_the_template(engine: Engine) -> None:
    ids = engine.encode("hi", chat=True)
    assert engine.tokenizer.decode(ids, skip_special_tokens=False) == "<s>user: hi\nassistant:"


def test_tampered_or_incomplete_artifacts_are_refused(artifact: Path, tmp_path: Path) -> None:
    copy = tmp_path / "a"
    shutil.copytree(artifact, copy)
    data = bytearray((copy / "model.onnx.data").read_bytes())
    data[100] ^= 0xFF
    (copy / "model.onnx.data").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data: sha256 does not match"):
        Engine.load(copy)
    shutil.rmtree(copy)
    shutil.copytree(artifact, copy)
    (copy / "extra.bin").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="extra.bin: not listed"):
        Engine.load(copy)
    (copy / "extra.bin").unlink()
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="manifest.json: missing"):
        Engine.load(copy)


def test_files_are_hashed_while_the_session_is_created(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights' hash waits for onnxruntime to have opened the model: the load can only end if the
    two run at once (hashing first, as loads once did, would wait out the timeout and fail)."""
    opened = threading.Event()
    overlapped = []
    sha256_file, open_session = manifest_module.sha256_file, engine_module.open_session

    def hash_after_open(path: Path) -> str:
        if path.name == "model.onnx.data":
            overlapped.append(opened.wait(timeout=60))
        return sha256_file(path)

    def open_then_signal(*args: Any, **kwargs: Any) -> Session:
        session = open_session(*args, **kwargs)
        opened.set()
        return session

    monkeypatch.setattr(manifest_module, "sha256_file", hash_after_open)
    monkeypatch.setattr(engine_module, "open_session", open_then_signal)
    assert Engine.load(artifact, huge_pages=False).generate(PROMPT, max_new_tokens=3, temperature=0.0)
    assert overlapped == [True]


def test_a_modified_file_found_after_the_session_opened_leaves_no_engine(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """onnxruntime opens weights whose hash is still being checked; when the check fails, the load
    raises the mismatch and the session is gone (the traceback keeps nothing of it)."""
    copy = tmp_path / "a"
    shutil.copytree(artifact, copy)
    data = bytearray((copy / "model.onnx.data").read_bytes())
    data[100] ^= 0xFF  # inside a weight: onnxruntime loads the model all the same
    (copy / "model.onnx.data").write_bytes(bytes(data))
    sessions: list[weakref.ref[Session]] = []
    open_session = engine_module.open_session

    def recorded(*args: Any, **kwargs: Any) -> Session:
        session = open_session(*args, **kwargs)
        sessions.append(weakref.ref(session))
        return session

    monkeypatch.setattr(engine_module, "open_session", recorded)
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data: sha256 does not match") as caught:
        Engine.load(copy)
    assert len(sessions) == 1  # the session was made before the hash was known
    gc.collect()
    assert sessions[0]() is None and caught.value is not None


def test_a_modified_model_reports_its_hash_not_what_onnxruntime_made_of_it(artifact: Path, tmp_path: Path) -> None:
    """A model.onnx cut short fails in the readers that open it while it is hashed; the error is the
    hash's, as when the hashes were checked first."""
    copy = tmp_path / "a"
    shutil.copytree(artifact, copy)
    model = (copy / "model.onnx").read_bytes()
    (copy / "model.onnx").write_bytes(model[: len(model) // 2])
    with pytest.raises(ArtifactError, match=r"model\.onnx: sha256 does not match"):
        Engine.load(copy)


def test_a_modified_graph_is_refused_before_onnxruntime_parses_it(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the weights' bytes are hashed while onnxruntime loads: the graph it parses is checked first."""
    import onnxruntime

    copy = tmp_path / "a"
    shutil.copytree(artifact, copy)
    model = (copy / "model.onnx").read_bytes()
    (copy / "model.onnx").write_bytes(model + b"\x32\x02hi")  # a doc_string field: still a valid model

    def refuse(*args: Any, **kwargs: Any) -> None:
        pytest.fail("onnxruntime opened a graph whose hash does not match")

    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)
    with pytest.raises(ArtifactError, match=r"model\.onnx: sha256 does not match"):
        Engine.load(copy)


def test_runner_works_without_torch(artifact: Path, engine: Engine) -> None:
    script = (
        "import sys, json\n"
        "sys.modules['torch'] = None; sys.modules['transformers'] = None  # import of either now fails\n"
        "from kvforge import Engine\n"
        f"e = Engine.load({str(artifact)!r}); e.eos_ids = ()\n"
        f"print(json.dumps(e.generate({PROMPT!r}, max_new_tokens=10, temperature=0.0)))\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == engine.generate(PROMPT, max_new_tokens=10, temperature=0.0)


def test_greedy_logits_match_session_directly(engine: Engine) -> None:
    """generate_tokens' first token is the argmax of one plain session call."""
    ids = engine.encode(PROMPT)
    feeds = {
        "input_ids": np.array([ids]),
        "attention_mask": np.ones((1, len(ids)), np.int64),
        "position_ids": np.arange(len(ids))[None],
    }
    feeds.update(empty_cache(engine.session.io, 1, capacity=len(ids)))
    first = int(engine.session.run(feeds)["logits"][0, -1].argmax())
    assert engine.generate_tokens([ids], max_new_tokens=1, temperature=0.0)[0] == [first]


def test_one_session_serves_generations_of_any_shape(artifact: Path, engine: Engine) -> None:
    """The session keeps its cache binding between steps; generations of other batch sizes and lengths in
    between must not see a stale binding, and every step's logits stay as they were when returned."""
    prompts = [engine.encode(PROMPT), engine.encode("import os")]

    def steps(session_engine: Engine, batch: list[list[int]], new: int) -> list[np.ndarray]:
        run = logit_steps(
            session_engine.session,
            batch,
            max_new_tokens=new,
            max_positions=session_engine.max_positions,
            decoders=batch_decoders(SamplingParams(temperature=0.0), batch),
        )
        return [step.logits for step in run]

    first = steps(engine, prompts[:1], 6)
    kept = [logits.copy() for logits in first]
    mixed = steps(engine, prompts, 4)  # batch 2, another capacity: a new binding
    again = steps(engine, prompts[:1], 6)
    for got, want in zip(first, kept):
        np.testing.assert_array_equal(got, want)  # not overwritten by later steps
    fresh = Engine.load(artifact)
    for got, want in zip(again, steps(fresh, prompts[:1], 6)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(mixed, steps(fresh, prompts, 4)):
        np.testing.assert_array_equal(got, want)


def test_generations_stepped_in_turn_keep_their_bindings_and_match_each_alone(
    artifact: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two generations alternating step by step on one session (a server's batch and the prompt it is
    prefilling, `kvforge bench`'s configurations) each bind their cache once, and each computes what it
    computes alone; more sets of buffers than the session keeps are bound anew, never stale."""
    session = engine.session
    assert isinstance(session, OrtSession)
    bound = []
    bind = session._bind_cache
    monkeypatch.setattr(session, "_bind_cache", lambda feeds: bound.append(feeds["input_ids"].shape[0]) or bind(feeds))
    prompts = [engine.encode(PROMPT), engine.encode("import os")]

    def run(batch: list[list[int]], on: Engine = engine) -> Iterator[Step]:
        return logit_steps(
            on.session,
            batch,
            max_new_tokens=6,
            max_positions=on.max_positions,
            decoders=batch_decoders(SamplingParams(temperature=0.0), batch),
        )

    one, two = run(prompts[:1]), run(prompts)
    alternating: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    for a, b in zip(one, two):
        alternating[0].append(a.logits)
        alternating[1].append(b.logits)
    # one binding per set of buffers, not one per step: each prompt's prefill cache, then the batch of
    # two (a batch of one row goes on in its prefill's buffers)
    assert bound == [1, 1, 1, 2]
    many = [run(prompts[:1]) for _ in range(6)]  # more sets of buffers than the session keeps bindings for
    for index, steps in enumerate(zip(*many)):
        for step in steps:
            np.testing.assert_array_equal(step.logits, alternating[0][index])
    assert bound[4:] == [1] * 36  # in turn, six sets evict each other from four kept: every step rebinds
    fresh = Engine.load(artifact)
    for logits, batch in zip(alternating, (prompts[:1], prompts)):
        for got, want in zip(logits, (step.logits for step in run(batch, fresh)), strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_stop_string_inside_the_prompt_does_not_stop_generation(engine: Engine) -> None:
    """The prompt's last ids are decoding context only; the stop matcher never sees prompt text."""
    full = engine.generate(PROMPT, max_new_tokens=20, temperature=0.0)
    in_prompt = {PROMPT[i:j] for i in range(len(PROMPT)) for j in range(i + 2, len(PROMPT) + 1)}
    across = {PROMPT[-k:] + full[:m] for k in (1, 2, 3) for m in (1, 2, 3)}  # prompt end + generated start
    stops = sorted(s for s in in_prompt | across if s not in full)
    assert "fibonacci" in stops and PROMPT in stops and len(across & set(stops)) >= 3
    stream = engine.stream(PROMPT, max_new_tokens=20, temperature=0.0, stop=stops)
    assert "".join(stream) == full
    assert stream.stats.finish_reason == "length" and stream.stats.new_tokens == 20
    assert engine.generate(PROMPT, max_new_tokens=20, temperature=0.0, stop=stops) == full


@pytest.mark.parametrize(
    ("prompt", "request_", "message"),
    [
        ("", {}, "prompt is empty"),
        (PROMPT, {"temperature": -1.0}, "temperature must be >= 0"),
        (PROMPT, {"temperature": float("nan")}, "temperature must be finite"),
        (PROMPT, {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        (PROMPT, {"top_k": -1}, "top_k must be >= 0"),
        (PROMPT, {"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        (PROMPT, {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
        (PROMPT, {"stop": [""]}, r"stop\[0\] must be a non-empty string"),
    ],
)
def test_bad_requests_are_refused_before_any_work(
    engine: Engine, prompt: str, request_: dict[str, object], message: str
) -> None:
    calls = []
    run = engine.session.run
    engine.session.run = lambda feeds: calls.append(1) or run(feeds)  # type: ignore[method-assign]
    with pytest.raises(GenerationError, match=message):
        engine.stream(prompt, **request_)  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match=message):
        engine.generate([PROMPT, prompt], **request_)  # type: ignore[arg-type]
    assert calls == []


def test_a_rebuilt_model_pointing_outside_the_artifact_is_refused(artifact: Path, tmp_path: Path) -> None:
    """The real model with its weights' location rewritten, and a manifest rehashed to match."""
    import onnx

    from kvforge.runners.external_data import check_external_data
    from kvforge.runners.manifest import sha256_file

    manifest = json.loads((artifact / "manifest.json").read_text())
    assert check_external_data(artifact / "model.onnx", set(manifest["files"])) == ["model.onnx.data"]
    copy = tmp_path / "a"
    shutil.copytree(artifact, copy)
    shutil.copy(artifact / "model.onnx.data", tmp_path / "secret.bin")
    model = onnx.load(str(copy / "model.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in tensor.external_data if e.key == "location").value = "../secret.bin"
    onnx.save(model, str(copy / "model.onnx"))
    manifest["files"]["model.onnx"] = sha256_file(copy / "model.onnx")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=rf"model\.onnx: tensor '{tensor.name}' .*location '\.\./secret\.bin'"):
        Engine.load(copy)


def test_a_session_without_prepacked_weights_computes_the_same_products(built_artifact: Callable[..., Path]) -> None:
    """The verification gate of an unquantized build loads the graph with `prepack=False`; what
    it checks must be what `Engine.load`'s prepacked session computes, to float32 rounding
    (the 125M reference differs by 2.4e-6 at most; the gate's fp32 tolerance is 1e-4)."""
    artifact = built_artifact("llama")
    io = Engine.load(artifact).session.io
    ids, mask = left_pad([[5, 6, 7, 8, 9, 10], [3, 4, 5]], pad_id=0)
    outputs = []
    for prepack in (True, False):
        session = OrtSession(artifact / "model.onnx", io, prepack=prepack)
        logits, cache = forward(session, ids, mask, empty_cache(io, 2, capacity=8))
        step, _ = forward(session, np.array([[11], [12]]), np.ones((2, 7), np.int64), cache)
        outputs.append((logits, step))
    for prepacked, as_stored in zip(*outputs):
        np.testing.assert_allclose(as_stored, prepacked, rtol=1e-5, atol=1e-5)


def _edited_manifest(artifact: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the artifact with its manifest edited and nothing rehashed."""
    copy = tmp_path / "edited"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _io_edit(**changes: Any) -> Callable[[dict[str, Any]], None]:
    """Replace io fields, with the inputs and outputs they derive rewritten to match (a consistent forgery)."""
    from dataclasses import replace

    from kvforge.runners.contract import DecoderIO

    def edit(manifest: dict[str, Any]) -> None:
        manifest["io"] = replace(DecoderIO.from_dict(manifest["io"]), **changes).to_dict()
        manifest["spec"].update({k: v for k, v in changes.items() if k in manifest["spec"]})

    return edit


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: m["spec"].update(vocab_size=10), r"spec\.vocab_size is 10 but io\.vocab_size is 384"),
        (lambda m: m["spec"].update(num_layers=3), r"spec\.num_layers is 3 but io\.num_layers is 2"),
        (_io_edit(vocab_size=10), r"logits is float32 \['batch', 'kept', 384\] in the graph, but manifest\.json"),
        (_io_edit(kv_dtype="float16"), r"past_key_values\.0\.key is float32 .* io says float16"),
        (
            _io_edit(num_kv_heads=1),
            r"past_key_values\.0\.key is float32 \['batch', 2, .* io says float32 \['batch', 1,",
        ),
    ],
    ids=["spec-vocab", "spec-layers", "io-vocab", "io-dtype", "io-heads"],
)
def test_a_manifest_edited_without_rehashing_is_refused(
    artifact: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None], expected: str
) -> None:
    """The manifest is not hashed itself: every field the runner reads must agree with the hashed graph."""
    copy = _edited_manifest(artifact, tmp_path, edit)
    with pytest.raises(ArtifactError, match=expected):
        Engine.load(copy)
    result = subprocess.run(
        [sys.executable, "-m", "kvforge", "generate", str(copy), "Hi", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvforge: error: "), result.stderr
