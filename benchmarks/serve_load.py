"""Load on `kvforge serve`: time to first token and inter-token latency at several concurrencies.

    python benchmarks/serve_load.py ARTIFACT [--concurrency 1 4 8] [--requests 8] [--prompt 64] [--new 64]
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --model NAME ...
    python benchmarks/serve_load.py ARTIFACT --kvforge .venv/bin/kvforge OTHER/.venv/bin/kvforge --rounds 3
    python benchmarks/serve_load.py ARTIFACT --kvforge .venv/bin/kvforge --llama-server BIN FILE.gguf --concurrency 1

Starts `kvforge serve ARTIFACT` on a free loopback port (or uses --url), then for each
concurrency C runs C clients, each sending --requests streamed completions one after the
other: a prompt of --prompt token ids, --new tokens with ignore_eos, greedy. Every figure
comes from client timestamps: time to first token (request sent to first text event),
inter-token latency (between consecutive text events), and tokens/s over the whole run.
Only loopback is used; every request is bounded by --timeout.

With several --kvforge executables (two checkouts side by side), one server of each is
started and the loads alternate between them, --rounds times per concurrency; the table
gives each server's medians over the rounds and, for the second and later servers, the
first one's figures relative to theirs (tokens/s ratio, TTFT ratio), and each server's CPU
time per generated token (user + system, all its threads, from /proc on Linux): on a shared
machine the wall-clock figures move with the other work, its CPU time much less.

Every round sends the same prompts (the generator is seeded by the concurrency), so each
server sees them cold in the first round and again in the later ones: the table also gives
the first round's time to first token ("round 1", cold) and the median of the later rounds'
("later", repeated); with --fresh-prompts every round draws new prompts, so every round is
cold. --llama-server BIN FILE adds llama.cpp's server on a GGUF file to the alternation (`-np`
the largest concurrency, `-c 8192`, `-t` the machine's cores), for the same loads on the file
ARTIFACT was built from.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0


def stream_one(url: str, body: dict[str, object], timeout: float) -> tuple[float | None, list[float], int]:
    """One streamed completion: (time to first token, gaps between text events, tokens); no time
    to first token when no event had text (tokens that decode to nothing, such as end-of-text
    ids generated under ignore_eos)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        began = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        stamps: list[float] = []
        tokens = 0
        while True:
            line = response.readline()
            if not line:
                break
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0]["text"]:
                stamps.append(time.perf_counter())
        first = stamps[0] - began if stamps else None
        return first, [b - a for a, b in zip(stamps, stamps[1:])], tokens
    finally:
        conn.close()


def load(url: str, model: str, concurrency: int, args: argparse.Namespace, round_: int = 0) -> tuple[Run, float]:
    rng = random.Random(concurrency + 1000 * round_ if args.fresh_prompts else concurrency)

    def client(index: int) -> Run:
        run = Run()
        for _ in range(args.requests):
            prompt = [rng.randrange(3, args.vocab) for _ in range(args.prompt)]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": args.new,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            ttft, gaps, tokens = stream_one(url, body, args.timeout)
            if ttft is not None:
                run.ttft.append(ttft)
            run.gaps.extend(gaps)
            run.tokens += tokens
        return run

    began = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        runs = list(pool.map(client, range(concurrency)))
    wall = time.perf_counter() - began
    total = Run()
    for run in runs:
        total.ttft += run.ttft
        total.gaps += run.gaps
        total.tokens += run.tokens
    return total, wall


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux's /proc; nan elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(
    artifact: str, args: argparse.Namespace, kvforge: str | None = None
) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = Path(tempfile.mkstemp(prefix="serve-load-", suffix=".log")[1])
    kvforge = kvforge or str(Path(sys.executable).with_name("kvforge"))
    command = [kvforge, "serve", artifact, "--port", "0", "--max-num-seqs", str(max(args.concurrency))]
    command += ["--prefill-chunk", str(args.prefill_chunk)]
    with open(log, "wb") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "ready:" in text:
            return process, text.split("listening on ", 1)[1].split(",", 1)[0], log
        if process.poll() is not None:
            raise SystemExit(f"kvforge serve exited: {text}")
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"kvforge serve was not ready in 120 s: {log.read_text()}")


