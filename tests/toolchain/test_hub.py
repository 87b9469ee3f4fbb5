"""Hub ids resolved from a Hugging Face cache laid out in the test, and the snapshot link rule."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvforge.runners.errors import CheckpointError
from kvforge.toolchain import hub, safetensors_check
from kvforge.toolchain.checkpoint import load

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
REPO = "tiny-org/tiny-llama"


def hub_snapshot(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str | None = "main") -> Path:
    """`source`'s files as huggingface_hub stores a download: each in blobs/ under its hash, and
    linked from snapshots/<commit>/ by a relative link; refs/<ref> holds the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blobs / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # as huggingface_hub writes it: no newline
    return snapshot


def sharded_copy(source: Path, target: Path) -> Path:
    """`source` with its single safetensors file split into two shards and an index."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    (target / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(target / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys, shard)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache named by HF_HUB_CACHE; HF_HOME points elsewhere, to show which one wins."""
    path = tmp_path / "hub-cache"
    path.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "unused-home"))
    monkeypatch.chdir(tmp_path)  # no relative path named like the id
    return path


@pytest.fixture(autouse=True)
def no_hub_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any request to the Hub fails the test: resolution is from the cache only."""
    import huggingface_hub

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Hub request was made")

    for name in ("repo_info", "model_info", "list_repo_tree", "list_repo_files"):
        monkeypatch.setattr(huggingface_hub.HfApi, name, refuse)


def tensors_of(directory: Path | str, **kwargs: str) -> dict[str, torch.Tensor]:
    return load(directory, **kwargs).state_dict()


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_id_resolves_to_its_cached_snapshot_through_hf_hub_cache(
    cache: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    snapshot = hub_snapshot(cache, REPO, tiny_checkpoint("llama"))
    checkpoint = load(REPO)
    assert checkpoint.path == snapshot.resolve()
    assert checkpoint.hub is not None and checkpoint.hub.to_dict() == {"id": REPO, "commit": COMMIT}
    assert all(f.is_symlink() for f in checkpoint.input_files())
    assert same_tensors(checkpoint.state_dict(), tensors_of(tiny_checkpoint("llama")))
    assert checkpoint.source_hashes() == load(tiny_checkpoint("llama")).source_hashes()


def test_a_sharded_snapshot_resolves_through_hf_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Callable[..., Path]
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    sharded = sharded_copy(tiny_checkpoint("llama"), tmp_path / "sharded")
    hub_snapshot(tmp_path / "home" / "hub", REPO, sharded)
    checkpoint = load(REPO)
    assert checkpoint.index_file is not None and len(checkpoint.weight_files) == 2
    assert all(f.is_symlink() for f in checkpoint.weight_files)
    assert same_tensors(checkpoint.state_dict(), tensors_of(tiny_checkpoint("llama")))


def test_the_default_cache_is_under_the_home_directory(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hub.cache_dir() == tmp_path / ".cache" / "huggingface" / "hub"


def test_a_revision_is_a_ref_or_a_commit(cache: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    hub_snapshot(cache, REPO, tiny_checkpoint("llama"))
    hub_snapshot(cache, REPO, tiny_checkpoint("qwen2"), commit=OTHER_COMMIT, ref="v2")
    assert load(REPO).config["model_type"] == "llama"
    by_ref = load(REPO, revision="v2")
    assert by_ref.config["model_type"] == "qwen2" and by_ref.hub is not None and by_ref.hub.commit == OTHER_COMMIT
    assert load(REPO, revision=COMMIT).config["model_type"] == "llama"


def test_a_missing_model_names_the_cache_and_the_download_command(cache: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        load("someone/absent")
    text = str(exc.value)
    assert str(cache) in text and "`hf download someone/absent`" in text and "no model someone/absent" in text


def test_a_missing_revision_names_the_revisions_the_cache_has(
    cache: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    hub_snapshot(cache, REPO, tiny_checkpoint("llama"))
    with pytest.raises(CheckpointError) as exc:
        load(REPO, revision="v9")
    text = str(exc.value)
    assert "revision v9" in text and str(cache) in text and f"`hf download {REPO} --revision v9`" in text
    assert "main" in text and COMMIT[:12] in text


def test_a_local_path_wins_over_an_id(cache: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    hub_snapshot(cache, REPO, tiny_checkpoint("qwen2"))
    shutil.copytree(tiny_checkpoint("llama"), Path(REPO))  # ./tiny-org/tiny-llama, relative to the cwd
    checkpoint = load(REPO)
    assert checkpoint.config["model_type"] == "llama" and checkpoint.hub is None
    with pytest.raises(CheckpointError, match="--revision selects a revision of a Hub id"):
        load(REPO, revision="main")


def test_the_snapshot_directory_given_as_a_path_is_the_same_checkpoint(
    cache: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    snapshot = hub_snapshot(cache, REPO, tiny_checkpoint("llama"))
    checkpoint = load(snapshot)
    assert checkpoint.hub is not None and checkpoint.hub.to_dict() == {"id": REPO, "commit": COMMIT}


def test_a_plain_file_in_a_snapshot_is_read_as_it_is(cache: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    snapshot = hub_snapshot(cache, REPO, tiny_checkpoint("llama"))
    (snapshot / "config.json").unlink()
    shutil.copyfile(tiny_checkpoint("llama") / "config.json", snapshot / "config.json")
    assert load(REPO).config["model_type"] == "llama"


# --- links that leave the repository's blobs are refused, naming the file ------------------

ESCAPES = ["outside-the-cache", "another-repository", "dangling"]


def plant(snapshot: Path, name: str, how: str, cache: Path, elsewhere: Path) -> None:
    """Replace the snapshot's link `name` by one that leads where it must not."""
    link = snapshot / name
    content = link.read_bytes()
    link.unlink()
    if how == "outside-the-cache":
        target = elsewhere / name
        target.write_bytes(content)
        link.symlink_to(target)
    elif how == "another-repository":  # a relative link into a sibling repository's blobs
        blobs = cache / "models--other--repo" / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        (blobs / "x").write_bytes(content)
        link.symlink_to(Path("..", "..", "..", "models--other--repo", "blobs", "x"))
    else:
        link.symlink_to(Path("..", "..", "blobs", "0" * 64))


