"""The `kvforge` command line: build, generate, chat, verify, inspect, bench, serve.

Every KvforgeError is printed as one line on stderr, with no traceback, and exits 2 (bad input),
or 3 where the verification gate refused the artifact; Ctrl-C exits 130 with one line, nothing
published. With --json, a command prints one JSON object on stdout, its error included.

Importing this module loads click and a few small modules of ours: the heavy libraries (torch,
transformers, onnx, onnxruntime) load inside a command, once its arguments are checked.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import click

from passes.targets import DEFAULT_TARGET, TARGETS
from runners.errors import ArtifactError, CheckpointError, KvforgeError, ParityError
from toolchain import tune as tuning

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

# --dtype by the dtype it names (toolchain.build.DTYPES, inverted), for the help text
_SHORT_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_GATE_REFUSED = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a process Ctrl-C ended


# What `pip install kvforge[build]` adds to the runtime's packages: what build, verify and inspect
# import, and what those import first (onnx-ir's ml_dtypes, say).
_BUILD_PACKAGES = frozenset(
    {"torch", "transformers", "onnx", "onnx_ir", "onnxscript", "safetensors", "huggingface_hub", "gguf", "accelerate"}
    | {"ml_dtypes", "typing_extensions"}
)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """One line on stderr and the documented exit status for every failure the user can act on;
    with --json (`as_json`), the same error as one JSON object on stdout."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except KvforgeError as e:
            gate = e.report if isinstance(e, ParityError) else None  # None: the gate did not run
            if gate is None:
                _fail(str(e), EXIT_BAD_INPUT, as_json, kind="input")
            _fail(str(e), EXIT_GATE_REFUSED, as_json, kind="gate", gate=gate)
        except KeyboardInterrupt:
            click.echo(file=sys.stderr)  # end the line ^C was typed on
            _fail(_interrupted_note(fn.__name__), EXIT_INTERRUPTED, as_json, kind="interrupted", prefix="kvforge: ")
        except ModuleNotFoundError as e:
            if (e.name or "").partition(".")[0] not in _BUILD_PACKAGES:
                raise
            command = click.get_current_context().info_name
            message = f"`kvforge {command}` needs {e.name}, which the runtime install leaves out"
            message += "; install kvforge[build]"
            _fail(message, EXIT_BAD_INPUT, as_json, kind="input")

    return wrapper


def _interrupted_note(command: str) -> str:
    return "interrupted; nothing was published" if command in ("build", "export_triton") else "interrupted"


def _fail(
    message: str,
    code: int,
    as_json: bool,
    *,
    kind: str,
    prefix: str = "kvforge: error: ",
    gate: Mapping[str, Any] | None = None,
) -> NoReturn:
    click.echo(f"{prefix}{message}", err=True)
    if as_json:
        data: dict[str, Any] = {"ok": False, "exit_code": code, "error": {"kind": kind, "message": message}}
        _emit_json(data | ({} if gate is None else {"gate": gate}))
    sys.exit(code)


def _emit_json(data: Mapping[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, ensure_ascii=False, default=str))


def _json_option(what: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--json", "as_json", is_flag=True, help=f"Print {what} as one JSON object on stdout (an error too)."
    )


def _require_artifact(path: Path) -> None:
    """Refuse at once, and say why, a path that is no artifact: a checkpoint is told to be built."""
    from runners.manifest import MANIFEST

    if (path / MANIFEST).is_file() or not path.is_dir():
        return  # an artifact, or what the loader explains (a missing directory)
    if (path / "config.json").is_file():
        raise ArtifactError(
            f"{path}: this is a checkpoint, not an artifact: build it with `kvforge build {path} -o OUT`, then pass OUT"
        )


