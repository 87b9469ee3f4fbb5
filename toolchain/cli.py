"""The `kvforge` command line, its build side: build, verify, inspect, build-engine and
export-triton, registered on the group of `kvforge.runners.cli` when this module is imported
(`kvforge.cli` imports it when one of them runs or the help lists them).

Importing this module loads click and a few small modules of ours: the heavy libraries (torch,
transformers, onnx, onnxruntime) load inside a command, once its arguments are checked.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from kvforge.passes.storage import MIXES
from kvforge.passes.targets import DEFAULT_TARGET, TARGETS
from kvforge.runners.cli import (
    _RUNTIME_HELP,
    EXIT_OK,
    _emit_json,
    _engine_options,
    _guarded,
    _json_option,
    _own_process,
    _require_artifact,
    _runtime_option,
    main,
    serving_option,
)
from kvforge.runners.errors import CheckpointError, KvforgeError
from kvforge.toolchain import tune as tuning

# A checkpoint directory, a GGUF file, or a Hub id (ORG/NAME) resolved in the local Hugging Face
# cache: a string, so that what was typed decides (an existing path wins over an id).
_CHECKPOINT = click.Path(exists=False)
_REVISION = click.option(
    "--revision", default=None, help="With a Hub id: the branch, tag or commit to use from the cache. Default: main."
)

_CONTEXT = click.option(
    "--context",
    type=click.IntRange(1),
    default=None,
    help="Positions (prompt + new tokens) the artifact serves, at most config.json's. Default: config.json's, else "
    "tokenizer_config.json's model_max_length; needed where neither gives one (ALiBi models such as bloom).",
)

# --dtype by the dtype it names (kvforge.toolchain.build.DTYPES, inverted), for the help text
_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _require_checkpoint_path(checkpoint: str, revision: str | None, instead: str) -> None:
    """Refuse a checkpoint that is not there, or an artifact given as one, before the libraries
    that would read it load. `instead`: what to do with an artifact given here."""
    from kvforge.runners.manifest import MANIFEST
    from kvforge.toolchain import hub

    located = hub.locate(checkpoint, revision)  # an id missing from the cache is refused here
    if not os.path.lexists(located):
        raise CheckpointError(
            f"{located}: no such directory; expected a local checkpoint directory, a .gguf file, or a Hub id "
            "ORG/NAME in the local Hugging Face cache"
        )
    if (located / MANIFEST).is_file():
        raise CheckpointError(f"{located}: this is a kvforge artifact, not a checkpoint: {instead}")


def _tolerance_option(default: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The parity gate's bound, shared by `build` and `verify`."""
    return click.option(
        "--tolerance",
        type=float,
        default=None,
        help="The parity gate's largest error, as a fraction of each output's scale (a logits row's standard "
        f"deviation, a present tensor's RMS). Default: {default} (fp32 2e-4, fp16 0.1, bf16 0.3).",
    )


def _device_memory(text: str) -> int:
    """--device-memory's bytes (`kvforge.runners.units`), above 0."""
    from kvforge.runners.units import parse_bytes

    size = parse_bytes(text, "--device-memory: memory size")
    if size <= 0:
        raise KvforgeError(f"--device-memory: memory size {text!r}: write a size above 0, e.g. 24GiB or 16GB")
    return size


def _calibration(choice: str | None, quantization: Any) -> Any:
    """--calibration: the text an int4 build without zero points (symmetric or --free-min)
    calibrates on, None where the build rounds to nearest (the default); refused where it has
    nothing to calibrate."""
    from kvforge.toolchain.calibration import NONE, CalibrationText, calibratable

    if choice is None or choice == NONE:
        return None
    if not calibratable(quantization):
        raise click.BadParameter(
            f"{choice}: calibration chooses int4 weights without zero points; this build is "
            f"{'asymmetric ' if quantization is not None and quantization.bits == 4 else ''}"
            f"{quantization.name if quantization is not None else 'unquantized'}: add --weights int4 (without "
            "--asymmetric), or drop --calibration",
            param_hint="--calibration",
        )
    return CalibrationText.resolve(choice)


