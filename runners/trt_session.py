"""A `Session` over the TensorRT engine of a `tensorrt`-target artifact.

The same interface as `kvforge.runners.session.OrtSession`, so the generation loop, the samplers
and the streaming detokenizer are the ones every backend uses. What it adds:

- **Manifest gating, before anything is deserialized.** The engine file must be the one
  the manifest's `engine` section names, listed in its `files` with the same sha256 (the
  bytes are hashed again after reading, just before deserializing), built by this very
  TensorRT version for this GPU's compute capability. Anything else is refused with a
  message that says to rebuild (`kvforge build-engine`). These checks are plain functions
  (`read_engine_entry`, `check_engine`, `read_engine_bytes`) that run without TensorRT.
- **One execution context per optimization profile** (decode: profile 0, prefill:
  profile 1), both bound to the same preallocated device KV buffers: each `past_key_values.*`
  input and its `present.*` output at one address, as TensorRT's KV-cache update layer
  requires (checked with `ICudaEngine.get_aliased_input_tensor`). Steps run with
  `execute_async_v3` on one CUDA stream.
- **Chunked prefill.** A prompt longer than the prefill profile's `max_prefill` is fed in
  chunks; each chunk's attention mask is one chunk longer, so the graph's write index
  (mask length minus chunk length) advances through the cache.

The API calls follow the TensorRT Python API documentation (`trt.Runtime`,
`deserialize_cuda_engine`, `create_execution_context`, `set_optimization_profile_async`,
`set_input_shape`, `set_tensor_address`, `execute_async_v3`) and cuda-python's runtime
bindings for memory and streams. `runners` must import without TensorRT or CUDA, so both
are imported when a session is opened.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.runners.cache import HOST, Device
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ArtifactError
from kvforge.runners.manifest import MANIFEST, is_plain_file_name, read_io, read_manifest, verify_files

DECODE_PROFILE, PREFILL_PROFILE = 0, 1
_REBUILD = "rebuild the engine on this machine with `kvforge build-engine ARTIFACT`"


@dataclass(frozen=True)
class EngineEntry:
    """The manifest's `engine` section, checked."""

    file: str
    sha256: str
    tensorrt: str
    compute_capability: str
    capacity: int
    max_batch: int
    max_prefill: int


def read_engine_entry(directory: Path, manifest: Mapping[str, Any]) -> EngineEntry:
    """The `engine` section of `manifest`, refused unless it names a file the manifest lists with the same hash."""
    where = directory / MANIFEST
    engine = manifest.get("engine")
    if not isinstance(engine, dict):
        raise ArtifactError(
            f"{where}: no engine section; this artifact has no TensorRT engine, add one with "
            f"`kvforge build-engine {directory}` on a GPU machine"
        )
    name, digest = engine.get("file"), engine.get("sha256")
    files = manifest.get("files")
    if not isinstance(name, str) or not is_plain_file_name(name) or not isinstance(files, dict) or name not in files:
        raise ArtifactError(f"{where}: engine.file {str(name)[:80]!r} is not a file the manifest lists; {_REBUILD}")
    if not isinstance(digest, str) or files[name] != digest:
        raise ArtifactError(f"{where}: engine.sha256 does not match files[{name!r}]; {_REBUILD}")
    flags = engine.get("flags")
    flags = flags if isinstance(flags, dict) else {}
    values: dict[str, Any] = {
        "tensorrt": engine.get("tensorrt"),
        "compute_capability": engine.get("compute_capability"),
        "capacity": engine.get("capacity"),
        "max_batch": flags.get("max_batch"),
        "max_prefill": flags.get("max_prefill"),
    }
    for field in ("tensorrt", "compute_capability"):
        if not isinstance(values[field], str) or not values[field]:
            raise ArtifactError(f"{where}: engine.{field} is missing or not a string; {_REBUILD}")
    for field in ("capacity", "max_batch", "max_prefill"):
        value = values[field]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArtifactError(
                f"{where}: engine {field} must be a positive integer, got {str(value)[:40]}; {_REBUILD}"
            )
    return EngineEntry(file=name, sha256=digest, **values)


def check_engine(entry: EngineEntry, io: DecoderIO, *, tensorrt_version: str, compute_capability: str) -> None:
    """Refuse an engine built by another TensorRT version, for another GPU, or for another cache."""
    if entry.tensorrt != tensorrt_version:
        raise ArtifactError(
            f"{entry.file}: built by TensorRT {entry.tensorrt}, this is TensorRT {tensorrt_version} "
            f"(engines run only on the version that built them); {_REBUILD}"
        )
    if _capability(entry.compute_capability) != _capability(compute_capability):
        raise ArtifactError(
            f"{entry.file}: built for compute capability {entry.compute_capability}, this GPU has "
            f"{compute_capability}; {_REBUILD}"
        )
    if io.capacity != entry.capacity:
        raise ArtifactError(
            f"{entry.file}: engine capacity {entry.capacity} differs from the graph's io.capacity {io.capacity}; "
            f"{_REBUILD}"
        )