@pytest.mark.parametrize("how", ESCAPES)
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"])
def test_a_single_file_snapshot_link_out_of_its_blobs_is_refused(
    how: str,
    name: str,
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[..., Path],
) -> None:
    snapshot = hub_snapshot(cache, REPO, tiny_checkpoint("llama"))
    (tmp_path / "elsewhere").mkdir()
    plant(snapshot, name, how, cache, tmp_path / "elsewhere")
    opened: list[Path] = []
    monkeypatch.setattr(safetensors_check, "read_header", lambda file: opened.append(file))
    with pytest.raises(CheckpointError) as exc:
        load(REPO)
    text = str(exc.value)
    assert str(snapshot / name) in text.replace(str(snapshot.resolve()), str(snapshot))
    assert ("outside" in text) if how != "dangling" else ("does not exist" in text)
    assert f"hf download {REPO}" in text and opened == []


@pytest.mark.parametrize("how", ESCAPES)
def test_a_sharded_snapshot_link_out_of_its_blobs_is_refused(
    how: str,
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[..., Path],
) -> None:
    snapshot = hub_snapshot(cache, REPO, sharded_copy(tiny_checkpoint("llama"), tmp_path / "sharded"))
    (tmp_path / "elsewhere").mkdir()
    plant(snapshot, "model-00002-of-00002.safetensors", how, cache, tmp_path / "elsewhere")
    opened: list[Path] = []
    monkeypatch.setattr(safetensors_check, "read_header", lambda file: opened.append(file))
    with pytest.raises(CheckpointError) as exc:
        load(REPO)
    text = str(exc.value)
    assert "model.safetensors.index.json" in text and "'model-00002-of-00002.safetensors'" in text
    assert ("outside" in text) if how != "dangling" else ("does not exist" in text)
    assert opened == []


def test_a_blobs_folder_on_another_disk_is_followed(
    cache: Path, tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """The repository's own blobs/ may itself be a link (a cache spread over disks)."""
    snapshot = hub_snapshot(cache, REPO, tiny_checkpoint("llama"))
    blobs = snapshot.parent.parent / "blobs"
    shutil.move(blobs, tmp_path / "big-disk-blobs")
    os.symlink(tmp_path / "big-disk-blobs", blobs)
    assert load(REPO).config["model_type"] == "llama"


# --- a build by id ----------------------------------------------------------------------


@pytest.mark.slow
def test_kvforge_build_by_id_and_revision_records_them_and_shows_progress(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tiny_checkpoint: Callable[..., Path],
    built_artifact: Callable[..., Path],
) -> None:
    """A sharded snapshot found through HF_HOME, at a tag: the same graph as the plain directory
    gives, and the manifest names the id and the commit. Not a terminal: progress as lines."""
    from click.testing import CliRunner

    from kvforge.cli import main

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "home" / "hub"
    hub_snapshot(cache, REPO, tiny_checkpoint("qwen2"))  # main: another model
    hub_snapshot(cache, REPO, sharded_copy(tiny_checkpoint("llama"), tmp_path / "sharded"), OTHER_COMMIT, "v2")
    result = CliRunner().invoke(main, ["build", REPO, "--revision", "v2", "-o", "out"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["hub"] == {"id": REPO, "commit": OTHER_COMMIT}
    assert manifest["spec"]["model_type"] == "llama"
    plain = json.loads((built_artifact("llama") / "manifest.json").read_text())
    assert manifest["files"] == plain["files"] and "hub" not in plain
    assert "model.safetensors.index.json" in manifest["sources"]
    lines = result.stderr.splitlines()
    for stage in ("load", "export", "lower", "passes", "emit", "verify", "publish"):
        assert f"kvforge: {stage}..." in lines
        assert any(line.startswith(f"kvforge: {stage} done in ") for line in lines)
    tensors = len(load(tiny_checkpoint("llama")).tensor_metadata())
    assert any(line.endswith(f"({tensors}/{tensors} tensors)") for line in lines)
    assert any(line.startswith("kvforge: passes done in ") and line.endswith(" passes)") for line in lines)
    assert any(line.startswith("kvforge: verify done in ") and line.endswith(" steps)") for line in lines)
    assert "\r" not in result.stderr
