"""`kvforge build` as a plain function over the pipeline's stages (`kvforge verify`, which
re-runs a published artifact's gate, is `kvforge.toolchain.gate.verify`, importable from here too).

A build writes into a locked staging sibling of the output directory, verifies the graph
from the files it just wrote, writes the manifest last, and only then swaps the directory
into place (`kvforge.toolchain.publish`). Any failure removes the staging directory: nothing is
published, and a previous artifact stays as it was.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import torch

from kvforge.passes import pipeline
from kvforge.passes.kv_cache import KV_DTYPES, KVCacheRefused, QuantizeKVCache
from kvforge.passes.pipeline import PassReport
from kvforge.passes.quantize import WeightQuantization
from kvforge.passes.storage import table_block
from kvforge.passes.targets import DEFAULT_TARGET, TARGETS, TENSORRT_ENGINE, Target
from kvforge.passes.tensorrt_check import UnsupportedByTensorRT
from kvforge.runners.contract import KEEP_INPUT, DecoderIO
from kvforge.runners.errors import ArtifactError, ParityError
from kvforge.runners.manifest import MANIFEST
from kvforge.runners.session import Session
from kvforge.runners.tokenizer import TokenizerBundle
from kvforge.toolchain import calibration as calibrating
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain import (
    emit,
    gguf,
    hashing,
    kv_scales,
    lowering_cache,
    manifest,
    moe_graph,
    prequantized,
    progress,
    stamp,
)
from kvforge.toolchain import tune as tuning
from kvforge.toolchain.emit import genai
from kvforge.toolchain.emit import tensorrt as trt_engine
from kvforge.toolchain.export import eager_model, export_decoder, layer_windows, read_spec
from kvforge.toolchain.footprint import (
    QuantLayout,
    footprint,
    format_bytes,
    imported_weight_bytes,
    quantized_weight_bytes,
)
from kvforge.toolchain.gate import check_tolerance, eager_session, record_gate, verifiable
from kvforge.toolchain.gate import verify as verify  # `kvforge verify`, importable from here as before
from kvforge.toolchain.lower import OPSET, apply_contract, to_onnx
from kvforge.toolchain.publish import check_output, check_writable, publish, staged
from kvforge.toolchain.requirements import ROTARY_IN_ATTENTION, installed_at_least
from kvforge.toolchain.spec import DecoderSpec
from kvforge.toolchain.system import return_freed_memory, write_failure
from kvforge.toolchain.verify import DistributionReport, ParityReport, gate_provider, require_parity

log = logging.getLogger(__name__)

# --dtype: the graph's compute dtype (weights that stay unquantized, activations, KV cache),
# by the CLI's name. Logits leave every graph in fp32.
DTYPES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_DTYPE_NAMES = {name: short for short, name in DTYPES.items()}


@dataclass(frozen=True)
class BuildOptions:
    force: bool = False
    allow_pickle: bool = False
    decode_steps: int = 8
    target: Target = TARGETS[DEFAULT_TARGET]  # the CLI parses --target into its record
    dtype: str = "float32"  # one of DTYPES' values
    weights: WeightQuantization | None = None  # None: weights stay in the compute dtype
    capacity: int | None = None  # a fixed-capacity target's KV-cache length S_max (None: the model's context)
    # The positions the artifact serves (None: config.json's, else tokenizer_config.json's
    # model_max_length); at most config.json's where it states one
    context: int | None = None
    engine: trt_engine.EngineOptions = trt_engine.EngineOptions()  # an engine-emitting target, where one can be built
    # Refuse up front when the runtime footprint (weights + KV cache for memory_batch sequences
    # of memory_seq tokens; None: the model's context) exceeds this many bytes.
    device_memory: int | None = None
    memory_batch: int = 1
    memory_seq: int | None = None
    revision: str | None = None  # of a Hub id (a branch, tag or commit), resolved in the local cache
    # The parity gate's relative tolerance in place of the table's (TOLERANCES) for the dtype
    tolerance: float | None = None
    # The positions the graph returns logits for: "keep" (the last `logits_to_keep` ones, an input
    # the runner sets to 1 for a prefill, which then computes the LM head on one position, and to
    # the step's length for a speculative verify step), "last" (the last one only) or "all"
    # (every one). None: "keep", or "last" on a target whose graph cannot take the input
    # (`Target.logits_to_keep`)
    logits: str | None = None
    # Trace each distinct layer kind once and stamp out the stack (`kvforge.toolchain.stamp`); False:
    # export and lower the whole stack
    stamp: bool = True
    # Keep the lowered cut-down graph on disk and read it back for a later build of the same model
    # (`kvforge.toolchain.lowering_cache`; KVFORGE_LOWERING_CACHE says where, or `off`)
    lowering_cache: bool = True
    # Each quantized weight's MatMulNBits form: "off" (--block-size, accuracy level 4, for every
    # weight), "fast" or "full" (timed on this machine, `kvforge.toolchain.tune`)
    tune: str = tuning.DEFAULT_MODE
    tune_cache: Path | None = None  # the timing cache's file (None: `kvforge.toolchain.tune.cache_path()`)
    # The text symmetric int4 weights are calibrated on (`kvforge.toolchain.calibration`; the CLI's
    # default is the text kvforge ships); None: rounded to nearest
    calibration: calibrating.CalibrationText | None = None

    def __post_init__(self) -> None:
        # the recipe's zero points where it leaves them to the target (`WeightQuantization.resolved`)
        if self.weights is not None and isinstance(self.target, Target):
            resolved = self.weights.resolved(self.target.symmetric_only, self.calibration is not None)
            object.__setattr__(self, "weights", resolved)

    @property
    def calibrating(self) -> bool:
        return self.calibration is not None and calibrating.calibratable(self.weights)

    # The KV cache's storage: None, the compute dtype; "int8", codes with static per-channel scales
    # calibrated on the eager model (`kvforge.toolchain.kv_scales`), judged by the distribution gate
    kv_dtype: str | None = None
    # A GGUF file's quantized matrices with float activations (MatMulNBits' accuracy level 0), the
    # artifact computing what the dequantized file does, judged by the float gate. False: with no
    # `weights`, such a file builds as `weights=IMPORTED_DEFAULT` does (`_gguf_default`)
    exact_activations: bool = False

    def flags(self) -> dict[str, Any]:
        """What determines the artifact's bytes (not `force`, which only says where they may go)."""
        return (
            {
                "target": self.target.name,
                "dtype": self.dtype,
                "opset": OPSET,
                "allow_pickle": self.allow_pickle,
                "decode_steps": self.decode_steps,
                "weights": None if self.weights is None else self.weights.to_dict(),
                "tolerance": self.tolerance,
            }
            | ({"capacity": self.capacity} if self.target.fixed_capacity else {})
            | ({} if self.context is None else {"context": self.context})  # absent by default, as before
            | (
                {} if self.logits is None else {"logits": self.logits}  # absent by default (io says what it is)
            )
            | ({} if self.stamp else {"stamp": False})
            | ({} if self.tune == tuning.DEFAULT_MODE else {"tune": self.tune})  # absent when off, as before
            | ({"calibration": self.calibration.to_dict()} if self.calibration and self.calibrating else {})
            | ({} if self.kv_dtype is None else {"kv_dtype": self.kv_dtype})  # absent by default, as before
            | ({"exact_activations": True} if self.exact_activations else {})  # absent by default
        )