@main.command()
@click.argument("checkpoint", type=_CHECKPOINT)
@_REVISION
@click.option("-q", "--quiet", is_flag=True, help="No progress output (the result and errors are still printed).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="Artifact directory to create.")
@click.option("--force", is_flag=True, help="Replace an existing artifact at --output.")
@click.option(
    "--target",
    type=click.Choice(list(TARGETS)),
    default=DEFAULT_TARGET,
    show_default=True,
    help="; ".join(f"{t.name}: {t.summary}" for t in TARGETS.values()) + ".",
)
@click.option(
    "--capacity",
    type=click.IntRange(1),
    default=None,
    help=", ".join(t.name for t in TARGETS.values() if t.fixed_capacity)
    + ": the KV cache's fixed length S_max (prompt + new tokens). Default: the model's context.",
)
@_CONTEXT
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "fp16", "bf16"]),
    default=None,
    help="Compute dtype: activations, KV cache and the weights left unquantized. Logits are fp32 always. "
    "Default: the target's ("
    + ", ".join(f"{t.name} {_SHORT_DTYPES[t.default_dtype]}" for t in TARGETS.values())
    + ").",
)
@click.option(
    "--weights",
    type=click.Choice(["int8", "int4"]),
    default=None,
    help="Weight-only quantization of the MatMul weights and the token embeddings (block-wise; int4 calibrated, "
    "see --calibration). Default: none.",
)
@click.option(
    "--exact-activations",
    is_flag=True,
    help="A GGUF file's own quantized codes computed with float activations, the artifact computing what the "
    "dequantized file does (judged by the float gate), several times slower to decode. Default for a quantized "
    "GGUF file: its codes at int8 activations (as --weights int4 builds it), judged by the distribution gate.",
)
@click.option(
    "--block-size", type=click.Choice(["32", "64", "128"]), default="32", show_default=True, help="Weights per scale."
)
@click.option(
    "--kv-dtype",
    type=click.Choice(["int8"]),
    default=None,
    help="Keep the KV cache as int8 codes with per-channel scales calibrated at build time (a quarter of a float32 "
    "cache's bytes; onnxruntime's GroupQueryAttention: --target ort-cpu or ort-cuda). Judged by the distribution "
    "gate. Default: the compute dtype.",
)
@click.option(
    "--asymmetric/--symmetric",
    default=None,
    help="With --weights: an integer zero point per block of weights, or none. Default: zero points at int4 where "
    "the target's kernel reads them (ort-cpu, ort-cuda, onnx) and the weights are neither calibrated nor given "
    "--free-min; symmetric otherwise, and at int8.",
)
@click.option(
    "--free-min",
    is_flag=True,
    help="With --weights int4: each block of weights as a float step times codes 0..15 plus a float minimum, as "
    "GGUF's Q4_1 holds a block (the closest 4-bit form; exact on weights that were such blocks), the minimum "
    "added through a small float term per projection. Decodes slower than the symmetric form (docs/performance.md).",
)
@click.option(
    "--calibration",
    metavar="builtin|none|FILE",
    default=None,
    help="With --weights int4 (without --asymmetric; calibrated weights take no zero points): the text whose "
    "activations choose each weight's scales "
    "and codes (GPTQ-style error feedback; the build takes minutes longer). builtin: the text kvforge ships; none: "
    "round to nearest (the default); or a UTF-8 text file. Recorded in the manifest with its sha256.",
)
@click.option(
    "--tune",
    type=click.Choice(list(tuning.MODES)),
    default=tuning.DEFAULT_MODE,
    show_default=True,
    help="With --weights on "
    + ", ".join(t.name for t in TARGETS.values() if t.kernel_tuning)
    + ": each weight's MatMulNBits block size and accuracy level. off: --block-size and accuracy level 4 "
    "everywhere (the same bytes on every machine); fast: timed here per weight shape at decode (M=1); full: also "
    "at prefill and with the float path. Timings are cached (KVFORGE_TUNE_CACHE, default "
    "~/.cache/kvforge/tune.json); the same cache gives the same bytes.",
)
@click.option(
    "--keep",
    multiple=True,
    metavar="PATTERN",
    help="Leave weights whose name matches this glob at full precision (repeatable); 'lm_head' names the LM head, "
    "'embeddings' the token-embedding table.",
)
@click.option(
    "--int8",
    "int8",
    multiple=True,
    metavar="PATTERN",
    help="With --weights int4: quantize weights whose name matches this glob to int8 instead (repeatable); "
    "'lm_head' names the LM head, 'embeddings' the token-embedding table. A mixed recipe, like llama.cpp's "
    "K-quant mixes.",
)
@click.option(
    "--mix",
    type=click.Choice(list(MIXES)),
    default=None,
    help="With --weights int4: which weights stay at int8 besides --int8's. all_attention (the default): the "
    "attention's q/k/v projections of every layer and the down projection in the layers llama.cpp's Q4_K_M gives "
    "more bits (the first and last eighth and every third layer between); attention: q/k/v in those layers; "
    "attention_down: q/k/v in those layers and every layer's down projection; q4_k_m: Q4_K_M's choice, q/k/v "
    "and the down projection in those layers and the LM head (more bytes than Q4_K_M); none: every weight at int4.",
)
@click.option(
    "--device-memory",
    metavar="SIZE",
    default=None,
    help="Refuse up front if weights + KV cache (for --batch × --seq) exceed SIZE, e.g. 24GiB.",
)
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1), help="Sequences, for --device-memory.")
@click.option("--seq", default=None, type=click.IntRange(1), help="Tokens per sequence, for --device-memory.")
@click.option("--report", is_flag=True, help="Print what each graph pass did (nodes before/after, fusions, time).")
@click.option("--explain", is_flag=True, help="For each expected fusion that did not fire: the node and the reason.")
@click.option(
    "--allow-pickle", is_flag=True, help="Accept pytorch_model.bin (read with torch.load(weights_only=True))."
)
@click.option(
    "--decode-steps",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Greedy decode steps the verification gate compares.",
)
@click.option(
    "--logits",
    type=click.Choice(["keep", "last", "all"]),
    default=None,
    help="Positions the graph returns logits for: keep (default where the target takes it: as many last "
    "positions as the runner asks for, one for generation, every one fed for a speculative verify step), "
    "last (the last one only; tensorrt's default), or all (every one).",
)
@click.option(
    "--whole-stack",
    is_flag=True,
    help="Export and lower every layer (default: each distinct layer kind once, the stack stamped out from it).",
)
@click.option(
    "--no-lowering-cache",
    is_flag=True,
    help="Trace and lower the layers afresh, and keep nothing (default: a rebuild of the same model reads its "
    "lowered layers from KVFORGE_LOWERING_CACHE, else ~/.cache/kvforge/lowered).",
)
@_tolerance_option("the compute dtype's")
@_json_option("the artifact's paths, hashes, gate figures and stage times")
@_guarded
def build(
    checkpoint: str,
    revision: str | None,
    quiet: bool,
    output: Path,
    target: str,
    dtype: str | None,
    weights: str | None,
    exact_activations: bool,
    block_size: str,
    kv_dtype: str | None,
    asymmetric: bool | None,
    free_min: bool,
    calibration: str | None,
    tune: str,
    keep: tuple[str, ...],
    int8: tuple[str, ...],
    mix: str | None,
    device_memory: str | None,
    batch: int,
    seq: int | None,
    force: bool,
    report: bool,
    explain: bool,
    allow_pickle: bool,
    decode_steps: int,
    capacity: int | None,
    context: int | None,
    whole_stack: bool,
    no_lowering_cache: bool,
    tolerance: float | None,
    logits: str | None,
    as_json: bool,
) -> None:
    """Export CHECKPOINT, lower it to ONNX, verify it against the eager model, publish it to -o.

    CHECKPOINT is a checkpoint directory, a GGUF file (or a directory holding one), or a Hub id
    (ORG/NAME) already in the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub); nothing
    is downloaded.
    """
    from kvforge.toolchain import progress
    from kvforge.toolchain.publish import check_output, check_writable

    # the summary's first stage: from the process's start where the command has one of its own
    began = time.perf_counter() - ((_own_process() and progress.process_seconds()) or 0.0)
    # what can be refused without torch is refused before it loads
    _require_checkpoint_path(
        checkpoint,
        revision,
        f"to rebuild it, pass the checkpoint it was built from; to run it, `kvforge generate {checkpoint} PROMPT`",
    )
    check_output(Path(os.path.abspath(output)), force)
    check_writable(Path(os.path.abspath(output)))
    _check_weight_flags(weights, asymmetric, int8, free_min, exact_activations, mix)
    _require_build_packages()  # a runtime install: one line saying what to install, before any progress
    verbose = bool(click.get_current_context().find_root().params.get("verbose"))
    # -v logs a line as each stage starts and ends: a progress display would say it all again
    with progress.interruptible(), progress.reporting(progress.for_stream(sys.stderr, quiet or verbose)):
        with progress.stage("startup"):  # torch, transformers and onnx load: seconds, before any stage
            from kvforge.passes.quantize import WeightQuantization
            from kvforge.toolchain.build import DTYPES, BuildOptions
            from kvforge.toolchain.build import build as run_build

        if _own_process():
            # What the imports made lives as long as the process: frozen out of the collector's
            # sight, every full collection while the build traces and lowers scans far fewer objects.
            gc.freeze()
        quantization = None
        if weights is not None:
            quantization = WeightQuantization(
                int(weights[3:]),
                int(block_size),
                None if asymmetric is None else not asymmetric,
                keep,
                int8=int8,
                free_min=free_min,
                mix=mix,
            )
        options = BuildOptions(
            force=force,
            allow_pickle=allow_pickle,
            decode_steps=decode_steps,
            target=TARGETS[target],
            dtype=TARGETS[target].default_dtype if dtype is None else DTYPES[dtype],
            weights=quantization,
            capacity=capacity,
            context=context,
            device_memory=None if device_memory is None else _device_memory(device_memory),
            memory_batch=batch,
            memory_seq=seq,
            revision=revision,
            tolerance=tolerance,
            logits=logits,
            stamp=not whole_stack,
            lowering_cache=not no_lowering_cache,
            tune=tune,
            calibration=_calibration(calibration, quantization),
            kv_dtype=kv_dtype,
            exact_activations=exact_activations,
        )
        startup = time.perf_counter() - began
        result = run_build(checkpoint, output, options)
    seconds = {"startup": startup, **result.seconds}
    wall = time.perf_counter() - began
    if wall - sum(seconds.values()) >= 0.05:  # the work between stages: the summary accounts for every second
        seconds["other"] = wall - sum(seconds.values())
    if report:
        click.echo(result.passes.summary(), err=True)
    if explain:
        click.echo(result.passes.explanation(), err=True)
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in seconds.items())
    click.echo(f"built {result.output} in {wall:.1f}s ({stages})", err=True)
    if result.lowering is not None:
        click.echo(result.lowering.summary(), err=True)
    click.echo(result.parity.summary(), err=True)
    if result.next_step:
        click.echo(result.next_step, err=True)
    if as_json:
        _emit_json(_build_json(result, seconds))


