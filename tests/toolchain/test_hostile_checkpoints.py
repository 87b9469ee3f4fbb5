"""Every checkpoint input is untrusted: nothing in it executes, and each broken file is
refused with a CheckpointError naming the file and the field or tensor at fault."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge.runners.errors import CheckpointError, KvforgeError, ParityError, UnsupportedModelError
from kvforge.toolchain import checkpoint as ckpt
from kvforge.toolchain import safetensors_check
from kvforge.toolchain.checkpoint import check_against_spec, check_tokenizer_fits, load
from kvforge.toolchain.spec import DecoderSpec
from tests.toolchain.test_checkpoint import CONFIG, _mapped_ranges


def write_dir(directory: Path, *, config: Any = None, weights: dict[str, torch.Tensor] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    if weights is None:
        weights = {"a": torch.ones(3, 2), "b": torch.zeros(4, dtype=torch.float16)}
    if weights:
        save_file(weights, str(directory / "model.safetensors"))
    return directory


def raw_safetensors(header: dict[str, Any] | bytes, data: bytes, length: int | None = None) -> bytes:
    """A safetensors file made byte by byte, so that any rule can be broken."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(text) if length is None else length).to_bytes(8, "little") + text + data


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def message(exc: pytest.ExceptionInfo[Any]) -> str:
    return str(exc.value)


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def edit_config(directory: Path, **changes: Any) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


# --- pickles never execute ---------------------------------------------------------------


class _CreatesFile:
    """A pickle payload: unpickling it calls open(path, "w"), which creates the file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


class _RunsShell:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.path}",))


PAYLOADS = {"open": _CreatesFile, "os.system": _RunsShell}


def write_malicious_pickle(directory: Path, payload: Any) -> Path:
    write_dir(directory, weights={})
    torch.save({"w": torch.ones(2), "x": payload}, directory / "pytorch_model.bin")
    return directory


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_payload_is_live_under_plain_pickle(tmp_path: Path, payload: str) -> None:
    """Control: the payloads below really would run if loaded without weights_only."""
    marker = tmp_path / "pwned"
    directory = write_malicious_pickle(tmp_path / "m", PAYLOADS[payload](marker))
    torch.load(directory / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
@pytest.mark.parametrize(
    "environment",
    [{}, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "true"}],
    ids=["no-env", "force-no-weights-only=1", "force-no-weights-only=true"],
)
def test_malicious_pickle_does_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: str, environment: dict[str, str]
) -> None:
    """torch ignores TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD when weights_only=True is passed explicitly."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    marker = tmp_path / "pwned"
    directory = write_malicious_pickle(tmp_path / "m", PAYLOADS[payload](marker))
    calls: list[dict[str, Any]] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    c = load(directory, allow_pickle=True)
    for read in (c.state_dict, c.tensor_metadata):
        with pytest.raises(CheckpointError) as exc:
            read()
        assert "pytorch_model.bin" in message(exc) and "weights_only" in message(exc)
    assert not marker.exists()
    assert calls and all(kwargs["weights_only"] is True for kwargs in calls), "no fallback to a plain unpickler"
    assert len(calls) == 2  # one try per read, never a second, laxer attempt


