"""All-or-nothing publishing: killed builds, full disks, planted links, reproducible bytes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvforge import BuildOptions, build
from kvforge.runners.errors import ArtifactError
from kvforge.toolchain import publish as publish_module
from kvforge.toolchain.publish import check_output, clean_leftovers, publish, staged

ROOT = Path(__file__).resolve().parents[2]


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def fake_artifact(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "manifest.json").write_text("{}")
    (path / "model.onnx").write_text(content)
    return path


# --- the publishing mechanism, on plain directories --------------------------------------


def test_staged_directory_is_published_and_nothing_else_is_left(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged(out) as staging:
        (staging / "manifest.json").write_text("{}")
        assert staging.parent == tmp_path and staging.name.startswith(".out.partial-")
        publish(staging, out)
    assert tree_bytes(out) == {"manifest.json": b"{}"}
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "two-renames"])
def test_previous_artifact_is_replaced_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool) -> None:
    if not exchange:
        monkeypatch.setattr(publish_module, "_rename2", lambda *a: False)
    out = fake_artifact(tmp_path / "out", "old")
    with staged(out) as staging:
        (staging / "manifest.json").write_text("{}")
        (staging / "model.onnx").write_text("new")
        publish(staging, out)
    assert (out / "model.onnx").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failure_inside_staging_removes_it_and_keeps_the_previous(tmp_path: Path) -> None:
    out = fake_artifact(tmp_path / "out", "old")
    with pytest.raises(RuntimeError), staged(out) as staging:
        (staging / "model.onnx").write_text("half")
        raise RuntimeError("gate failed")
    assert (out / "model.onnx").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_leftovers_of_dead_builds_are_removed_but_live_ones_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dead = tmp_path / ".out.partial-dead"
    live = tmp_path / ".out.partial-live"
    other = tmp_path / ".other.partial-x"  # another output's staging: not ours to touch
    for d in (dead, live, other):
        d.mkdir()
        (d / "model.onnx").write_text("x")
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a build still running
    try:
        clean_leftovers(out)
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-x", ".out.partial-live"]


def test_an_artifact_retired_by_an_interrupted_publish_is_restored(tmp_path: Path) -> None:
    out = tmp_path / "out"
    retired = tmp_path / ".out.retired-abc"  # the old artifact moved aside, the new one not yet in place
    retired.mkdir()
    fake_artifact(retired / "out", "old")
    clean_leftovers(out)
    assert (out / "model.onnx").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_symlink_planted_at_the_output_is_never_written_through(tmp_path: Path) -> None:
    victim = fake_artifact(tmp_path / "victim", "precious")
    out = tmp_path / "out"
    out.symlink_to(victim)
    for force in (False, True):
        with pytest.raises(ArtifactError, match="symbolic link"):
            check_output(out, force)
    with staged(tmp_path / "elsewhere") as staging, pytest.raises(ArtifactError, match="symbolic link"):
        publish(staging, out)
    assert tree_bytes(victim) == {"manifest.json": b"{}", "model.onnx": b"precious"}


# --- real builds --------------------------------------------------------------------------

KILLED_BUILD = """
import os, signal, sys
from pathlib import Path
from kvforge.toolchain import emit, manifest, publish
from kvforge import BuildOptions, build

stage = sys.argv[3]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def after(module, name):
    real = getattr(module, name)
    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        die()
        return result
    setattr(module, name, wrapped)

if stage == "emit":
    after(emit, "write_onnx")          # model written, tokenizer and manifest not yet
elif stage == "manifest":
    after(manifest, "write")           # complete staging directory, not yet published
elif stage == "publish":
    after(publish, "_rename2")         # swapped into place, previous not yet deleted
