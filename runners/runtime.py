"""Which runtime runs an artifact: its TensorRT engine, onnxruntime on a GPU, or on the CPU.

    choice = choose("auto", manifest, Environment.detect())
    session = open_session(directory, manifest, choice)

`auto` takes the fastest one present: the TensorRT engine where the artifact has one
(`kvforge build-engine`) and TensorRT, cuda-python and a GPU are here; onnxruntime's CUDA
provider where onnxruntime-gpu and a GPU are here; else onnxruntime on the CPU. A runtime
asked for by name that cannot run is refused with one line saying what is missing.

What is installed is read once into an `Environment`, so the choice is a pure function of
the manifest and that record (the tests pass fakes for machines with a GPU).
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ArtifactError, KvforgeError
from kvforge.runners.manifest import FileHashes, built_with
from kvforge.runners.session import OrtSession, Session

RUNTIMES = ("auto", "ort", "ort-cuda", "tensorrt")
MODEL_FILE = "model.onnx"
CPU_PROVIDER, CUDA_PROVIDER = "CPUExecutionProvider", "CUDAExecutionProvider"


class RuntimeUnavailable(KvforgeError):
    """A runtime asked for by name cannot run this artifact on this machine."""


@dataclass(frozen=True)
class Environment:
    """What this machine offers: onnxruntime's providers, TensorRT's packages, CUDA GPUs."""

    providers: tuple[str, ...]
    tensorrt: bool  # the tensorrt and cuda-python packages import
    gpus: int  # CUDA devices the driver reports

    @classmethod
    def detect(cls) -> Environment:
        import onnxruntime

        tensorrt = _importable("tensorrt") and _importable("cuda.bindings")
        return cls(tuple(onnxruntime.get_available_providers()), tensorrt, cuda_device_count())


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is absent or broken
        return False


def cuda_device_count() -> int:
    """CUDA devices, asked of the driver library itself (no torch, no CUDA toolkit); 0 without one."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


@dataclass(frozen=True)
class Choice:
    runtime: str  # "ort", "ort-cuda" or "tensorrt"
    providers: tuple[str, ...] = (CPU_PROVIDER,)


def choose(runtime: str, manifest: Mapping[str, Any], env: Environment, artifact: str = "ARTIFACT") -> Choice:
    """The runtime to open, or RuntimeUnavailable naming what is missing for the one asked for
    (`artifact`: the directory, as the message names it)."""
    if runtime not in RUNTIMES:
        raise RuntimeUnavailable(f"runtime {runtime!r} is not one of {', '.join(RUNTIMES)}; choose one")
    if runtime in ("auto", "tensorrt"):
        missing = _tensorrt_missing(manifest, env, artifact)
        if missing is None:
            return Choice("tensorrt", ())
        if runtime == "tensorrt":
            raise RuntimeUnavailable(f"--runtime tensorrt: {missing}")
    if runtime in ("auto", "ort-cuda"):
        missing = _cuda_missing(env)
        if missing is None:
            return Choice("ort-cuda", (CUDA_PROVIDER, CPU_PROVIDER))
        if runtime == "ort-cuda":
            raise RuntimeUnavailable(f"--runtime ort-cuda: {missing}")
    return Choice("ort")


def _tensorrt_missing(manifest: Mapping[str, Any], env: Environment, artifact: str) -> str | None:
    if not isinstance(manifest.get("engine"), dict):
        return f"{artifact} has no TensorRT engine; add one with `kvforge build-engine {artifact}` on a GPU machine"
    if not env.tensorrt:
        return "the tensorrt and cuda-python packages are not installed; pip install 'kvforge[tensorrt]'"
    if env.gpus < 1:
        return "no CUDA GPU found (the driver reports none); run on a machine with one"
    return None


def _cuda_missing(env: Environment) -> str | None:
    if CUDA_PROVIDER not in env.providers:
        return (
            f"onnxruntime has no {CUDA_PROVIDER} (it offers {', '.join(env.providers) or 'none'}); "
            "install onnxruntime-gpu in place of onnxruntime"
        )
    if env.gpus < 1:
        return "no CUDA GPU found (the driver reports none); run on a machine with one"
    return None


def open_session(
    directory: Path,
    manifest: Mapping[str, Any],
    io: DecoderIO,
    choice: Choice,
    *,
    huge_pages: bool = False,
    stop_spinning: bool = False,
    providers: Sequence[str] | None = None,
    hashes: FileHashes | None = None,
) -> Session:
    """The session of `choice` over an artifact whose files were checked against `manifest`, or are
    being checked by `hashes` (`OrtSession`; a TensorRT engine is checked whole before it is read).

    `providers`, where given, are passed to onnxruntime as they are (a caller that picks the
    device itself, as the Triton backend does)."""
    if choice.runtime == "tensorrt":
        from kvforge.runners.trt_session import TrtSession

        return TrtSession(directory)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{directory}: manifest field files is missing; rebuild the artifact")
    return OrtSession(
        directory / MODEL_FILE,
        io,
        tuple(providers) if providers is not None else choice.providers,
        data_files=set(files),
        huge_pages=huge_pages and choice.runtime == "ort",  # pages for host memory: the CPU's weights
        hashes=hashes,
        stop_spinning=stop_spinning,
        built_with=built_with(manifest, "onnxruntime"),
    )
