"""The command line's conventions: startup without the heavy libraries, --version and -h, exit
statuses (2 bad input, 3 gate refused, 130 interrupted), --json objects, prompts from files
and standard input, the default budget cut to the context, `chat` through a terminal."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.runners.cli import EXIT_BAD_INPUT, EXIT_GATE_REFUSED, EXIT_INTERRUPTED
from kvforge.runners.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "onnx_ir")

# Runs the command line in this process's place and reports which heavy libraries it loaded.
_PROBE = """
import json, sys
from kvforge.cli import main
try:
    main(sys.argv[1:], standalone_mode=True)
except SystemExit as e:
    code = e.code or 0
print(json.dumps({"exit": code, "loaded": sorted(m for m in HEAVY if m in sys.modules)}), file=sys.stderr)
"""


def kvforge(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvforge", *args], input=stdin, capture_output=True, text=True, check=False
    )


def probe(*args: str) -> tuple[dict[str, object], str]:
    """The command's exit status and the heavy modules loaded by the time it ended."""
    code = f"HEAVY = {HEAVY!r}\n{_PROBE}"
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, cwd=ROOT)
    *output, last = done.stderr.strip().splitlines()
    return json.loads(last), done.stdout + "\n".join(output)


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["--version"], 0, f"kvforge {version('kvforge')}"),
        (["--help"], 0, "Usage: "),
        (["build", "-h"], 0, "Usage: "),
        (["build", "{tmp}/missing-dir", "-o", "{tmp}/x"], EXIT_BAD_INPUT, "missing-dir: no such directory"),
        (["build", "{ckpt}", "-o", "/proc/nope"], EXIT_BAD_INPUT, "/proc/nope: cannot write in /proc"),
        (["build", "{ckpt}", "-o", "{ckpt}/config.json/x"], EXIT_BAD_INPUT, "config.json is not a directory"),
        (["generate", "{ckpt}", "hi"], EXIT_BAD_INPUT, "this is a checkpoint, not an artifact: build it with"),
        (["generate", "{ckpt}"], EXIT_BAD_INPUT, "give a PROMPT, -f FILE, or -"),
        (["inspect", "{tmp}/missing-dir"], EXIT_BAD_INPUT, "missing-dir: no such directory"),
        (["inspect", "{ckpt}"], 0, "KV cache"),  # config and headers, the cache's layout read from the config
        # an artifact where a checkpoint is expected is known by its manifest
        (["build", "{art}", "-o", "{tmp}/x"], EXIT_BAD_INPUT, "art: this is a kvforge artifact, not a checkpoint: to"),
        (["inspect", "{art}"], EXIT_BAD_INPUT, "art: this is a kvforge artifact, not a checkpoint: inspect the"),
        (["verify", "{art}", "--checkpoint", "{art}"], EXIT_BAD_INPUT, "a kvforge artifact, not a checkpoint: pass"),
        # -o at a directory kvforge did not write: refused for good, with or without --force
        (["build", "{ckpt}", "-o", "{ckpt}"], EXIT_BAD_INPUT, "is not a kvforge artifact; --force replaces only"),
        (["build", "{ckpt}", "-o", "{ckpt}", "--force"], EXIT_BAD_INPUT, "so it will not replace this: choose"),
    ],
)
def test_commands_with_nothing_heavy_to_do_answer_without_loading_the_heavy_libraries(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path], args: list[str], status: int, says: str
) -> None:
    ckpt = str(tiny_checkpoint("llama"))
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{}")
    result, output = probe(*(a.format(tmp=tmp_path, ckpt=ckpt, art=tmp_path / "art") for a in args))
    assert result == {"exit": status, "loaded": []}, output
    assert says in output
    assert not (tmp_path / "x").exists() and "Traceback" not in output


def test_h_is_help_on_every_command() -> None:
    for command in ([], ["build"], ["generate"], ["chat"], ["verify"]):
        short, long = (CliRunner().invoke(main, [*command, flag]) for flag in ("-h", "--help"))
        assert short.exit_code == 0 and short.output == long.output and "Usage:" in short.output


