"""Real trained checkpoints (tests/real/models.py): each GGUF file builds with no flags keeping
the file's quantized tensors, computed at int8 activations (the distribution gate), and with
`--exact-activations` (computed in float: the float gate against the dequantized file); the
exact build answers its prompt exactly as transformers does (greedy, token for token,
through `Engine`, `Engine.stream`, `kvforge generate` and `kvforge serve` with the
official `openai` client), and the streaming detokenizer
joins to the full decode on its real vocabulary. The default build's greedy answer is not
transformers' float one on every prompt (int8 activations: SmolLM2's chat answer differs from
its first token, as the `--weights int4` import's did), so the token-for-token tests take the
exact build.

SmolLM2-135M-Instruct answers a chat prompt (byte-level BPE, 49k tokens); Gemma 3 270M, a
base model with no chat template, continues a sentence (sentencepiece-style BPE with byte
fallback, 262k tokens, sliding and full attention layers)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.real.models import xdist_group

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    prompt: str
    chat: bool
    max_new_tokens: int
    num_layers: int
    expected: str  # transformers' greedy answer, as quoted where the model was tried by hand
    split_character: str  # one character the vocabulary holds only as several byte pieces


CASES = {
    "smollm2": Case("What is the capital of France?", True, 32, 30, "The capital of France is Paris.", "🇯🇵"),
    "gemma3": Case(
        "The capital of France is",
        False,
        16,
        18,
        " the capital of the country of France. It is the largest city in France and",
        "ꙮ",  # U+A66E: three <0x..> byte-fallback tokens
    ),
}
# Under pytest-xdist, one worker per model (tests/real/models.py: xdist_group): each
# model's artifacts are built once in the run, and the two models' tests run side by side.
MODELS = pytest.mark.parametrize("name", [pytest.param(name, marks=xdist_group(name)) for name in CASES])


def _kept(manifest: dict[str, Any], gguf: Path, regrouped: bool) -> None:
    """Every quantized matrix of the file is in the graph with its own codes: the manifest's
    `imported_weights` lists each one's GGUF type as imported exactly, the LM head (tied to the
    token-embedding table) and the table's lookup too; but with int8 activations (`regrouped`)
    each Q6_K matrix, whose blocks of 16 are rounded again in blocks of 32, and the LM head's
    8-bit codes where its rows are whole blocks of 128, rounded again in those
    (docs/pipeline.md), are listed as regrouped and not exact."""
    from collections import Counter

    from gguf import GGMLQuantizationType, GGUFReader

    entry = manifest["imported_weights"]
    assert (entry["method"], entry["file"]) == ("gguf", gguf.name)
    assert entry["sha256"] == manifest["sources"][gguf.name]
    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    stored = {
        t.name: t.tensor_type.name
        for t in GGUFReader(gguf).tensors
        if len(t.shape) == 2 and t.tensor_type not in floats
    }
    weights = dict(entry["weights"])

    def moved(name: str, form: dict[str, Any]) -> bool:
        return any(name in f.get("regrouped", ()) for f in [form, *form.get("also", [])])

    table = weights.pop("model.embed_tokens.weight")
    assert (table["stored_as"], table["form"]) == (stored["token_embd.weight"], "gather_block_quantized")
    head = weights.pop("lm_head.weight")
    assert head["stored_as"] == stored.pop("output.weight", stored["token_embd.weight"])
    whole = manifest["spec"]["hidden_size"] % 128 == 0  # the head's rows: whole blocks of 128
    head_moved = regrouped and whole and head["bits"] == 8
    assert moved("lm_head.weight", head) == head_moved and head["exact"] == (not head_moved)
    if "also" in head:  # tied: the table is the head's record, regrouped with it
        assert moved("model.embed_tokens.weight", table) == head_moved and table["exact"] == (not head_moved)
    del stored["token_embd.weight"]
    assert all(form["form"] == "matmul_nbits" for form in weights.values())
    for name, form in weights.items():
        assert moved(name, form) == (regrouped and form["stored_as"] == "Q6_K") and form["exact"] == (
            not moved(name, form)
        ), name
    assert Counter(form["stored_as"] for form in weights.values()) == Counter(stored.values())


def _weight_bytes(artifact: Path) -> int:
    return sum(f.stat().st_size for f in artifact.glob("model.onnx*"))


@MODELS
def test_the_default_build_keeps_the_files_codes_at_int8_activations_and_passes_the_distribution_gate(
    real_checkpoint: Callable[[str], Path], real_artifact: Callable[..., Path], name: str
) -> None:
    """No flags: the file's own codes, computed with int8 activations (MatMulNBits' accuracy
    level 4), as `--weights int4` builds a quantized file: nothing the file quantizes is rounded
    again, so the distribution gate passes where rounding the dequantized weights did not
    (docs/performance.md)."""
    manifest = json.loads((real_artifact(name) / "manifest.json").read_text())
    gguf = real_checkpoint(name)  # the build's one input, the file as the package ships it
    assert manifest["sources"] == {gguf.name: hashlib.sha256(gguf.read_bytes()).hexdigest()}
    parity = manifest["parity"]
    assert parity["passed"] and parity["precision"] == "int4"
    assert parity["top1_decisive"] >= 0.90 and parity["kl_mean"] <= 0.10
    assert (
        manifest["flags"]["weights"]["accuracy_level"] == 4 and manifest["spec"]["num_layers"] == CASES[name].num_layers
    )
    assert manifest["imported_weights"]["activations"] == "int8"
    _kept(manifest, gguf, regrouped=True)
    # the file's bytes about as the file holds them: a tied table once, scales as stored (docs/performance.md)
    assert _weight_bytes(real_artifact(name)) <= 1.1 * gguf.stat().st_size


@MODELS
def test_exact_activations_keep_the_files_codes_and_pass_the_float_gate(
    real_checkpoint: Callable[[str], Path], real_artifact: Callable[..., Path], name: str
) -> None:
    artifact = real_artifact(name, exact=True)
    manifest = json.loads((artifact / "manifest.json").read_text())
    parity = manifest["parity"]
    assert parity["passed"] and parity["tolerance"] == {"relative": 2e-4}
    assert manifest["flags"]["tolerance"] is None and manifest["flags"]["weights"] is None
    assert parity["decode_steps"] == 8 and parity["first_diverging_step"] is None
    assert manifest["imported_weights"]["activations"] == "float"
    _kept(manifest, real_checkpoint(name), regrouped=False)
    # the default build's regrouped blocks (fewer scales) aside, the same bytes
    assert 0.95 * _weight_bytes(artifact) <= _weight_bytes(real_artifact(name)) <= 1.01 * _weight_bytes(artifact)


@dataclass
class Reference:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str


@pytest.fixture(scope="module")
def transformers_answer(real_checkpoint: Callable[[str], Path]) -> Callable[[str], Reference]:
    """transformers' own greedy answer to each model's prompt, from the GGUF file."""
    answers: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in answers:
            answers[name] = _transformers_greedy(real_checkpoint(name), CASES[name])
        return answers[name]

    return get


def _transformers_greedy(gguf: Path, case: Case) -> Reference:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    if case.chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": case.prompt}], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        prompt = tokenizer(case.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=case.max_new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt)
        )
    new = out[0, prompt.shape[1] :].tolist()
    return Reference(prompt[0].tolist(), new, tokenizer.decode(new, skip_special_tokens=True))


@MODELS
def test_answer_equals_transformers_token_for_token(
    real_artifact: Callable[..., Path], transformers_answer: Callable[[str], Reference], name: str
) -> None:
    from kvforge.runners.engine import Engine

    case, reference = CASES[name], transformers_answer(name)
    engine = Engine.load(real_artifact(name, exact=True))
    assert engine.encode(case.prompt, chat=case.chat) == reference.prompt_ids
    [tokens] = engine.generate_tokens([reference.prompt_ids], max_new_tokens=case.max_new_tokens, temperature=0.0)
    assert tokens == reference.new_ids
    assert reference.text.startswith(case.expected)
    streamed = engine.stream(case.prompt, chat=case.chat, max_new_tokens=case.max_new_tokens, temperature=0.0)
    assert "".join(streamed) == reference.text


@MODELS
def test_generate_on_the_command_line_prints_transformers_answer(
    real_artifact: Callable[..., Path], transformers_answer: Callable[[str], Reference], name: str
) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    case = CASES[name]
    args = ["generate", str(real_artifact(name, exact=True)), case.prompt, "--temperature", "0"]
    args += ["--max-new-tokens", str(case.max_new_tokens)] + (["--chat"] if case.chat else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == transformers_answer(name).text + "\n"


@MODELS
def test_serve_answers_the_openai_client_as_transformers_does(
    real_artifact: Callable[..., Path],
    transformers_answer: Callable[[str], Reference],
    tmp_path: Path,
    name: str,
) -> None:
    """`kvforge serve` over the real artifact, asked through the official `openai` client:
    the greedy reply, whole and streamed, is transformers' text, and the usage counts its prompt."""
    import openai

    from tests.serve.conftest import start_server

    case, reference = CASES[name], transformers_answer(name)
    artifact = real_artifact(name, exact=True)
    server = start_server(artifact, tmp_path / "serve.log", "--max-num-seqs", "2")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120.0)
        served, request = artifact.name, {"max_tokens": case.max_new_tokens, "temperature": 0}
        if case.chat:
            messages: Any = [{"role": "user", "content": case.prompt}]
            whole = client.chat.completions.create(model=served, messages=messages, **request)
            text = whole.choices[0].message.content
            chunks = client.chat.completions.create(model=served, messages=messages, stream=True, **request)
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            whole = client.completions.create(model=served, prompt=case.prompt, **request)  # type: ignore[assignment]
            text = whole.choices[0].text  # type: ignore[union-attr]
            pieces = client.completions.create(model=served, prompt=case.prompt, stream=True, **request)
            streamed = "".join(c.choices[0].text for c in pieces if c.choices)
    finally:
        server.terminate()
    assert text == streamed == reference.text
    assert whole.usage is not None and whole.usage.prompt_tokens == len(reference.prompt_ids)


