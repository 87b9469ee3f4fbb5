"""GGUF files in: a tiny llama written as GGUF (gguf's writer, llama.cpp's layout) builds, and
the artifact generates what transformers generates from the same file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from runners.errors import CheckpointError
from toolchain import checkpoint as checkpoints
from toolchain import gguf as gguf_files

gguf = pytest.importorskip("gguf", reason="the gguf package reads and writes GGUF files (.ci/install installs it)")

# Written in llama.cpp's block-quantized Q8_0, as its converter's `--outtype q8_0` does for matrices.
QUANTIZED = gguf.GGMLQuantizationType.Q8_0


def _llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter stores the llama query and key rows of each head with the two
    rotary halves interleaved (its `LlamaModel.permute`); transformers' loader undoes it."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(checkpoint: Path, file: Path) -> dict[str, gguf.GGMLQuantizationType]:
    """The tiny llama at `checkpoint` as a GGUF file: config, BPE tokenizer, chat template, its
    matrices in Q8_0 and the rest in F32. Returns each written tensor's type by GGUF name."""
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    template = json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"]
    state = checkpoints.load(checkpoint).state_dict()
    layers, heads, kv_heads = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]

    writer = gguf.GGUFWriter(file, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    special = {t["content"] for t in tokenizer["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_chat_template(template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    types = {}
    for hf_name, tensor in state.items():
        stem, _, suffix = hf_name.rpartition(".")
        name = f"{names.get_name(stem)}.{suffix}"
        data = tensor.numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _llama_cpp_rows(data, heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _llama_cpp_rows(data, kv_heads)
        kind = QUANTIZED if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        stored = gguf.quants.quantize(data, kind) if kind is QUANTIZED else data
        writer.add_tensor(name, stored, raw_dtype=kind)  # a quantized array's shape is in bytes
        types[name] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf"
    write_gguf(tiny_checkpoint("llama"), file)
    return file


def test_tensors_are_named_as_transformers_names_them_in_the_types_the_file_stores(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    file = tmp_path / "tiny.gguf"
    written = write_gguf(tiny_checkpoint("llama"), file)
    names = list(checkpoints.load(tiny_checkpoint("llama")).tensor_metadata())
    found = gguf_files.tensors(file, [*names, "model.rotary_emb.inv_freq"])
    assert set(found) == set(names)  # every weight, and nothing for a name the file does not hold
    assert {t.gguf_name: t.type for t in found.values()} == written
    q = found["model.layers.1.self_attn.q_proj.weight"]
    assert (q.gguf_name, q.type, q.shape) == ("blk.1.attn_q.weight", QUANTIZED, (64, 64))
    norm = found["model.norm.weight"]
    assert (norm.gguf_name, norm.type, norm.shape) == ("output_norm.weight", gguf.GGMLQuantizationType.F32, (64,))
    embed = checkpoints.load(tiny_checkpoint("llama")).state_dict()["model.embed_tokens.weight"].numpy()
    dequantized = gguf.quants.dequantize(found["model.embed_tokens.weight"].data, QUANTIZED)
    np.testing.assert_allclose(dequantized, embed, atol=np.abs(embed).max() / 127)  # Q8_0: one step of 8 bits


def test_a_directory_holding_one_gguf_file_is_that_file(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert gguf_files.find(tmp_path) == tmp_path / "model.gguf"
    assert gguf_files.find(tmp_path / "model.gguf") == tmp_path / "model.gguf"
    (tmp_path / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(CheckpointError, match=r"holds 2 GGUF files \(model.gguf, other.gguf\); pass the one"):
        gguf_files.find(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory that also holds GGUF files
    assert gguf_files.find(tmp_path) is None


def test_a_file_that_is_not_gguf_is_one_line_naming_it(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 a zip, say")
    with pytest.raises(CheckpointError, match=r"model.gguf: not a GGUF file \(it does not start with GGUF\)"):
        checkpoints.load(fake)


def test_a_truncated_gguf_file_is_refused_naming_it(tiny_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"cut.gguf: transformers' GGUF loader cannot read it"):
        checkpoints.load(cut)


def test_loading_dequantizes_into_a_checkpoint_whose_only_input_is_the_file(
    tiny_gguf: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    ckpt = checkpoints.load(tiny_gguf)
    assert ckpt.input_files() == (tiny_gguf.absolute(),)
    assert ckpt.source_hashes() == {tiny_gguf.name: hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}
    assert ckpt.config["model_type"] == "llama" and "quantization_config" not in ckpt.config
    assert {f.name for f in ckpt.tokenizer_files} >= {"tokenizer.json", "chat_template.jinja"}
    assert checkpoints.load(tiny_gguf.parent) is ckpt  # read once while the first is held
    original = checkpoints.load(tiny_checkpoint("llama")).state_dict()
    loaded = ckpt.state_dict()
    assert set(loaded) == set(original)
    for name, weight in original.items():  # the rotary rows back in transformers' order, within Q8_0's step
        step = float(weight.abs().max()) / 127 if weight.dim() == 2 else 0.0
        torch.testing.assert_close(loaded[name], weight, atol=step, rtol=0, msg=name)
    scratch = ckpt.path
    del ckpt, loaded
    assert not scratch.exists()  # the dequantized copy goes with the checkpoint


@pytest.mark.slow
def test_kvforge_build_of_a_gguf_file_generates_what_transformers_generates_from_it(
    tiny_gguf: Path, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from click.testing import CliRunner
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from runners import Engine
    from tests.tiny import hf_greedy
    from toolchain.cli import main

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_gguf), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sources"] == {tiny_gguf.name: hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()}
    # the tokenizer and chat template the file carries
    original = Tokenizer.from_file(str(tiny_checkpoint("llama") / "tokenizer.json"))
    built = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def fibonacci(n):\n    return n  # héllo 🙂"
    assert built.encode(text).ids == original.encode(text).ids
    template = json.loads((tiny_checkpoint("llama") / "tokenizer_config.json").read_text())["chat_template"]
    assert (out / "chat_template.jinja").read_text() == template

    engine = Engine.load(out)
    prompt = original.encode("for i in range(10):").ids
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    expected = hf_greedy(reference.eval(), prompt, 12)
    assert engine.generate_tokens([prompt], max_new_tokens=12, temperature=0.0)[0] == expected


def test_a_link_to_a_gguf_file_keeps_its_own_name(tiny_gguf: Path, tmp_path: Path) -> None:
    """As in a Hugging Face cache snapshot, where model.gguf links to a blob named by its hash."""
    blob = tmp_path / "blobs" / "3f2a9c"
    blob.parent.mkdir()
    blob.write_bytes(tiny_gguf.read_bytes())
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.gguf").symlink_to(blob)
    ckpt = checkpoints.load(tmp_path / "snapshot")
    assert list(ckpt.source_hashes()) == ["model.gguf"]
    assert ckpt.config["model_type"] == "llama"
