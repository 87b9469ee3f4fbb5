"""Run-time package: load a compiled artifact and generate text. Imports without torch.

The names below load on first use, so that importing one small module of the package
(`kvforge.runners.errors`, say, as the command line does before it has work to do) does not load
the engine, numpy and the tokenizer with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvforge.runners.engine import Engine, GenerationStats, TextStream
    from kvforge.runners.errors import KvforgeError
    from kvforge.runners.sampling import SamplingParams

__all__ = ["Engine", "GenerationStats", "KvforgeError", "SamplingParams", "TextStream"]

_HOMES = {
    "Engine": "kvforge.runners.engine",
    "GenerationStats": "kvforge.runners.engine",
    "TextStream": "kvforge.runners.engine",
    "KvforgeError": "kvforge.runners.errors",
    "SamplingParams": "kvforge.runners.sampling",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvforge.runners' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
