"""The text a build calibrates on: deterministic, shipped with kvforge, never the gate's texts."""

from __future__ import annotations

import sysconfig
from pathlib import Path

_MODULES = ("heapq.py", "bisect.py", "colorsys.py", "string/__init__.py")


def calibration_text() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n".join((stdlib / name).read_text(encoding="utf-8") for name in _MODULES if (stdlib / name).exists())
