"""The TensorRT engine of a `tensorrt`-target artifact: profiles, timing cache, build, manifest entry.

Every decision is a plain function that runs without TensorRT (profile ranges from the KV
contract, the timing cache's key, the manifest entry, whether an engine can be built
here); only `build_engine` imports `tensorrt` and needs a GPU. The API calls follow the
TensorRT Python API documentation (docs.nvidia.com/deeplearning/tensorrt/latest/_static/
python-api): `trt.Builder`, `create_network` with `NetworkDefinitionCreationFlag.STRONGLY_TYPED`
(types come from the graph; the precision builder flags are gone in TensorRT 11),
`trt.OnnxParser.parse_from_file`, `IBuilderConfig.set_memory_pool_limit(MemoryPoolType.WORKSPACE)`,
`builder_optimization_level`, `add_optimization_profile`, `create_timing_cache` /
`set_timing_cache` (a timing cache is specific to the device, CUDA and TensorRT versions:
docs.nvidia.com/deeplearning/tensorrt/latest/performance/builder-performance.html), and
`build_serialized_network`.

One engine has two optimization profiles over the same graph, both derived from the
contract (`kvforge.runners.contract.DecoderIO`) and the engine options:

- `decode` (profile 0): one new token per row, batch 1..max_batch;
- `prefill` (profile 1): 1..max_prefill new tokens per row, batch 1..max_batch; a longer
  prompt is prefilled in chunks (`kvforge.runners.trt_session`).

In both the cache inputs are `[batch, kv_heads, S_max, head_dim]` with `S_max` the graph's
fixed capacity, and the attention mask covers 1..S_max positions.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvforge.passes.targets import TARGETS, TENSORRT_ENGINE
from kvforge.passes.tensorrt_check import min_tensorrt_version
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ArtifactError
from kvforge.runners.manifest import MANIFEST, read_io, read_manifest, sha256_file, verify_files
from kvforge.toolchain.emit import MODEL_FILE, write_json
from kvforge.toolchain.system import write_atomically

log = logging.getLogger(__name__)

ENGINE_FILE = "engine.plan"
DECODE, PREFILL = "decode", "prefill"
DEFAULT_TIMING_CACHE_DIR = Path("~/.cache/kvforge/tensorrt")
DEFAULT_MAX_PREFILL = 512
MIN_TENSORRT = min_tensorrt_version()


class EngineError(ArtifactError):
    """The engine cannot be built: TensorRT or a GPU is missing, the parser refused the graph, or the build failed."""


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 8  # rows per step, both profiles
    max_prefill: int | None = None  # new tokens per row per prefill step (None: 512 or the capacity, the smaller)
    opt_batch: int = 1  # the batch the kernels are tuned for
    optimization_level: int = 3  # IBuilderConfig.builder_optimization_level, 0..5
    workspace_mib: int | None = None  # IBuilderConfig workspace pool limit; None: TensorRT's default
    timing_cache_dir: Path = DEFAULT_TIMING_CACHE_DIR  # not a flag: it changes build time, not the engine

    def check(self, io: DecoderIO) -> None:
        capacity = io.capacity
        if capacity is None or not io.shared_kv:
            raise EngineError(
                "the artifact's KV cache has no fixed capacity (io.capacity); TensorRT engines are built from "
                "--target tensorrt artifacts, rebuild with `kvforge build CHECKPOINT -o OUT --target tensorrt`"
            )
        if io.keeps_logits:
            raise EngineError(
                "the artifact's graph takes logits_to_keep (io.logits_positions 'keep'), whose default TensorRT's "
                "parser would read as a constant; rebuild with `--target tensorrt` (logits 'last' or 'all')"
            )
        if not 1 <= self.opt_batch <= self.max_batch:
            raise EngineError(f"--opt-batch {self.opt_batch} must be between 1 and --max-batch {self.max_batch}")
        if self.max_prefill is not None and not 1 <= self.max_prefill <= capacity:
            raise EngineError(
                f"--max-prefill {self.max_prefill} must be between 1 and the artifact's cache capacity {capacity}"
            )
        if not 0 <= self.optimization_level <= 5:
            raise EngineError(f"--optimization-level {self.optimization_level} must be between 0 and 5")
        if self.workspace_mib is not None and self.workspace_mib < 1:
            raise EngineError(f"--workspace-mib {self.workspace_mib} must be a positive number of MiB")

    def prefill(self, capacity: int) -> int:
        return min(DEFAULT_MAX_PREFILL, capacity) if self.max_prefill is None else self.max_prefill

    def flags(self) -> dict[str, Any]:
        """What shapes the engine, for the manifest (the timing cache's place does not)."""
        data = asdict(self)
        del data["timing_cache_dir"]
        data["strongly_typed"] = True
        return data


@dataclass(frozen=True)
class ShapeRange:
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def to_dict(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True)
class Profile:
    name: str
    shapes: dict[str, ShapeRange]  # every graph input, in the contract's order

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shapes": {name: r.to_dict() for name, r in self.shapes.items()}}


def profiles(io: DecoderIO, options: EngineOptions) -> list[Profile]:
    """The decode and prefill optimization profiles, from the contract's inputs and the options."""
    options.check(io)
    assert io.capacity is not None  # checked
    capacity, batch = io.capacity, (1, options.opt_batch, options.max_batch)
    prefill = options.prefill(capacity)
    made = []
    # The mask spans the past and the new positions: 1 up to the whole capacity in both;
    # decode is tuned for a half-full cache, prefill for one full chunk over an empty one.
    steps = (
        (DECODE, (1, 1, 1), (1, max(1, capacity // 2), capacity)),
        (PREFILL, (1, prefill, prefill), (1, prefill, capacity)),
    )
    for name, seq, total in steps:
        sizes = {"batch": batch, "seq": seq, "total": total}
        shapes = {}
        for spec in io.inputs:
            ranges = [
                (dim, dim, dim) if isinstance(dim, int) else sizes[dim]  # a fixed dim: the same at min, opt, max
                for dim in spec.dims
            ]
            shapes[spec.name] = ShapeRange(*(tuple(r[i] for r in ranges) for i in range(3)))
        made.append(Profile(name, shapes))
    return made


def timing_cache_name(tensorrt_version: str, gpu_name: str, compute_capability: str) -> str:
    """One cache per TensorRT version and GPU: a timing cache is only valid for the device and
    TensorRT version that made it (TensorRT refuses a mismatched one: `ignore_mismatch=False`)."""
    gpu = re.sub(r"[^A-Za-z0-9.]+", "-", gpu_name).strip("-").lower() or "gpu"
    version = re.sub(r"[^0-9.]+", "", tensorrt_version) or "unknown"
    capability = re.sub(r"[^0-9.]+", "", compute_capability) or "unknown"
    return f"timing-trt{version}-sm{capability}-{gpu}.cache"


def engine_entry(
    *, sha256: str, tensorrt_version: str, gpu_name: str, compute_capability: str, io: DecoderIO, options: EngineOptions
) -> dict[str, Any]:
    """The manifest's `engine` section: what the runner checks before it deserializes the engine."""
    return {
        "file": ENGINE_FILE,
        "sha256": sha256,
        "tensorrt": tensorrt_version,
        "compute_capability": compute_capability,
        "gpu": gpu_name,
        "capacity": io.capacity,
        "dtype": io.kv_dtype,
        "profiles": [p.to_dict() for p in profiles(io, options)],
        "flags": options.flags() | {"max_prefill": options.prefill(io.capacity or 1)},
    }


def unavailable() -> str | None:
    """Why no engine can be built in this process (None when it can): TensorRT or a CUDA device missing."""
    try:
        import tensorrt as trt
    except ImportError:
        return f"the tensorrt Python package (TensorRT >= {MIN_TENSORRT}) is not installed"
    if _version_tuple(trt.__version__) < _version_tuple(MIN_TENSORRT):
        return f"TensorRT {trt.__version__} is older than {MIN_TENSORRT}, the first to import this graph"
    try:
        gpu_name, _ = device()
    except EngineError as e:
        return str(e)
    log.info("TensorRT %s on %s", trt.__version__, gpu_name)
    return None


def device() -> tuple[str, str]:
    """(name, compute capability "major.minor") of CUDA device 0, through cuda-python's runtime API."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError as e:
        raise EngineError("cuda-python (cuda.bindings) is not installed; install it beside TensorRT") from e
    err, count = cudart.cudaGetDeviceCount()
    if int(err) != 0 or count < 1:
        raise EngineError("no CUDA device is visible to this process")
    err, props = cudart.cudaGetDeviceProperties(0)
    if int(err) != 0:
        raise EngineError(f"cannot read the properties of CUDA device 0 (error {int(err)})")
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return name.rstrip("\x00"), f"{props.major}.{props.minor}"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def build_engine(directory: Path, io: DecoderIO, options: EngineOptions) -> dict[str, Any]:
    """Parse `directory/model.onnx`, build the engine with both profiles, write `engine.plan`
    atomically beside it, and return the manifest's `engine` section. Needs TensorRT and a GPU."""
    reason = unavailable()
    if reason is not None:
        raise EngineError(
            f"cannot build the TensorRT engine here: {reason}; run `kvforge build-engine` on a GPU machine"
        )
    import tensorrt as trt

    options.check(io)
    gpu_name, capability = device()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(directory / MODEL_FILE)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineError(f"{directory / MODEL_FILE}: TensorRT's ONNX parser refused the graph: {'; '.join(errors)}")
    config = builder.create_builder_config()
    if options.workspace_mib is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
    config.builder_optimization_level = options.optimization_level
    for profile in profiles(io, options):  # added in order: decode is profile 0, prefill profile 1
        trt_profile = builder.create_optimization_profile()
        for name, shape in profile.shapes.items():
            trt_profile.set_shape(name, shape.min, shape.opt, shape.max)
        config.add_optimization_profile(trt_profile)
    cache_path = options.timing_cache_dir.expanduser() / timing_cache_name(trt.__version__, gpu_name, capability)
    cached = cache_path.read_bytes() if cache_path.is_file() else b""
    timing_cache = config.create_timing_cache(cached)
    config.set_timing_cache(timing_cache, ignore_mismatch=False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"{directory / MODEL_FILE}: TensorRT could not build an engine (see its log above)")
    cache_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(cache_path, bytes(timing_cache.serialize()))
    data = bytes(plan)
    write_atomically(directory / ENGINE_FILE, data)
    return engine_entry(
        sha256=hashlib.sha256(data).hexdigest(),
        tensorrt_version=trt.__version__,
        gpu_name=gpu_name,
        compute_capability=capability,
        io=io,
        options=options,
    )


def with_engine(manifest: dict[str, Any], directory: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """The manifest with its `engine` section and the engine file's hash added (written last)."""
    updated = dict(manifest)
    updated["engine"] = entry
    updated["files"] = {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.name != MANIFEST}
    tools = dict(updated.get("tools") or {})
    tools["tensorrt"] = entry["tensorrt"]
    updated["tools"] = tools
    return updated


def add_engine(artifact: Path, options: EngineOptions) -> dict[str, Any]:
    """`kvforge build-engine OUT`: build the engine of a published tensorrt-target artifact and
    republish it, with the engine in the manifest, in one atomic swap (kvforge.toolchain.publish)."""
    from kvforge.toolchain.publish import publish, staged

    artifact = Path(os.path.abspath(artifact))
    recorded = read_manifest(artifact)
    verify_files(artifact, recorded)
    target = TARGETS.get(recorded.get("target", ""))
    if target is None or target.emitter != TENSORRT_ENGINE:
        engines = [t.name for t in TARGETS.values() if t.emitter == TENSORRT_ENGINE]
        raise EngineError(
            f"{artifact / MANIFEST}: target is {recorded.get('target')!r}, not {' or '.join(map(repr, engines))}; "
            f"build the artifact with `kvforge build CHECKPOINT -o OUT --target {engines[0]}` first"
        )
    io = read_io(artifact, recorded)
    options.check(io)
    reason = unavailable()
    if reason is not None:
        raise EngineError(
            f"cannot build the TensorRT engine here: {reason}; run `kvforge build-engine` on a GPU machine"
        )
    with staged(artifact) as staging:
        for name in recorded["files"]:
            if name == ENGINE_FILE:
                continue  # rebuilt below
            _link_or_copy(artifact / name, staging / name)
        entry = build_engine(staging, io, options)
        manifest = with_engine(recorded, staging, entry)
        write_json(staging / MANIFEST, manifest)
        publish(staging, artifact)
    return manifest


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link where the file system allows one (weights can be gigabytes), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
