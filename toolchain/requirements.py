"""The oldest release of each library the toolchain is tested with, checked when it is imported.

An older release fails deep inside a build (a keyword argument its API lacks, a graph it
lowers differently); this check turns that into one line naming the package and the
release needed. The bounds are pyproject's (a test keeps the two equal).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

from kvforge.runners.errors import KvforgeError
from kvforge.runners.manifest import release

MINIMUM = {
    "torch": "2.13",
    "transformers": "5.25",
    "onnx": "1.18",
    "onnx-ir": "1.0",
    "onnxscript": "0.7.2",
    "onnxruntime": "1.23",
}
# onnxruntime's GPU build is another distribution of the same module.
_ALTERNATIVES = {"onnxruntime": ("onnxruntime", "onnxruntime-gpu")}


class DependencyError(KvforgeError, ImportError):
    """A library the toolchain needs is missing or older than the release it is tested with."""


def check_versions(version: Callable[[str], str] = metadata.version) -> None:
    """Raise DependencyError for the first library installed at a release older than MINIMUM.

    A library that is not installed passes: the runtime install (`pip install kvforge`) leaves
    the compiler's out, and `generate` and `serve` run without them; a command that needs one
    says in one line to install kvforge[build] when it imports it (`kvforge.toolchain.cli`)."""
    for package, minimum in MINIMUM.items():
        installed = _installed(package, version)
        if installed is None:
            continue
        if release(installed) < release(minimum):
            raise DependencyError(
                f"{package} {installed} is installed; kvforge needs {package}>={minimum} "
                f"(pip install '{package}>={minimum}')"
            )


# The onnxruntime release whose GroupQueryAttention takes `query_seqlens`, which a graph that
# rotates q and k inside it needs (kvforge.passes.fuse_attention.RotaryInAttention)
ROTARY_IN_ATTENTION = "1.32"


def installed_at_least(package: str, minimum: str, version: Callable[[str], str] = metadata.version) -> bool:
    """Whether `package` (either distribution of onnxruntime) is installed at `minimum` or later."""
    installed = _installed(package, version)
    return installed is not None and release(installed) >= release(minimum)


def _installed(package: str, version: Callable[[str], str]) -> str | None:
    for name in _ALTERNATIVES.get(package, (package,)):
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