@dataclass
class BuildResult:
    output: Path
    manifest: dict[str, Any]
    parity: ParityReport | DistributionReport
    passes: PassReport
    seconds: dict[str, float] = field(default_factory=dict)
    next_step: str | None = None  # what completes the artifact elsewhere (an engine that cannot be built here)
    lowering: stamp.Lowering | None = None  # stamped, or the whole stack and why


def build(checkpoint_dir: Path | str, output: Path, options: BuildOptions = BuildOptions()) -> BuildResult:
    """Build `checkpoint_dir` (a directory, or a Hub id in the local cache) into `output`."""
    output = Path(os.path.abspath(output))
    if not isinstance(options.target, Target):
        raise ArtifactError(
            f"unknown target {options.target!r}: BuildOptions.target takes a record of kvforge.passes.targets.TARGETS "
            f"({', '.join(TARGETS)}), e.g. TARGETS[{DEFAULT_TARGET!r}]"
        )
    if options.dtype not in DTYPES.values():
        raise ArtifactError(f"unknown dtype {options.dtype!r}; choose one of {', '.join(DTYPES.values())}")
    check_tolerance(options.tolerance, options.weights is not None or options.kv_dtype is not None)
    if options.exact_activations and options.weights is not None:
        raise ArtifactError(
            f"exact activations keep a GGUF file's own codes, computed in float; --weights {options.weights.name} "
            "quantizes the build's weights and activations: drop one of the two"
        )
    _check_logits(options)
    # --tune without --weights is refused now, but for a GGUF file, whose codes are quantized
    # weights by default (`_gguf_default`): that case is checked once the file is read
    _check_tune(options, weights_may_default=_may_be_gguf(checkpoint_dir))
    _check_kv_dtype(options)
    check_output(output, options.force)
    check_writable(output)
    return_freed_memory()
    seconds: dict[str, float] = {}
    # the config, the weights' headers (a GGUF file: parsed and dequantized, a line of its own), the
    # cache's layout off the modeling code
    with _timed(seconds, "read"):
        ckpt = checkpoints.load(checkpoint_dir, allow_pickle=options.allow_pickle, revision=options.revision)
        options = _gguf_default(options, ckpt)
        _check_tune(options)
        spec = read_spec(ckpt, options.context)
        io = DecoderIO.for_spec(spec, kv_dtype=options.dtype)
        target = options.target
        _check_layer_states(io, target, spec)
        if target.bounded_windows:
            io = replace(io, layer_windows=layer_windows(ckpt.config, spec))
        if options.device_memory is not None:
            _check_fits(ckpt, spec, options)
        options = _target_options(options, spec)
    with _timed(seconds, "load"):
        model = eager_model(ckpt, spec, getattr(torch, options.dtype))
    with _timed(seconds, "reference"):  # the eager side of the gate, now: its weights are freed before verify
        reference = eager_session(model, spec, io)
        gate = record_gate(reference, options.flags(), spec, ckpt.path)
        cache_scales = None if options.kv_dtype is None else calibrated_kv_scales(reference, ckpt.path)
        del reference
    scales = _calibrate(model, ckpt, options, seconds)
    models = [model]  # the compilation takes the last reference: its weights can go once lowered
    # the sources' hashes, on a core that export and lowering leave idle (after the reference,
    # whose torch threads want both)
    with hashing.Pending(ckpt.input_files()) as sources, ExitStack() as kept:
        # a calibrated build keeps its calibrated weights for the whole stack's compilation, should the
        # gate refuse the stamped graph: calibrating again would take minutes
        calibrated = list(scales) if scales and options.stamp else []
        scratch = kept.enter_context(_scratch(output)) if calibrated else None
        if scratch is not None:
            _write_weights(model, calibrated, scratch)
        del model
        # what both compilations share: the stamped one, and the whole stack's if the gate refuses it
        compile_models = partial(
            _compile,
            checkpoint_dir=checkpoint_dir,
            output=output,
            options=options,
            ckpt=ckpt,
            spec=spec,
            io=io,
            gate=gate,
            seconds=seconds,
            sources=sources,
            cache_scales=cache_scales,
        )
        try:
            return compile_models(models, stamping=options.stamp, scales=scales)
        except _StampedGraphRefused as e:
            refused = str(e)
        # Out of the handler, the exception's traceback is gone, and with it the frames that held the
        # refused graph, its weights and the gate's onnxruntime session: freed before the checkpoint is
        # loaded again (docs/performance.md has what holding them cost).
        gc.collect()
        # the whole stack's graph is what stamping stands for: a stamped graph the gate refuses is rebuilt
        # info, not a warning: the build either succeeds (its summary says the stack was lowered whole, and
        # why) or fails with the gate's own one-line error, which with -q must be the only line
        log.info("the stamped graph failed the parity gate (%s); lowering the whole stack", refused)
        with _timed(seconds, "load"):
            models = [eager_model(ckpt, spec, getattr(torch, options.dtype))]
        if scratch is not None:
            _read_weights(models[0], calibrated, scratch)
        return compile_models(models, stamping=False, scales=scales, reason=_REFUSED)


