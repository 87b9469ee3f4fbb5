"""External data locations in model.onnx are confined to the artifact, checked before onnxruntime.

Hostile models are written with the ``onnx`` package (tests only; the runner reads the
protobuf fields itself) with a manifest that matches them, so every hash check passes and
only the location check stands between the model and onnxruntime.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

from kvforge.runners.contract import DecoderIO
from kvforge.runners.engine import Engine
from kvforge.runners.errors import ArtifactError
from kvforge.runners.external_data import check_external_data
from kvforge.runners.manifest import MANIFEST, SCHEMA_VERSION, sha256_file

IO = DecoderIO(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=8)
SECRET = np.arange(4, dtype=np.float32)


def external(name: str, location: str, *, keys: tuple[str, ...] = ("location",)) -> TensorProto:
    """A float[4] tensor whose bytes are said to live at ``location``."""
    tensor = numpy_helper.from_array(np.zeros(4, np.float32), name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key in keys:
        entry = tensor.external_data.add()
        entry.key, entry.value = key, location
    for key, value in (("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def model_with(
    initializers: list[TensorProto] = (),  # type: ignore[assignment]
    nodes: list[onnx.NodeProto] = (),  # type: ignore[assignment]
    sparse: list[onnx.SparseTensorProto] = (),  # type: ignore[assignment]
) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])
    graph = helper.make_graph(
        [*nodes, helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [x],
        [y],
        list(initializers),
        sparse_initializer=list(sparse),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def constant_node(tensor: TensorProto) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [tensor.name], value=tensor)


def if_node(branch_initializer: TensorProto) -> tuple[onnx.NodeProto, TensorProto]:
    out = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])
    branch = helper.make_graph(
        [helper.make_node("Identity", [branch_initializer.name], ["b"])], "branch", [], [out], [branch_initializer]
    )
    cond = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    return helper.make_node("If", ["cond"], ["unused"], then_branch=branch, else_branch=branch, name="if"), cond


@pytest.fixture()
def artifact(tmp_path: Path) -> Callable[..., Path]:
    """Write model.onnx (and extra files) into tmp/art with a manifest listing them all."""

    def write(model: onnx.ModelProto | bytes, files: dict[str, bytes] | None = None) -> Path:
        directory = tmp_path / "art"
        directory.mkdir(exist_ok=True)
        data = model if isinstance(model, bytes) else model.SerializeToString()
        (directory / "model.onnx").write_bytes(data)
        for name, content in (files or {}).items():
            (directory / name).write_bytes(content)
        listed = {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.name != MANIFEST}
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "files": listed,
            "io": IO.to_dict(),
            "spec": {"max_positions": 64, "vocab_size": IO.vocab_size, "num_layers": IO.num_layers},
        }
        (directory / MANIFEST).write_text(json.dumps(manifest))
        return directory

    (tmp_path / "secret.bin").write_bytes(SECRET.tobytes())
    return write


@pytest.fixture(autouse=True)
def onnxruntime_never_opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Records every model onnxruntime is asked to open; the hostile ones must never get there."""
    opened: list[str] = []
    real = onnxruntime.InferenceSession

    def recording(path: str, *args: object, **kwargs: object) -> onnxruntime.InferenceSession:
        opened.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", recording)
    yield opened


def refused(directory: Path, opened: list[str], *fragments: str) -> str:
    with pytest.raises(ArtifactError) as caught:
        Engine.load(directory)
    message = str(caught.value)
    assert str(directory / "model.onnx") in message
    for fragment in fragments:
        assert fragment in message, message
    assert opened == []
    return message


@pytest.mark.parametrize(
    "location",
    ["../secret.bin", "/etc/passwd", "sub/../../secret.bin", "..", ".", "", "a\\..\\..\\secret.bin", "C:secret.bin"],
)
def test_a_location_outside_the_directory_is_refused_naming_file_and_location(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str], location: str
) -> None:
    directory = artifact(model_with([external("w", location)]))
    refused(directory, onnxruntime_never_opens, "tensor 'w'", f"location {location!r}", "not a plain file name")


def test_an_absolute_path_to_an_existing_secret_is_refused(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str], tmp_path: Path
) -> None:
    secret = str(tmp_path / "secret.bin")
    directory = artifact(model_with([external("w", secret)]))
    refused(directory, onnxruntime_never_opens, f"location {secret!r}")


