"""Fuzzing the readers of untrusted input: config.json, the shard index, safetensors headers.

Whatever the input, a reader either returns a value or raises one of our typed errors
(a `KvforgeError` subclass); anything else (KeyError, OverflowError, RecursionError, a
raw library error) is a bug. Kept small enough to run on every CI push in seconds.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvforge.runners.errors import CheckpointError, KvforgeError
from kvforge.toolchain import checkpoint as ckpt
from kvforge.toolchain import safetensors_check
from kvforge.toolchain.spec import LAYOUTS, DecoderSpec
from tests.fuzzing import json_values
from tests.tiny import ARCH_CONFIGS

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- value strategies -----------------------------------------------------------------------

# Values that have broken readers before or could: zero, negatives, ints past float and
# int64 range, non-finite floats, numbers as strings, bools (an int subclass), containers.
NASTY: list[Any] = [0, -1, 1, 3, 2**63, 10**400, 1.5, 1e308, float("nan"), float("inf"), "8", "", True, None, [], {}]
JSON_VALUES = json_values(NASTY)


def _layout_keys(model_type: str) -> list[str]:
    """The config.json fields one architecture reads."""
    layout = LAYOUTS[model_type]
    fields = {v for v in vars(layout).values() if isinstance(v, str) and v not in ("rmsnorm", "layernorm", "rope")}
    fields -= {"learned"}
    common = {"rope_scaling", "rope_parameters", "torch_dtype", "dtype", "tie_word_embeddings", "use_sliding_window"}
    return sorted(fields | common | {"bos_token_id", "eos_token_id", "pad_token_id", "max_window_layers"})


def _config_keys() -> list[str]:
    """Every field name any layout reads, so fuzzed dicts reach past the first lookup."""
    return sorted({key for model_type in LAYOUTS for key in _layout_keys(model_type)} | {"model_type"})


CONFIG_KEYS = _config_keys()
MODEL_TYPES = st.sampled_from([*LAYOUTS, "bert", ""])


def config_dicts() -> st.SearchStrategy[dict[str, Any]]:
    """Dicts over the real field names, with arbitrary values (a real model_type most of the time)."""
    return st.builds(
        lambda fields, model_type: {**fields, "model_type": model_type},
        st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, max_size=12),
        st.one_of(MODEL_TYPES, JSON_VALUES),
    )


@st.composite
def mutated_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A valid tiny config of some architecture with a few of the fields it reads replaced or deleted."""
    model_type = draw(st.sampled_from(sorted(ARCH_CONFIGS)))
    config: dict[str, Any] = {"model_type": model_type, "vocab_size": 384, **ARCH_CONFIGS[model_type]}
    keys = _layout_keys(model_type)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()) and key in config:
            del config[key]
        else:
            config[key] = draw(st.one_of(st.sampled_from(NASTY), JSON_VALUES))
    return config


def only_typed_errors(call: Callable[..., Any], *args: Any) -> Any:
    """`call(*args)`, or None when it raised one of our typed errors; anything else propagates."""
    try:
        return call(*args)
    except KvforgeError:
        return None


# --- config.json -------------------------------------------------------------------------------


@FUZZ
@given(config=st.one_of(config_dicts(), st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=6)))
def test_spec_from_arbitrary_config(config: dict[str, Any]) -> None:
    spec = only_typed_errors(lambda: DecoderSpec.from_config(config))
    if spec is not None:  # what is accepted is a sane spec, and survives the manifest round trip
        assert spec.num_heads % spec.num_kv_heads == 0 and spec.head_dim > 0
        assert DecoderSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@FUZZ
@given(config=mutated_configs(), generation=st.one_of(st.none(), config_dicts()))
def test_spec_from_mutated_valid_config(config: dict[str, Any], generation: dict[str, Any] | None) -> None:
    only_typed_errors(lambda: DecoderSpec.from_config(config, generation))


@FUZZ
@given(config=mutated_configs())
def test_spec_survives_the_json_file_round_trip(config: dict[str, Any]) -> None:
    """What the file reader hands over (json with NaN/Infinity allowed) is also handled."""
    try:
        text = json.dumps(config)
    except ValueError:
        assume(False)
    only_typed_errors(lambda: DecoderSpec.from_config(json.loads(text)))


def test_every_field_with_every_nasty_value() -> None:
    """Deterministic sweep: each architecture, each field it reads, each nasty value."""
    for model_type, arch in ARCH_CONFIGS.items():
        valid: dict[str, Any] = {"model_type": model_type, "vocab_size": 384, **arch}
        DecoderSpec.from_config(valid)
        for key in _layout_keys(model_type):
            for value in NASTY:
                only_typed_errors(DecoderSpec.from_config, {**valid, key: value})
                only_typed_errors(DecoderSpec.from_config, valid, {key: value})


# --- files read as JSON ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch() -> Any:
    with tempfile.TemporaryDirectory() as directory:
        yield Path(directory)