def test_a_refused_gate_exits_3_with_its_figures_in_json_and_publishes_nothing(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    out = tmp_path / "out"
    result = kvforge("build", str(tiny_checkpoint("llama")), "-o", str(out), "-q", "--tolerance", "1e-12", "--json")
    assert result.returncode == EXIT_GATE_REFUSED, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is False and data["exit_code"] == EXIT_GATE_REFUSED and data["error"]["kind"] == "gate"
    assert "compiled model does not match the eager model" in data["error"]["message"]
    gate = data["gate"]  # the figures that refused it
    assert gate["passed"] is False and gate["tolerance"]["relative"] == 1e-12
    assert any(not e["within"] and e["error"] > 1e-12 for e in gate["prefill"] + gate["decode"])
    assert result.stderr.strip().splitlines()[-1] == f"kvforge: error: {data['error']['message']}"
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_build_json_carries_paths_hashes_gate_figures_and_stage_times(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    out = tmp_path / "out"
    result = kvforge("-v", "build", str(tiny_checkpoint("llama")), "-o", str(out), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["exit_code"] == 0 and data["output"] == str(out)
    assert data["manifest"] == str(out / "manifest.json") and data["target"] == "ort-cpu"
    on_disk = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in out.iterdir() if f.name != "manifest.json"}
    assert data["files"] == on_disk
    assert data["sources"] == json.loads((out / "manifest.json").read_text())["sources"]
    gate = data["gate"]
    assert gate["passed"] is True and gate["decode_steps"] == 8 and gate["summary"].startswith("parity passed")
    assert all(e["error"] <= gate["tolerance"]["relative"] for e in gate["prefill"] + gate["decode"])
    assert {"load", "export", "lower", "passes", "emit", "verify", "publish"} <= set(data["seconds"])
    assert list(data["seconds"])[:2] == ["startup", "read"]  # the imports and reading the config count too
    built = next(line for line in result.stderr.splitlines() if line.startswith("built "))
    wall = float(built.split(" in ")[1].split("s (")[0])
    assert abs(sum(data["seconds"].values()) - wall) < 0.1  # the stages account for the whole wall time
    # -v: the log marks each stage's start once; no progress lines repeat it
    assert result.stderr.count("kvforge.toolchain.build: load...") == 1 and "kvforge: load" not in result.stderr


def sigint_as_at_a_terminal() -> None:
    """In a child before it runs: Ctrl-C's default action, as a command typed at a terminal has it.
    A test run in the background of a shell without job control ignores SIGINT, and an ignored
    SIGINT is inherited (Python then installs no KeyboardInterrupt at all)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_with_one_line_and_publishes_nothing(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    out = tmp_path / "out"
    build = subprocess.Popen(
        [sys.executable, "-m", "kvforge", "build", str(tiny_checkpoint("llama")), "-o", str(out)],
        preexec_fn=sigint_as_at_a_terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert build.stderr is not None
    lines = []
    while not (line := build.stderr.readline()).startswith("kvforge: export..."):  # well into the work
        assert line, "".join(lines)
        lines.append(line)
    assert lines[0] == "kvforge: startup...\n"  # the command says what it does before the libraries load
    build.send_signal(signal.SIGINT)
    _, rest = build.communicate(timeout=120)
    assert build.returncode == EXIT_INTERRUPTED, rest
    assert rest.strip().splitlines()[-1] == "kvforge: interrupted; nothing was published"
    assert "Aborted!" not in rest and "Traceback" not in rest
    assert list(tmp_path.iterdir()) == []  # neither the artifact nor its staging directory


def test_verify_and_inspect_json(tiny_checkpoint: Callable[..., Path], built_artifact: Callable[..., Path]) -> None:
    ckpt, artifact = tiny_checkpoint("llama"), built_artifact("llama")
    result = CliRunner().invoke(main, ["verify", str(artifact), "--checkpoint", str(ckpt), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["artifact"] == str(artifact.resolve()) and data["checkpoint"] == str(ckpt)
    assert data["gate"]["passed"] is True and data["gate"]["tolerance"]["relative"] == 2e-4
    result = CliRunner().invoke(main, ["inspect", str(ckpt), "--batch", "8", "--seq", "200", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["model_type"] == "llama" and data["checkpoint"] == str(ckpt.resolve())
    # 2 (K and V) * 2 layers * 2 kv heads * 16 head dim * 4 bytes * 8 * 200 tokens
    assert data["footprint"]["kv_bytes_total"]["fp32"] == 2 * 2 * 2 * 16 * 4 * 8 * 200
    assert data["parameters"] == sum(data["footprint"]["parameters_by_dtype"].values()) > 0


def test_bench_json_and_an_error_in_json(built_artifact: Callable[..., Path], tmp_path: Path) -> None:
    artifact = built_artifact("llama")
    args = ["bench", str(artifact), "--prompt", "8", "--batch", "1", "--new-tokens", "2", "--repeats", "1", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is True and data["artifact"] == str(artifact.resolve())
    assert [(r["prompt"], r["batch"]) for r in data["results"]] == [(8, 1)] and data["skipped"] == []
    result = CliRunner().invoke(main, ["bench", str(tmp_path / "nothing"), "--json"])
    data = json.loads(result.stdout)
    assert result.exit_code == EXIT_BAD_INPUT and data["ok"] is False and data["exit_code"] == EXIT_BAD_INPUT
    assert data["error"]["kind"] == "input" and "nothing" in data["error"]["message"]


def test_generate_reads_the_prompt_from_a_file_or_standard_input(
    built_artifact: Callable[..., Path], tmp_path: Path
) -> None:
    artifact = built_artifact("llama")
    text = "def f(x):\n    return"
    expected = Engine.load(artifact).generate(text, max_new_tokens=6, temperature=0.0)
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    args = ["generate", str(artifact), "--max-new-tokens", "6", "--temperature", "0"]
    from_file = CliRunner().invoke(main, [*args, "-f", str(tmp_path / "prompt.txt")])
    from_stdin = CliRunner().invoke(main, [*args, "-"], input=text)
    assert from_file.exit_code == from_stdin.exit_code == 0, from_file.output + from_stdin.output
    assert from_file.stdout == from_stdin.stdout == expected + "\n"
    twice = CliRunner().invoke(main, [*args, "-", "-f", "-"], input=text)
    assert twice.exit_code == EXIT_BAD_INPUT and "one prompt only" in twice.output
    missing = CliRunner().invoke(main, [*args, "-f", str(tmp_path / "gone.txt")])
    assert missing.exit_code == EXIT_BAD_INPUT and "gone.txt: no such file" in missing.stderr


def test_the_default_budget_is_cut_to_the_context_left_and_a_given_one_is_not(
    built_artifact: Callable[..., Path],
) -> None:
    artifact = built_artifact("llama")
    engine = Engine.load(artifact)
    assert engine.max_positions == 256 and engine.max_new_tokens == 128
    prompt = "x " * 200
    while len(engine.encode(prompt)) > 143:
        prompt = prompt[:-2]
    assert len(engine.encode(prompt)) == 143
    result = kvforge("generate", str(artifact), prompt, "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert "[143 prompt tokens, 113 new tokens" in result.stderr  # 256 - 143, not refused for 143 + 128
    note = "kvforge: note: the default budget of 128 new tokens is cut to 113, what the 256-token context leaves"
    assert result.stderr.count(note) == 1  # said once, not only as `finish: length`
    result = kvforge("generate", str(artifact), prompt, "--max-new-tokens", "128")
    assert result.returncode == EXIT_BAD_INPUT and "143 tokens + max_new_tokens 128 = 271 exceeds" in result.stderr


def test_a_constrained_reply_cut_by_its_budget_says_so(built_artifact: Callable[..., Path]) -> None:
    args = ["generate", str(built_artifact("llama")), "def f(", "--temperature", "0"]
    cut = CliRunner().invoke(main, [*args, "--regex", "[a-z]{40}", "--max-new-tokens", "3"])
    assert cut.exit_code == 0, cut.output
    assert re.fullmatch(r"[a-z]+\n", cut.stdout) and len(cut.stdout) < 41  # letters, fewer than the regex asks
    assert "kvforge: warning: the reply reached its budget of new tokens before the --regex was complete" in cut.stderr
    assert cut.stderr.strip().endswith("finish: incomplete]")
    whole = CliRunner().invoke(main, [*args, "--regex", "[a-z]{2}", "--max-new-tokens", "8"])
    assert whole.exit_code == 0 and re.fullmatch(r"[a-z]{2}\n", whole.stdout), whole.output
    assert "warning" not in whole.stderr and whole.stderr.strip().endswith("finish: stop]")
    plain = CliRunner().invoke(main, [*args, "--max-new-tokens", "3"])  # no grammar: cut by the budget as asked
    assert "warning" not in plain.stderr and plain.stderr.strip().endswith("finish: length]")


class Terminal:
    """A process on a pseudo-terminal: what it writes, read up to a marker; lines typed to it."""

    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True, preexec_fn=sigint_as_at_a_terminal
        )
        os.close(slave)
        self.seen = b""

    def read_until(self, marker: bytes, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            assert time.monotonic() < deadline, f"no {marker!r} in {self.seen!r}"
            if select.select([self.master], [], [], 0.5)[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:  # the process ended and closed the terminal
                    break
        assert marker in self.seen, f"no {marker!r} in {self.seen!r}"
        text, _, self.seen = self.seen.partition(marker)
        # line editing's terminal modes (bracketed paste) switched on and off around each line
        return re.sub(r"\x1b\[\?[0-9]+[hl]", "", text.decode("utf-8", "replace")).replace("\r\n", "\n")

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")


def test_chat_through_a_terminal_keeps_the_conversation_resets_and_exits(built_artifact: Callable[..., Path]) -> None:
    artifact = built_artifact("llama")
    engine = Engine.load(artifact)

    def reply(messages: list[dict[str, str]]) -> str:
        return "".join(engine.stream(messages, max_new_tokens=6, temperature=0.0))

    system = {"role": "system", "content": "be brief"}
    first = [system, {"role": "user", "content": "hello"}]
    second = [*first, {"role": "assistant", "content": reply(first)}, {"role": "user", "content": "again"}]
    assert reply(second) != reply([system, {"role": "user", "content": "again"}])  # the history matters

    argv = [sys.executable, "-m", "kvforge", "chat", str(artifact), "--system", "be brief"]
    chat = Terminal([*argv, "--temperature", "0", "--max-new-tokens", "6"])
    chat.read_until(b"> ")
    for typed, messages in (("hello", first), ("again", second), ("/reset", None), ("hello", first)):
        chat.type(typed)
        said = chat.read_until(b"> ")
        if messages is None:
            assert "[conversation reset]" in said
        else:
            assert said == f"{typed}\n{reply(messages)}\n"  # the typed line echoed, then the reply
    chat.type("/exit")
    assert chat.process.wait(timeout=60) == 0


def test_chat_drops_the_oldest_turns_to_stay_within_the_context(built_artifact: Callable[..., Path]) -> None:
    artifact = built_artifact("llama")
    # a reply may take 200 of the 256 positions: the prompt keeps 56, too few for two turns
    chat = Terminal([sys.executable, "-m", "kvforge", "chat", str(artifact), "--max-new-tokens", "200"])
    chat.read_until(b"> ")
    long_message = "x " * 20
    chat.type(long_message)
    assert "dropped" not in chat.read_until(b"> ")
    chat.type(long_message)
    assert "[dropped the 1 oldest turn(s) to stay within the context]" in chat.read_until(b"> ")
    chat.type("x " * 100)  # alone past the 56 tokens: refused, and the chat goes on
    assert "kvforge: error: the message makes a prompt of" in chat.read_until(b"> ")
    # at the prompt: the chat ends. Python notices a signal in input() only while it waits in select(),
    # which follows the prompt's write: a Ctrl-C in between is seen at the next key, as any terminal
    # program's would be, so the signal is sent once the process is waiting
    time.sleep(0.5)
    chat.process.send_signal(signal.SIGINT)
    chat.read_until(b"kvforge: interrupted\r\n")
    assert chat.process.wait(timeout=60) == EXIT_INTERRUPTED


def test_shell_completion_as_documented_completes_commands_and_choices() -> None:
    script = Path(sys.executable).parent / "kvforge"  # the console script: completion keys on its name
    if not script.exists():
        pytest.skip("kvforge is not installed as a console script beside this interpreter")
    env = os.environ | {"PYTHONPATH": str(ROOT), "_KVFORGE_COMPLETE": "bash_complete"}

    def complete(words: str) -> list[str]:
        cword = str(len(words.split()) - (0 if words.endswith(" ") else 1))
        done = subprocess.run(
            [str(script)], env=env | {"COMP_WORDS": words, "COMP_CWORD": cword}, capture_output=True, text=True
        )
        return done.stdout.split()

    assert complete("kvforge bu") == ["plain,build", "plain,build-engine"]
    assert complete("kvforge build ck --dtype ") == ["plain,fp32", "plain,fp16", "plain,bf16"]
    source = subprocess.run([str(script)], env=env | {"_KVFORGE_COMPLETE": "bash_source"}, capture_output=True)
    assert b"_kvforge_completion()" in source.stdout


@pytest.mark.parametrize("command", ["generate", "bench", "chat"])
def test_ctrl_c_in_a_command_that_runs_an_artifact_exits_130_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "load", interrupted)
    monkeypatch.setattr("kvforge.runners.bench.bench", interrupted)
    (tmp_path / "manifest.json").write_text("{}")  # what tells an artifact from a checkpoint
    args = {"generate": [str(tmp_path), "hi"], "bench": [str(tmp_path), "--json"], "chat": [str(tmp_path)]}[command]
    result = CliRunner().invoke(main, [command, *args])
    assert result.exit_code == EXIT_INTERRUPTED
    assert result.stderr.strip().splitlines() == ["kvforge: interrupted"] and "Aborted" not in result.output
    if command == "bench":
        assert json.loads(result.stdout)["error"] == {"kind": "interrupted", "message": "interrupted"}