def _compile(
    models: list[torch.nn.Module],
    checkpoint_dir: Path | str,
    output: Path,
    options: BuildOptions,
    ckpt: checkpoints.Checkpoint,
    spec: DecoderSpec,
    io: DecoderIO,
    gate: Callable[[Session], ParityReport | DistributionReport],
    seconds: dict[str, float],
    stamping: bool,
    sources: hashing.Pending,
    scales: dict[str, Any] | None = None,
    reason: str = "stamping is off",
    cache_scales: dict[str, np.ndarray] | None = None,
) -> BuildResult:
    """Lower, run the passes, emit, verify and publish the eager model in `models` (taken).
    `sources`: the checkpoint's hashes, being computed; the artifact's are, while the gate runs."""
    target = options.target
    cache = lowering_cache.directory() if options.lowering_cache else None
    onnx_model, lowering = _lower(models.pop(), spec, io, stamping, seconds, reason, cache)
    log.info(lowering.summary())
    with _timed(seconds, "lower"):
        # The graph's initializers now hold the weights; the eager model's references would keep
        # every weight a pass replaces (packing, quantization) alive next to its replacement.
        gc.collect()
    moe_layers = moe_graph.moe_layers(onnx_model, spec)
    header = ckpt.quantization_header()
    with nullcontext() if header is None else _timed(seconds, "import"):
        imported = ckpt.quantized_weights()  # a pre-quantized checkpoint's codes (a GGUF file's, decoded)
    exact = {name: found.record for name, found in imported.items() if found.exact}
    tuner = (
        None
        if options.tune == tuning.DEFAULT_MODE or options.weights is None
        else tuning.tuner(options.tune, options.weights, options.tune_cache)
    )
    with _timed(seconds, "passes"):
        try:
            pass_report = pipeline.run(
                onnx_model,
                target,
                target.expected_fusions(spec.attention_layers, moe_layers),
                options.weights,
                capacity=options.capacity,
                dtype=options.dtype,
                logits=logits_positions(options),
                on_pass=lambda done, total, _: progress.count(done, total, "passes"),
                moe=moe_layers > 0,
                choose=tuner,
                imported=exact,
                scales=scales,
                rotary_positions=spec.max_positions if installed_at_least("onnxruntime", ROTARY_IN_ATTENTION) else None,
            )
            del exact, scales
        except UnsupportedByTensorRT as e:
            raise ArtifactError(f"{checkpoint_dir}: {e}") from e
    if cache_scales is not None:
        try:
            QuantizeKVCache(cache_scales)(onnx_model)
        except KVCacheRefused as e:
            raise ArtifactError(f"{checkpoint_dir}: --kv-dtype {options.kv_dtype}: {e}") from e
        io = replace(io, kv_dtype=str(options.kv_dtype))
    imported_entry = (
        None
        if header is None
        else prequantized.manifest_entry(header, imported, pass_report.imported, options.weights is not None)
        # what the imported codes are multiplied with: float activations, or int8 ones (MatMulNBits'
        # accuracy level 4, the fast path)
        | {"activations": "float" if options.weights is None or not options.weights.accuracy_level else "int8"}
    )
    del imported
    graph_io = _graph_contract(onnx_model, io, target, options.capacity)
    experts = moe_graph.experts(onnx_model, spec)
    engine_entry: dict[str, Any] | None = None
    next_step = None
    try:
        with staged(output) as staging, ExitStack() as helpers:
            with _timed(seconds, "emit"):
                emit.write_onnx(onnx_model, staging)
                # the compiled session never shares the machine with the graph's weights: they
                # are in the file now, and dropped here, without a full collection of the graph
                _drop_weights(onnx_model)
                del onnx_model
                emit.copy_tokenizer(ckpt, staging)
                emit.write_generation_config(ckpt, spec, staging)
                if genai.drives(target, graph_io):
                    genai.write_genai_config(staging, spec, graph_io, emit.generation_config(ckpt, spec))
            # the files are final (the gate only reads the graph): hashed while it runs
            emitted = helpers.enter_context(hashing.Pending(staging.iterdir()))
            provider = gate_provider(target.providers)
            unquantized = options.weights is None and not pass_report.imported and options.kv_dtype is None
            with _timed(seconds, "verify"), verifiable(staging, graph_io, unquantized, provider) as session:
                report = gate(progress.CountedSession(session))
                if lowering.stamped and not report.passed:
                    if lowering.entry is not None:  # a later build traces afresh (and is refused alike)
                        lowering_cache.forget(lowering.entry)
                    raise _StampedGraphRefused(report.failures())
                _require_parity(report, str(checkpoint_dir), options.tune)
                computed_in = session.io.kv_dtype  # the dtype onnxruntime ran the graph in
                del session
            if target.emitter == TENSORRT_ENGINE:
                if (missing := trt_engine.unavailable()) is None:
                    with _timed(seconds, "engine"):
                        engine_entry = trt_engine.build_engine(staging, graph_io, options.engine)
                else:
                    next_step = (
                        f"the graph is built and verified; {missing}, so no engine was built: run "
                        f"`kvforge build-engine {output}` on a machine with TensorRT >= {trt_engine.MIN_TENSORRT} "
                        "and a GPU to add it"
                    )
            with _timed(seconds, "publish"):
                source_hashes = sources.result()
                if imported_entry is not None and ckpt.gguf is not None:  # the file the codes were read from
                    imported_entry["sha256"] = source_hashes[ckpt.gguf.name]
                written = manifest.write(
                    staging,
                    spec=spec,
                    io=graph_io,
                    sources=source_hashes,
                    flags=options.flags(),
                    passes=pass_report.to_dict(timings=False),
                    parity=report.to_dict() | {"computed_in": computed_in, "verified_on": provider},
                    hub=ckpt.hub,
                    experts=experts,
                    kernels=None if tuner is None else tuning.kernels_entry(options.tune, pass_report.kernel_forms),
                    file_hashes=emitted.result(),
                    imported=imported_entry,
                )
                if engine_entry is not None:
                    written = trt_engine.with_engine(written, staging, engine_entry)
                    emit.write_json(staging / MANIFEST, written)
                publish(staging, output, force=options.force)
    except OSError as e:  # a full disk, a read-only or vanished directory: nothing was published
        where = e.filename or output.parent
        raise ArtifactError(
            f"{where}: cannot write the artifact ({write_failure(e, output)}); nothing was published"
        ) from e
    log.info("published %s (%s)", output, report.summary())
    return BuildResult(output, written, report, pass_report, seconds, next_step, lowering)