JSON_TEXTS = st.one_of(
    st.binary(max_size=64),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(900, 3000)),
    st.builds(lambda n: b'{"x": ' + b"7" * n + b"}", st.integers(4000, 6000)),
)


@FUZZ
@given(data=JSON_TEXTS)
def test_json_reader_on_arbitrary_bytes(scratch: Path, data: bytes) -> None:
    file = scratch / "config.json"
    file.write_bytes(data)
    result = only_typed_errors(lambda: ckpt._read_json(file, required=True))
    assert result is None or isinstance(result, dict)


# --- the shard index ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shard_dir(scratch: Path) -> Path:
    directory = scratch / "shards"
    directory.mkdir()
    for name in ("model-1.safetensors", "model-2.safetensors"):
        save_file({"w": torch.ones(1)}, str(directory / name))
    (directory / "config.json").write_text("{}")
    (scratch / "outside.safetensors").write_bytes(b"")
    (directory / "escape.safetensors").symlink_to(scratch / "outside.safetensors")
    return directory


SHARD_NAMES = st.one_of(
    st.sampled_from(
        [
            "model-1.safetensors",
            "model-2.safetensors",
            "escape.safetensors",
            "missing.safetensors",
            "config.json",
            "../outside.safetensors",
            "/etc/passwd",
            "..",
            "",
            "a\\b.safetensors",
        ]
    ),
    st.text(max_size=20),
    JSON_VALUES,
)


@FUZZ
@given(
    data=st.one_of(
        st.dictionaries(st.text(max_size=6), SHARD_NAMES, max_size=6).map(lambda m: {"weight_map": m}),
        st.dictionaries(st.text(max_size=6), JSON_VALUES, max_size=3),
    )
)
def test_index_reader_on_arbitrary_indexes(shard_dir: Path, data: dict[str, Any]) -> None:
    index = shard_dir / "model.safetensors.index.json"
    shards = only_typed_errors(lambda: ckpt.shard_map(data, index))
    if shards is not None:  # every accepted shard is a real file inside the directory
        for path in shards.values():
            assert path.parent == shard_dir and path.resolve().parent == shard_dir.resolve() and path.is_file()


@FUZZ
@given(data=JSON_TEXTS)
def test_index_reader_on_arbitrary_bytes(shard_dir: Path, data: bytes) -> None:
    index = shard_dir / "model.safetensors.index.json"
    index.write_bytes(data)
    only_typed_errors(lambda: ckpt.read_index(index))


# --- safetensors headers ---------------------------------------------------------------------------


def _valid_file() -> bytes:
    with tempfile.TemporaryDirectory() as directory:
        file = Path(directory) / "x.safetensors"
        tensors = {"a": torch.ones(3, 2), "b": torch.zeros(4, dtype=torch.float16), "c": torch.zeros(0)}
        save_file(tensors, str(file), metadata={"format": "pt"})
        return file.read_bytes()


VALID = _valid_file()


@st.composite
def mutated_files(draw: st.DrawFn) -> bytes:
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "append", "length", "splice"]))
        if kind == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del data[draw(st.integers(0, len(data))) :]
        elif kind == "append":
            data += draw(st.binary(min_size=1, max_size=16))
        elif kind == "length" and len(data) >= 8:
            data[:8] = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
        elif kind == "splice" and len(data) > 8:
            at = draw(st.integers(8, len(data) - 1))
            data[at:at] = draw(st.sampled_from([b"[", b"]", b"{", b"}", b",", b'"', b"-1", b"1e999", b"NaN", b"0"]))
    return bytes(data)


def headers() -> st.SearchStrategy[bytes]:
    """Structurally plausible headers with hostile values, followed by a data section."""
    offsets = st.one_of(st.lists(st.integers(-8, 64), min_size=2, max_size=2), JSON_VALUES)
    entry = st.one_of(
        st.fixed_dictionaries(
            {
                "dtype": st.one_of(st.sampled_from([*safetensors_check.DTYPE_SIZES, "F128", "U64"]), JSON_VALUES),
                "shape": st.one_of(st.lists(st.integers(-1, 8), max_size=4), JSON_VALUES),
                "data_offsets": offsets,
            }
        ),
        JSON_VALUES,
    )
    header = st.dictionaries(st.one_of(st.text(max_size=4), st.just("__metadata__")), entry, max_size=4)
    return st.builds(
        lambda h, data: (lambda text: len(text).to_bytes(8, "little") + text + data)(json.dumps(h).encode()),
        header,
        st.binary(max_size=64),
    )


def check_accepted(entries: dict[str, safetensors_check.TensorEntry], data: bytes) -> None:
    """What the reader accepts tiles the data section exactly, each tensor its dtype × shape."""
    data_bytes = len(data) - 8 - int.from_bytes(data[:8], "little")
    position = 0
    for entry in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        assert entry.begin == position
        assert entry.end - entry.begin == safetensors_check.DTYPE_SIZES[entry.dtype] * _numel(entry.shape)
        position = entry.end
    assert position == data_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@FUZZ