def _require_build_packages() -> None:
    """Refuse where the compiler's packages are not installed (`pip install kvforge` is the
    runtime): `_guarded` turns the error into one line naming the package and what to install."""
    for name in ("torch", "transformers", "onnx", "onnx_ir", "onnxscript"):
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _check_weight_flags(
    weights: str | None,
    asymmetric: bool | None,
    int8: tuple[str, ...],
    free_min: bool,
    exact_activations: bool,
    mix: str | None = None,
) -> None:
    """Refuse flags that only an int4 build takes, or that contradict --weights, before the libraries load."""
    if exact_activations and weights is not None:
        raise click.BadParameter(
            f"computes a GGUF file's own codes in float; --weights {weights} quantizes the weights and the "
            "activations: drop one of the two",
            param_hint="--exact-activations",
        )
    if int8 and weights != "int4":
        raise click.BadParameter(
            f"picks weights to keep at int8 in an int4 build; this build is {weights or 'unquantized'}: "
            "add --weights int4, or drop --int8",
            param_hint="--int8",
        )
    if mix is not None and weights != "int4":
        raise click.BadParameter(
            f"picks weights to keep at int8 in an int4 build; this build is {weights or 'unquantized'}: "
            "add --weights int4, or drop --mix",
            param_hint="--mix",
        )
    if asymmetric is not None and weights is None:
        flag = "--asymmetric" if asymmetric else "--symmetric"
        raise click.BadParameter(
            f"chooses how --weights quantizes; this build is unquantized: add --weights int4 (or int8), or drop {flag}",
            param_hint=flag,
        )
    if free_min and (weights != "int4" or asymmetric):
        raise click.BadParameter(
            "a float minimum per block is a 4-bit form without zero points: add --weights int4"
            + (", and drop --asymmetric" if asymmetric else "")
            + ", or drop --free-min",
            param_hint="--free-min",
        )


