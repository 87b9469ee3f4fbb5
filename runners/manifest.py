"""Reading an artifact's manifest and checking its files against it.

The manifest is written last by the build, so a directory without one is incomplete.
The runner refuses an artifact whose files do not hash to what the manifest records.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from runners.errors import ArtifactError

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(
            f"{directory}: not an artifact directory; build one with `kvforge build CHECKPOINT -o {directory}`"
        )
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; the artifact is incomplete, rebuild it with `kvforge build`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: not valid JSON ({e}); rebuild the artifact") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: expected a JSON object; rebuild the artifact")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path}: schema_version {version!r} is not supported (expected {SCHEMA_VERSION}); "
            "rebuild the artifact with this kvforge version"
        )
    return manifest


def verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Every file in the directory is listed with the right hash, and nothing else is there."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise ArtifactError(f"{directory / MANIFEST}: field files is missing or empty; rebuild the artifact")
    present = {p.name for p in directory.iterdir()} - {MANIFEST}
    for extra in sorted(present - set(files)):
        raise ArtifactError(f"{directory / extra}: not listed in {MANIFEST}; remove it or rebuild the artifact")
    for name, expected in sorted(files.items()):
        path = directory / name
        if Path(name).name != name or not path.is_file() or path.is_symlink():
            raise ArtifactError(f"{path}: listed in {MANIFEST} but missing or not a plain file; rebuild the artifact")
        if sha256_file(path) != expected:
            raise ArtifactError(
                f"{path}: sha256 does not match {MANIFEST}; the file was modified, rebuild the artifact"
            )
