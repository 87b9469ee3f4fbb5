"""Where an ONNX model's tensors say their bytes live, checked before onnxruntime opens it.

A tensor stored as external data names a file by its ``location``, which onnxruntime
resolves against the model's directory. In an untrusted model that location could be
``../../home/me/.ssh/id_rsa``, ``/etc/passwd`` or a symlink out of the directory, and the
bytes read from there would flow into the outputs. Recent onnxruntime releases validate
these paths themselves (microsoft/onnxruntime#26776 and follow-ups), but older releases
that kvforge supports do not, so the runner checks on its own and more strictly: every
location must be a plain file name (no directory part, no ``..``) of a regular file in the
model's directory, not a symlink, and, when the caller knows the artifact's files, one of
them.

The runner must not need the ``onnx`` package, so the few protobuf fields involved are
read here from the wire format. Every message that can hold a TensorProto is walked
(graph initializers, sparse initializers, node attributes, subgraphs, functions, training
graphs), and every occurrence of a field is visited, because protobuf merges repeated
occurrences of a message field; so no tensor the runtime would see is skipped.
"""

from __future__ import annotations

from collections.abc import Iterator, Set
from pathlib import Path

from kvforge.runners.errors import ArtifactError
from kvforge.runners.manifest import is_plain_file_name

# Field numbers from onnx.proto, by message. Only length-delimited (wire type 2) fields.
_MODEL = {7: "graph", 20: "training", 25: "function"}  # ModelProto
_TRAINING = {1: "graph", 2: "graph"}  # TrainingInfoProto: initialization, algorithm
_FUNCTION = {7: "node", 11: "attribute"}  # FunctionProto: node, attribute_proto
_GRAPH = {1: "node", 5: "tensor", 15: "sparse"}  # GraphProto: node, initializer, sparse_initializer
_NODE = {5: "attribute"}  # NodeProto
_ATTRIBUTE = {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"}  # t, g, tensors, ...
_SPARSE = {1: "tensor", 2: "tensor"}  # SparseTensorProto: values, indices
_CHILDREN = {
    "model": _MODEL,
    "training": _TRAINING,
    "function": _FUNCTION,
    "graph": _GRAPH,
    "node": _NODE,
    "attribute": _ATTRIBUTE,
    "sparse": _SPARSE,
}
_TENSOR_EXTERNAL_DATA = 13  # TensorProto.external_data: repeated StringStringEntryProto
_TENSOR_NAME = 8
_ENTRY_KEY, _ENTRY_VALUE = 1, 2


class _Malformed(Exception):
    """The bytes are not a protobuf message; turned into an ArtifactError by the caller."""


def check_external_data(model_path: Path, allowed: Set[str] | None = None) -> list[str]:
    """Refuse a model whose external data lies outside its directory; return the locations.

    ``allowed``, when given, is the set of file names the artifact's manifest lists (and
    that were verified against their hashes): a location must be one of them.
    """
    try:
        data = model_path.read_bytes()
    except OSError as e:
        raise ArtifactError(f"{model_path}: cannot be read ({e.strerror or e}); rebuild the artifact") from e
    try:
        references = list(_external_references(data))
    except _Malformed as e:
        raise ArtifactError(f"{model_path}: not a valid ONNX model ({e}); rebuild the artifact") from e
    locations: set[str] = set()
    for tensor, location in references:
        locations.add(_check_location(model_path, tensor, location, allowed))
    return sorted(locations)


def _check_location(model_path: Path, tensor: str, location: str | None, allowed: Set[str] | None) -> str:
    where = f"{model_path}: tensor {tensor!r} has external data"
    hint = "the artifact was tampered with or not built by kvforge; rebuild it"
    if location is None:
        raise ArtifactError(f"{where} without a location; {hint}")
    if not is_plain_file_name(location):
        raise ArtifactError(
            f"{where} at location {location!r}, which is not a plain file name in the model's directory "
            f"(no directories, '..' or absolute paths are allowed); {hint}"
        )
    if allowed is not None and location not in allowed:
        raise ArtifactError(f"{where} at location {location!r}, which is not a file listed in the manifest; {hint}")
    path = model_path.parent / location
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"{where} at location {location!r}, which is missing or not a plain file; {hint}")
    return location


def _external_references(data: bytes) -> Iterator[tuple[str, str | None]]:
    """(tensor name, location) of every tensor with external data entries, at any depth.

    A tensor is reported when it has any ``external_data`` entry, whatever its
    ``data_location`` says: checking more tensors than the runtime reads is safe.
    """
    view = memoryview(data)
    stack: list[tuple[str, memoryview]] = [("model", view)]  # explicit stack: nesting depth is untrusted
    while stack:
        kind, message = stack.pop()
        if kind == "tensor":
            reference = _tensor_reference(message)
            if reference is not None:
                yield reference
            continue
        children = _CHILDREN[kind]
        for number, payload in _length_delimited_fields(message):
            child = children.get(number)
            if child is not None:
                stack.append((child, payload))


def _tensor_reference(tensor: memoryview) -> tuple[str, str | None] | None:
    name = ""
    entries = 0
    location: str | None = None
    for number, payload in _length_delimited_fields(tensor):
        if number == _TENSOR_NAME:
            name = _text(payload)
        elif number == _TENSOR_EXTERNAL_DATA:
            entries += 1
            key, value = _entry(payload)
            if key == "location":
                if location is not None:
                    raise _Malformed(f"tensor {name!r} names its external data location twice")
                location = value
    return (name, location) if entries else None


def _entry(payload: memoryview) -> tuple[str, str]:
    """A StringStringEntryProto; a repeated scalar field keeps its last value, as protobuf does."""
    key = value = ""
    for number, field in _length_delimited_fields(payload):
        if number == _ENTRY_KEY:
            key = _text(field)
        elif number == _ENTRY_VALUE:
            value = _text(field)
    return key, value


def _text(payload: memoryview) -> str:
    try:
        return bytes(payload).decode("utf-8")
    except UnicodeDecodeError as e:
        raise _Malformed(f"a string field is not UTF-8 ({e})") from e


def _length_delimited_fields(message: memoryview) -> Iterator[tuple[int, memoryview]]:
    """(field number, payload) of each length-delimited field; other fields are skipped.

    A field of another wire type under a known number is skipped too, as protobuf treats
    it as an unknown field. Groups (wire types 3 and 4) are refused: ONNX never uses them.
    """
    position, end = 0, len(message)
    while position < end:
        tag, position = _varint(message, position)
        number, wire_type = tag >> 3, tag & 7
        if number == 0:
            raise _Malformed("field number 0")
        if wire_type == 0:
            _, position = _varint(message, position)
        elif wire_type == 1:
            position += 8
        elif wire_type == 5:
            position += 4
        elif wire_type == 2:
            length, position = _varint(message, position)
            if length > end - position:
                raise _Malformed("a field runs past the end of its message")
            yield number, message[position : position + length]
            position += length
        else:
            raise _Malformed(f"unsupported wire type {wire_type}")
        if position > end:
            raise _Malformed("a field runs past the end of its message")


def _varint(message: memoryview, position: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if position >= len(message) or shift > 63:
            raise _Malformed("a truncated or overlong varint")
        byte = message[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7