def test_a_symlink_escaping_the_directory_is_refused(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str], tmp_path: Path
) -> None:
    directory = artifact(model_with([external("w", "weights.bin")]), {"weights.bin": SECRET.tobytes()})
    (directory / "weights.bin").unlink()
    os.symlink(tmp_path / "secret.bin", directory / "weights.bin")  # same bytes, so the hash still matches
    with pytest.raises(ArtifactError, match=r"art/weights\.bin: listed in manifest\.json but missing or not a plain"):
        Engine.load(directory)  # the manifest check refuses the link first ...
    with pytest.raises(
        ArtifactError, match=r"model\.onnx: tensor 'w' .* location 'weights\.bin', which is missing or not"
    ):
        check_external_data(directory / "model.onnx")  # ... and the location check on its own would too
    assert onnxruntime_never_opens == []


def test_a_location_not_listed_in_the_manifest_is_refused(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str]
) -> None:
    directory = artifact(model_with([external("w", "elsewhere.bin")]))
    refused(directory, onnxruntime_never_opens, "location 'elsewhere.bin'", "not a file listed in the manifest")


@pytest.mark.parametrize(
    "where",
    ["constant attribute", "subgraph initializer", "sparse initializer", "second external tensor"],
)
def test_locations_are_found_wherever_a_tensor_can_be(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str], where: str
) -> None:
    good = external("ok", "weights.bin")
    bad = external("w", "../secret.bin")
    if where == "constant attribute":
        model = model_with([good], nodes=[constant_node(bad)])
    elif where == "subgraph initializer":
        node, cond = if_node(bad)
        model = model_with([good, cond], nodes=[node])
    elif where == "sparse initializer":
        indices = numpy_helper.from_array(np.array([0, 1], np.int64), "w_indices")
        model = model_with([good], sparse=[helper.make_sparse_tensor(bad, indices, [8])])
    else:
        model = model_with([good, bad])
    directory = artifact(model, {"weights.bin": SECRET.tobytes()})
    refused(directory, onnxruntime_never_opens, "tensor 'w'", "location '../secret.bin'")


def test_a_tensor_naming_two_locations_is_refused(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str]
) -> None:
    tensor = external("w", "weights.bin", keys=("location", "location"))
    directory = artifact(model_with([tensor]), {"weights.bin": SECRET.tobytes()})
    refused(directory, onnxruntime_never_opens, "names its external data location twice")


def test_a_model_that_is_not_protobuf_is_refused_before_onnxruntime(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str]
) -> None:
    data = model_with([external("w", "weights.bin")]).SerializeToString()
    directory = artifact(data[: len(data) // 2], {"weights.bin": SECRET.tobytes()})
    refused(directory, onnxruntime_never_opens, "not a valid ONNX model")


def test_a_location_inside_the_directory_passes_the_check(
    artifact: Callable[..., Path], onnxruntime_never_opens: list[str]
) -> None:
    node, cond = if_node(external("sub", "weights.bin"))
    model = model_with([external("w", "weights.bin"), cond], nodes=[node, constant_node(external("k", "more.bin"))])
    directory = artifact(model, {"weights.bin": SECRET.tobytes(), "more.bin": SECRET.tobytes()})
    assert check_external_data(directory / "model.onnx", {"weights.bin", "more.bin"}) == ["more.bin", "weights.bin"]
    # Engine.load gets past the check: onnxruntime opens the model, whose I/O is not a decoder's.
    with pytest.raises(ArtifactError, match="does not match the manifest's contract"):
        Engine.load(directory)
    assert onnxruntime_never_opens == [str(directory / "model.onnx")]


def test_without_a_manifest_any_plain_file_beside_the_model_passes(tmp_path: Path) -> None:
    """OrtSession used on its own (the build's staging directory) still confines locations."""
    model = model_with([numpy_helper.from_array(SECRET, "inline")], nodes=[constant_node(external("c", "x.bin"))])
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    (tmp_path / "x.bin").write_bytes(SECRET.tobytes())
    assert check_external_data(path) == ["x.bin"]
    onnx.save(model_with([external("w", "../x.bin")]), path)
    with pytest.raises(ArtifactError, match="location '../x.bin', which is not a plain file name"):
        check_external_data(path)
