"""genai_config.json: onnxruntime-genai's own runtime opens kvforge artifacts as they are.

The slow tests run onnxruntime-genai's Model, Tokenizer and Generator on built artifacts (no
kvforge code in its loop) and require kvforge's runner to give the same greedy token ids, and
its tokenizer the same text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from kvforge.passes.targets import TARGETS
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ArtifactError
from kvforge.runners.manifest import read_manifest, verify_files
from kvforge.toolchain.emit import genai
from kvforge.toolchain.spec import DecoderSpec
from tests.genai import genai_greedy
from tests.tiny import CORPUS

NEW_TOKENS = 16
# Prompts: the start of each tiny corpus text (code, and one with accents, CJK and an emoji).
PROMPTS = [text[:20] for text in CORPUS]


def _spec(**overrides: object) -> DecoderSpec:
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 384,
        "max_position_embeddings": 256,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    return DecoderSpec.from_config(config | overrides)


def test_config_names_the_contract_and_its_cache_layout() -> None:
    spec = _spec()
    io = replace(DecoderIO.for_spec(spec), kv_mode="shared", logits_positions="last")
    config = genai.genai_config(spec, io, {"eos_token_id": [2]})
    decoder = config["model"]["decoder"]
    assert decoder["filename"] == "model.onnx"
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (2, 2, 16)
    layer1 = [decoder["inputs"]["past_key_names"] % 1, decoder["outputs"]["present_value_names"] % 1]
    assert layer1 == [io.past_name(1, "key"), io.present_name(1, "value")]
    assert {decoder["inputs"][k] for k in ("input_ids", "attention_mask", "position_ids")} <= {
        t.name for t in io.inputs
    }
    model = config["model"]
    assert (model["type"], model["context_length"], model["vocab_size"]) == ("llama", 256, 384)
    assert (model["eos_token_id"], model["bos_token_id"], model["pad_token_id"]) == ([2], 1, 2)  # pad: first eos
    assert config["search"]["past_present_share_buffer"] is True
    assert genai.genai_config(spec, replace(io, kv_mode="concat"), {})["search"]["past_present_share_buffer"] is False


def test_search_defaults_follow_the_generation_config_as_kvforge_reads_it() -> None:
    spec, io = _spec(), DecoderIO.for_spec(_spec())
    greedy = genai.search_defaults({"temperature": 0.7}, spec, io)  # no do_sample: greedy, as in transformers
    assert greedy["do_sample"] is False and greedy["max_length"] == 256
    sampled = genai.search_defaults({"do_sample": True, "temperature": 0.7, "top_k": 1000, "top_p": 0.9}, spec, io)
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_p"]) == (True, 0.7, 0.9)
    assert sampled["top_k"] == 384  # onnxruntime-genai refuses a top_k above the vocabulary
    with pytest.raises(ArtifactError, match="generation_config.json"):
        genai.search_defaults({"do_sample": True, "temperature": "hot"}, spec, io)


def test_architectures_without_a_plain_type_of_their_own_run_as_the_generic_decoder() -> None:
    assert genai.model_type(_spec(model_type="qwen3", head_dim=16)) == "qwen3"
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "vocab_size": 384}
    assert genai.model_type(DecoderSpec.from_config(gpt2)) == "decoder"  # genai's gpt2 reads combined KV tensors


def test_only_targets_onnxruntime_genai_can_drive_get_the_file() -> None:
    io = DecoderIO.for_spec(_spec())
    assert genai.drives(TARGETS["ort-cpu"], io) and genai.drives(TARGETS["onnx"], replace(io, kv_dtype="float16"))
    assert not genai.drives(TARGETS["tensorrt"], replace(io, kv_mode="shared", capacity=64))
    assert not genai.drives(TARGETS["ort-cpu"], replace(io, kv_dtype="bfloat16"))


# --- onnxruntime-genai's own runtime on built artifacts ---------------------------------


@pytest.fixture(scope="module")
def int4_artifact(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvforge import BuildOptions, build
    from kvforge.passes.quantize import WeightQuantization

    out = tmp_path_factory.mktemp("art-int4") / "out"
    return build(tiny_checkpoint("llama"), out, BuildOptions(weights=WeightQuantization(4))).output


@pytest.fixture(scope="module")
def concat_artifact(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gemma2 (eager attention: a concat cache) on target onnx, where its sliding layers keep their
    whole history; on ort-cpu they are bounded by the window, and no genai config is written."""
    from kvforge import BuildOptions, build

    out = tmp_path_factory.mktemp("art-gemma2-onnx") / "out"
    return build(tiny_checkpoint("gemma2"), out, BuildOptions(target=TARGETS["onnx"])).output


def _valid_prefix(text: str) -> str:
    """Text up to the first U+FFFD: where the two tokenizers' decodes of invalid UTF-8 part ways."""
    return text.split("\ufffd", 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "qwen3", "gemma2-onnx", "llama-int4"])
def test_onnxruntime_genai_generates_the_same_tokens_and_text(
    case: str, built_artifact: Callable[..., Path], request: pytest.FixtureRequest
) -> None:
    og = pytest.importorskip("onnxruntime_genai")
    from kvforge.runners.engine import Engine

    fixtures = {"llama-int4": "int4_artifact", "gemma2-onnx": "concat_artifact"}
    artifact = request.getfixturevalue(fixtures[case]) if case in fixtures else built_artifact(case)
    manifest = read_manifest(artifact)
    assert genai.GENAI_CONFIG in manifest["files"]  # listed and hashed like every file
    assert "layer_windows" not in manifest["io"]  # every layer keeps its whole history
    config = json.loads((artifact / genai.GENAI_CONFIG).read_text())
    assert config["search"]["past_present_share_buffer"] == (manifest["io"]["kv_mode"] == "shared")

    model = og.Model(str(artifact))
    tokenizer = og.Tokenizer(model)
    engine = Engine.load(artifact, huge_pages=False)
    full_runs = 0
    for prompt in PROMPTS:
        ids = [int(i) for i in tokenizer.encode(prompt)]
        assert ids == engine.tokenizer.encode(prompt), prompt
        theirs = genai_greedy(og, model, ids, NEW_TOKENS)
        ours = engine.generate_tokens([ids], max_new_tokens=NEW_TOKENS, temperature=0)[0]
        assert theirs == ours, prompt  # both stop at eos, and include it
        full_runs += len(ours) == NEW_TOKENS
        body = [t for t in ours if t not in engine.eos_ids]
        text, expected = tokenizer.decode(body), engine.tokenizer.decode(body)
        # A random-weight model emits lone UTF-8 bytes; onnxruntime-extensions ends its text at the
        # first, where transformers' tokenizers writes U+FFFD and goes on (docs/artifact.md).
        assert text == expected if "\ufffd" not in expected else _valid_prefix(text) == _valid_prefix(expected)
    assert full_runs >= 3  # most prompts run all 16 tokens without meeting eos
    verify_files(artifact, manifest)  # onnxruntime-genai wrote nothing into the artifact