def test_both_torch_overrides_set_is_a_checkpoint_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    directory = write_dir(tmp_path / "m", weights={})
    torch.save({"w": torch.ones(2)}, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        load(directory, allow_pickle=True).state_dict()


@pytest.mark.parametrize("version", ["2.5.1", "2.9.1+cpu", "2.10.0a0+git1234", "1.13.1"])
def test_old_torch_is_refused_for_pickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    directory = write_dir(tmp_path / "m", weights={})
    torch.save({"w": torch.ones(2)}, directory / "pytorch_model.bin")
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(CheckpointError) as exc:
        load(directory, allow_pickle=True)
    assert "pytorch_model.bin" in message(exc) and ckpt.MIN_TORCH_FOR_PICKLE in message(exc)
    assert version in message(exc)


@pytest.mark.parametrize("version", ["2.10.0", "2.13.0+cpu", "3.0.0"])
def test_recent_torch_loads_pickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    directory = write_dir(tmp_path / "m", weights={})
    torch.save({"w": torch.ones(2)}, directory / "pytorch_model.bin")
    monkeypatch.setattr(torch, "__version__", version)
    assert torch.equal(load(directory, allow_pickle=True).state_dict()["w"], torch.ones(2))


def test_legacy_pickle_format_loads_without_mmap(tmp_path: Path) -> None:
    """torch can memory-map only its zip format; the older format is read whole, still weights-only."""
    directory = write_dir(tmp_path / "m", weights={})
    torch.save({"w": torch.ones(2)}, directory / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert torch.equal(load(directory, allow_pickle=True).state_dict()["w"], torch.ones(2))


def test_garbage_pickle(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m", weights={})
    (directory / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot be loaded with weights_only=True"):
        load(directory, allow_pickle=True).state_dict()


# --- paths taken from the index ------------------------------------------------------------


def write_index(directory: Path, weight_map: dict[str, Any]) -> Path:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def sharded(directory: Path) -> Path:
    write_dir(directory, weights={})
    save_file({"a": torch.ones(2)}, str(directory / "model-1.safetensors"))
    save_file({"b": torch.ones(3)}, str(directory / "model-2.safetensors"))
    return write_index(directory, {"a": "model-1.safetensors", "b": "model-2.safetensors"})


@pytest.mark.parametrize(
    "name",
    [
        "..",
        ".",
        "../model-1.safetensors",
        "../../etc/passwd",
        "/etc/passwd",
        "/tmp/model.safetensors",
        "sub/model-1.safetensors",
        "./model-1.safetensors",
        "a\\..\\b.safetensors",
        "model\x00.safetensors",
        "",
    ],
)
def test_escaping_shard_names_are_refused_before_anything_is_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    directory = sharded(tmp_path / "m")
    write_index(directory, {"a": "model-1.safetensors", "b": "model-2.safetensors", "z": name})
    opened: list[Path] = []
    monkeypatch.setattr(safetensors_check, "read_header", lambda file: opened.append(file))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model.safetensors.index.json" in message(exc) and "plain file name" in message(exc)
    assert opened == []


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors.index.json", "weights.bin"])
def test_shards_must_be_safetensors_files(tmp_path: Path, name: str) -> None:
    directory = write_index(sharded(tmp_path / "m"), {"a": "model-1.safetensors", "b": name})
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model.safetensors.index.json" in message(exc) and ".safetensors" in message(exc) and name in message(exc)


@pytest.mark.parametrize("link", ["file", "directory", "chain"])
def test_symlinked_shard_escaping_the_directory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, link: str
) -> None:
    directory = sharded(tmp_path / "m")
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"b": torch.ones(3)}, str(outside / "model-2.safetensors"))
    (directory / "model-2.safetensors").unlink()
    if link == "file":
        (directory / "model-2.safetensors").symlink_to(outside / "model-2.safetensors")
    elif link == "directory":  # the file name is plain, but it resolves through a linked folder
        (directory / "sub").symlink_to(outside)
        (directory / "model-2.safetensors").symlink_to("sub/model-2.safetensors")
    else:  # a link to a link inside the directory that leaves it
        (directory / "hop.safetensors").symlink_to(outside / "model-2.safetensors")
        (directory / "model-2.safetensors").symlink_to("hop.safetensors")
    opened: list[Path] = []
    monkeypatch.setattr(safetensors_check, "read_header", lambda file: opened.append(file))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model-2.safetensors" in message(exc) and "outside the checkpoint directory" in message(exc)
    assert opened == []


def test_dangling_shard_link_is_reported_as_missing(tmp_path: Path) -> None:
    directory = sharded(tmp_path / "m")
    (directory / "model-2.safetensors").unlink()
    (directory / "model-2.safetensors").symlink_to("gone.safetensors")
    with pytest.raises(CheckpointError, match=r"shard 'model-2\.safetensors' listed in weight_map does not exist"):
        load(directory)


def test_missing_shard(tmp_path: Path) -> None:
    directory = sharded(tmp_path / "m")
    (directory / "model-2.safetensors").unlink()
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model.safetensors.index.json" in message(exc) and "'model-2.safetensors'" in message(exc)


def test_index_lists_a_tensor_no_shard_has(tmp_path: Path) -> None:
    directory = write_index(
        sharded(tmp_path / "m"), {"a": "model-1.safetensors", "b": "model-2.safetensors", "c": "model-2.safetensors"}
    )
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "index.json" in message(exc) and "'c'" in message(exc) and "no shard contains it" in message(exc)


def test_index_puts_a_tensor_in_the_wrong_shard(tmp_path: Path) -> None:
    directory = write_index(sharded(tmp_path / "m"), {"a": "model-2.safetensors", "b": "model-1.safetensors"})
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "index.json" in message(exc) and "'a'" in message(exc) and "model-1.safetensors" in message(exc)


def test_shard_holds_a_tensor_the_index_does_not_list(tmp_path: Path) -> None:
    directory = sharded(tmp_path / "m")
    save_file({"b": torch.ones(3), "stowaway": torch.ones(1)}, str(directory / "model-2.safetensors"))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model-2.safetensors" in message(exc) and "'stowaway'" in message(exc) and "weight_map" in message(exc)


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    directory = sharded(tmp_path / "m")
    save_file({"a": torch.ones(2), "b": torch.ones(3)}, str(directory / "model-2.safetensors"))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "model-2.safetensors" in message(exc) and "'a' also appears in model-1.safetensors" in message(exc)


def test_auto_map_is_refused_before_weights_are_looked_at(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = write_dir(tmp_path / "m", config={**CONFIG, "auto_map": {"AutoModelForCausalLM": "evil.Model"}})
    monkeypatch.setattr(safetensors_check, "read_header", lambda file: pytest.fail("weights were opened"))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert "config.json" in message(exc) and "'auto_map'" in message(exc)


# --- broken safetensors files --------------------------------------------------------------

GOOD_HEADER = {"a": entry("F32", [3, 2], 0, 24), "b": entry("F16", [4], 24, 32)}
GOOD_DATA = bytes(32)

BROKEN_FILES: dict[str, tuple[bytes, list[str]]] = {
    # case: (file bytes, what the message must name)
    "shorter than the length prefix": (b"\x10\x00\x00", ["too short"]),
    "empty file": (b"", ["0 bytes", "too short"]),
    "truncated in the header": (raw_safetensors(GOOD_HEADER, GOOD_DATA)[:40], ["past the end of the file"]),
    "truncated in the data": (raw_safetensors(GOOD_HEADER, GOOD_DATA[:30]), ["'b'", "[24, 32]", "past the end"]),
    "trailing bytes": (raw_safetensors(GOOD_HEADER, GOOD_DATA + b"extra"), ["5 trailing bytes"]),
    "header length past the end": (raw_safetensors(GOOD_HEADER, GOOD_DATA, length=10_000), ["10,000", "past the end"]),
    "header length beyond the limit": (raw_safetensors(GOOD_HEADER, GOOD_DATA, length=1 << 40), ["exceeds"]),
    "header not JSON": (raw_safetensors(b"{not json", b""), ["not valid JSON"]),
    "header not an object": (raw_safetensors(b"[1, 2]", b""), ["not a JSON object"]),
    "header not UTF-8": (raw_safetensors(b'{"\xff": 1}', b""), ["not UTF-8"]),
    "duplicate tensor name": (
        raw_safetensors(
            b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
            b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
            bytes(8),
        ),
        ["'a' appears twice"],
    ),
    "overlapping offsets": (
        raw_safetensors({"a": entry("F32", [4], 0, 16), "b": entry("F32", [2], 8, 16)}, bytes(16)),
        ["'a'", "'b'", "overlap"],
    ),
    "gap between tensors": (
        raw_safetensors({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 12, 20)}, bytes(20)),
        ["'b'", "belong to no tensor"],
    ),
    "offsets out of range": (
        raw_safetensors({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 1_000_000, 1_000_008)}, bytes(8)),
        ["'b'", "past the end"],
    ),
    "offsets do not match dtype and shape": (
        raw_safetensors({"a": entry("F32", [3, 2], 0, 16)}, bytes(16)),
        ["'a'", "16 bytes", "F32", "[3, 2]", "needs 24"],
    ),
    "unknown dtype": (raw_safetensors({"a": entry("F128", [1], 0, 16)}, bytes(16)), ["'a'", "'F128'"]),
    "dtype not a string": (raw_safetensors({"a": entry(4, [1], 0, 4)}, bytes(4)), ["'a'", "dtype 4"]),  # type: ignore[arg-type]
    "negative offset": (raw_safetensors({"a": entry("F32", [1], -4, 0)}, b""), ["'a'", "data_offsets"]),
    "offsets reversed": (raw_safetensors({"a": entry("F32", [0], 4, 0)}, bytes(4)), ["'a'", "end before"]),
    "float in shape": (
        raw_safetensors({"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, bytes(4)),
        ["'a'", "shape"],
    ),
    "bool in offsets": (
        raw_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}}, bytes(4)),
        ["'a'", "data_offsets"],
    ),
    "missing data_offsets": (raw_safetensors({"a": {"dtype": "F32", "shape": [1]}}, bytes(4)), ["'a'", "data_offsets"]),
    "tensor not an object": (raw_safetensors({"a": [1, 2]}, b""), ["'a'", "expected an object"]),
    "metadata not strings": (raw_safetensors({"__metadata__": {"format": 1}}, b""), ["'__metadata__'"]),
    "absurd rank": (raw_safetensors({"a": entry("F32", [1] * 65, 0, 4)}, bytes(4)), ["'a'", "at most 64"]),
    "NaN in header": (
        raw_safetensors(b'{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', b""),
        ["NaN"],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_broken_safetensors_is_refused_at_load_naming_file_and_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    data, expected = BROKEN_FILES[case]
    directory = write_dir(tmp_path / "m", weights={})
    (directory / "model.safetensors").write_bytes(data)
    library_calls: list[Any] = []
    monkeypatch.setattr("safetensors.torch.load_file", lambda *a, **k: library_calls.append(a))
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    text = message(exc)
    assert text.startswith(f"{directory / 'model.safetensors'}: ")
    for part in expected:
        assert part in text, f"{part!r} not in {text!r}"
    assert "re-save" in text  # says what to do
    assert library_calls == []  # refused by our checks, before the library opened the file


# Where we are deliberately stricter than the safetensors library.
STRICTER_THAN_LIBRARY = {"absurd rank"}


@pytest.mark.parametrize("case", sorted(set(BROKEN_FILES) - STRICTER_THAN_LIBRARY))
def test_the_library_refuses_these_too(tmp_path: Path, case: str) -> None:
    """Each broken file above is broken by the library's rules too: our checks are not inventing any."""
    file = tmp_path / "x.safetensors"
    file.write_bytes(BROKEN_FILES[case][0])
    with pytest.raises(Exception):  # noqa: B017 (the library raises several types)
        load_file(str(file))


def test_valid_edge_cases_are_accepted(tmp_path: Path) -> None:
    weights = {
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(3.0),
        "flag": torch.tensor([True, False]),
        "half": torch.ones(3, dtype=torch.bfloat16),
    }
    directory = write_dir(tmp_path / "m", weights=weights)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    c = load(directory)
    assert c.tensor_metadata() == {
        "empty": ("F32", (0, 4)),
        "scalar": ("F32", ()),
        "flag": ("BOOL", (2,)),
        "half": ("BF16", (3,)),
    }
    assert set(c.state_dict()) == set(weights)


def test_a_file_cut_short_after_its_header_was_checked_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file shrinks between the header check and the read (another process rewriting it)."""
    from kvforge.toolchain import safetensors_check

    c = load(write_dir(tmp_path / "m"))
    file = c.weight_files[0]
    entries = safetensors_check.read_header(file)
    monkeypatch.setattr(safetensors_check, "read_header", lambda _: entries)
    file.write_bytes(file.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"model.safetensors: the file ended inside tensor .*re-download it"):
        c.state_dict()


def test_a_read_error_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    c = load(write_dir(tmp_path / "m"))
    raised = OSError(5, "Input/output error")

    class FailingRead(io.BytesIO):
        def readinto(self, buffer: Any) -> int:
            raise raised

    real_open = Path.open

    def open_weights(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name == "model.safetensors":
            with real_open(self, "rb") as f:
                return FailingRead(f.read())
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_weights)
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot be read \(Input/output error\)") as exc:
        c.state_dict()
    assert exc.value.__cause__ is raised


def test_unreadable_weights_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = write_dir(tmp_path / "m")
    real_open = Path.open

    def denied(self: Path, *args: Any, **kwargs: Any) -> Any:
        if self.name == "model.safetensors":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", denied)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot be read \(Permission denied\)"):
        load(directory)


# --- broken JSON files ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ],
)
@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"a": 1,\n "b": }', "line 2"),
        ("", "line 1"),
        ('{"n": ' + "9" * 5000 + "}", "invalid JSON"),
        ("[" * 100_000 + "]" * 100_000, "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
    ],
    ids=["syntax", "empty", "huge-number", "deep-nesting", "not-an-object"],
)
def test_invalid_json_names_the_file(tmp_path: Path, name: str, text: str, expected: str) -> None:
    directory = sharded(tmp_path / "m") if name == "model.safetensors.index.json" else write_dir(tmp_path / "m")
    (directory / name).write_text(text)
    with pytest.raises(CheckpointError) as exc:
        load(directory)
    assert message(exc).startswith(f"{directory / name}: ") and expected in message(exc)


def test_oversized_json_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt, "MAX_JSON_BYTES", 100)
    directory = write_dir(tmp_path / "m", config={**CONFIG, "padding": "x" * 200})
    with pytest.raises(CheckpointError, match=r"config\.json: .*beyond the 100-byte limit"):
        load(directory)


# --- config values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"num_attention_heads": -2}, "num_attention_heads"),
        ({"hidden_size": 5}, "hidden_size"),  # 5 is not divisible by 2 heads
        ({"max_position_embeddings": 1_000_000_000}, "max_position_embeddings"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers"),
        ({"vocab_size": True}, "vocab_size"),
        ({"vocab_size": 8.0}, "vocab_size"),
        ({"intermediate_size": None}, "intermediate_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rms_norm_eps": 10**400}, "rms_norm_eps"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rope_scaling": ["linear"]}, "rope_scaling"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"eos_token_id": [2, "x"]}, "eos_token_id"),
        ({"bos_token_id": -5}, "bos_token_id"),
        ({"head_dim": 0}, "head_dim"),
    ],
)
def test_bad_config_values_name_config_json_and_the_field(tmp_path: Path, changes: dict[str, Any], field: str) -> None:
    directory = write_dir(tmp_path / "m", config={**CONFIG, **changes})
    c = load(directory)
    with pytest.raises(CheckpointError) as exc:
        DecoderSpec.from_config(c.config, c.generation_config)
    assert "config.json" in message(exc) and f"'{field}'" in message(exc)


@pytest.mark.parametrize("model_type", [None, 7, "bert", "../llama"])
def test_unknown_model_type(tmp_path: Path, model_type: Any) -> None:
    directory = write_dir(tmp_path / "m", config={**CONFIG, "model_type": model_type})
    with pytest.raises(KvforgeError, match=r"config\.json.*model_type"):
        DecoderSpec.from_config(load(directory).config)


def test_bad_generation_config_value(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m")
    (directory / "generation_config.json").write_text('{"eos_token_id": "</s>"}')
    c = load(directory)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: field 'eos_token_id'"):
        DecoderSpec.from_config(c.config, c.generation_config)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"bos_token_id": 256.5}, "bos_token_id"),
        ({"bos_token_id": "0"}, "bos_token_id"),
        ({"eos_token_id": 1.5}, "eos_token_id"),
        ({"pad_token_id": "x"}, "pad_token_id"),
    ],
)
def test_config_token_ids_are_checked_where_generation_config_overrides_them(
    tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    """transformers validates config.json's own ids when it builds the model, whichever file wins."""
    directory = write_dir(tmp_path / "m", config={**CONFIG, **changes})
    (directory / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}')
    c = load(directory)
    with pytest.raises(CheckpointError, match=rf"^config\.json: field '{field}' .*; fix config\.json$"):
        DecoderSpec.from_config(c.config, c.generation_config)


def test_transformers_config_errors_at_model_build_name_config_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the config class still rejects when the model is made is one line naming config.json."""
    from transformers import AutoConfig

    from kvforge.toolchain import export

    spec = DecoderSpec.from_config(CONFIG)

    def reject(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("bos_token_id must be an int\nsecond line")

    monkeypatch.setattr(AutoConfig, "for_model", reject)
    with pytest.raises(CheckpointError) as exc:
        export._model_class(dict(CONFIG), spec)
    assert message(exc).startswith("config.json: transformers' llama config rejects it (ValueError: bos_token_id")
    assert "\n" not in message(exc) and message(exc).endswith("fix config.json")


def test_unsupported_weight_dtype_in_config(tmp_path: Path) -> None:
    directory = write_dir(tmp_path / "m", config={**CONFIG, "torch_dtype": "float8_e4m3fn"})
    with pytest.raises(UnsupportedModelError, match=r"config\.json: field 'torch_dtype'"):
        DecoderSpec.from_config(load(directory).config)


# --- weights and tokenizer against the config ---------------------------------------------------


@pytest.fixture
def llama_copy(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> Path:
    return copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "llama")


def checked(directory: Path) -> None:
    c = load(directory)
    check_against_spec(c, DecoderSpec.from_config(c.config, c.generation_config))


def test_tiny_checkpoints_pass_the_spec_checks(tiny_checkpoint: Callable[..., Path]) -> None:
    for model_type in ("llama", "gpt2", "gpt_neox", "gemma"):
        checked(tiny_checkpoint(model_type))


@pytest.mark.parametrize(
    "changes, shape",
    [({"vocab_size": 400}, "[400, 64]"), ({"hidden_size": 128, "head_dim": 16}, "[384, 128]")],
)
def test_embedding_shape_must_match_config(llama_copy: Path, changes: dict[str, Any], shape: str) -> None:
    edit_config(llama_copy, **changes)
    with pytest.raises(CheckpointError) as exc:
        checked(llama_copy)
    text = message(exc)
    assert "model.safetensors" in text and "'model.embed_tokens.weight'" in text
    assert "[384, 64]" in text and shape in text


def test_learned_position_table_must_match_config(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    directory = copy_checkpoint(tiny_checkpoint("gpt2"), tmp_path / "gpt2")
    edit_config(directory, n_positions=512)
    with pytest.raises(CheckpointError, match=r"'transformer\.wpe\.weight' has shape \[256, 64\].*\[512, 64\]"):
        checked(directory)


@pytest.mark.parametrize("changes", [{"num_hidden_layers": 5000}, {"intermediate_size": 5_000_000}])
def test_config_describing_a_far_larger_model_is_refused(llama_copy: Path, changes: dict[str, Any]) -> None:
    edit_config(llama_copy, **changes)
    with pytest.raises(CheckpointError) as exc:
        checked(llama_copy)
    assert "config.json" in message(exc) and "the weights hold" in message(exc)


def test_tokenizer_ids_beyond_the_embedding_table(llama_copy: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(llama_copy / "tokenizer.json"))
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.add_special_tokens([f"<extra_{i}>" for i in range(384 - size + 3)])
    tokenizer.save(str(llama_copy / "tokenizer.json"))
    c = load(llama_copy)
    with pytest.raises(CheckpointError) as exc:
        check_tokenizer_fits(c, DecoderSpec.from_config(c.config, c.generation_config))
    text = message(exc)
    assert text.startswith(f"{llama_copy / 'tokenizer.json'}: ")
    assert "387 token ids" in text and "384 rows" in text and "'<extra_" in text


@pytest.mark.parametrize("text", ['{"version": "1.0"}', '{"model": {"type": "BPE", "vocab": 5}}'])
def test_tokenizer_the_library_cannot_load(llama_copy: Path, text: str) -> None:
    (llama_copy / "tokenizer.json").write_text(text)
    c = load(llama_copy)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: the tokenizers library cannot load it"):
        check_tokenizer_fits(c, DecoderSpec.from_config(c.config, c.generation_config))


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("tokenizer_config.json", '{"bos_token": ["<s>"]}', r"tokenizer_config\.json: bos_token must be a string"),
        ("generation_config.json", '{"temperature": "hot"}', r"generation_config\.json: .*temperature must be"),
        ("generation_config.json", '{"do_sample": "no"}', r"generation_config\.json: .*do_sample must be"),
    ],
)
def test_files_the_runner_would_refuse_fail_the_build_checks(
    llama_copy: Path, name: str, text: str, expected: str
) -> None:
    """The artifact carries these files as they are: what `Engine.load` refuses, the build refuses first."""
    (llama_copy / name).write_text(text)
    with pytest.raises(CheckpointError, match=expected) as exc:
        checked(llama_copy)
    assert "\n" not in message(exc) and "fix the checkpoint's file" in message(exc)


# --- through the whole build (slow) --------------------------------------------------------------


def rewrite_weights(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = directory / "model.safetensors"
    weights = {name: tensor.clone() for name, tensor in load_file(str(file)).items()}
    change(weights)
    save_file(weights, str(file), metadata={"format": "pt"})


LAYER_WEIGHT = "model.layers.0.mlp.down_proj.weight"


def _missing(weights: dict[str, torch.Tensor]) -> None:
    del weights[LAYER_WEIGHT]


def _extra(weights: dict[str, torch.Tensor]) -> None:
    weights["model.layers.0.mlp.stowaway.weight"] = torch.ones(4, 4)


def _wrong_shape(weights: dict[str, torch.Tensor]) -> None:
    weights[LAYER_WEIGHT] = torch.ones(64, 64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, expected",
    [
        (_missing, ["missing keys", LAYER_WEIGHT]),
        (_extra, ["unexpected keys", "model.layers.0.mlp.stowaway.weight"]),
        (_wrong_shape, ["mismatched keys", LAYER_WEIGHT]),
    ],
    ids=["missing", "extra", "wrong-shape"],
)
def test_weights_that_do_not_fit_the_architecture_fail_the_build(
    llama_copy: Path, tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], None], expected: list[str]
) -> None:
    from kvforge import build

    rewrite_weights(llama_copy, change)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as exc:
        build(llama_copy, out)
    for part in expected:
        assert part in message(exc)
    assert not out.exists()


@pytest.mark.slow
def test_nan_weight_fails_the_parity_gate_and_publishes_nothing(llama_copy: Path, tmp_path: Path) -> None:
    from kvforge import build

    def plant_nan(weights: dict[str, torch.Tensor]) -> None:
        weights[LAYER_WEIGHT][3, 5] = float("nan")

    rewrite_weights(llama_copy, plant_nan)
    parent = tmp_path / "artifacts"
    parent.mkdir()
    with pytest.raises(ParityError, match="NaN or Inf") as exc:
        build(llama_copy, parent / "out")
    assert list(parent.iterdir()) == []  # neither the artifact nor a staging directory is left
    assert "nan" in message(exc)


def test_a_read_error_while_mapping_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapped weights are populated at load, so a disk's read error is an error that names the
    file there, not a crash at the first touch of a page."""
    c = load(write_dir(tmp_path / "m"))
    raised = OSError(5, "Input/output error")

    def failing(mapped: Any) -> None:
        raise raised

    monkeypatch.setattr(ckpt, "_populate", failing)
    with pytest.raises(CheckpointError, match=r"model.safetensors: cannot be read \(Input/output error\)") as exc:
        c.state_dict()
    assert exc.value.__cause__ is raised


def test_weights_are_read_where_the_kernel_cannot_populate_a_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    expected = {"a": torch.arange(6.0).reshape(3, 2), "b": torch.full((4,), 2.5, dtype=torch.float16)}
    directory = write_dir(tmp_path / "m", weights=expected)

    def unsupported(mapped: Any) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(ckpt, "_populate", unsupported)
    state = load(directory).state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    assert _mapped_ranges((directory / "model.safetensors").resolve()) == []