def start_llama_server(binary: str, gguf: str, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str, Path]:
    """llama.cpp's server on GGUF at a free loopback port, once its /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    slots = str(max(args.concurrency))
    command = [binary, "-m", gguf, "-np", slots, "-c", "8192", "-t", str(os.cpu_count()), "--port", str(port)]
    with open(log, "wb") as err:
        process = subprocess.Popen(command, stdout=err, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited: {log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return process, url, log
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit(f"llama-server was not ready in 120 s: {log.read_text(errors='replace')[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", nargs="?")
    parser.add_argument("--url", help="a running server instead of starting one")
    parser.add_argument("--model", help="the served model name (default: the artifact directory's name)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=8, help="requests per client")
    parser.add_argument("--prompt", type=int, default=64, help="prompt length in tokens")
    parser.add_argument("--new", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn from [3, vocab)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="the server's --prefill-chunk")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--kvforge", nargs="+", help="kvforge executables to compare, one server each")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per concurrency (--kvforge)")
    parser.add_argument("--fresh-prompts", action="store_true", help="new prompts every round: every round cold")
    parser.add_argument(
        "--llama-server", nargs=2, metavar=("BINARY", "GGUF"), help="also llama.cpp's server on GGUF (--kvforge)"
    )
    args = parser.parse_args()
    if not args.url and not args.artifact:
        parser.error("give ARTIFACT or --url")
    if args.llama_server and not args.kvforge:
        parser.error("--llama-server joins a --kvforge comparison: give --kvforge too")
    if args.kvforge:
        if not args.artifact:
            parser.error("--kvforge starts servers: give ARTIFACT")
        compare(args)
        return
    process = None
    url = args.url
    if not url:
        process, url, _ = start_server(args.artifact, args)
    model = args.model or Path(args.artifact).resolve().name
    try:
        print(f"{'conc':>4} {'reqs':>5} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} {'tok/s':>7}")
        for concurrency in args.concurrency:
            run, wall = load(url, model, concurrency, args)
            print(
                f"{concurrency:>4} {len(run.ttft):>5} {percentile(run.ttft, 0.5) * 1e3:>7.1f}ms "
                f"{percentile(run.ttft, 0.99) * 1e3:>7.1f}ms {percentile(run.gaps, 0.5) * 1e3:>6.1f}ms "
                f"{percentile(run.gaps, 0.99) * 1e3:>6.1f}ms {run.tokens / wall:>7.1f}"
            )
            sys.stdout.flush()
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


def compare(args: argparse.Namespace) -> None:
    """One server per executable (and llama-server); each concurrency's loads alternate between
    them, round by round."""
    servers = [start_server(args.artifact, args, kvforge) for kvforge in args.kvforge]
    names = [kvforge[-40:] for kvforge in args.kvforge]
    if args.llama_server:
        binary, gguf = args.llama_server
        servers.append(start_llama_server(binary, gguf, args))
        names.append("llama-server")
    model = args.model or Path(args.artifact).resolve().name
    try:
        print(
            f"{'server':<40} {'conc':>4} {'ttft p50':>9} {'round 1':>8} {'later':>8} {'itl p50':>8} {'tok/s':>7} "
            f"{'cpu/tok':>8} {'tok/s x':>8} {'ttft x':>7}"
        )
        for concurrency in args.concurrency:
            figures: list[list[tuple[float, float, float, float]]] = [[] for _ in servers]
            for round_ in range(args.rounds):
                order = range(len(servers)) if round_ % 2 == 0 else reversed(range(len(servers)))
                for index in order:
                    process, url, _ = servers[index]
                    cpu = cpu_seconds(process.pid)
                    run, wall = load(url, model, concurrency, args, round_)
                    cpu = (cpu_seconds(process.pid) - cpu) / max(run.tokens, 1)
                    ttft, itl = percentile(run.ttft, 0.5), percentile(run.gaps, 0.5)
                    figures[index].append((ttft, itl, run.tokens / wall, cpu))
            medians = [[statistics.median(f[i] for f in runs) for i in range(4)] for runs in figures]
            for index, (ttft, itl, rate, cpu) in enumerate(medians):
                ratios = ""
                if index:
                    ratios = f"{medians[0][2] / rate:>7.2f}x {ttft / medians[0][0]:>6.2f}x"
                first = figures[index][0][0]
                later = statistics.median(f[0] for f in figures[index][1:]) if args.rounds > 1 else float("nan")
                print(
                    f"{names[index]:<40} {concurrency:>4} {ttft * 1e3:>7.1f}ms {first * 1e3:>6.1f}ms "
                    f"{later * 1e3:>6.1f}ms {itl * 1e3:>6.1f}ms {rate:>7.1f} {cpu * 1e3:>6.2f}ms {ratios}"
                )
            sys.stdout.flush()
    finally:
        for process, _, _ in servers:
            process.send_signal(signal.SIGTERM)
            process.wait(60)


if __name__ == "__main__":
    main()