def read_engine_bytes(directory: Path, entry: EngineEntry) -> bytes:
    """The engine's bytes, hashed once more as read: what is deserialized is what the manifest lists."""
    path = directory / entry.file
    if path.is_symlink() or not path.is_file():
        raise ArtifactError(f"{path}: missing or not a plain file; {_REBUILD}")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry.sha256:
        raise ArtifactError(f"{path}: sha256 does not match {MANIFEST}; the file was modified, {_REBUILD}")
    return data


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:2])


def prefill_chunks(seq: int, max_prefill: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of `seq` new positions, at most `max_prefill` each."""
    if seq < 1 or max_prefill < 1:
        raise ValueError(f"seq {seq} and max_prefill {max_prefill} must be positive")
    return [(start, min(start + max_prefill, seq)) for start in range(0, seq, max_prefill)]


def chunk_feeds(feeds: Mapping[str, np.ndarray], start: int, end: int) -> dict[str, np.ndarray]:
    """The step inputs of new positions [start, end): the mask reaches exactly the chunk's last position."""
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    past = mask.shape[1] - ids.shape[1]
    return {
        "input_ids": np.ascontiguousarray(ids[:, start:end]),
        "attention_mask": np.ascontiguousarray(mask[:, : past + end]),
        "position_ids": np.ascontiguousarray(feeds["position_ids"][:, start:end]),
    }


def profile_for(seq: int) -> int:
    """The optimization profile a step of `seq` new positions per row runs under."""
    return DECODE_PROFILE if seq == 1 else PREFILL_PROFILE


def _cuda_check(result: Any) -> Any:
    """cuda-python calls return (error, value...); raise on an error, return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise ArtifactError(f"CUDA call failed with error {int(err)} ({err}); check the GPU and its driver")
    return values[0] if len(values) == 1 else tuple(values)


class _DeviceBuffer:
    def __init__(self, cudart: Any, nbytes: int) -> None:
        self._cudart = cudart
        self.nbytes = max(nbytes, 1)
        self.ptr = int(_cuda_check(cudart.cudaMalloc(self.nbytes)))

    def free(self) -> None:
        if self.ptr:
            self._cudart.cudaFree(self.ptr)
            self.ptr = 0


class TrtSession:
    """A TensorRT engine behind the `Session` interface; `mirror_cache` copies the device cache back
    into the caller's arrays after every step (the verification gate compares them)."""

    def __init__(self, artifact: Path, *, mirror_cache: bool = False) -> None:
        artifact = Path(artifact)
        manifest = read_manifest(artifact)
        verify_files(artifact, manifest)
        self.io = read_io(artifact, manifest)
        self.device: Device = HOST  # feeds and returns numpy arrays
        entry = read_engine_entry(artifact, manifest)
        try:
            import tensorrt as trt
            from cuda.bindings import runtime as cudart
        except ImportError as e:
            raise ArtifactError(
                f"{artifact}: running its TensorRT engine needs the tensorrt and cuda-python packages ({e}); "
                "install them, or run the graph with onnxruntime (`kvforge generate`)"
            ) from e
        properties = _cuda_check(cudart.cudaGetDeviceProperties(0))
        check_engine(
            entry,
            self.io,
            tensorrt_version=trt.__version__,
            compute_capability=f"{properties.major}.{properties.minor}",
        )
        plan = read_engine_bytes(artifact, entry)
        self._trt, self._cudart = trt, cudart
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(plan)
        if self._engine is None:
            raise ArtifactError(f"{artifact / entry.file}: TensorRT could not deserialize the engine; {_REBUILD}")
        self._check_aliasing(artifact / entry.file)
        self._entry = entry
        self._mirror = mirror_cache
        self._stream = _cuda_check(cudart.cudaStreamCreate())
        self._contexts = []
        for index in (DECODE_PROFILE, PREFILL_PROFILE):
            context = self._engine.create_execution_context()
            context.set_optimization_profile_async(index, int(self._stream))
            self._contexts.append(context)
        self._scratch: dict[str, _DeviceBuffer] = {}
        self._cache: dict[str, _DeviceBuffer] = {}
        self._bound: list[tuple[weakref.ref[np.ndarray], tuple[int, ...]]] = []

    def _check_aliasing(self, path: Path) -> None:
        """Every present output must be the in-place update of its past input (one device address)."""
        for past, present in zip(self.io.past_names, self.io.present_names):
            aliased = self._engine.get_aliased_input_tensor(present)
            if aliased != past:
                raise ArtifactError(
                    f"{path}: output {present} is not aliased to input {past} (got {aliased!r}), so the KV cache "
                    f"would not be updated in place; {_REBUILD}"
                )

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = feeds["input_ids"]
        batch, seq = ids.shape
        if batch > self._entry.max_batch:
            raise ArtifactError(
                f"batch of {batch} rows exceeds the engine's max_batch {self._entry.max_batch}; "
                "rebuild the engine with a larger --max-batch"
            )
        self._bind_cache(feeds)
        logits = np.empty(0)
        for start, end in prefill_chunks(seq, 1 if seq == 1 else self._entry.max_prefill):
            logits = self._step(chunk_feeds(feeds, start, end) if seq > 1 else feeds, batch)
        if self._mirror:
            for past in self.io.past_names:
                host = feeds[past]
                self._copy(host.ctypes.data, self._cache[past].ptr, host.nbytes, to_device=False)
            _cuda_check(self._cudart.cudaStreamSynchronize(self._stream))
        outputs = {present: feeds[past] for past, present in zip(self.io.past_names, self.io.present_names)}
        outputs["logits"] = logits
        return outputs

    def _bind_cache(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Upload the caller's cache arrays once per generation (new arrays: a new prefill)."""
        buffers = [feeds[past] for past in self.io.past_names]
        same = len(self._bound) == len(buffers) and all(
            r() is a and s == a.shape for (r, s), a in zip(self._bound, buffers)
        )
        if same:
            return
        for past, host in zip(self.io.past_names, buffers):
            if host.shape[2] != self.io.capacity or not host.flags.c_contiguous:
                raise ArtifactError(
                    f"{past}: a cache buffer must be C-contiguous [batch, heads, {self.io.capacity}, head_dim], "
                    f"got {host.shape}"
                )
            buffer = self._cache.get(past)
            if buffer is None or buffer.nbytes < host.nbytes:
                if buffer is not None:
                    buffer.free()
                buffer = self._cache[past] = _DeviceBuffer(self._cudart, host.nbytes)
            self._copy(buffer.ptr, host.ctypes.data, host.nbytes, to_device=True)
        self._bound = [(weakref.ref(a), a.shape) for a in buffers]

    def _step(self, feeds: Mapping[str, np.ndarray], batch: int) -> np.ndarray:
        seq = feeds["input_ids"].shape[1]
        context = self._contexts[profile_for(seq)]
        for name in ("input_ids", "attention_mask", "position_ids"):
            host = np.ascontiguousarray(feeds[name], dtype=np.int64)
            buffer = self._scratch_buffer(name, host.nbytes)
            self._copy(buffer.ptr, host.ctypes.data, host.nbytes, to_device=True)
            context.set_input_shape(name, host.shape)
            context.set_tensor_address(name, buffer.ptr)
        assert self.io.capacity is not None
        for past, present in zip(self.io.past_names, self.io.present_names):
            context.set_input_shape(past, self.io.kv_shape(past, batch, self.io.capacity))
            context.set_tensor_address(past, self._cache[past].ptr)
            context.set_tensor_address(present, self._cache[past].ptr)  # in place: one address
        logits = np.empty((batch, self.io.logits_rows(feeds), self.io.vocab_size), dtype=self.io.logits_dtype)
        out = self._scratch_buffer("logits", logits.nbytes)
        context.set_tensor_address("logits", out.ptr)
        if not context.execute_async_v3(int(self._stream)):
            raise ArtifactError("TensorRT could not run the step (execute_async_v3 failed); see its log above")
        self._copy(logits.ctypes.data, out.ptr, logits.nbytes, to_device=False)
        _cuda_check(self._cudart.cudaStreamSynchronize(self._stream))
        return logits

    def _scratch_buffer(self, name: str, nbytes: int) -> _DeviceBuffer:
        buffer = self._scratch.get(name)
        if buffer is None or buffer.nbytes < nbytes:
            if buffer is not None:
                buffer.free()
            buffer = self._scratch[name] = _DeviceBuffer(self._cudart, nbytes)
        return buffer

    def _copy(self, destination: int, source: int, nbytes: int, *, to_device: bool) -> None:
        kind = self._cudart.cudaMemcpyKind
        direction = kind.cudaMemcpyHostToDevice if to_device else kind.cudaMemcpyDeviceToHost
        _cuda_check(self._cudart.cudaMemcpyAsync(destination, source, nbytes, direction, self._stream))

    def close(self) -> None:
        for buffer in [*self._scratch.values(), *self._cache.values()]:
            buffer.free()
        self._scratch.clear()
        self._cache.clear()
        self._bound = []