_REFUSED = "the stamped graph failed the parity gate"

# What a GGUF file holding quantized matrices builds as when no `weights` are asked for: its
# codes as they are, at MatMulNBits' accuracy level 4 (int8 activations, the fast path), and
# any matrix the file keeps in float at symmetric int4 (no mix: the file chose each tensor's
# bits); judged by the distribution gate.
IMPORTED_DEFAULT = WeightQuantization(4, symmetric=True, mix="none")


def _gguf_default(options: BuildOptions, ckpt: checkpoints.Checkpoint) -> BuildOptions:
    """The options a build of `ckpt` runs with: a GGUF file's quantized codes at int8 activations
    (`IMPORTED_DEFAULT`) unless `weights` or `exact_activations` say otherwise, where the target
    reads the codes (`pipeline.imports_codes`); other checkpoints, as asked."""
    if ckpt.gguf is None:
        if options.exact_activations:
            raise ArtifactError(
                f"{ckpt.path}: exact activations choose how a GGUF file's own codes are computed, and this is "
                "not a GGUF file (its build computes in float unless --weights is given): drop --exact-activations"
            )
        return options
    if (
        options.weights is not None
        or options.exact_activations
        or not pipeline.imports_codes(options.target)
        or not gguf.holds_quantized(ckpt.gguf)
    ):
        return options
    if options.tolerance is not None:
        raise ArtifactError(
            f"{ckpt.gguf}: --tolerance {options.tolerance:g} sets the float gate; a quantized GGUF file builds "
            "with int8 activations, judged by its next-token distributions: add --exact-activations for the "
            "float gate, or drop --tolerance"
        )
    log.info("%s: its quantized codes at int8 activations (--exact-activations computes them in float)", ckpt.gguf)
    return replace(options, weights=IMPORTED_DEFAULT)


