"""The one exception root of kvforge and the failures every layer can raise.

Messages name the file, field, tensor or value at fault and say what to do; the CLI
prints them as one line and exits with status 2 (3 where a verification gate refused).
"""

from __future__ import annotations

from typing import Any


class KvforgeError(Exception):
    """Root of every error kvforge raises on purpose."""


class CheckpointError(KvforgeError):
    """A checkpoint directory or one of its files is missing, malformed or unsafe."""


class UnsupportedModelError(KvforgeError):
    """The checkpoint's architecture or one of its settings is not supported."""


class ExportError(KvforgeError):
    """Tracing or lowering the decoder failed."""


class ParityError(KvforgeError):
    """The compiled model does not match the eager model within tolerance.

    `report` holds the refusing gate's figures (its report's `to_dict()`); None where the gate
    could not run (its inputs were refused).
    """

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report


class ArtifactError(KvforgeError):
    """An artifact directory is missing, incomplete, tampered with or cannot be written."""


class GenerationError(KvforgeError):
    """A generation request is invalid (too long, bad sampling values, ...)."""
