"""Writing manifest.json, the last file of every artifact.

It records what went in (source hashes, flags, tool versions), what the graph is (spec,
I/O contract), how it was checked (parity report) and the sha256 of every file.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from kvforge.runners.contract import DecoderIO
from kvforge.runners.manifest import MANIFEST, SCHEMA_VERSION, sha256_file
from kvforge.toolchain.emit import write_json
from kvforge.toolchain.hub import HubSnapshot
from kvforge.toolchain.spec import DecoderSpec

_TOOLS = (
    "kvforge",
    "torch",
    "transformers",
    "onnx",
    "onnx-ir",
    "onnxscript",
    "onnxruntime",
    "safetensors",
    "tokenizers",
)


def tool_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _TOOLS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def write(
    directory: Path,
    *,
    spec: DecoderSpec,
    io: DecoderIO,
    sources: Mapping[str, str],
    flags: Mapping[str, Any],
    passes: Mapping[str, Any],
    parity: Mapping[str, Any],
    hub: HubSnapshot | None = None,
    experts: Mapping[str, int] | None = None,
    kernels: Mapping[str, Any] | None = None,
    file_hashes: Mapping[str, str] | None = None,
    imported: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """`hub`: the Hugging Face cache snapshot the checkpoint was, recorded as `hub` (id and commit).
    `experts`: a mixture of experts' routed experts, experts per token and their weight bytes.
    `kernels`: the MatMulNBits forms `kvforge build --tune` chose (`kvforge.toolchain.tune.kernels_entry`).
    `imported`: a pre-quantized checkpoint's weights and the form each was imported in
    (`kvforge.toolchain.prequantized.manifest_entry`), recorded as `imported_weights`.
    `file_hashes`: the sha256 of files of `directory` already hashed since they were written,
    by name; every other file is hashed here."""
    known = file_hashes or {}
    files = {
        p.name: known[p.name] if p.name in known else sha256_file(p)
        for p in sorted(directory.iterdir())
        if p.name != MANIFEST
    }
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "target": flags["target"],
        "flags": dict(flags),
        "sources": dict(sources),
        **({"hub": hub.to_dict()} if hub is not None else {}),
        "tools": tool_versions(),
        "spec": spec.to_dict(),
        "io": io.to_dict(),
        "passes": dict(passes),
        "parity": dict(parity),
        **({"experts": dict(experts)} if experts is not None else {}),
        **({"kernels": dict(kernels)} if kernels is not None else {}),
        **({"imported_weights": dict(imported)} if imported is not None else {}),
        "files": files,
    }
    write_json(directory / MANIFEST, manifest)
    return manifest