def _calibrate(
    model: torch.nn.Module, ckpt: checkpoints.Checkpoint, options: BuildOptions, seconds: dict[str, float]
) -> dict[str, Any] | None:
    """Calibrated scales of the symmetric int4 weights (the eager model's weights become their
    codes' values), or None where the build does not calibrate."""
    if options.calibration is None or options.weights is None or not options.calibrating:
        return None
    with _timed(seconds, "calibrate"):
        return calibrating.calibrate(model, options.calibration, ckpt.path, options.weights)


@contextmanager
def _scratch(output: Path) -> Iterator[Path]:
    """A locked staging directory beside `output` for what the build keeps on disk while it runs
    (a build that cleans up leftovers leaves it alone), removed when the block ends."""
    with staged(output) as scratch:
        try:
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _write_weights(model: torch.nn.Module, names: list[str], directory: Path) -> None:
    """The parameters `names` of `model` as raw bytes, a file each (nothing in them executes)."""
    for i, name in enumerate(names):
        model.get_parameter(name).detach().contiguous().view(torch.uint8).numpy().tofile(directory / f"{i}.bin")


def _read_weights(model: torch.nn.Module, names: list[str], directory: Path) -> None:
    """What `_write_weights` wrote, into the same parameters of a freshly loaded `model`."""
    with torch.no_grad():
        for i, name in enumerate(names):
            weight = model.get_parameter(name)
            data = torch.from_numpy(np.fromfile(directory / f"{i}.bin", np.uint8))
            weight.copy_(data.view(weight.dtype).reshape(weight.shape))


