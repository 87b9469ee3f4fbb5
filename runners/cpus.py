"""How many CPUs this process may use: what sizes onnxruntime's and the file hashers' thread pools."""

from __future__ import annotations

import os


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask where the OS has one, which a container's
    cpuset narrows (onnxruntime's own default counts the host's cores and would oversubscribe)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1