def _build_json(result: Any, seconds: dict[str, float]) -> dict[str, Any]:
    """`build --json`: what CI keeps of a build (docs/cli.md lists the fields)."""
    from kvforge.runners.manifest import MANIFEST

    manifest = result.manifest
    return {
        "ok": True,
        "exit_code": EXIT_OK,
        "output": str(result.output),
        "manifest": str(result.output / MANIFEST),
        "target": manifest.get("target"),
        "flags": manifest.get("flags"),
        "files": manifest.get("files"),
        "sources": manifest.get("sources"),
        # a pre-quantized checkpoint's (a GGUF file's) codes: how they were read and computed
        "imported": None
        if manifest.get("imported_weights") is None
        else {k: v for k, v in manifest["imported_weights"].items() if k != "weights"},
        "gate": result.parity.to_dict() | {"summary": result.parity.summary()},
        "lowering": None if result.lowering is None else result.lowering.summary(),
        "seconds": seconds,
        "next_step": result.next_step,
    }


@main.command("build-engine")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1), help="Rows per step, both profiles.")
@click.option(
    "--max-prefill",
    default=None,
    type=click.IntRange(1),
    help="New tokens per row in one prefill step; longer prompts are prefilled in chunks. Default: 512 or the "
    "capacity, the smaller.",
)
@click.option(
    "--opt-batch", default=1, show_default=True, type=click.IntRange(1), help="The batch kernels are tuned for."
)
@click.option(
    "--optimization-level", default=3, show_default=True, type=click.IntRange(0, 5), help="TensorRT builder level."
)
@click.option(
    "--workspace-mib", default=None, type=click.IntRange(1), help="Workspace memory limit. Default: TensorRT's."
)
@click.option(
    "--timing-cache",
    "timing_cache_dir",
    default="~/.cache/kvforge/tensorrt",
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of timing caches, one per TensorRT version and GPU.",
)
@_guarded
def build_engine(artifact: Path, **engine: Any) -> None:
    """Build the TensorRT engine of ARTIFACT (a --target tensorrt artifact) on this GPU machine."""
    _require_artifact(artifact)
    from kvforge.toolchain.emit.tensorrt import EngineOptions, add_engine

    written = add_engine(artifact, EngineOptions(**engine))
    entry = written["engine"]
    click.echo(
        f"built {artifact / entry['file']} (TensorRT {entry['tensorrt']}, {entry['gpu']}, "
        f"compute capability {entry['compute_capability']}, capacity {entry['capacity']})",
        err=True,
    )