def _check_kv_dtype(options: BuildOptions) -> None:
    """--kv-dtype int8 needs onnxruntime's GroupQueryAttention, whose kernel reads an int8 cache."""
    if options.kv_dtype is None:
        return
    if options.kv_dtype not in KV_DTYPES:
        raise ArtifactError(f"--kv-dtype {options.kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}, or leave it out")
    if ("com.microsoft", "GroupQueryAttention") not in options.target.in_place_cache_ops:
        able = ", ".join(
            name for name, t in TARGETS.items() if ("com.microsoft", "GroupQueryAttention") in t.in_place_cache_ops
        )
        raise ArtifactError(
            f"--kv-dtype {options.kv_dtype}: --target {options.target.name} keeps its cache in the compute dtype; "
            f"an int8 cache is onnxruntime's GroupQueryAttention's (--target {able}): change --target, or drop "
            "--kv-dtype"
        )


def calibrated_kv_scales(reference: Session, tokenizer_dir: Path) -> dict[str, np.ndarray]:
    """The int8 cache's scales from the eager model's cache over the calibration text's windows."""
    encode = TokenizerBundle.load(tokenizer_dir).encode
    text = calibrating.builtin_text().read_text(encoding="utf-8")
    return kv_scales.calibrate(reference, kv_scales.windows(encode(text), reference.io.vocab_size))


def _may_be_gguf(checkpoint_dir: Path | str) -> bool:
    """Whether `checkpoint_dir` is a GGUF file here or may name one (a Hub id's snapshot, read later)."""
    path = Path(checkpoint_dir)
    if path.exists():
        return gguf.find(path) is not None
    return not path.is_absolute()


def _check_tune(options: BuildOptions, weights_may_default: bool = False) -> None:
    """--tune fast|full chooses quantized MatMulNBits forms: refused where there are none
    (`weights_may_default`: not yet for want of --weights, which a GGUF file's build defaults)."""
    tuning.check_mode(options.tune)
    if options.tune == tuning.DEFAULT_MODE:
        return
    if options.weights is None and not weights_may_default:
        raise ArtifactError(
            f"--tune {options.tune} chooses the kernel form of quantized weights; add --weights int8|int4, "
            "or drop --tune"
        )
    if not options.target.kernel_tuning:
        able = ", ".join(name for name, t in TARGETS.items() if t.kernel_tuning)
        raise ArtifactError(
            f"--tune {options.tune}: --target {options.target.name} writes no kernel-specific forms to choose from "
            f"(kernel tuning is for --target {able}); drop --tune"
        )


