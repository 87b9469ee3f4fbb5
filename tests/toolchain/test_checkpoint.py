"""Loading checkpoint directories: what is accepted, memory mapping, and every refusal."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import kvforge.runners.manifest as manifest_module
from kvforge.runners.errors import CheckpointError
from kvforge.toolchain import checkpoint as ckpt
from kvforge.toolchain.checkpoint import Checkpoint, load

CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 8,
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "max_position_embeddings": 16,
}


def tensors() -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.arange(32, dtype=torch.float32).reshape(8, 4),
        "model.norm.weight": torch.ones(4, dtype=torch.float16),
        "lm_head.weight": torch.full((8, 4), 0.5, dtype=torch.bfloat16),
        "step": torch.tensor([3], dtype=torch.int64),
    }


def write_dir(
    directory: Path,
    *,
    weights: dict[str, torch.Tensor] | None = None,
    config: Any = None,
    tokenizer: bool = True,
    extra: dict[str, str] | None = None,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG if config is None else config, indent=2))
    if tokenizer:
        (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    if weights is None:
        weights = tensors()
    if weights:
        save_file(weights, str(directory / "model.safetensors"))
    for name, text in (extra or {}).items():
        (directory / name).write_text(text)
    return directory


def write_sharded(directory: Path, weight_map: dict[str, str] | None = None) -> Path:
    write_dir(directory, weights={})
    all_tensors = tensors()
    names = sorted(all_tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, keys in shards.items():
        save_file({k: all_tensors[k] for k in keys}, str(directory / shard))
    if weight_map is None:
        weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def error_text(exc: pytest.ExceptionInfo[CheckpointError]) -> str:
    return str(exc.value)


# --- accepted directories ------------------------------------------------------------------


def test_single_file_checkpoint(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m")
    c = load(directory)
    assert isinstance(c, Checkpoint)
    assert c.path == directory.resolve()
    assert c.config == CONFIG
    assert c.weight_files == (directory / "model.safetensors",)
    assert c.tokenizer_files == (directory / "tokenizer.json",)
    assert c.generation_config is None
    assert c.uses_pickle is False


def test_relative_path_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_dir(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    c = load("m")
    assert c.path == (tmp_path / "m").resolve()
    assert c.path.is_absolute()


def test_optional_tokenizer_files_and_generation_config(tmp_path: Path) -> None:
    directory = write_dir(
        tmp_path / "m",
        extra={
            "special_tokens_map.json": '{"eos_token": "</s>"}',
            "tokenizer_config.json": '{"model_max_length": 16}',
            "generation_config.json": '{"eos_token_id": [2, 3], "do_sample": false}',
        },
    )
    c = load(directory)
    assert [f.name for f in c.tokenizer_files] == [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ]
    assert c.generation_config == {"eos_token_id": [2, 3], "do_sample": False}


def test_state_dict_values_and_dtypes(tmp_path: Path) -> None:
    state = load(write_dir(tmp_path / "m")).state_dict()
    expected = tensors()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == tensor.dtype
        assert torch.equal(state[name], tensor)
        assert state[name].device.type == "cpu"


def _mapped_ranges(file: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(file)):
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((low, high))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_each_safetensors_tensor_maps_only_its_own_pages_and_unmaps_with_its_last_reference(tmp_path: Path) -> None:
    """A weight the pipeline replaces goes with its last reference: one mapping of the whole
    file would keep every page it touched. Each tensor's mapping covers its own bytes (and at
    most a page on either side), and no tensor shares storage with another."""
    weights = {"big": torch.randn(256, 1024), "other": torch.randn(64, 64)}
    directory = write_dir(tmp_path / "m", weights=weights)
    file = (directory / "model.safetensors").resolve()
    state = load(directory).state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in weights.items())
    ranges = sorted(_mapped_ranges(file), key=lambda r: r[1] - r[0])
    sizes = sorted(t.nbytes for t in state.values())
    assert len(ranges) == 2
    for (low, high), size in zip(ranges, sizes):
        assert size <= high - low <= size + 2 * mmap.PAGESIZE
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in state.values())
    del state["big"]
    assert len(_mapped_ranges(file)) == 1
    state.clear()
    assert _mapped_ranges(file) == []


def test_a_tensor_at_an_offset_its_dtype_cannot_align_to_is_read_into_memory_of_its_own(tmp_path: Path) -> None:
    """safetensors does not require aligned offsets: three bytes, then a float32 tensor at offset 3."""
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    header = {
        "flags": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "weight": {"dtype": "F32", "shape": [3], "data_offsets": [3, 15]},
    }
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    directory = write_dir(tmp_path / "m", weights={})
    data = bytes([7, 8, 9]) + values.numpy().tobytes()
    (directory / "model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)
    state = load(directory).state_dict()
    assert torch.equal(state["weight"], values)
    assert state["flags"].tolist() == [7, 8, 9]


def test_state_dict_converts_floats_to_the_build_dtype_and_leaves_integers(tmp_path: Path) -> None:
    weights = {"w": torch.randn(8, 4), "steps": torch.arange(5, dtype=torch.int64)}
    state = load(write_dir(tmp_path / "m", weights=weights)).state_dict(torch.bfloat16)
    assert state["w"].dtype == torch.bfloat16 and torch.equal(state["w"], weights["w"].to(torch.bfloat16))
    assert state["steps"].dtype == torch.int64 and torch.equal(state["steps"], weights["steps"])


def test_tensor_metadata_reads_headers_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = load(write_dir(tmp_path / "m"))

    def no_data(*_: Any, **__: Any) -> None:
        raise AssertionError("tensor data was loaded")

    monkeypatch.setattr(ckpt, "_read_safetensors", no_data)
    monkeypatch.setattr(torch, "load", no_data)
    assert c.tensor_metadata() == {
        "model.embed_tokens.weight": ("F32", (8, 4)),
        "model.norm.weight": ("F16", (4,)),
        "lm_head.weight": ("BF16", (8, 4)),
        "step": ("I64", (1,)),
    }


def test_source_hashes_cover_every_input(tmp_path: Path) -> None:
    directory = write_dir(
        tmp_path / "m",
        extra={
            "tokenizer_config.json": "{}",
            "generation_config.json": '{"eos_token_id": 2}',
            "README.md": "not an input",
        },
    )
    hashes = load(directory).source_hashes()
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert list(hashes) == names
    for name in names:
        assert hashes[name] == hashlib.sha256((directory / name).read_bytes()).hexdigest()


def test_hashes_are_streamed_in_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = write_dir(tmp_path / "m", weights={"w": torch.randn(1000)})
    monkeypatch.setattr(manifest_module, "_CHUNK", 7)
    reads: list[int] = []
    real_chunks = manifest_module._chunks

    def counting(f: Any) -> Any:
        for chunk in real_chunks(f):
            reads.append(len(chunk))
            yield chunk

    monkeypatch.setattr(manifest_module, "_chunks", counting)
    hashes = load(directory).source_hashes()
    assert max(reads) == 7
    weights = (directory / "model.safetensors").read_bytes()
    assert hashes["model.safetensors"] == hashlib.sha256(weights).hexdigest()


def test_sharded_checkpoint(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m")
    c = load(directory)
    assert [f.name for f in c.weight_files] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    state = c.state_dict()
    assert set(state) == set(tensors())
    assert torch.equal(state["lm_head.weight"], tensors()["lm_head.weight"])
    assert set(c.tensor_metadata()) == set(tensors())
    assert "model.safetensors.index.json" in c.source_hashes()


def test_tensor_locations_name_the_shard(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m")
    locations = load(directory).tensor_locations()
    assert locations["lm_head.weight"] == (directory / "model-00001-of-00002.safetensors", "BF16", (8, 4))
    assert locations["step"] == (directory / "model-00002-of-00002.safetensors", "I64", (1,))


def test_single_file_wins_over_index(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m")
    save_file(tensors(), str(directory / "model.safetensors"))
    assert load(directory).weight_files == (directory / "model.safetensors",)


def test_symlinked_shard_inside_the_directory_is_accepted(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m")
    first = directory / "model-00001-of-00002.safetensors"
    first.rename(directory / "real.safetensors")
    first.symlink_to("real.safetensors")
    assert len(load(directory).state_dict()) == 4


def test_checkpoint_from_tiny_factory(tmp_path: Path) -> None:
    from tests.tiny import make_checkpoint

    directory = make_checkpoint(tmp_path / "tiny", "qwen2", dtype="bfloat16")
    c = load(directory)
    assert c.config["model_type"] == "qwen2"
    state = c.state_dict()
    metadata = c.tensor_metadata()
    assert set(state) == set(metadata)
    for name, tensor in state.items():
        assert metadata[name] == ("BF16", tuple(tensor.shape))


# --- pickled weights -------------------------------------------------------------------------


def write_pickle(directory: Path, obj: Any) -> Path:
    write_dir(directory, weights={})
    torch.save(obj, directory / "pytorch_model.bin")
    return directory


def test_pickle_refused_by_default(tmp_path: Path) -> None:
    directory = write_pickle(tmp_path / "m", tensors())
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    text = error_text(exc)
    assert "pytorch_model.bin" in text and "safetensors" in text and "--allow-pickle" in text


def test_pickle_allowed(tmp_path: Path) -> None:
    directory = write_pickle(tmp_path / "m", tensors())
    c = load(directory, allow_pickle=True)
    assert c.uses_pickle is True
    assert c.weight_files == (directory / "pytorch_model.bin",)
    state = c.state_dict()
    for name, tensor in tensors().items():
        assert torch.equal(state[name], tensor)
    assert c.tensor_metadata()["lm_head.weight"] == ("BF16", (8, 4))
    assert "pytorch_model.bin" in c.source_hashes()


def test_pickle_is_loaded_with_weights_only_and_mmap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = write_pickle(tmp_path / "m", tensors())
    seen: dict[str, Any] = {}
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    load(directory, allow_pickle=True).state_dict()
    assert seen == {"map_location": "cpu", "weights_only": True, "mmap": True}


def test_safetensors_preferred_over_pickle(tmp_path: Path) -> None:
    directory = write_pickle(tmp_path / "m", tensors())
    save_file(tensors(), str(directory / "model.safetensors"))
    c = load(directory, allow_pickle=True)
    assert c.uses_pickle is False
    assert c.weight_files == (directory / "model.safetensors",)


class _Sneaky:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (os.getcwd, ())


def test_pickle_with_code_is_refused_at_load(tmp_path: Path) -> None:
    directory = write_pickle(tmp_path / "m", {"w": torch.ones(2), "x": _Sneaky()})
    c = load(directory, allow_pickle=True)
    with pytest.raises(CheckpointError) as exc:
        c.state_dict()
    assert "weights_only" in error_text(exc) and "pytorch_model.bin" in error_text(exc)


def test_pickle_that_is_not_a_state_dict(tmp_path: Path) -> None:
    directory = write_pickle(tmp_path / "m", [torch.ones(2)])
    with pytest.raises(CheckpointError, match="state dict"):
        load(directory, allow_pickle=True).state_dict()


def test_sharded_pickle_is_refused(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m", weights={}, extra={"pytorch_model.bin.index.json": "{}"})
    with pytest.raises(CheckpointError, match="convert the checkpoint to safetensors"):
        load(directory, allow_pickle=True)


# --- refused directories ----------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        load(tmp_path / "nope")
    assert "nope" in error_text(exc) and "config.json" in error_text(exc)


def test_hub_id_is_not_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError) as exc:
        load("meta-llama/Llama-3.2-1B")
    assert str(tmp_path / "cache") in error_text(exc) and "`hf download meta-llama/Llama-3.2-1B`" in error_text(exc)


def test_file_instead_of_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    save_file(tensors(), str(file))
    with pytest.raises(CheckpointError) as exc:
        load(file)
    assert "not a directory" in error_text(exc) and "config.json" in error_text(exc)


def test_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError) as exc:
        load(tmp_path / "empty")
    assert "empty" in error_text(exc) and "tokenizer.json" in error_text(exc)


def test_missing_config(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m")
    (directory / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        load(directory)


def test_invalid_config_json_names_file_and_line(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m")
    (directory / "config.json").write_text('{\n  "model_type": "llama",\n  "vocab_size": 8,,\n}\n')
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "config.json" in error_text(exc) and "line 3" in error_text(exc)


def test_config_floats_written_as_transformers_tags_read_as_floats(tmp_path: Path) -> None:
    """transformers saves inf and nan as {"__float__": ...} (bamba's time_step_limit, for one)."""
    import math

    from transformers import BambaConfig

    assert "__float__" in BambaConfig(time_step_limit=(0.0, float("inf"))).to_json_string()
    config = {**CONFIG, "limit": {"__float__": "Infinity"}, "odd": [{"__float__": "NaN"}, {"__float__": "soon"}]}
    directory = write_dir(tmp_path / "m", config=config)
    loaded = load(directory).config
    assert loaded["limit"] == math.inf and math.isnan(loaded["odd"][0])
    assert loaded["odd"][1] == {"__float__": "soon"}  # not one of the tags: left as it is


def test_config_must_be_an_object(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m", config=[1, 2])
    with pytest.raises(CheckpointError, match=r"config\.json: expected a JSON object"):
        load(directory)


def test_config_not_utf8(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m")
    (directory / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(CheckpointError, match=r"config\.json: cannot be read as UTF-8"):
        load(directory)


def test_remote_code_is_refused(tmp_path: Path) -> None:
    config = {**CONFIG, "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}
    directory = write_dir(tmp_path / "m", config=config)
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "config.json" in error_text(exc) and "auto_map" in error_text(exc)


def test_missing_tokenizer(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m", tokenizer=False)
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "tokenizer.json" in error_text(exc) and "save_pretrained" in error_text(exc)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json"])
def test_invalid_optional_json(tmp_path: Path, name: str) -> None:
    directory = write_dir(tmp_path / "m", extra={name: '{"a": 1'})
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert name in error_text(exc) and "line 1" in error_text(exc)


def test_no_weights(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m", weights={})
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model.safetensors" in error_text(exc) and "no weights" in error_text(exc)


def test_corrupt_safetensors_is_refused_at_load(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m")
    (directory / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: the header is not a JSON object"):
        load(directory)


def test_file_broken_after_load_is_refused_when_read(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m")
    c = load(directory)
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:-3])
    for read in (c.state_dict, c.tensor_metadata):
        with pytest.raises(
            CheckpointError, match=r"model\.safetensors: tensor '.*': data_offsets .* reach past the end"
        ):
            read()


@pytest.mark.parametrize(
    "shard",
    [
        "../outside.safetensors",
        "sub/model.safetensors",
        "/etc/passwd",
        "..",
        "",
        "a\\b.safetensors",
    ],
)
def test_shard_names_must_be_plain(tmp_path: Path, shard: str) -> None:
    directory = write_sharded(tmp_path / "m", {"w": shard})
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model.safetensors.index.json" in error_text(exc) and "plain file name" in error_text(exc)


def test_missing_shard(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m", {"w": "model-00009-of-00009.safetensors"})
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model-00009-of-00009.safetensors" in error_text(exc) and "does not exist" in error_text(exc)


def test_shard_symlink_outside_is_refused(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m")
    outside = tmp_path / "elsewhere.safetensors"
    save_file({"w": torch.ones(1)}, str(outside))
    (directory / "evil.safetensors").symlink_to(outside)
    index = directory / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["w"] = "evil.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "evil.safetensors" in error_text(exc) and "outside" in error_text(exc)


@pytest.mark.parametrize("weight_map", [None, {}, [1], "model.safetensors"])
def test_weight_map_must_be_an_object(tmp_path: Path, weight_map: Any) -> None:
    directory = write_sharded(tmp_path / "m")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="weight_map"):
        load(directory)


def test_weight_map_values_must_be_names(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m", {"w": 3})  # type: ignore[dict-item]
    with pytest.raises(CheckpointError, match=r"weight_map\['w'\]"):
        load(directory)


def test_invalid_index_json(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m")
    (directory / "model.safetensors.index.json").write_text('{"weight_map":\n {"a": }}')
    with pytest.raises(CheckpointError, match=r"index\.json: invalid JSON at line 2"):
        load(directory)


def test_tensor_in_two_shards(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m")
    save_file({"step": torch.zeros(1, dtype=torch.int64)}, str(directory / "model-00001-of-00002.safetensors"))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    text = error_text(exc)
    assert "'step' also appears in model-00001-of-00002.safetensors" in text
    assert "model-00002-of-00002.safetensors" in text


def test_chat_template_file_travels_with_the_tokenizer(tmp_path: Path) -> None:
    from kvforge.toolchain.checkpoint import load
    from tests.tiny import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "c", "llama")
    (ckpt / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert [p.name for p in load(ckpt).tokenizer_files][-1] == "chat_template.jinja"