# --- the streaming detokenizer on the real vocabularies -------------------------------------------------

SAMPLES = [
    "The capital of France is Paris.",
    "naïve café déjà vu — “quotes” ½ ∑ ≠ ∞",
    "日本語のテキストと中文文本 한국어 텍스트 Ελληνικά русский עברית العربية",
    "emoji: 🙂 😀 🚀 👩‍💻 🇯🇵 🏳️‍🌈",
    "rare: ꙮ 𓀀 𝔘𝔫𝔦 𐐀",  # byte-fallback pieces in Gemma's vocabulary, byte-level ones in SmolLM2's
    "def f(x):\n\treturn x ** 2  # tab, newline\r\n",
]


@pytest.fixture(scope="module")
def real_tokenizer(real_checkpoint: Callable[[str], Path]) -> Callable[[str], Any]:
    """The `tokenizers` tokenizer transformers makes of each GGUF file's vocabulary."""
    from transformers import AutoTokenizer

    loaded: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in loaded:
            gguf = real_checkpoint(name)
            loaded[name] = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).backend_tokenizer
        return loaded[name]

    return get


def _streamed(tokenizer: Any, ids: list[int]) -> str:
    from kvforge.runners.detokenizer import StreamingDetokenizer

    detokenizer = StreamingDetokenizer(tokenizer)
    return "".join([detokenizer.add(i) for i in ids] + [detokenizer.finish()])


@MODELS
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pieces=st.lists(
        st.one_of(st.sampled_from(SAMPLES), st.text(alphabet=st.characters(codec="utf-8"), max_size=12)), max_size=5
    )
)
def test_streamed_text_joins_to_the_full_decode(
    real_tokenizer: Callable[[str], Any], name: str, pieces: list[str]
) -> None:
    """Multilingual text, emoji (several tokens to one character: the byte pieces of a character
    the vocabulary does not hold whole) and arbitrary characters."""
    tokenizer = real_tokenizer(name)
    ids = tokenizer.encode("".join(pieces), add_special_tokens=False).ids
    assert _streamed(tokenizer, ids) == tokenizer.decode(ids)


@MODELS
def test_a_character_split_into_byte_pieces_streams_as_one_character(
    real_tokenizer: Callable[[str], Any], name: str
) -> None:
    tokenizer, character = real_tokenizer(name), CASES[name].split_character
    ids = tokenizer.encode(character, add_special_tokens=False).ids
    assert len(ids) > 1 and all(tokenizer.decode([i]) != character for i in ids)
    assert _streamed(tokenizer, ids) == character