def _require_parity(report: ParityReport | DistributionReport, where: str, mode: str) -> None:
    """The gate's verdict; a tuned build that fails it says which choice to undo."""
    try:
        require_parity(report, where)
    except ParityError as e:
        if mode == tuning.DEFAULT_MODE:
            raise
        raise ParityError(
            f"{e}; the kernel forms --tune {mode} chose (larger blocks, or a different accuracy level) "
            "cost this accuracy: build with --tune off",
            e.report,
        ) from e


class _StampedGraphRefused(ParityError):
    """The parity gate refused a stamped graph (nothing was published)."""


def _lower(
    model: torch.nn.Module,
    spec: DecoderSpec,
    io: DecoderIO,
    stamping: bool,
    seconds: dict[str, float],
    reason: str,
    cache: Path | None,
) -> tuple[ir.Model, stamp.Lowering]:
    """The graph of `model` (its last reference: freed once lowered), stamped from two traced
    layers per layer kind where `stamping` and the structure is proven, else of the whole stack.
    `cache`: the lowering cache's directory (None: off)."""
    if stamping:
        try:
            with _timed(seconds, "export"):
                cut = stamp.export(model, spec, io, cache)
            with _timed(seconds, "lower"):
                onnx_model, lowering = stamp.lower(cut, model, io)
            del cut, model
            return onnx_model, lowering
        except stamp.Unstampable as e:
            cut = None
            reason = str(e)
            log.info("stamping not possible (%s); lowering the whole stack", reason)
    with _timed(seconds, "export"):
        program = export_decoder(model, spec, io)
    with _timed(seconds, "lower"):
        onnx_model = to_onnx(program, io)
    del program, model
    return onnx_model, stamp.whole(spec, reason)


def _drop_weights(model: ir.Model) -> None:
    """Free the weights of a graph that has been written: its initializers no longer hold them."""
    for value in model.graph.initializers.values():
        value.const_value = None


def _check_layer_states(io: DecoderIO, target: Target, spec: DecoderSpec) -> None:
    if io.layers is not None and not target.layer_states:
        kinds = sorted({layer.kind for layer in io.layers} - {"attention"})
        able = [name for name, t in TARGETS.items() if t.layer_states]
        raise ArtifactError(
            f"{spec.model_type}: its {', '.join(kinds)} layers keep a fixed-size state, which kvforge compiles for "
            f"--target {', '.join(able)} only so far; build with --target {able[0]}"
        )


def _check_fits(ckpt: checkpoints.Checkpoint, spec: DecoderSpec, options: BuildOptions) -> None:
    """Refuse, before any work, a build whose artifact would not fit in --device-memory."""
    assert options.device_memory is not None
    seq = options.memory_seq or spec.max_positions
    half = options.dtype != "float32"  # fp16 and bf16 take the same bytes
    compute_bytes = 2 if half else 4
    windows = layer_windows(ckpt.config, spec) if options.target.bounded_windows else None
    fp = footprint(ckpt, spec, batch=options.memory_batch, seq=seq, compute_bytes=compute_bytes, layer_windows=windows)
    compute = "fp16" if half else "fp32"
    quant = options.weights
    layout = None
    if quant is not None:
        # MatMulNBits reads float16 scales; a DequantizeLinear target, the compute dtype's
        nbits = options.target.quantization_form(quant.bits) == "matmul_nbits"
        layout = QuantLayout(
            quant.bits,
            quant.block_size,
            zero_points=not quant.symmetric,
            free_min=quant.free_min,
            mix=quant.mixed,
            scale_bytes=2 if nbits else compute_bytes,
            wide_blocks=nbits,
            table_block=table_block(options.target.embedding_form, quant.bits, quant.block_size, quant.free_min),
            tied_lookup=options.target.tied_lookup,
        )
    # the checkpoint's own quantized weights, where the target imports them, as the import writes them
    imported = None
    if pipeline.imports_codes(options.target):
        imported = imported_weight_bytes(ckpt, spec, layout, compute_bytes)
    if imported is not None:
        weights = imported
    elif layout is None:
        weights = fp.weight_bytes_at[compute]
    else:
        weights = quantized_weight_bytes(ckpt, spec, layout, compute_bytes)
    kv = fp.kv_bytes_total[compute if options.kv_dtype is None else options.kv_dtype]
    cache = options.dtype if options.kv_dtype is None else options.kv_dtype
    precision = _DTYPE_NAMES[options.dtype] if options.weights is None else options.weights.name
    if weights + kv > options.device_memory:
        raise ArtifactError(
            f"{ckpt.path}: the built model needs {format_bytes(weights + kv)} at run time ({precision} weights "
            f"{format_bytes(weights)} + {cache} KV cache {format_bytes(kv)} for batch {options.memory_batch} × "
            f"{seq} tokens), more than --device-memory {format_bytes(options.device_memory)}; "
            + ("quantize the weights (--weights int4), " if precision != "int4" else "")
            + "plan for a smaller --batch or --seq, or a larger device"
        )


