"""The `kvforge` command line, its runtime side: the group, the conventions every command
keeps, and the commands that run an artifact (generate, chat, bench, serve).

Every KvforgeError is printed as one line on stderr, with no traceback, and exits 2 (bad input),
or 3 where the verification gate refused the artifact; Ctrl-C exits 130 with one line, nothing
published. With --json, a command prints one JSON object on stdout, its error included.

The build commands (build, verify, inspect, build-engine, export-triton) live with the compiler
(`kvforge.toolchain.cli`) and join the group when one of them runs or the help lists them
(`kvforge.cli`): a runtime command never imports the build side. Importing this module loads
click and a few small modules of ours; numpy, onnxruntime and the tokenizer load inside a command.
"""

from __future__ import annotations

import functools
import gc
import importlib
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

import click

from kvforge.runners.errors import ArtifactError, KvforgeError, ParityError

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
    from kvforge.runners.manifest import MANIFEST

    if (path / MANIFEST).is_file() or not path.is_dir():
        return  # an artifact, or what the loader explains (a missing directory)
    if (path / "config.json").is_file():
        raise ArtifactError(
            f"{path}: this is a checkpoint, not an artifact: build it with `kvforge build {path} -o OUT`, then pass OUT"
        )


def _engine_options(queue_note: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The batching engine's knobs, shared by `serve` and `export-triton`: the config.pbtxt
    parameters `ServingParams` declares (`kvforge.runners.settings`); `queue_note` ends
    max_queued's help."""
    from kvforge.runners.settings import serving_settings

    def apply(fn: Callable[..., Any]) -> Callable[..., Any]:
        for declared in reversed([s for s in serving_settings() if s.triton_parameter]):
            note = f"{queue_note}." if declared.name == "max_queued" else ""
            fn = serving_option(declared.name, declared.help + note)(fn)
        return fn

    return apply


def serving_option(name: str, help: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The option of the serving setting `name` as `ServingParams` declares it (flag, type, range,
    default, value name), with the command's own `help` where it says more."""
    from kvforge.runners.settings import serving_setting

    declared = serving_setting(name)
    kind: Any = declared.kind
    if declared.kind is int:
        low, high = declared.minimum, declared.maximum
        kind = click.IntRange(None if low is None else int(low), None if high is None else int(high))
    return click.option(
        declared.flag,
        declared.name,
        type=kind,
        default=declared.default,
        show_default=declared.default is not None,
        metavar=declared.metavar,
        help=declared.help if help is None else help,
    )


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


class _Commands(click.Group):
    """The command group, with commands that other modules define and register on import,
    loaded only when one of them is asked for (or listed by --help)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.elsewhere: dict[str, str] = {}  # command name -> the module that registers it

    def add_elsewhere(self, module: str, names: Iterable[str]) -> None:
        self.elsewhere.update(dict.fromkeys(names, module))

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(self.commands) | set(self.elsewhere))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.elsewhere:
            importlib.import_module(self.elsewhere[cmd_name])
        return self.commands.get(cmd_name)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvforge", prog_name="kvforge", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log each stage to stderr.")
def main(verbose: bool) -> None:
    """kvforge: compile Hugging Face decoder-only models to verified ONNX artifacts and run them."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if not verbose:  # the tracing libraries warn about their own deprecations; not the user's business
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    for ours in ("kvforge.toolchain", "kvforge.runners", "kvforge.passes"):
        logging.getLogger(ours).setLevel(logging.INFO if verbose else logging.WARNING)


def _sampling_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The sampling knobs, shared by `generate` and `chat`: one option per field `SamplingParams`
    declares (`kvforge.runners.settings`); unset, the artifact's generation defaults hold."""
    from kvforge.runners.settings import sampling_settings

    for declared in reversed(sampling_settings()):
        fn = click.option(declared.flag, declared.name, type=declared.kind, default=None, help=declared.help)(fn)
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
@serving_option(
    "speculative",
    "Exact speculative decoding: drafts from n-grams of the prompt and output (prompt-lookup) or from a "
    "smaller artifact with the same tokenizer (draft:PATH), checked in one target step; the same text as without. "
    "Any default build takes it (not one built with --logits last).",
)
@serving_option("draft_tokens")
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
    from kvforge.runners.engine import Engine
    from kvforge.runners.speculative import takes_turns

    engine = Engine.load(artifact, runtime=runtime, stop_spinning=takes_turns(speculative))
    sampling["json_schema"] = json_schema.read_text() if json_schema else None
    sampling["grammar"] = grammar.read_text() if grammar else None
    sampling["regex"] = regex
    sampling["speculative"] = speculative
    sampling["draft_tokens"] = draft_tokens
    constraint = next((f"--{n}" for n in ("json-schema", "regex", "grammar") if sampling[n.replace("-", "_")]), None)
    if len(prompts) > 1:
        if max_new_tokens is None:
            _note_cut_budget(engine, [engine.encode(p, chat) for p in prompts])
        texts = engine.generate(list(prompts), max_new_tokens=max_new_tokens, stop=stop, chat=chat, **sampling)
        for text in texts if isinstance(texts, list) else [texts]:
            click.echo(json.dumps(text, ensure_ascii=False))
        return
    speculation = {"speculative": sampling.pop("speculative"), "draft_tokens": sampling.pop("draft_tokens")}
    request = engine.request(prompts[0], max_new_tokens=max_new_tokens, stop=stop, chat=chat, **sampling)
    if max_new_tokens is None:
        _note_cut_budget(engine, [request.ids])
    stream = engine.stream(request, **speculation)
    for chunk in stream:
        click.echo(chunk, nl=False)
        sys.stdout.flush()
    click.echo()
    s = stream.stats
    finish = s.finish_reason
    if constraint is not None and request.cut_short:
        finish = "incomplete"
        _warn_cut_short(constraint)
    click.echo(
        f"[{s.prompt_tokens} prompt tokens, {s.new_tokens} new tokens, first token {s.first_token_s * 1000:.0f} ms, "
        f"{s.decode_tokens_per_s:.1f} tokens/s, finish: {finish}"
        + (
            ""
            if s.speculation is None
            else f", {s.speculation.verify_steps} verify steps, {s.speculation.tokens_per_step:.2f} tokens/step, "
            f"acceptance {s.speculation.acceptance_rate:.0%}"
        )
        + "]",
        err=True,
    )


def _note_cut_budget(engine: Any, prompts: list[list[int]]) -> None:
    """Say, once, that the default budget was cut to what the context leaves after the prompt."""
    budget = engine.budget(None, prompts)
    if budget < engine.max_new_tokens:
        longest = max(len(p) for p in prompts)
        click.echo(
            f"kvforge: note: the default budget of {engine.max_new_tokens} new tokens is cut to {budget}, what the "
            f"{engine.max_positions}-token context leaves after the prompt's {longest} tokens",
            err=True,
        )


def _warn_cut_short(constraint: str) -> None:
    """Say that the reply was cut by its budget before its grammar was complete (finish: incomplete)."""
    click.echo(
        f"kvforge: warning: the reply reached its budget of new tokens before the {constraint} was complete, so it "
        "does not match it; raise --max-new-tokens",
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
        from kvforge.runners.chat import Conversation
        from kvforge.runners.engine import Engine

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
    from kvforge.runners.bench import bench as run_bench
    from kvforge.runners.bench import format_results, peak_memory_bytes, ratios

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
@serving_option("prefix_cache_bytes")
@serving_option(
    "speculative",
    "Exact speculative decoding for every request (as `kvforge generate --speculative`): the same text as "
    "without. Not for an artifact built with --logits last, nor with sliding-window or state layers.",
)
@serving_option("draft_tokens", "Tokens drafted per step and row, with --speculative. Default: 8.")
@click.option(
    "--speculative-rows",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="With --speculative: speculate while the batch holds at most this many requests (beyond, each row's "
    "verify step is a call of its own, which costs more than it gains on the models measured in "
    "docs/performance.md).",
)
@click.option("--quiet", is_flag=True, help="No access-log line per request.")
@click.option("--no-web-page", is_flag=True, help="No chat page at GET / (a 404 there).")
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
    quiet: bool,
    no_web_page: bool,
    runtime: str,
) -> None:
    """Serve ARTIFACT over an OpenAI-compatible HTTP API with continuous batching."""
    _require_artifact(artifact)
    from kvforge.runners.serve import ServeOptions
    from kvforge.runners.serve import serve as run_serve
    from kvforge.runners.units import parse_bytes

    try:
        budget = None if prefix_cache_bytes is None else parse_bytes(prefix_cache_bytes, "size")
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
        quiet=quiet,
        web_page=not no_web_page,
    )
    options.validate()
    run_serve(artifact, options, announce=lambda line: click.echo(f"kvforge serve: {line}", err=True))


def run() -> None:
    """`kvforge` as a process of its own (the console script, `python -m kvforge`), with
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
