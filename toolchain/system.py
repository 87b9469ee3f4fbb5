"""What the build asks of the operating system: the C allocator's tuning, whole-file writes, the
user's cache directory, and why a write failed."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile
from pathlib import Path

# glibc's malloc (malloc.h): once a large block has been freed it raises its mmap threshold
# up to 32 MiB, and blocks under it then come from a heap that is returned to the system
# only from its top. A build allocates and frees weight-sized blocks stage after stage, so
# the thresholds are fixed: every block of 128 KiB or more is its own mapping, unmapped when
# freed, and a free heap top over 128 KiB is trimmed.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_RETURNED_BLOCK_BYTES = 128 << 10


def return_freed_memory() -> None:
    """Make the C allocator hand freed weight-sized blocks back to the system at once, so the
    build's peak is what it holds, not what it once held (glibc; elsewhere nothing changes;
    docs/performance.md, "Memory-bounded builds", has what it saves)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, _RETURNED_BLOCK_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _RETURNED_BLOCK_BYTES)


def write_failure(error: OSError, output: Path) -> str:
    """Why a write failed, in words. numpy's `tofile`, which writes array-backed weights, reports
    a short write without an errno ("N requested and M written"): a full disk, told as such."""
    if error.strerror:
        return error.strerror
    try:
        full = shutil.disk_usage(output.parent).free < (1 << 20)
    except OSError:
        full = False
    return os.strerror(errno.ENOSPC) if full else str(error)


def write_atomically(path: Path, data: bytes) -> None:
    """`path` holds either its previous content or all of `data`, never a part."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def user_cache() -> Path:
    """The user's cache directory, as the XDG convention has it: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))
