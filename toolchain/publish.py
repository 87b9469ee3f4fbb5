"""All-or-nothing artifact directories: stage beside the output, then swap into place.

A build writes into `.NAME.partial-XXXX`, a sibling of the output `NAME` on the same file
system, and holds an exclusive `flock` on it while it works. Publishing swaps the staged
directory with the previous artifact in one `renameat2(RENAME_EXCHANGE)` call, so at
every instant `NAME` is either the previous complete artifact or the new one; the
previous one, now at the staging path, is then deleted. Where the exchange is not
available (not Linux, or a file system without it), the previous artifact is first moved
to `.NAME.retired-XXXX`; if the process dies before the new one is in place, the next
build moves it back.

Whether an existing `NAME` may be replaced is decided twice: before any work
(`check_output`), so a doomed build fails at once, and again at publish time, while the
build holds an exclusive `flock` on the output's parent directory, so two builds to the
same output publish one after the other and a build without --force never replaces an
artifact another build published while it ran.

A killed build leaves only its staging directory, whose lock died with it: the next
build to the same output removes every unlocked leftover before it starts.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvforge.runners.errors import ArtifactError
from kvforge.runners.manifest import MANIFEST

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _staging_prefix(output: Path) -> str:
    return f".{output.name}.partial-"


def _retired_prefix(output: Path) -> str:
    return f".{output.name}.retired-"


def check_output(output: Path, force: bool, marker: str = MANIFEST) -> None:
    """Refuse, before any work, an output that exists without --force or is not ours to replace.

    Ours is an empty directory or one holding `marker`, the file kvforge writes last into
    that kind of output (an artifact's manifest by default).
    """
    if output.is_symlink():
        raise ArtifactError(f"{output}: is a symbolic link; refusing to write through it, choose another -o")
    if not output.exists():
        return
    if not output.is_dir() or (any(output.iterdir()) and not (output / marker).is_file()):
        # said first, so that no one is told to pass --force only to be refused again
        what = "is not a kvforge artifact" if marker == MANIFEST else f"holds no {marker}: kvforge did not write it"
        raise ArtifactError(
            f"{output}: exists and {what}; --force replaces only what kvforge wrote (or an empty directory), "
            "so it will not replace this: choose another -o"
        )
    if not force:
        raise ArtifactError(f"{output}: already exists; pass --force to replace it")


def check_writable(output: Path) -> None:
    """Refuse, before any work, an output whose directory cannot be written: a directory is
    made and removed where the staging directory will go (or in the nearest ancestor that
    exists, where the missing ones will be made), so every reason the system has is caught."""
    parent = output.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ArtifactError(f"{output}: {parent} is not a directory; choose another -o")
    try:
        os.rmdir(tempfile.mkdtemp(dir=parent, prefix=f".{output.name}.probe-"))
    except OSError as e:
        raise ArtifactError(
            f"{output}: cannot write in {parent} ({e.strerror or e}); choose another -o, or fix its permissions"
        ) from e


@contextmanager
def staged(output: Path, marker: str = MANIFEST) -> Iterator[Path]:
    """A locked, empty staging directory beside `output`; removed if the block fails."""
    output.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(output, marker)
    path = Path(tempfile.mkdtemp(dir=output.parent, prefix=_staging_prefix(output)))
    lock = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path.chmod(0o755)  # mkdtemp makes it private; the published artifact is an ordinary directory
        yield path
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        os.close(lock)


def publish(staging: Path, output: Path, marker: str = MANIFEST, *, force: bool = True) -> None:
    """Put the complete `staging` directory at `output`, atomically replacing a previous
    artifact where `force` allows it; decided and done under the lock of `output`'s parent."""
    with _publish_lock(output.parent):
        try:
            check_output(output, force=force, marker=marker)  # the output may have changed while we built
        except ArtifactError as e:
            if force or not (output / marker).is_file():
                raise
            raise ArtifactError(
                f"{output}: was published by another build while this one ran; nothing was replaced, "
                "pass --force to replace it"
            ) from e
        _swap_in(staging, output)


@contextmanager
def _publish_lock(directory: Path) -> Iterator[None]:
    """An exclusive flock on `directory`, held while an output in it is checked and swapped."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _swap_in(staging: Path, output: Path) -> None:
    if not output.exists():
        _rename_noreplace(staging, output)
        return
    if _rename2(staging, output, _RENAME_EXCHANGE):
        shutil.rmtree(staging, ignore_errors=True)  # now the previous artifact
        return
    retired = Path(tempfile.mkdtemp(dir=output.parent, prefix=_retired_prefix(output)))
    os.rename(output, retired / output.name)
    os.rename(staging, output)
    shutil.rmtree(retired, ignore_errors=True)


def clean_leftovers(output: Path, marker: str = MANIFEST) -> None:
    """Remove what killed builds left beside `output`; restore a retired artifact if `output` is gone."""
    for path in sorted(output.parent.glob(_retired_prefix(output) + "*")):
        previous = path / output.name
        if not output.exists() and (previous / marker).is_file():
            log.warning("restoring %s from an interrupted publish", output)
            os.rename(previous, output)
        shutil.rmtree(path, ignore_errors=True)
    for path in sorted(output.parent.glob(_staging_prefix(output) + "*")):
        if _unlocked(path):
            log.info("removing %s, left by an interrupted build", path)
            shutil.rmtree(path, ignore_errors=True)


def _unlocked(path: Path) -> bool:
    """True when no live build holds the directory's lock (the lock dies with its process)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _rename2(source: Path, target: Path, flags: int) -> bool:
    """renameat2(2); False where the system or file system does not offer it."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(source), _AT_FDCWD, os.fsencode(target), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(target))


def _rename_noreplace(source: Path, target: Path) -> None:
    try:
        if _rename2(source, target, _RENAME_NOREPLACE):
            return
    except FileExistsError as e:
        raise ArtifactError(f"{target}: appeared while building; rebuild with --force to replace it") from e
    os.rename(source, target)