def _target_options(options: BuildOptions, spec: DecoderSpec) -> BuildOptions:
    """The settings the target's record calls for, resolved and checked before any work: a
    fixed capacity (default: the model's context), symmetric-only weights."""
    target = options.target
    if target.symmetric_only and options.weights is not None and not options.weights.symmetric:
        raise ArtifactError(
            f"--target {target.name} takes symmetric weight quantization only (its runtime requires a zero "
            "zero-point); drop the asymmetric setting"
        )
    if target.symmetric_only and options.weights is not None and options.weights.free_min:
        raise ArtifactError(
            f"--target {target.name} takes symmetric weight quantization only (a float minimum per block is "
            "not checked against its parser); drop --free-min"
        )
    if not target.fixed_capacity:
        return options
    capacity = options.capacity if options.capacity is not None else spec.max_positions
    if not 1 <= capacity <= spec.max_positions:
        raise ArtifactError(
            f"--capacity {capacity} must be between 1 and the model's context of {spec.max_positions} positions"
        )
    return replace(options, capacity=capacity)


def logits_positions(options: BuildOptions) -> str:
    """The positions the build's graph returns logits for (`BuildOptions.logits`, the target's default)."""
    if options.logits is not None:
        return options.logits
    return options.target.default_logits


def _check_logits(options: BuildOptions) -> None:
    if options.logits is not None and options.logits not in pipeline.LOGITS_POSITIONS:
        raise ArtifactError(f"logits must be one of {', '.join(pipeline.LOGITS_POSITIONS)}, got {options.logits!r}")
    if options.logits == "keep" and not options.target.logits_to_keep:
        raise ArtifactError(
            f"--logits keep: target {options.target.name} takes no logits_to_keep input (its runtime would read the "
            "input's default as a constant); use --logits last, or --logits all for speculative decoding"
        )


def _graph_contract(model: ir.Model, io: DecoderIO, target: Target, capacity: int | None = None) -> DecoderIO:
    """The contract the passes made of the exported one, applied to the graph's I/O:
    `shared` KV when every present tensor comes from an op that updates the cache in
    place (the target's `in_place_cache_ops`), `keep` logits when the graph takes
    `logits_to_keep`, `last` when the LM head only sees the last position."""
    outputs = {v.name: v for v in model.graph.outputs}
    producers = {name: v.producer() for name, v in outputs.items()}
    in_place = all(
        (node := producers.get(name)) is not None and (node.domain, node.op_type) in target.in_place_cache_ops
        for name in io.present_names
    )
    logits_shape = outputs["logits"].shape
    last_only = logits_shape is not None and len(logits_shape) == 3 and logits_shape[1] == 1
    keeps = any(value.name == KEEP_INPUT for value in model.graph.inputs)
    final = replace(
        io,
        kv_mode="shared" if in_place else "concat",
        logits_positions="keep" if keeps else "last" if last_only else "all",
        capacity=capacity if in_place else None,
    )
    apply_contract(model.graph, final)
    return final


@contextmanager
def _timed(seconds: dict[str, float], stage: str, shown: bool = True) -> Iterator[None]:
    """Time `stage` into `seconds`; `shown`: as a stage of the progress display too (False: it
    shows its own, or is too short to show)."""
    log.info("%s...", stage)
    start = time.perf_counter()
    with progress.stage(stage) if shown else nullcontext():
        yield
    seconds[stage] = seconds.get(stage, 0.0) + time.perf_counter() - start  # a stage run again adds up
    # the process's peak so far: the stage after which it grows is where the memory goes
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    log.info("%s: %.1f s, peak resident memory so far %s", stage, seconds[stage], format_bytes(peak))
