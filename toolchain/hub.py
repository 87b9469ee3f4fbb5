"""Hugging Face Hub ids resolved from the local cache, never downloaded.

`locate` turns what the user typed into a checkpoint directory: a path that exists is
used as it is; otherwise an id such as `Qwen/Qwen3-8B` (with an optional revision: a
branch, a tag or a commit) is looked up in the local cache through huggingface_hub's own
resolution with `local_files_only=True`, which answers from the cache or fails. The cache
is the one huggingface_hub itself would use: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
`~/.cache/huggingface/hub`, read when called.

`snapshot_of` recognizes a cache snapshot directory by its layout
(`<cache>/models--ORG--NAME/snapshots/<commit>`), whichever way it was reached: its files
are links into the repository's `blobs/`, the one place such a link may lead
(`kvforge.toolchain.checkpoint`), and its id and commit go into the manifest.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.runners.errors import CheckpointError
from kvforge.toolchain.system import user_cache

_REPO_PREFIX = "models--"
# ORG/NAME as the Hub spells it: letters, digits, '-', '_', '.'; neither part starts with '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


@dataclass(frozen=True)
class HubSnapshot:
    """A snapshot directory of the Hugging Face cache."""

    repo_id: str  # ORG/NAME
    commit: str  # the snapshot folder's name: the commit its files are from
    blobs: Path  # the repository's blobs/ folder, where the snapshot's links lead

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.repo_id, "commit": self.commit}


def cache_dir() -> Path:
    """The cache huggingface_hub reads, from the environment as it is now."""
    hub_cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if hub_cache:
        return Path(os.path.expandvars(hub_cache)).expanduser()
    home = os.environ.get("HF_HOME") or str(user_cache() / "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def is_repo_id(text: str) -> bool:
    """ORG/NAME, as the Hub validates it ('--' and '..' are not allowed)."""
    return bool(_REPO_ID.fullmatch(text)) and "--" not in text and ".." not in text and not text.endswith(".git")


def locate(source: str | Path, revision: str | None = None) -> Path:
    """The checkpoint directory `source` names: a local path wins over a Hub id.

    An id missing from the cache, or present without `revision`, is a CheckpointError that
    names the cache searched and the `hf download` command that fetches it.
    """
    text = os.fspath(source)
    given = Path(text).expanduser()
    if given.exists() or os.path.lexists(given):
        if revision is not None:
            raise CheckpointError(
                f"{given}: is a local directory; --revision selects a revision of a Hub id (ORG/NAME) only, drop it"
            )
        return given
    if not is_repo_id(text):
        if revision is not None:
            raise CheckpointError(f"{text}: no such directory, and not a Hub id (ORG/NAME) that --revision applies to")
        return given  # the loader reports the missing directory
    return _cached_snapshot(text, revision)


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = cache_dir()
    fetch = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    try:
        found = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except HFValidationError as e:
        raise CheckpointError(f"{repo_id}: not a valid Hub id ({e}); pass ORG/NAME or a checkpoint directory") from e
    except LocalEntryNotFoundError as e:  # no such model or revision, or a snapshot the cache lists as incomplete
        repo = cache / (_REPO_PREFIX + repo_id.replace("/", "--"))
        if not repo.is_dir():
            what = f"no such directory, and the Hugging Face cache {cache} has no model {repo_id}"
        elif _snapshot_folder(repo, revision or "main") is not None:
            what = f"the cached snapshot in {cache} is incomplete ({_first_sentence(e)})"
        else:
            revisions = ", ".join(_known_revisions(repo)) or "none"
            what = (
                f"revision {revision or 'main'} is not in the Hugging Face cache {cache} "
                f"(cached revisions: {revisions})"
            )
        raise CheckpointError(
            f"{repo_id}: {what}; kvforge never downloads: fetch it with {fetch} "
            "(or set HF_HUB_CACHE / HF_HOME to the cache that holds it)"
        ) from e
    except OSError as e:  # an unreadable cache
        raise CheckpointError(f"{repo_id}: the Hugging Face cache {cache} cannot be read ({e}); check it") from e
    return Path(found)


def _snapshot_folder(repo: Path, revision: str) -> Path | None:
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    folder = repo / "snapshots" / commit
    return folder if folder.is_dir() else None


def _first_sentence(error: Exception) -> str:
    return str(error).split(". ")[0].strip()[:300]


def _known_revisions(repo: Path) -> list[str]:
    refs = repo / "refs"
    names = sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []
    snapshots = repo / "snapshots"
    commits = sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []
    return names + [c[:12] for c in commits]


def snapshot_of(directory: Path) -> HubSnapshot | None:
    """The cache snapshot `directory` (resolved) is, judged by its layout; None for any other folder."""
    snapshots = directory.parent
    repo = snapshots.parent
    if snapshots.name != "snapshots" or not repo.name.startswith(_REPO_PREFIX):
        return None
    owner, _, name = repo.name[len(_REPO_PREFIX) :].partition("--")
    repo_id = f"{owner}/{name}" if name else owner
    return HubSnapshot(repo_id=repo_id, commit=directory.name, blobs=repo / "blobs")
