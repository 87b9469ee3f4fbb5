"""The sha256 of a build's input and output files, hashed on an idle core where there is one.

A build hashes every byte of the checkpoint (the manifest's `sources`) and of the artifact
(its `files`), a pass as long as the weights. Most of a build keeps one core busy (tracing
and lowering are Python), so a helper process hashes the files while the build goes on, at
idle priority (Linux's SCHED_IDLE): where other jobs keep every core busy it takes no time
from them or from the build, and whatever it has not hashed when the build asks for the
hashes, the build hashes itself. A process, not a thread: a thread would take the GIL back
after every chunk, and one descheduled while holding it stalls the build. The hashes are
the same whoever computes them.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from kvforge.runners.manifest import sha256_file

# The helper: the sha256 of each file named on its command line, one hex digest a line, in order.
_HELPER = """
import hashlib, os, sys
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    pass
buffer = memoryview(bytearray(1 << 20))
for path in sys.argv[1:]:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while size := f.readinto(buffer):
            digest.update(buffer[:size])
    print(digest.hexdigest(), flush=True)
"""
_DIGEST = re.compile(r"[0-9a-f]{64}")


def sha256_files(paths: Iterable[Path]) -> dict[str, str]:
    """File name -> sha256 of its bytes, sorted by name."""
    return {path.name: sha256_file(path) for path in sorted(paths, key=lambda p: p.name)}


class Pending:
    """Files being hashed by a helper process; `result` completes them, `cancel` drops them."""

    def __init__(self, paths: Iterable[Path]) -> None:
        self._paths = sorted(paths, key=lambda p: p.name)
        self._helper: subprocess.Popen[bytes] | None = None
        if sys.executable and self._paths:  # an app embedding Python may have no interpreter to start
            try:
                self._helper = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _HELPER, *map(str, self._paths)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,  # a file it cannot read is the build's to report, when it hashes it
                )
            except OSError:
                self._helper = None

    def result(self) -> dict[str, str]:
        """File name -> sha256, sorted by name: the helper's, and the rest hashed here."""
        done = self._stop()
        return {
            path.name: done[i] if i < len(done) and _DIGEST.fullmatch(done[i]) else sha256_file(path)
            for i, path in enumerate(self._paths)
        }

    def cancel(self) -> None:
        self._stop()

    def __enter__(self) -> Pending:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def _stop(self) -> list[str]:
        """The digests the helper finished, in order, once it has ended."""
        helper, self._helper = self._helper, None
        if helper is None:
            return []
        if helper.poll() is None:
            helper.kill()
        out, _ = helper.communicate()
        return out.decode("ascii", "replace").split("\n")[:-1]  # a line cut short by the kill has no newline