@given(data=st.one_of(st.binary(max_size=256), mutated_files(), headers()))
def test_safetensors_header_reader(data: bytes) -> None:
    entries = only_typed_errors(lambda: safetensors_check.parse_bytes(data, "x.safetensors"))
    if entries is not None:
        check_accepted(entries, data)


@settings(max_examples=60, deadline=None)
@given(data=st.one_of(mutated_files(), headers()))
def test_safetensors_file_reader_and_loader(scratch: Path, data: bytes) -> None:
    """Through the file: the header check and the reader raise only our errors, and whatever they accept
    reads to the bytes the safetensors library reads."""
    from safetensors.torch import load_file

    file = scratch / "model.safetensors"
    file.write_bytes(data)
    try:
        entries = safetensors_check.read_header(file)
    except CheckpointError:
        return
    tensors = ckpt._read_safetensors(file, None)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {n: e.shape for n, e in entries.items()}
    reference = load_file(file)
    for name, tensor in tensors.items():
        assert tensor.dtype == reference[name].dtype
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), reference[name].reshape(-1).view(torch.uint8))


# --- through `kvforge build` -------------------------------------------------------------------------

# Each example loads the tiny model (about a second where it is refused late): 15 keep it near a minute.
BUILD_FUZZ = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)
LLAMA_KEYS = _layout_keys("llama")
TOKENIZER_FIELDS = ["bos_token", "eos_token", "pad_token", "chat_template"]
GENERATION_FIELDS = ["do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens"]
GENERATION_FIELDS += ["bos_token_id", "eos_token_id", "pad_token_id"]


class _ReachedLowering(KvforgeError):
    """Raised in place of tracing: the input passed every check before it."""


def _edit_json(path: Path, key: str, value: Any, delete: bool) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    if delete:
        data.pop(key, None)
    else:
        data[key] = value
    try:
        path.write_text(json.dumps(data))
    except ValueError:  # a value JSON cannot hold: the file is written as a reader would see it anyway
        path.write_text(json.dumps(data, allow_nan=True))


@st.composite
def checkpoint_mutations(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """A few edits of a valid checkpoint: config, generation and tokenizer fields, safetensors header bytes."""
    edits: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["config", "generation", "tokenizer", "header"]))
        if kind == "header":
            edits.append((kind, (draw(st.integers(0, 300)), draw(st.binary(min_size=1, max_size=4)))))
        else:
            keys = {"config": LLAMA_KEYS, "generation": GENERATION_FIELDS, "tokenizer": TOKENIZER_FIELDS}[kind]
            value = draw(st.one_of(st.sampled_from(NASTY), JSON_VALUES))
            edits.append((kind, (draw(st.sampled_from(keys)), value, draw(st.booleans()))))
    return edits


def _apply(directory: Path, edits: list[tuple[str, Any]]) -> None:
    files = {"config": "config.json", "generation": "generation_config.json", "tokenizer": "tokenizer_config.json"}
    for kind, edit in edits:
        if kind == "header":
            at, data = edit
            weights = directory / "model.safetensors"
            raw = bytearray(weights.read_bytes())
            header_end = 8 + int.from_bytes(raw[:8], "little")
            at = at % header_end
            raw[at : at + len(data)] = data
            weights.write_bytes(bytes(raw))
        else:
            _edit_json(directory / files[kind], *edit)


@pytest.mark.slow
@BUILD_FUZZ
@given(edits=checkpoint_mutations())
def test_kvforge_build_on_mutated_checkpoints_is_one_line_and_publishes_nothing(
    tiny_checkpoint: Callable[..., Path], edits: list[tuple[str, Any]]
) -> None:
    """Whatever is edited, `kvforge build` exits 2 with one line and leaves nothing behind, or the input
    passed every check up to tracing (stopped there: a real build per example would not fit in CI)."""
    import shutil

    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.toolchain import build as build_module

    with tempfile.TemporaryDirectory() as scratch, pytest.MonkeyPatch.context() as patch:
        parent = Path(scratch)
        directory = parent / "ckpt"
        shutil.copytree(tiny_checkpoint("llama"), directory)
        _apply(directory, edits)

        def reached(*args: Any, **kwargs: Any) -> Any:
            raise _ReachedLowering("reached lowering")

        patch.setattr(build_module, "_lower", reached)
        result = CliRunner().invoke(main, ["build", str(directory), "-o", str(parent / "out"), "-q"])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2, (edits, result.output, result.exception)
        assert len(lines) == 1 and lines[0].startswith("kvforge: error: "), (edits, result.output)
        assert sorted(p.name for p in parent.iterdir()) == ["ckpt"]  # no artifact, no staging directory
