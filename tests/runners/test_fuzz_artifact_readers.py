"""Fuzzing what the runner reads from an artifact before it generates: manifest, model, config.

An artifact may come from anywhere. Whatever its manifest.json, generation_config.json or
model.onnx holds, the readers either return a value or raise one of our typed errors (a
`KvforgeError` subclass); anything else (KeyError, OverflowError, RecursionError, a hang)
is a bug. Small enough to run on every CI push in a few seconds.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from kvforge.runners.contract import DecoderIO
from kvforge.runners.engine import generation_settings
from kvforge.runners.errors import ArtifactError, KvforgeError
from kvforge.runners.external_data import check_external_data
from kvforge.runners.manifest import (
    MANIFEST,
    SCHEMA_VERSION,
    check_spec_against_io,
    read_io,
    read_manifest,
    read_max_positions,
    sha256_file,
    verify_files,
)
from tests.fuzzing import json_values

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NASTY: list[Any] = [0, -1, 1, 2, 2**63, 10**400, 1.5, 1e308, float("nan"), float("inf"), "8", "", True, None, [], {}]
NASTY_NAMES = [
    "model.onnx",
    "model.onnx.data",
    MANIFEST,
    "missing.bin",
    "",
    ".",
    "..",
    "../secret.bin",
    "/etc/passwd",
    "sub/model.onnx",
    "a\\b",
    "C:x",
    "nul\x00byte",
    "\ud800",
    " model.onnx",
    "日本語.bin",
]
JSON_VALUES = json_values(NASTY)
IO = DecoderIO(num_layers=2, num_kv_heads=2, head_dim=4, vocab_size=32)
FILES = {"model.onnx": b"graph", "model.onnx.data": b"weights", "tokenizer.json": b"{}"}


@pytest.fixture(scope="module")
def directory() -> Iterator[Path]:
    """One artifact-like directory for every example; only manifest.json changes between them."""
    with tempfile.TemporaryDirectory() as name:
        path = Path(name) / "art"
        path.mkdir()
        for file, content in FILES.items():
            (path / file).write_bytes(content)
        (Path(name) / "secret.bin").write_bytes(b"secret")
        yield path


def valid_manifest(directory: Path) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "files": {name: sha256_file(directory / name) for name in FILES},
        "io": IO.to_dict(),
        "spec": {"max_positions": 64, "eos_token_ids": [2], "vocab_size": IO.vocab_size, "num_layers": IO.num_layers},
    }


def read_all(directory: Path, text: bytes) -> None:
    """Everything Engine.load reads from the manifest, in its order; typed errors are fine."""
    (directory / MANIFEST).write_bytes(text)
    try:
        manifest = read_manifest(directory)
        verify_files(directory, manifest)
        io = read_io(directory, manifest)
        assert io.to_dict() == manifest["io"]  # accepted only if exact
        check_spec_against_io(directory, manifest, io)
        assert (manifest["spec"]["vocab_size"], manifest["spec"]["num_layers"]) == (io.vocab_size, io.num_layers)
        assert read_max_positions(directory, manifest) >= 1
    except KvforgeError:
        pass


# --- mutations of a valid manifest ------------------------------------------------------------


@st.composite
def mutated_manifests(draw: st.DrawFn, base: dict[str, Any]) -> Any:
    """A valid manifest with a few values replaced, keys dropped or files renamed."""
    manifest = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 4))):
        section = draw(st.sampled_from(["top", "io", "spec", "files"]))
        target = manifest if section == "top" else manifest.setdefault(section, {})
        if not isinstance(target, dict):
            continue
        action = draw(st.sampled_from(["replace", "drop", "add"]))
        keys = sorted(target) or ["schema_version"]
        if action == "replace":
            target[draw(st.sampled_from(keys))] = draw(JSON_VALUES)
        elif action == "drop":
            target.pop(draw(st.sampled_from(keys)), None)
        elif section == "files":
            target[draw(st.sampled_from(NASTY_NAMES))] = draw(
                st.one_of(st.sampled_from(list(target.values()) or ["0"]), JSON_VALUES)
            )
        else:
            target[draw(st.sampled_from(NASTY_NAMES + ["num_layers", "max_positions", "io", "files"]))] = draw(
                JSON_VALUES
            )
    return manifest


def test_the_valid_manifest_reads(directory: Path) -> None:
    (directory / MANIFEST).write_text(json.dumps(valid_manifest(directory)))
    manifest = read_manifest(directory)
    assert read_io(directory, manifest) == IO and read_max_positions(directory, manifest) == 64


@FUZZ
@given(data=st.data())
def test_mutated_manifests_raise_only_typed_errors(directory: Path, data: st.DataObject) -> None:
    manifest = data.draw(mutated_manifests(valid_manifest(directory)))
    read_all(directory, json.dumps(manifest).encode("utf-8", "surrogatepass"))


@FUZZ
@given(value=JSON_VALUES)
def test_any_json_document_raises_only_typed_errors(directory: Path, value: Any) -> None:
    read_all(directory, json.dumps(value).encode())


@FUZZ
@given(data=st.data())
def test_corrupted_manifest_bytes_raise_only_typed_errors(directory: Path, data: st.DataObject) -> None:
    text = bytearray(json.dumps(valid_manifest(directory)).encode())
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(text) - 1))
        text[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(text)))
    read_all(directory, bytes(text[:cut] if data.draw(st.booleans()) else text))


@pytest.mark.parametrize(
    "text",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nesting past the recursion limit
        b'{"schema_version": 1, "files": {"a": 1' + b"0" * 5000 + b"}}",  # an integer past str->int's digit limit
        b'{"schema_version": 1, "files": {"model.onnx": "x"}, "io": {"num_layers": 1e999}}',
        b"\xff\xfe not utf-8",
        b"",
    ],
)
def test_pathological_manifests_raise_artifact_errors(directory: Path, text: bytes) -> None:
    (directory / MANIFEST).write_bytes(text)
    with pytest.raises(ArtifactError, match=r"manifest\.json"):
        manifest = read_manifest(directory)
        read_io(directory, manifest)


@pytest.mark.parametrize("layers", [10**12, 2**63, -1, 0, 1.0, True, "2", None])
def test_absurd_io_sizes_fail_at_once(directory: Path, layers: Any) -> None:
    io = dict(IO.to_dict(), num_layers=layers)
    with pytest.raises(ArtifactError, match=r"io\.num_layers must be an integer in \[1, 10000\]"):
        read_io(directory, {"io": io})


# --- generation_config.json -------------------------------------------------------------------

GENERATION_KEYS = [
    "eos_token_id",
    "pad_token_id",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
]


@FUZZ
@given(config=st.dictionaries(st.sampled_from(GENERATION_KEYS), JSON_VALUES, max_size=6), spec=JSON_VALUES)
def test_generation_configs_raise_only_artifact_errors(config: dict[str, Any], spec: Any) -> None:
    try:
        settings_ = generation_settings(config, spec)
    except ArtifactError:
        return
    settings_.defaults.validate()
    assert all(isinstance(i, int) and i >= 0 for i in settings_.eos_ids)
    assert isinstance(settings_.max_new_tokens, int) and settings_.max_new_tokens >= 1


# --- model.onnx's external data references ------------------------------------------------------


def _model_bytes() -> bytes:
    tensor = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "model.onnx.data"), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    constant = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(4, np.float32), "c"))
    graph = helper.make_graph([constant, helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [x], [tensor])
    return helper.make_model(graph).SerializeToString()


MODEL = _model_bytes()


@FUZZ
@given(data=st.data())
def test_corrupted_models_raise_only_artifact_errors(directory: Path, data: st.DataObject) -> None:
    model = bytearray(MODEL)
    for _ in range(data.draw(st.integers(1, 6))):
        model[data.draw(st.integers(0, len(model) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        model = model[: data.draw(st.integers(0, len(model)))]
    path = directory / "fuzzed.onnx"
    path.write_bytes(bytes(model))
    try:
        locations = check_external_data(path, set(FILES))
    except ArtifactError:
        return
    assert set(locations) <= set(FILES)


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bytes_as_a_model_raise_only_artifact_errors(directory: Path, data: bytes) -> None:
    path = directory / "fuzzed.onnx"
    path.write_bytes(data)
    try:
        check_external_data(path, set(FILES))
    except ArtifactError:
        pass


def test_deeply_nested_subgraphs_do_not_hit_the_recursion_limit(directory: Path) -> None:
    """Nesting is untrusted too: the walk keeps an explicit stack."""
    inner = b""
    for _ in range(5000):  # graph -> node -> attribute -> graph -> ...
        attribute = _field(6, inner)
        node = _field(5, attribute)
        inner = _field(1, node)
    path = directory / "nested.onnx"
    path.write_bytes(_field(7, inner))
    assert check_external_data(path) == []


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"do_sample": False, "temperature": "hot"}, "temperature"),
        ({"do_sample": False, "top_k": 2.5}, "top_k"),
        ({"do_sample": False, "top_p": [0.9]}, "top_p"),
        ({"do_sample": "false"}, "do_sample"),
    ],
)
def test_sampling_fields_are_checked_even_where_greedy_ignores_them(config: dict[str, Any], field: str) -> None:
    with pytest.raises(ArtifactError, match=rf"^generation_config\.json: invalid sampling defaults \({field} must"):
        generation_settings(config)


def test_valid_sampling_fields_are_ignored_when_do_sample_is_false() -> None:
    settings_ = generation_settings({"do_sample": False, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1})
    assert settings_.defaults.temperature == 0.0 and settings_.defaults.repetition_penalty == 1.1
