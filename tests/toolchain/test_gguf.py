"""GGUF files in: a tiny llama written as GGUF (gguf's writer, llama.cpp's layout) builds, and
the artifact generates what transformers generates from the same file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch

from kvforge.runners.errors import CheckpointError
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain import gguf as gguf_files

gguf = pytest.importorskip("gguf", reason="the gguf package reads and writes GGUF files (.ci/install installs it)")

# Written in llama.cpp's block-quantized Q8_0, as its converter's `--outtype q8_0` does for matrices.
QUANTIZED = gguf.GGMLQuantizationType.Q8_0


def _llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter stores the llama query and key rows of each head with the two
    rotary halves interleaved (its `LlamaModel.permute`); transformers' loader undoes it."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_gguf(
    checkpoint: Path, file: Path, types: Mapping[str, gguf.GGMLQuantizationType] | None = None
) -> dict[str, gguf.GGMLQuantizationType]:
    """The tiny llama at `checkpoint` as a GGUF file: config, BPE tokenizer, chat template, its
    matrices in Q8_0 (or the type `types` gives the GGUF name's role: "attn_q", "ffn_up"...) and
    the rest in F32. Returns each written tensor's type by GGUF name."""
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
    written = {}
    for hf_name, tensor in state.items():
        stem, _, suffix = hf_name.rpartition(".")
        role = names.get_name(stem)
        name = f"{role}.{suffix}"
        data = tensor.numpy()
        if hf_name.endswith("q_proj.weight"):
            data = _llama_cpp_rows(data, heads)
        elif hf_name.endswith("k_proj.weight"):
            data = _llama_cpp_rows(data, kv_heads)
        kind = (types or {}).get(role.split(".")[-1], QUANTIZED) if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        if kind == gguf.GGMLQuantizationType.Q4_K:  # the package has no Q4_K quantizer
            stored = q4_k(data)
        else:
            stored = gguf.quants.quantize(data, kind) if data.ndim == 2 else data
        writer.add_tensor(name, stored, raw_dtype=kind)  # a quantized array's shape is in bytes
        written[name] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def q4_k(weight: np.ndarray) -> np.ndarray:
    """[N, K] (K a multiple of 256) as Q4_K blocks, packed as ggml lays them out (the layout the
    package's `Q4_K.dequantize_blocks` reads): per 256 values d, dmin (fp16), 12 bytes of eight
    6-bit sub-block scales and mins, 128 bytes of 4-bit codes; weight = d * sc * q - dmin * m
    per sub-block of 32. Round to nearest: no search, as the test needs valid blocks only."""
    sub = weight.astype(np.float32).reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    step, lift = (sub.max(-1) - low) / 15, -low  # each sub-block's scale and min
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (lift.max(-1, keepdims=True) / 63).astype(np.float16)
    sc = np.clip(np.rint(step / np.maximum(d.astype(np.float32), 1e-30)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(lift / np.maximum(dmin.astype(np.float32), 1e-30)), 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32) * sc)[..., None]
    q = np.clip(np.rint((sub + (dmin.astype(np.float32) * mn)[..., None]) / scale), 0, 15).astype(np.uint8)
    packed_scales = np.concatenate(
        [
            sc[:, :4] | (sc[:, 4:] >> 4) << 6,
            mn[:, :4] | (mn[:, 4:] >> 4) << 6,
            (sc[:, 4:] & 0x0F) | (mn[:, 4:] & 0x0F) << 4,
        ],
        axis=-1,
    )
    codes = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # sub-blocks 2c and 2c + 1 share 32 bytes
    blocks = np.concatenate([d.view(np.uint8), dmin.view(np.uint8), packed_scales, codes], axis=-1)
    return blocks.reshape(weight.shape[0], -1)


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


def test_the_checkpoint_is_what_transformers_loads_from_the_file(tiny_gguf: Path) -> None:
    """The config, the tokenizer and the float32 weights transformers' own loader gives, bit for bit:
    the build reads the file without building the model, one dequantization of each tensor."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoints.load(tiny_gguf)
    model = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32)
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    loaded = ckpt.state_dict()
    assert set(loaded) == set(expected)
    for name, weight in expected.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], weight), name
    skip = ("dtype", "transformers_version", "quantization_config", "_name_or_path")
    config = AutoConfig.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name).to_dict()
    written = AutoConfig.from_pretrained(ckpt.path).to_dict()
    assert {k: v for k, v in written.items() if k not in skip} == {k: v for k, v in config.items() if k not in skip}
    theirs = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    ours = AutoTokenizer.from_pretrained(ckpt.path)
    text = "def fibonacci(n):\n    return n  # héllo 🙂"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.chat_template == theirs.chat_template and ours.all_special_tokens == theirs.all_special_tokens
    # less the token GPT-2's defaults add past the file's vocabulary (an id past the embedding table)
    vocabulary = ckpt.config["vocab_size"]
    assert max(theirs.added_tokens_decoder) >= vocabulary
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: str(t) for i, t in theirs.added_tokens_decoder.items() if i < vocabulary
    }


def test_the_files_fields_are_those_the_gguf_packages_reader_reads(tiny_gguf: Path) -> None:
    """The build's reader walks arrays (the vocabulary, its types, the merges) in one loop each:
    every field's parts, data indices and types are still the package's own."""
    ours, theirs = gguf_files._fast_reader()(tiny_gguf, "r"), gguf.GGUFReader(tiny_gguf)
    assert list(ours.fields) == list(theirs.fields)
    assert any(len(field.data) > 100 for field in ours.fields.values())  # the vocabulary's array is among them
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.data, mine.types, len(mine.parts)) == (
            field.offset,
            field.data,
            field.types,
            len(field.parts),
        ), key
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), key
        assert mine.contents() == field.contents(), key


@pytest.mark.slow
def test_kvforge_build_of_a_gguf_file_generates_what_transformers_generates_from_it(
    tiny_gguf: Path, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from click.testing import CliRunner
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from kvforge import Engine
    from kvforge.cli import main
    from tests.tiny import hf_greedy

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


# What each projection of the file below is stored as, and the form it must be imported in:
# (GGUF type, MatMulNBits bits, whether a min term per block is added)
T = gguf.GGMLQuantizationType
MIXED = {
    "attn_q": (T.Q4_K, 4, True),  # rows in llama.cpp's rotary order: the record's rows follow transformers'
    "attn_k": (T.Q4_K, 4, True),
    "attn_v": (T.Q4_K, 4, True),
    "attn_output": (T.Q4_1, 4, True),
    "ffn_gate": (T.Q5_1, 8, True),
    "ffn_up": (T.Q5_0, 8, True),  # stacked with gate, whose min term it shares (zeros for its rows)
    "ffn_down": (T.Q4_0, 4, False),
    "token_embd": (T.Q8_0, 8, False),  # tied: the LM head and the lookup both read the table's codes
}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, gguf.GGMLQuantizationType]]:
    """A tiny tied llama (K a multiple of 256, for the k-quants) written in MIXED's types: the
    checkpoint, the file, and each written tensor's type."""
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("mixed")
    source = make_checkpoint(root / "ckpt", "llama", hidden_size=256, intermediate_size=256, tie_word_embeddings=True)
    file = root / "gguf" / "mixed.gguf"
    file.parent.mkdir()
    written = write_gguf(source, file, {role: kind for role, (kind, _, _) in MIXED.items()})
    return source, file, written


def _matmul_accuracy_levels(artifact: Path) -> set[int]:
    import onnx

    graph = onnx.load(artifact / "model.onnx", load_external_data=False).graph
    levels = set()
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            attributes = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
            levels.add(attributes.get("accuracy_level", 0))
    return levels


@pytest.mark.slow
def test_a_gguf_files_quantized_tensors_are_imported_exactly_and_pass_the_float_gate(
    mixed_gguf: tuple[Path, Path, dict[str, gguf.GGMLQuantizationType]], tmp_path: Path
) -> None:
    """Free-minimum k-quants and legacy types, mixed as llama.cpp mixes them, built with
    --exact-activations: every matrix keeps the file's codes (the manifest says how), and the
    artifact computes what transformers computes from the file (the float32 gate) and generates
    the same tokens."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from kvforge import Engine
    from kvforge.cli import main
    from tests.tiny import hf_greedy

    source, file, written = mixed_gguf
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(file), "-o", str(out), "-q", "--exact-activations"])
    assert result.exit_code == 0, result.output

    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["imported_weights"]
    assert (entry["method"], entry["file"]) == ("gguf", file.name)
    assert entry["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    matrices = [n for n in checkpoints.load(source).tensor_metadata() if n.endswith("proj.weight")] + ["lm_head.weight"]
    # the table is looked up with its own codes too, and is the LM head's weight
    embedding = entry["weights"].pop("model.embed_tokens.weight")
    assert (embedding["stored_as"], embedding["form"], embedding["exact"], embedding["bits"]) == (
        "Q8_0",
        "gather_block_quantized",
        True,
        8,
    )
    assert [form["form"] for form in entry["weights"]["lm_head.weight"]["also"]] == ["gather_block_quantized"]
    assert sorted(entry["weights"]) == sorted(matrices)
    assert "output.weight" not in written
    for hf_name, form in entry["weights"].items():
        gguf_name = "token_embd" if hf_name == "lm_head.weight" else names.get_name(hf_name.rpartition(".")[0])
        kind, bits, mins = MIXED[gguf_name.split(".")[-1]]
        assert written[f"{gguf_name}.weight"] == kind
        assert (form["stored_as"], form["exact"], form["bits"], form.get("mins", False)) == (
            kind.name,
            True,
            bits,
            mins,
        )
    # judged by the float gate, not the distribution bounds
    assert manifest["flags"]["weights"] is None and manifest["flags"]["exact_activations"] is True
    assert entry["activations"] == "float" and _matmul_accuracy_levels(out) == {0}
    assert manifest["parity"]["tolerance"] == {"relative": 2e-4}

    engine = Engine.load(out)
    prompt = [5, 17, 42, 8, 99, 3]
    reference = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    assert engine.generate_tokens([prompt], max_new_tokens=12, temperature=0.0)[0] == hf_greedy(
        reference.eval(), prompt, 12
    )


@pytest.mark.slow
def test_the_default_build_of_a_quantized_gguf_file_computes_its_codes_at_int8_activations(
    mixed_gguf: tuple[Path, Path, dict[str, gguf.GGMLQuantizationType]], tmp_path: Path
) -> None:
    """No flags: the file's own codes, each MatMulNBits at accuracy level 4 (int8 activations,
    the fast path) as `--weights int4` builds it, judged by the distribution gate; the manifest
    and --json say so."""
    from click.testing import CliRunner

    from kvforge.cli import main

    _, file, _ = mixed_gguf
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(file), "-o", str(out), "-q", "--json"])
    assert result.exit_code == 0, result.output
    reported = json.loads(result.stdout)
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["imported_weights"]
    assert reported["imported"] == {k: v for k, v in entry.items() if k != "weights"}
    assert (entry["method"], entry["activations"]) == ("gguf", "int8")
    # every matrix keeps the file's codes but the tied Q8_0 table, the LM head's: its rows (256) are
    # whole blocks of 128, which int8 activations read faster (regrouped, for the head and its lookup)
    tied = {"lm_head.weight", "model.embed_tokens.weight"}
    assert {name for name, form in entry["weights"].items() if not form["exact"]} == tied
    assert all(entry["weights"][name]["block_size"] == 128 for name in tied)
    assert _matmul_accuracy_levels(out) == {4}
    assert manifest["flags"]["weights"]["bits"] == 4 and "exact_activations" not in manifest["flags"]
    assert reported["flags"] == manifest["flags"]
    assert manifest["parity"]["passed"] and manifest["parity"]["precision"] == "int4"


def test_exact_activations_with_weights_is_refused_before_anything_loads(tiny_gguf: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    args = ["build", str(tiny_gguf), "-o", str(tmp_path / "out"), "--exact-activations", "--weights", "int4"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0
    assert "--exact-activations" in result.output and "drop one of the two" in result.output


def test_exact_activations_on_a_checkpoint_that_is_not_gguf_is_refused_naming_it(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    from kvforge.runners.errors import ArtifactError
    from kvforge.toolchain.build import BuildOptions, build

    source = tiny_checkpoint("llama")
    with pytest.raises(ArtifactError, match="not a GGUF file.*drop --exact-activations") as caught:
        build(source, tmp_path / "out", BuildOptions(exact_activations=True))
    assert str(source) in str(caught.value)


def test_tolerance_on_the_default_build_of_a_quantized_gguf_file_is_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    from kvforge.runners.errors import ArtifactError
    from kvforge.toolchain.build import BuildOptions, build

    with pytest.raises(ArtifactError, match="add --exact-activations for the float gate, or drop --tolerance"):
        build(tiny_gguf, tmp_path / "out", BuildOptions(tolerance=1e-3))


def test_device_memory_counts_a_gguf_files_codes_as_the_import_writes_them(tiny_gguf: Path, tmp_path: Path) -> None:
    """`inspect` and `--device-memory` count a GGUF file's default build as it is written: its
    records (`record_bytes`, the tied table once), the rest at int4; a build is refused by that
    figure, not by the file requantized."""
    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.toolchain.checkpoint import load
    from kvforge.toolchain.footprint import footprint, format_bytes, record_bytes
    from kvforge.toolchain.spec import DecoderSpec

    ckpt = load(tiny_gguf)
    fp = footprint(ckpt, DecoderSpec.from_config(ckpt.config), batch=1, seq=32)
    records = {id(f.record): f.record for f in ckpt.quantized_weights().values() if f.exact}
    assert fp.imported_bytes is not None and fp.imported_bytes > sum(record_bytes(q) for q in records.values())
    need = fp.imported_bytes + fp.kv_bytes_total["fp32"]
    args = ["build", str(tiny_gguf), "-o", str(tmp_path / "out"), "--batch", "1", "--seq", "32", "-q"]
    result = CliRunner().invoke(main, [*args, "--device-memory", str(need - 1)])
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert f"needs {format_bytes(need)}" in result.output
    inspected = CliRunner().invoke(main, ["inspect", str(tiny_gguf), "--batch", "1", "--seq", "32"])
    assert inspected.exit_code == 0 and f"{fp.imported_bytes:,}" in inspected.output
