"""kvforge: compile Hugging Face decoder-only models to verified ONNX artifacts, and run them.

The public API, imported from here and nowhere deeper:

- the runtime (no torch): `Engine`, `TextStream`, `GenerationStats`, `SamplingParams`,
  `KvforgeError`, and the server's entry, `serve` with its `ServeOptions`;
- the compiler (`pip install 'kvforge[build]'`): `build`, `BuildOptions`, `BuildResult`.

Each name loads its module on first use, so `from kvforge import Engine` imports neither
torch nor the compiler. Everything under `kvforge.toolchain`, `kvforge.passes` and
`kvforge.runners` is internal and may change between releases.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvforge.runners.engine import Engine, GenerationStats, TextStream
    from kvforge.runners.errors import KvforgeError
    from kvforge.runners.sampling import SamplingParams
    from kvforge.runners.serve.server import ServeOptions, serve
    from kvforge.toolchain.build import BuildOptions, BuildResult, build

__all__ = [
    "BuildOptions",
    "BuildResult",
    "Engine",
    "GenerationStats",
    "KvforgeError",
    "SamplingParams",
    "ServeOptions",
    "TextStream",
    "build",
    "serve",
]

_HOMES = {
    "Engine": "kvforge.runners.engine",
    "GenerationStats": "kvforge.runners.engine",
    "TextStream": "kvforge.runners.engine",
    "KvforgeError": "kvforge.runners.errors",
    "SamplingParams": "kvforge.runners.sampling",
    "ServeOptions": "kvforge.runners.serve.server",
    "serve": "kvforge.runners.serve.server",
    "BuildOptions": "kvforge.toolchain.build",
    "BuildResult": "kvforge.toolchain.build",
    "build": "kvforge.toolchain.build",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvforge' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