def _require_checkpoint_path(checkpoint: str, revision: str | None) -> None:
    """Refuse a checkpoint that is not there before the libraries that would read it load."""
    from toolchain import hub

    located = hub.locate(checkpoint, revision)  # an id missing from the cache is refused here
    if not os.path.lexists(located):
        raise CheckpointError(
            f"{located}: no such directory; expected a local checkpoint directory, a .gguf file, or a Hub id "
            "ORG/NAME in the local Hugging Face cache"
        )


def _engine_options(queue_note: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The batching engine's knobs, shared by `serve` and `export-triton`."""
    options = [
        click.option(
            "--max-num-seqs", default=8, show_default=True, type=click.IntRange(1), help="Requests generating at once."
        ),
        click.option(
            "--max-queued", default=64, show_default=True, type=click.IntRange(0), help=f"Requests waiting{queue_note}."
        ),
        click.option(
            "--prefill-chunk",
            default=256,
            show_default=True,
            type=click.IntRange(1),
            help="Prompt tokens prefilled per engine step.",
        ),
    ]

    def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            fn = option(fn)
        return fn

    return apply


def _runtime_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return click.option(
        "--runtime",
        type=click.Choice(["auto", "ort", "ort-cuda", "tensorrt"]),
        default="auto",
        show_default=True,
        help=help_text,
    )


_RUNTIME_HELP = (
    "auto: the artifact's TensorRT engine where TensorRT and a GPU are present, else onnxruntime's CUDA provider "
    "where onnxruntime-gpu and a GPU are, else the CPU; ort (CPU), ort-cuda, tensorrt: that one, or an error "
    "saying what is missing."
)


def _tolerance_option(default: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The parity gate's bound, shared by `build` and `verify`."""
    return click.option(
        "--tolerance",
        type=float,
        default=None,
        help="The parity gate's largest error, as a fraction of each output's scale (a logits row's standard "
        f"deviation, a present tensor's RMS). Default: {default} (fp32 2e-4, fp16 0.1, bf16 0.3).",
    )


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvforge", prog_name="kvforge", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log each stage to stderr.")
def main(verbose: bool) -> None:
    """kvforge: compile Hugging Face decoder-only models to verified ONNX artifacts and run them."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if not verbose:  # the tracing libraries warn about their own deprecations; not the user's business
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    for ours in ("toolchain", "runners", "passes"):
        logging.getLogger(ours).setLevel(logging.INFO if verbose else logging.WARNING)


def _calibration(choice: str | None, quantization: Any) -> Any:
    """--calibration: the text an int4 build without zero points (symmetric or --free-min)
    calibrates on, None where the build rounds to nearest (the default); refused where it has
    nothing to calibrate."""
    from toolchain.calibration import NONE, CalibrationText, calibratable

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
@click.option("--asymmetric", is_flag=True, help="Quantize with a zero point per block (default: symmetric).")
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
    help="With --weights int4 (symmetric, or --free-min): the text whose activations choose each weight's scales "
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
    block_size: str,
    kv_dtype: str | None,
    asymmetric: bool,
    free_min: bool,
    calibration: str | None,
    tune: str,
    keep: tuple[str, ...],
    int8: tuple[str, ...],
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
    tolerance: float | None,
    logits: str | None,
    as_json: bool,
) -> None:
    """Export CHECKPOINT, lower it to ONNX, verify it against the eager model, publish it to -o.

    CHECKPOINT is a checkpoint directory, a GGUF file (or a directory holding one), or a Hub id
    (ORG/NAME) already in the local Hugging Face cache (HF_HUB_CACHE, else HF_HOME/hub); nothing
    is downloaded.
    """
    from toolchain.publish import check_output, check_writable

    # what can be refused without torch is refused before it loads
    _require_checkpoint_path(checkpoint, revision)
    check_output(Path(os.path.abspath(output)), force)
    check_writable(Path(os.path.abspath(output)))

    from passes.quantize import WeightQuantization
    from toolchain import progress
    from toolchain.build import DTYPES, BuildOptions
    from toolchain.build import build as run_build
    from toolchain.footprint import parse_bytes

    if _own_process():
        # What the imports made lives as long as the process: frozen out of the collector's
        # sight, every full collection while the build traces and lowers scans far fewer objects.
        gc.freeze()
    quantization = None
    if int8 and weights != "int4":
        raise click.BadParameter(
            f"picks weights to keep at int8 in an int4 build; this build is {weights or 'unquantized'}: "
            "add --weights int4, or drop --int8",
            param_hint="--int8",
        )
    if free_min and (weights != "int4" or asymmetric):
        raise click.BadParameter(
            "a float minimum per block is a 4-bit form without zero points: add --weights int4"
            + (", and drop --asymmetric" if asymmetric else "")
            + ", or drop --free-min",
            param_hint="--free-min",
        )
    if weights is not None:
        quantization = WeightQuantization(
            int(weights[3:]), int(block_size), not asymmetric, keep, int8=int8, free_min=free_min
        )
    calibration_text = _calibration(calibration, quantization)
    options = BuildOptions(
        force=force,
        allow_pickle=allow_pickle,
        decode_steps=decode_steps,
        target=TARGETS[target],
        dtype=TARGETS[target].default_dtype if dtype is None else DTYPES[dtype],
        weights=quantization,
        capacity=capacity,
        context=context,
        device_memory=None if device_memory is None else parse_bytes(device_memory),
        memory_batch=batch,
        memory_seq=seq,
        revision=revision,
        tolerance=tolerance,
        logits=logits,
        stamp=not whole_stack,
        tune=tune,
        calibration=calibration_text,
        kv_dtype=kv_dtype,
    )
    verbose = bool(click.get_current_context().find_root().params.get("verbose"))
    # -v logs a line as each stage starts and ends: a progress display would say it all again
    with progress.reporting(progress.for_stream(sys.stderr, quiet or verbose)):
        result = run_build(checkpoint, output, options)
    if report:
        click.echo(result.passes.summary(), err=True)
    if explain:
        click.echo(result.passes.explanation(), err=True)
    stages = ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items())
    click.echo(f"built {result.output} ({stages})", err=True)
    if result.lowering is not None:
        click.echo(result.lowering.summary(), err=True)
    click.echo(result.parity.summary(), err=True)
    if result.next_step:
        click.echo(result.next_step, err=True)
    if as_json:
        _emit_json(_build_json(result))


def _build_json(result: Any) -> dict[str, Any]:
    """`build --json`: what CI keeps of a build (docs/cli.md lists the fields)."""
    from runners.manifest import MANIFEST

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
        "gate": result.parity.to_dict() | {"summary": result.parity.summary()},
        "lowering": None if result.lowering is None else result.lowering.summary(),
        "seconds": result.seconds,
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
    from toolchain.emit.tensorrt import EngineOptions, add_engine

    written = add_engine(artifact, EngineOptions(**engine))
    entry = written["engine"]
    click.echo(
        f"built {artifact / entry['file']} (TensorRT {entry['tensorrt']}, {entry['gpu']}, "
        f"compute capability {entry['compute_capability']}, capacity {entry['capacity']})",
        err=True,
    )


def _sampling_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The sampling knobs, shared by `generate` and `chat`."""
    options = [
        click.option(
            "--temperature", type=float, default=None, help="0 is greedy. Default: the artifact's generation config."
        ),
        click.option("--top-k", type=int, default=None, help="Keep the k most likely tokens (0: off)."),
        click.option(
            "--top-p", type=float, default=None, help="Keep the smallest set of tokens with this total probability."
        ),
        click.option(
            "--min-p", type=float, default=None, help="Drop tokens below this fraction of the top probability."
        ),
        click.option("--repetition-penalty", type=float, default=None, help="Penalize tokens already seen (1: off)."),
        click.option("--seed", type=int, default=None, help="Same seed, same text."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


_MAX_NEW_TOKENS_HELP = (
    "Default: the artifact's, else 128, cut to what the context leaves after the prompt (a budget given "
    "that does not fit is refused)."
)


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("prompts", nargs=-1)
@click.option(
    "-f",
    "--file",
    "prompt_file",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    default=None,
    help="Read the prompt from this file (UTF-8, as is); - reads standard input.",
)
@click.option("--max-new-tokens", type=click.IntRange(1), default=None, help=_MAX_NEW_TOKENS_HELP)
@_sampling_options
@click.option("--stop", multiple=True, help="Stop before this string (repeatable); it is not printed.")
@click.option("--chat", is_flag=True, help="Format the prompt with the tokenizer's chat template.")
@_runtime_option(_RUNTIME_HELP)
@click.option(
    "--json-schema",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reply as JSON valid under this schema file.",
)
@click.option("--regex", default=None, help="Reply with text matching this regular expression.")
@click.option(
    "--grammar",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reply in the language of this Lark grammar file.",
)
@click.option(
    "--speculative",
    metavar="prompt-lookup|draft:PATH",
    default=None,
    help="Exact speculative decoding: drafts from n-grams of the prompt and output (prompt-lookup) or from a "
    "smaller artifact with the same tokenizer (draft:PATH), checked in one target step; the same text as without. "
    "Any default build takes it (not one built with --logits last).",
)
@click.option(
    "--draft-tokens",
    type=click.IntRange(1, 64),
    default=None,
    help="Tokens drafted per target step, with --speculative. Default: 8.",
)
@_guarded
def generate(
    artifact: Path,
    prompts: tuple[str, ...],
    prompt_file: Path | None,
    max_new_tokens: int | None,
    stop: tuple[str, ...],
    chat: bool,
    runtime: str,
    json_schema: Path | None,
    regex: str | None,
    grammar: Path | None,
    speculative: str | None,
    draft_tokens: int | None,
    **sampling: Any,
) -> None:
    """Generate from ARTIFACT. One prompt streams to stdout; several run as one batch.

    A PROMPT of - is read from standard input; -f FILE reads one from FILE.
    """
    prompts = _read_prompts(prompts, prompt_file)
    _require_artifact(artifact)
    from runners.engine import Engine
    from runners.speculative import takes_turns

    engine = Engine.load(artifact, runtime=runtime, stop_spinning=takes_turns(speculative))
    sampling["json_schema"] = json_schema.read_text() if json_schema else None
    sampling["grammar"] = grammar.read_text() if grammar else None
    sampling["regex"] = regex
    sampling["speculative"] = speculative
    sampling["draft_tokens"] = draft_tokens
    if len(prompts) > 1:
        texts = engine.generate(list(prompts), max_new_tokens=max_new_tokens, stop=stop, chat=chat, **sampling)
        for text in texts if isinstance(texts, list) else [texts]:
            click.echo(json.dumps(text, ensure_ascii=False))
        return
    stream = engine.stream(prompts[0], max_new_tokens=max_new_tokens, stop=stop, chat=chat, **sampling)
    for chunk in stream:
        click.echo(chunk, nl=False)
        sys.stdout.flush()
    click.echo()
    s = stream.stats
    click.echo(
        f"[{s.prompt_tokens} prompt tokens, {s.new_tokens} new tokens, first token {s.first_token_s * 1000:.0f} ms, "
        f"{s.decode_tokens_per_s:.1f} tokens/s, finish: {s.finish_reason}"
        + (
            ""
            if s.speculation is None
            else f", {s.speculation.verify_steps} verify steps, {s.speculation.tokens_per_step:.2f} tokens/step, "
            f"acceptance {s.speculation.acceptance_rate:.0%}"
        )
        + "]",
        err=True,
    )


def _read_prompts(prompts: tuple[str, ...], prompt_file: Path | None) -> tuple[str, ...]:
    """The prompts given, `-` (standard input, read once at most) and -f FILE read as they are."""
    stdin = [p == "-" for p in prompts] + ([str(prompt_file) == "-"] if prompt_file is not None else [])
    if sum(stdin) > 1:
        raise click.UsageError("standard input (-) can give one prompt only")
    read = [sys.stdin.read() if p == "-" else p for p in prompts]
    if prompt_file is not None:
        read.append(sys.stdin.read() if str(prompt_file) == "-" else _read_text(prompt_file))
    if not read:
        raise click.UsageError("give a PROMPT, -f FILE, or - to read the prompt from standard input")
    return tuple(read)


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ArtifactError(f"{file}: no such file; pass the file that holds the prompt") from e
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from e
    except OSError as e:
        raise ArtifactError(f"{file}: cannot be read ({e.strerror or e}); check its permissions") from e


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--system", default=None, help="A system message that opens the conversation (and survives /reset).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=None, help="Per reply. " + _MAX_NEW_TOKENS_HELP)
@_sampling_options
@_runtime_option(_RUNTIME_HELP)
@_guarded
def chat(artifact: Path, system: str | None, max_new_tokens: int | None, runtime: str, **sampling: Any) -> None:
    """Talk with ARTIFACT: each line you type is a message, the reply streams back, formatted with
    the artifact's chat template. /reset forgets the conversation; /exit (or Ctrl-D) ends it."""
    _require_artifact(artifact)
    # Imported and loaded with SIGINT blocked, which every thread they start inherits (numpy's BLAS
    # pool and onnxruntime's at import, onnxruntime's and the hashing's at load): Ctrl-C then reaches
    # the main thread, and wakes it from waiting for a line in input().
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        from runners.chat import Conversation
        from runners.engine import Engine

        engine = Engine.load(artifact, runtime=runtime)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    engine.sampling(**sampling)  # a bad value is refused before the first message
    # the prompt leaves the reply its budget: the one asked for, else the default up to half the context
    reserve = max_new_tokens or min(engine.max_new_tokens, engine.max_positions // 2)
    conversation = Conversation(
        lambda messages: len(engine.encode_chat(messages)), engine.max_positions - reserve, system
    )
    conversation.count(conversation.messages() + [{"role": "user", "content": "?"}])  # a template, or why not
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - loaded, it gives input() line editing and history
        except ImportError:  # not on every platform
            pass
    click.echo(f"kvforge chat: {artifact} ({engine.max_positions} tokens of context); /reset, /exit", err=True)
    while (line := _read_message()) is not None:
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            conversation.reset()
            click.echo("[conversation reset]", err=True)
            continue
        if not text:
            continue
        try:
            messages, dropped = conversation.ask(text)
        except KvforgeError as e:  # one message's trouble does not end the conversation
            click.echo(f"kvforge: error: {e}", err=True)
            continue
        if dropped:
            click.echo(f"[dropped the {dropped} oldest turn(s) to stay within the context]", err=True)
        conversation.answer(_reply(engine, messages, max_new_tokens, sampling))


def _reply(engine: Any, messages: list[dict[str, str]], max_new_tokens: int | None, sampling: dict[str, Any]) -> str:
    """Stream the reply to `messages`; Ctrl-C ends the reply (what came of it is kept), not the chat."""
    reply: list[str] = []
    try:
        for chunk in engine.stream(messages, max_new_tokens=max_new_tokens, **sampling):
            reply.append(chunk)
            click.echo(chunk, nl=False)
            sys.stdout.flush()
    except KeyboardInterrupt:
        click.echo(" [reply interrupted]", nl=False, err=True)
    except KvforgeError as e:
        click.echo(f"kvforge: error: {e}", err=True)
    click.echo()
    return "".join(reply)


def _read_message() -> str | None:
    """The next line typed (with line editing on a terminal); None at the end of input."""
    try:
        return input("> " if sys.stdin.isatty() else "")
    except EOFError:
        click.echo(file=sys.stderr)
        return None


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    type=click.IntRange(1),
    help="Prompt length (repeatable; default 128 and 1024).",
)
@click.option(
    "--batch", "batches", multiple=True, type=click.IntRange(1), help="Batch size (repeatable; default 1 and 8)."
)
@click.option("--new-tokens", default=32, show_default=True, type=click.IntRange(2), help="Tokens generated per run.")
@click.option(
    "--repeats",
    default=3,
    show_default=True,
    type=click.IntRange(1),
    help="Rounds, each running every configuration once; medians over rounds are reported.",
)
@_json_option("the results")
@_runtime_option(_RUNTIME_HELP)
@_guarded
def bench(
    artifact: Path,
    prompts: tuple[int, ...],
    batches: tuple[int, ...],
    new_tokens: int,
    repeats: int,
    as_json: bool,
    runtime: str,
) -> None:
    """First token, decode tokens/s and its fraction of the memory-bandwidth roofline for ARTIFACT."""
    _require_artifact(artifact)
    from runners.bench import bench as run_bench
    from runners.bench import format_results, peak_memory_bytes, ratios

    results, skipped, bandwidth = run_bench(
        artifact,
        prompts=prompts or (128, 1024),
        batches=batches or (1, 8),
        new_tokens=new_tokens,
        repeats=repeats,
        runtime=runtime,
    )
    if as_json:
        data = {
            "ok": True,
            "exit_code": EXIT_OK,
            "artifact": str(artifact.resolve()),
            "bandwidth_bytes_per_s": bandwidth,
            "peak_memory_bytes": peak_memory_bytes(),
            "results": [r.to_dict() for r in results],
            "ratios": [asdict(r) for r in ratios(results)],
            "skipped": skipped,
        }
        _emit_json(data)
    else:
        click.echo(format_results(results, skipped, bandwidth))


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port (0: a free one).")
@click.option("--served-model-name", default=None, help="Model name clients pass. Default: ARTIFACT's directory name.")
@_engine_options(", beyond: 429")
@click.option(
    "--drain-timeout",
    default=30.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds SIGTERM waits for in-flight requests.",
)
@click.option(
    "--prefix-cache-bytes",
    default=None,
    metavar="BYTES",
    help="Memory for the KV of prompt prefixes reused across requests (e.g. 512M, 2G; 0: off). "
    "Default: a quarter of the memory available at start.",
)
@click.option(
    "--speculative",
    metavar="prompt-lookup|draft:PATH",
    default=None,
    help="Exact speculative decoding for every request (as `kvforge generate --speculative`): the same text as "
    "without. Not for an artifact built with --logits last, nor with sliding-window or state layers.",
)
@click.option(
    "--draft-tokens",
    type=click.IntRange(1, 64),
    default=None,
    help="Tokens drafted per step and row, with --speculative. Default: 8.",
)
@click.option(
    "--speculative-rows",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="With --speculative: speculate while the batch holds at most this many requests (beyond, each row's "
    "verify step is a call of its own, which costs more than it gains on the models measured in "
    "docs/performance.md).",
)
@_runtime_option(_RUNTIME_HELP)
@_guarded
def serve(
    artifact: Path,
    host: str,
    port: int,
    served_model_name: str | None,
    max_num_seqs: int,
    max_queued: int,
    prefill_chunk: int,
    drain_timeout: float,
    prefix_cache_bytes: str | None,
    speculative: str | None,
    draft_tokens: int | None,
    speculative_rows: int,
    runtime: str,
) -> None:
    """Serve ARTIFACT over an OpenAI-compatible HTTP API with continuous batching."""
    _require_artifact(artifact)
    from runners.serve import ServeOptions
    from runners.serve import serve as run_serve
    from runners.serve.prefix_cache import parse_bytes

    try:
        budget = None if prefix_cache_bytes is None else parse_bytes(prefix_cache_bytes)
    except KvforgeError as error:
        raise click.BadParameter(str(error), param_hint="--prefix-cache-bytes") from error
    options = ServeOptions(
        host,
        port,
        served_model_name,
        max_num_seqs,
        max_queued,
        prefill_chunk,
        drain_timeout,
        runtime,
        budget,
        speculative,
        draft_tokens,
        speculative_rows,
    )
    options.validate()
    run_serve(artifact, options, announce=lambda line: click.echo(f"kvforge serve: {line}", err=True))


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
@click.option(
    "--prefix-cache-bytes",
    default=None,
    metavar="BYTES",
    help="Memory per instance for the KV of prompt prefixes reused across requests (e.g. 512M, 2G; 0: off). "
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
    from toolchain.triton import TritonOptions
    from toolchain.triton import export_triton as run_export

    options["kind"] = _triton_kind(runtime, options["kind"], click.get_current_context())
    budget = options.pop("prefix_cache_bytes")
    if budget is not None:
        from runners.serve.prefix_cache import parse_bytes

        try:
            options["prefix_cache_bytes"] = parse_bytes(budget)
        except KvforgeError as error:
            raise click.BadParameter(str(error), param_hint="--prefix-cache-bytes") from error

    written = run_export(artifact, output, TritonOptions(name=name, **options))
    click.echo(
        f"wrote {written.path}: Triton model {written.model!r}; serving commands in {written.path / 'README.md'}",
        err=True,
    )


def _triton_kind(runtime: str, kind: str, context: click.Context) -> str:
    """The Triton instance kind --runtime asks for; a --kind given that contradicts it is refused."""
    from runners.runtime import RuntimeUnavailable

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
    _require_checkpoint_path(checkpoint, revision)
    from toolchain.build import verify as run_verify

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
    _require_checkpoint_path(checkpoint, revision)
    from toolchain import checkpoint as checkpoints
    from toolchain.export import cache_layout, layer_windows
    from toolchain.footprint import footprint, format_footprint
    from toolchain.spec import DecoderSpec

    ckpt = checkpoints.load(checkpoint, allow_pickle=allow_pickle, revision=revision)
    read = DecoderSpec.from_config(
        ckpt.config, ckpt.generation_config, context=context, tokenizer_config=checkpoints.tokenizer_config(ckpt)
    )
    spec = cache_layout(ckpt.config, read)
    # the KV cache as the default target keeps it: sliding layers bounded by their windows
    windows = layer_windows(ckpt.config, spec) if TARGETS[DEFAULT_TARGET].bounded_windows else None
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


def run() -> None:
    """`kvforge` as a process of its own (the console script, `python -m toolchain.cli`), with
    settings for the whole process that an app calling `main` keeps to itself."""
    # OpenMP threads that spin while they wait for work (libgomp's default) make torch's eager
    # runs (the gate's reference) many times slower wherever other jobs share the cores; threads
    # that sleep cost a wake-up per parallel region instead, the same threads computing the same
    # results. Read when torch loads, which nothing has made it do yet; a value set is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The imports, and a build's tracing and lowering, allocate millions of small objects that
    # outlive a young collection; the collector's default (a young collection every 700
    # allocations, a full one every 100 of those) rescans them all many times a build.
    gc.set_threshold(_YOUNG_COLLECTION_ALLOCATIONS, 10, 10)
    try:
        main(obj={_OWN_PROCESS: True})
    finally:
        # What is left is the exit's to free: frozen, the interpreter's shutdown does not scan it
        # in a full collection each time it clears modules.
        gc.freeze()


_OWN_PROCESS = "own_process"
_YOUNG_COLLECTION_ALLOCATIONS = 10_000


def _own_process() -> bool:
    """Whether this command runs in a process of its own (`run`), not in an app that called `main`."""
    return bool((click.get_current_context().find_root().obj or {}).get(_OWN_PROCESS))


if __name__ == "__main__":
    run()