@main.command("export-triton")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "-o", "--output", required=True, type=click.Path(path_type=Path), help="Model repository directory to create."
)
@click.option("--force", is_flag=True, help="Replace a repository kvforge wrote at --output.")
@click.option(
    "--kind",
    type=click.Choice(["cpu", "gpu"]),
    default="cpu",
    show_default=True,
    help="Instance kind: KIND_CPU, or KIND_GPU (onnxruntime-gpu in the Python backend's environment).",
)
@click.option(
    "--instances",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Model instances (processes, each with its own weights and KV cache); per GPU with --kind gpu.",
)
@click.option("--name", default=None, help="Triton model name. Default: ARTIFACT's directory name.")
@_engine_options(", per instance")
@serving_option(
    "prefix_cache_bytes",
    "Memory per instance for the KV of prompt prefixes reused across requests (e.g. 512M, 2G; 0: off). "
    "Default: a quarter of the memory available when the instance loads.",
)
@_runtime_option(
    "auto: as --kind says; ort: onnxruntime on the CPU (--kind cpu); ort-cuda: onnxruntime's CUDA provider "
    "(--kind gpu). The Triton backend runs onnxruntime only, so tensorrt is refused."
)
@_guarded
def export_triton(artifact: Path, output: Path, name: str | None, runtime: str, **options: Any) -> None:
    """Write a Triton Inference Server model repository that serves ARTIFACT with kvforge's engine."""
    _require_artifact(artifact)
    from kvforge.toolchain.triton import TritonOptions
    from kvforge.toolchain.triton import export_triton as run_export

    options["kind"] = _triton_kind(runtime, options["kind"], click.get_current_context())
    budget = options.pop("prefix_cache_bytes")
    if budget is not None:
        from kvforge.runners.units import parse_bytes

        try:
            options["prefix_cache_bytes"] = parse_bytes(budget, "size")
        except KvforgeError as error:
            raise click.BadParameter(str(error), param_hint="--prefix-cache-bytes") from error

    written = run_export(artifact, output, TritonOptions(name=name, **options))
    click.echo(
        f"wrote {written.path}: Triton model {written.model!r}; serving commands in {written.path / 'README.md'}",
        err=True,
    )