build(Path(sys.argv[1]), Path(sys.argv[2]), BuildOptions(force=True))
"""


def run_killed_build(checkpoint: Path, out: Path, stage: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", KILLED_BUILD, str(checkpoint), str(out), stage],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["emit", "manifest", "publish"])
def test_a_killed_build_leaves_the_previous_or_the_new_artifact_whole(
    stage: str, tmp_path: Path, tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    previous, new = built_artifact("qwen2"), built_artifact("llama")
    out = tmp_path / "out"
    shutil.copytree(previous, out)
    run_killed_build(tiny_checkpoint("llama"), out, stage)
    assert tree_bytes(out) == tree_bytes(new if stage == "publish" else previous)
    assert any(p.name.startswith(".out.partial-") for p in tmp_path.iterdir())  # the dead build's leftover
    clean_leftovers(out)  # what the next build does first
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.slow
def test_a_killed_first_build_leaves_no_output(tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    out = tmp_path / "out"
    run_killed_build(tiny_checkpoint("llama"), out, "manifest")
    assert not out.exists()
    build(tiny_checkpoint("llama"), out)  # the next run cleans up and succeeds
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.fixture()
def small_disk(tmp_path: Path) -> Callable[[str], Path]:
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        point = tmp_path / "disk"
        point.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point)], capture_output=True, check=False
        )
        if result.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here (needs root): {result.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_a_clear_error_and_keeps_the_previous_artifact(
    small_disk: Callable[[str], Path], tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]
) -> None:
    previous = built_artifact("qwen2")
    size = sum(p.stat().st_size for p in previous.iterdir())
    disk = small_disk(f"{size // 1024 + 200}k")  # room for the previous artifact, not for a second
    out = disk / "out"
    shutil.copytree(previous, out)
    with pytest.raises(ArtifactError, match=r"cannot write the artifact \(No space left on device\); nothing"):
        build(tiny_checkpoint("llama"), out, BuildOptions(force=True))
    assert tree_bytes(out) == tree_bytes(previous)
    assert [p.name for p in disk.iterdir()] == ["out"]


REPRODUCIBLE_BUILD = "from kvforge.cli import main; main()"


@pytest.mark.slow
def test_builds_are_byte_identical_across_paths_hash_seeds_and_working_directories(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    outputs = []
    for index, seed in enumerate(("1", "2")):
        place = tmp_path / f"place-{index}" / ("deeper" * (index + 1))
        checkpoint = place / "checkpoint"
        shutil.copytree(tiny_checkpoint("llama"), checkpoint)
        cwd = place / "cwd"
        cwd.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        result = subprocess.run(
            [sys.executable, "-c", REPRODUCIBLE_BUILD, "build", str(checkpoint), "-o", str(place / "out")],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert list(cwd.iterdir()) == []  # nothing written outside the output directory
        assert sorted(p.name for p in place.iterdir()) == ["checkpoint", "cwd", "out"]
        outputs.append(place / "out")
    first, second = (tree_bytes(o) for o in outputs)
    assert first == second
    forbidden = [str(tmp_path).encode(), socket.gethostname().encode(), str(ROOT).encode()]
    for name, content in first.items():
        for needle in forbidden:
            assert needle not in content, f"{name} contains {needle!r}"


# --- two builds to one output ------------------------------------------------------------

PUBLISHER = """
import sys, time
from pathlib import Path
from kvforge.toolchain.publish import check_output, publish, staged

out, force, content, go = Path(sys.argv[1]), sys.argv[2] == "force", sys.argv[3], Path(sys.argv[4])
check_output(out, force)  # what a build checks before any work
with staged(out) as staging:
    (staging / "manifest.json").write_text("{}")
    (staging / "model.onnx").write_text(content)
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.005)
    publish(staging, out, force=force)
"""


def start_publisher(out: Path, force: bool, content: str, go: Path) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(out), "force" if force else "no", content, str(go)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_a_build_without_force_never_replaces_what_another_published_meanwhile(tmp_path: Path) -> None:
    out = tmp_path / "out"
    plain = start_publisher(out, False, "plain", tmp_path / "go-plain")
    forced = start_publisher(out, True, "forced", tmp_path / "go-forced")
    (tmp_path / "go-forced").touch()
    assert forced.wait(60) == 0
    (tmp_path / "go-plain").touch()
    assert plain.wait(60) != 0
    assert plain.stderr is not None and "was published by another build while this one ran" in plain.stderr.read()
    assert (out / "model.onnx").read_text() == "forced"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_two_builds_released_together_publish_one_after_the_other(tmp_path: Path) -> None:
    """Whichever swaps first, the one with --force is what stays: the other either published
    first and was replaced, or found the output taken and published nothing."""
    for attempt in range(3):
        out, go = tmp_path / f"out{attempt}", tmp_path / f"go{attempt}"
        plain = start_publisher(out, False, "plain", go)
        forced = start_publisher(out, True, "forced", go)
        go.touch()
        assert forced.wait(60) == 0
        plain.wait(60)
        assert (out / "model.onnx").read_text() == "forced"


PUBLISH_AFTER_THE_OTHER = """
import sys, time
from pathlib import Path
from kvforge.toolchain import build
from kvforge.cli import main

real = build.publish

def publish_after_the_other(staging, output, **kwargs):
    deadline = time.monotonic() + 600
    while not (output / "manifest.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    real(staging, output, **kwargs)

build.publish = publish_after_the_other
main(["build", sys.argv[1], "-o", sys.argv[2]])
"""


@pytest.mark.slow
def test_two_real_builds_without_and_with_force(tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    """Started together; the one without --force reaches its swap after the other published
    (held there until then): it fails and the other's artifact stays. The forced one runs
    with -q: no progress lines, only its result."""
    out = tmp_path / "out"
    plain = subprocess.Popen(
        [sys.executable, "-c", PUBLISH_AFTER_THE_OTHER, str(tiny_checkpoint("llama")), str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    forced = subprocess.run(
        [sys.executable, "-m", "kvforge", "build", str(tiny_checkpoint("qwen2")), "-o", str(out)] + ["--force", "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert forced.returncode == 0, forced.stderr[-2000:]
    _, plain_err = plain.communicate(timeout=600)
    assert plain.returncode == 2, plain_err[-2000:]
    assert plain_err.strip().splitlines()[-1].startswith("kvforge: error: ")
    assert "was published by another build while this one ran" in plain_err
    assert "kvforge: load done in " in plain_err  # not quiet, not a terminal: progress lines
    assert not any(line.startswith("kvforge: ") and "error" not in line for line in forced.stderr.splitlines())
    assert forced.stderr.splitlines()[0].startswith("built ")
    assert json.loads((out / "manifest.json").read_text())["spec"]["model_type"] == "qwen2"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
