"""SmolLM2-135M-Instruct, a real trained checkpoint: it builds at fp32 and int8 with the
gate's defaults, answers a chat prompt exactly as transformers does, and the gate still
fails the build on the small bugs that matter, naming the first output they reach.

The sharpness cases reuse the one fp32 artifact: each bug is put into the eager model (a
weight, the rotary base, the norms' epsilon) or into what the compiled model is fed (its
positions, where its cache is written), and the gate is run again. The gate compares the
two sides symmetrically, so a bug on either side is the same difference to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runners.errors import ParityError
from runners.session import Session

pytestmark = pytest.mark.slow

NAME = "smollm2"
QUESTION = "What is the capital of France?"


def test_fp32_builds_and_passes_the_gate_with_the_defaults(real_artifact: Callable[..., Path]) -> None:
    import json

    manifest = json.loads((real_artifact(NAME) / "manifest.json").read_text())
    parity = manifest["parity"]
    assert parity["passed"] and parity["tolerance"] == {"relative": 2e-4}
    assert manifest["flags"]["tolerance"] is None and manifest["spec"]["num_layers"] == 30
    assert parity["decode_steps"] == 8 and parity["first_diverging_step"] is None


def test_int8_builds_and_passes_the_distribution_gate(real_artifact: Callable[..., Path]) -> None:
    import json

    manifest = json.loads((real_artifact(NAME, "int8") / "manifest.json").read_text())
    parity = manifest["parity"]
    assert parity["passed"] and parity["precision"] == "int8"
    assert parity["top1_decisive"] >= 0.97 and parity["kl_mean"] <= 0.01


@dataclass
class Reference:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str


@pytest.fixture(scope="module")
def transformers_answer(real_checkpoint: Callable[[str], Path]) -> Reference:
    """transformers' own greedy answer to the chat prompt, from the checkpoint directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = real_checkpoint(NAME)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt))
    new = out[0, prompt.shape[1] :].tolist()
    return Reference(prompt[0].tolist(), new, tokenizer.decode(new, skip_special_tokens=True))


def test_chat_answer_equals_transformers_token_for_token(
    real_artifact: Callable[..., Path], transformers_answer: Reference
) -> None:
    from runners.engine import Engine

    engine = Engine.load(real_artifact(NAME))
    assert engine.encode(QUESTION, chat=True) == transformers_answer.prompt_ids
    [tokens] = engine.generate_tokens([transformers_answer.prompt_ids], max_new_tokens=32, temperature=0.0)
    assert tokens == transformers_answer.new_ids
    assert "Paris" in transformers_answer.text
    assert "".join(engine.stream(QUESTION, chat=True, max_new_tokens=32, temperature=0.0)) == transformers_answer.text


def test_generate_chat_on_the_command_line_prints_transformers_answer(
    real_artifact: Callable[..., Path], transformers_answer: Reference
) -> None:
    from click.testing import CliRunner

    from toolchain.cli import main

    artifact = str(real_artifact(NAME))
    args = ["generate", artifact, QUESTION, "--chat", "--temperature", "0", "--max-new-tokens", "32"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == transformers_answer.text + "\n"


# --- the gate stays sharp ---------------------------------------------------------------------------


@dataclass
class GateSides:
    model: Any  # the eager torch model
    eager: Session
    compiled: Session
    max_positions: int
    good: Any  # the eager side's recorded run, unperturbed


@pytest.fixture(scope="module")
def gate_sides(real_checkpoint: Callable[[str], Path], real_artifact: Callable[..., Path]) -> GateSides:
    from runners.contract import DecoderIO
    from runners.manifest import read_manifest
    from runners.session import OrtSession
    from toolchain import checkpoint as checkpoints
    from toolchain.build import _eager_session
    from toolchain.export import eager_model
    from toolchain.spec import DecoderSpec
    from toolchain.verify import record_reference

    artifact = real_artifact(NAME)
    ckpt = checkpoints.load(real_checkpoint(NAME))
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    io = DecoderIO.from_dict(read_manifest(artifact)["io"])
    assert io.kv_mode == "shared"  # the cache bug below is one of a shared buffer
    model = eager_model(ckpt, spec)
    eager = _eager_session(model, spec, replace(io, kv_mode="concat", capacity=None))
    compiled = OrtSession(artifact / "model.onnx", io, prepack=False)
    good = record_reference(eager, max_positions=spec.max_positions)
    return GateSides(model, eager, compiled, spec.max_positions, good)


@contextmanager
def corrupted_weight(model: Any) -> Iterator[None]:
    """One element of layer 1's down_proj, 0.5 larger (the weights' std is 0.18)."""
    import torch

    weight = model.model.layers[1].mlp.down_proj.weight
    original = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] += 0.5
    try:
        yield
    finally:
        with torch.no_grad():
            weight[0, 0] = original


@contextmanager
def rotary_base_off(model: Any, factor: float = 1.01) -> Iterator[None]:
    """Every rotary table as if the base were `factor` times the config's: inv_freq = base^(-2i/d),
    so raising it to the power log(factor * base) / log(base) moves the base."""
    import math

    import torch

    base = model.config.rope_parameters["rope_theta"]
    exponent = math.log(factor * base) / math.log(base)
    modules = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    saved = [m.inv_freq.clone() for m in modules]
    for m in modules:
        m.inv_freq.copy_(m.inv_freq.double().pow(exponent).float())
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.inv_freq.copy_(original)


@contextmanager
def norm_epsilon_times_ten(model: Any) -> Iterator[None]:
    modules = [m for m in model.modules() if hasattr(m, "variance_epsilon")]
    saved = [m.variance_epsilon for m in modules]
    for m in modules:
        m.variance_epsilon *= 10
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            m.variance_epsilon = original