def _triton_kind(runtime: str, kind: str, context: click.Context) -> str:
    """The Triton instance kind --runtime asks for; a --kind given that contradicts it is refused."""
    from kvforge.runners.runtime import RuntimeUnavailable

    if runtime == "tensorrt":
        raise RuntimeUnavailable(
            "export-triton --runtime tensorrt: the Triton backend runs kvforge's engine on onnxruntime only; "
            "use --runtime ort-cuda (or serve the engine with `kvforge serve --runtime tensorrt`)"
        )
    wanted = {"ort": "cpu", "ort-cuda": "gpu"}.get(runtime)
    if wanted is None:
        return kind
    if kind != wanted and context.get_parameter_source("kind") == click.core.ParameterSource.COMMANDLINE:
        raise RuntimeUnavailable(f"--runtime {runtime} runs Triton instances of --kind {wanted}, not --kind {kind}")
    return wanted


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--checkpoint",
    required=True,
    type=_CHECKPOINT,
    help="The checkpoint the artifact was built from: a directory or a Hub id in the local cache.",
)
@_REVISION
@click.option(
    "--allow-pickle", is_flag=True, help="Accept pytorch_model.bin (read with torch.load(weights_only=True))."
)
@_runtime_option("The session the check runs ARTIFACT in; " + _RUNTIME_HELP)
@_tolerance_option("the one ARTIFACT was built with, else the compute dtype's")
@_json_option("the gate's figures")
@_guarded
def verify(
    artifact: Path,
    checkpoint: str,
    revision: str | None,
    allow_pickle: bool,
    runtime: str,
    tolerance: float | None,
    as_json: bool,
) -> None:
    """Re-run the parity check of ARTIFACT against the eager model of CHECKPOINT."""
    _require_artifact(artifact)
    _require_checkpoint_path(checkpoint, revision, "pass as --checkpoint the checkpoint ARTIFACT was built from")
    from kvforge.toolchain.build import verify as run_verify

    report = run_verify(
        artifact, checkpoint, allow_pickle=allow_pickle, revision=revision, runtime=runtime, tolerance=tolerance
    )
    if as_json:
        _emit_json(
            {
                "ok": True,
                "exit_code": EXIT_OK,
                "artifact": str(artifact.resolve()),
                "checkpoint": checkpoint,
                "gate": report.to_dict() | {"summary": report.summary()},
            }
        )
    else:
        click.echo(report.summary())


@main.command()
@click.argument("checkpoint", type=_CHECKPOINT)
@_REVISION
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1), help="Sequences held at once.")
@click.option("--seq", default=None, type=click.IntRange(1), help="Tokens per sequence. Default: the model's context.")
@_CONTEXT
@click.option(
    "--allow-pickle", is_flag=True, help="Accept pytorch_model.bin (read with torch.load(weights_only=True))."
)
@_json_option("the figures")
@_guarded
def inspect(
    checkpoint: str,
    revision: str | None,
    batch: int,
    seq: int | None,
    context: int | None,
    allow_pickle: bool,
    as_json: bool,
) -> None:
    """Parameters, weight bytes per precision and KV-cache bytes of CHECKPOINT (a directory or a cached Hub id)."""
    _require_checkpoint_path(
        checkpoint, revision, "inspect the checkpoint it was built from (its manifest.json records the build's flags)"
    )
    from kvforge.toolchain import checkpoint as checkpoints
    from kvforge.toolchain import kv_layout
    from kvforge.toolchain.footprint import footprint, format_footprint
    from kvforge.toolchain.spec import DecoderSpec

    ckpt = checkpoints.load(checkpoint, allow_pickle=allow_pickle, revision=revision)
    read = DecoderSpec.from_config(
        ckpt.config, ckpt.generation_config, context=context, tokenizer_config=checkpoints.tokenizer_config(ckpt)
    )
    layout = kv_layout.from_config(ckpt.config, read)
    if layout is None:  # only the modeling code can tell: torch and transformers load
        from kvforge.toolchain.export import cache_layout, layer_windows

        spec = cache_layout(ckpt.config, read)
        layout = spec, layer_windows(ckpt.config, spec)
    spec, windows = layout
    # the KV cache as the default target keeps it: sliding layers bounded by their windows
    if not TARGETS[DEFAULT_TARGET].bounded_windows:
        windows = None
    fp = footprint(ckpt, spec, batch=batch, seq=seq or spec.max_positions, layer_windows=windows)
    if as_json:
        _emit_json(
            {
                "ok": True,
                "exit_code": EXIT_OK,
                "checkpoint": str(ckpt.path),
                "model_type": spec.model_type,
                "parameters": sum(fp.parameters_by_dtype.values()),
                "footprint": asdict(fp),
            }
        )
    else:
        click.echo(format_footprint(fp, spec))


__all__ = ["main"]  # the whole group, its build commands registered

if __name__ == "__main__":
    from kvforge.runners.cli import run

    run()