class Fed:
    """The compiled session, fed through `change` (a bug in what the runner passes it)."""

    def __init__(self, inner: Session, change: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> None:
        self.inner, self.change, self.io = inner, change, inner.io

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.inner.run(self.change(dict(feeds)))


def positions_shifted(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every position one too far: rotary attention scores depend on the positions' differences
    only, so the logits barely move; the keys, rotated by the positions themselves, do."""
    feeds["position_ids"] = feeds["position_ids"] + 1
    return feeds


def decode_positions_shifted(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The prefill right, every generated token one position ahead of its cache."""
    if feeds["input_ids"].shape[1] == 1:
        feeds["position_ids"] = feeds["position_ids"] + 1
    return feeds


def cache_written_one_slot_late() -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """From the first decode step on, the mask claims one more cache slot before the new
    tokens than there is: the graph writes each new key and value one slot later in the
    shared buffer than it should, and attends to the never-written slot it skipped."""
    prompt_width: list[int] = []

    def change(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        mask = feeds["attention_mask"]
        if feeds["input_ids"].shape[1] > 1:
            prompt_width[:] = [mask.shape[1]]
            return feeds
        width = prompt_width[0]
        skipped = np.ones((len(mask), 1), dtype=mask.dtype)
        feeds["attention_mask"] = np.concatenate([mask[:, :width], skipped, mask[:, width:]], axis=1)
        return feeds

    return change


EAGER_BUGS = {
    "one corrupted weight": (corrupted_weight, "present.2.key"),  # layer 1's MLP feeds layer 2 first
    "rotary base 1% off": (rotary_base_off, "present.0.key"),
    "norm epsilon x10": (norm_epsilon_times_ten, "present.0.key"),
}
FED_BUGS = {
    "positions shifted by one": (lambda: positions_shifted, "present.0.key"),
    "decode positions shifted by one": (lambda: decode_positions_shifted, "decode step 1 logits"),
    "KV cache written one slot late": (cache_written_one_slot_late, "decode step 1 logits"),
}


def _fails_naming(report: Any, first: str) -> None:
    from toolchain.verify import require_parity

    with pytest.raises(ParityError) as failure:
        require_parity(report, NAME)
    assert f"first diverging output {first}: " in str(failure.value), str(failure.value)


def test_the_unperturbed_sides_pass(gate_sides: GateSides) -> None:
    from toolchain.verify import compare_with_reference

    report = compare_with_reference(gate_sides.good, gate_sides.compiled, max_positions=gate_sides.max_positions)
    assert report.passed, report.failures()


@pytest.mark.parametrize("bug", list(EAGER_BUGS))
def test_the_gate_fails_on_a_bug_in_the_model(gate_sides: GateSides, bug: str) -> None:
    from toolchain.verify import compare_with_reference, record_reference

    perturb, first = EAGER_BUGS[bug]
    with perturb(gate_sides.model):
        reference = record_reference(gate_sides.eager, max_positions=gate_sides.max_positions)
    report = compare_with_reference(reference, gate_sides.compiled, max_positions=gate_sides.max_positions)
    _fails_naming(report, first)


@pytest.mark.parametrize("bug", list(FED_BUGS))
def test_the_gate_fails_on_a_bug_in_what_the_graph_is_fed(gate_sides: GateSides, bug: str) -> None:
    from toolchain.verify import compare_with_reference

    make, first = FED_BUGS[bug]
    candidate = Fed(gate_sides.compiled, make())
    report = compare_with_reference(gate_sides.good, candidate, max_positions=gate_sides.max_positions)
    _fails_naming(report, first)


# --- the streaming detokenizer on the real vocabulary ---------------------------------------------------

SAMPLES = [
    "The capital of France is Paris.",
    "naïve café déjà vu — “quotes” ½ ∑ ≠ ∞",
    "日本語のテキストと中文文本 한국어 텍스트 Ελληνικά русский עברית العربية",
    "emoji: 🙂 😀 🚀 👩‍💻 🇯🇵 🏳️‍🌈",
    "def f(x):\n\treturn x ** 2  # tab, newline\r\n",
]


@pytest.fixture(scope="module")
def real_tokenizer(real_checkpoint: Callable[[str], Path]) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(real_checkpoint(NAME) / "tokenizer.json"))


def _streamed(tokenizer: Any, ids: list[int]) -> str:
    from runners.detokenizer import StreamingDetokenizer

    detokenizer = StreamingDetokenizer(tokenizer)
    return "".join([detokenizer.add(i) for i in ids] + [detokenizer.finish()])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(
        st.one_of(st.sampled_from(SAMPLES), st.text(alphabet=st.characters(codec="utf-8"), max_size=12)), max_size=5
    )
)
def test_streamed_text_joins_to_the_full_decode(real_tokenizer: Any, pieces: list[str]) -> None:
    """Multilingual text, emoji (several tokens to one character: the byte-level pieces of a
    character the vocabulary does not hold whole) and arbitrary characters."""
    ids = real_tokenizer.encode("".join(pieces), add_special_tokens=False).ids
    assert _streamed(real_tokenizer, ids) == real_tokenizer.decode(ids)


def test_an_emoji_is_split_into_byte_pieces_that_stream_as_one_character(real_tokenizer: Any) -> None:
    ids = real_tokenizer.encode("🇯🇵", add_special_tokens=False).ids
    assert len(ids) > 1 and all(real_tokenizer.decode([i]) != "🇯🇵" for i in ids)
    assert _streamed(real_tokenizer, ids) == "🇯🇵"
