"""The server's prefix cache: time to first token of a request sharing a long prefix with the last.

    python benchmarks/prefix_cache.py ARTIFACT [--prefix 1500] [--suffix 32] [--trials 5] [--new 16]

Starts `kvforge serve ARTIFACT` twice on a free loopback port, once with its prefix cache
(--prefix-cache-bytes, default the server's own) and once with `--prefix-cache-bytes 0`, and with
the official `openai` client sends, per trial, two streamed greedy completions one after the
other: a fresh random prefix of --prefix token ids plus suffix A, then the same prefix plus suffix
B. Time to first token is the client's time from sending to the first streamed chunk. Reports
the median of each, the ratio second / first within each server (the machine's load cancels
out of a ratio taken in one run), the server's hit tokens, bytes held and evictions from
/metrics, and whether every text equals the other server's.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def start(artifact: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str, Path]:
    log = Path(tempfile.mkstemp(prefix="prefix-cache-", suffix=".log")[1])
    kvforge = Path(sys.executable).with_name("kvforge")
    command = [str(kvforge), "serve", artifact, "--port", "0", *extra]
    with open(log, "wb") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "ready:" in text:
            return process, text.split("listening on ", 1)[1].split(",", 1)[0], log
        if process.poll() is not None:
            raise SystemExit(f"kvforge serve exited: {text}")
        time.sleep(0.1)
    process.kill()
    raise SystemExit(f"kvforge serve was not ready in 180 s: {log.read_text()}")


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(f"kvforge:{name}"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def first_token(client: object, model: str, ids: list[int], new: int) -> tuple[float, str]:
    """(seconds to the first streamed chunk, whole text) of one greedy completion."""
    began = time.perf_counter()
    stream = client.completions.create(  # type: ignore[attr-defined]
        model=model, prompt=ids, max_tokens=new, temperature=0, stream=True
    )
    ttft, parts = None, []
    for chunk in stream:
        if chunk.choices:
            if ttft is None:
                ttft = time.perf_counter() - began
            parts.append(chunk.choices[0].text)
    assert ttft is not None, "no chunk came back"
    return ttft, "".join(parts)


def run(artifact: str, extra: list[str], args: argparse.Namespace) -> dict[str, object]:
    import openai

    process, url, log = start(artifact, extra)
    model = Path(artifact).resolve().name
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=args.timeout, max_retries=0)
    rng = random.Random(args.seed)
    firsts, seconds, texts = [], [], []
    try:
        first_token(client, model, [rng.randrange(3, args.vocab) for _ in range(64)], 4)  # warm the session
        for _ in range(args.trials):
            prefix = [rng.randrange(3, args.vocab) for _ in range(args.prefix)]
            a = prefix + [rng.randrange(3, args.vocab) for _ in range(args.suffix)]
            b = prefix + [rng.randrange(3, args.vocab) for _ in range(args.suffix)]
            ttft_a, text_a = first_token(client, model, a, args.new)
            ttft_b, text_b = first_token(client, model, b, args.new)
            firsts.append(ttft_a)
            seconds.append(ttft_b)
            texts += [text_a, text_b]
        hit_tokens = metric(url, "prefix_cache_hit_tokens_total")
        held = metric(url, "prefix_cache_bytes")
        evictions = metric(url, "prefix_cache_evictions_total")
        announced = [line for line in log.read_text().splitlines() if "prefix cache" in line]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    return {
        "first": statistics.median(firsts),
        "second": statistics.median(seconds),
        "texts": texts,
        "hit_tokens": hit_tokens,
        "bytes": held,
        "evictions": evictions,
        "log": announced,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--prefix", type=int, default=1500, help="shared prefix length in tokens")
    parser.add_argument("--suffix", type=int, default=32, help="each request's own tokens after the prefix")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--new", type=int, default=16, help="tokens generated per request (greedy)")
    parser.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn from [3, vocab)")
    parser.add_argument("--prefill-chunk", type=int, default=256, help="the server's --prefill-chunk")
    parser.add_argument("--prefix-cache-bytes", default=None, help="the cached server's budget (default: its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    common = ["--prefill-chunk", str(args.prefill_chunk)]
    budget = [] if args.prefix_cache_bytes is None else ["--prefix-cache-bytes", args.prefix_cache_bytes]
    cached = run(args.artifact, common + budget, args)
    plain = run(args.artifact, common + ["--prefix-cache-bytes", "0"], args)
    print(f"prefix {args.prefix} + suffix {args.suffix} tokens, {args.trials} trials, medians")
    for name, result in (("cache", cached), ("no cache", plain)):
        first, second = float(result["first"]), float(result["second"])  # type: ignore[arg-type]
        print(
            f"{name:>9}: first {first * 1e3:7.1f} ms  second {second * 1e3:7.1f} ms  "
            f"second/first {second / first:.3f}  hit tokens {result['hit_tokens']:.0f}  bytes {result['bytes']:.0f}  "
            f"evictions {result['evictions']:.0f}"
        )
    for line in cached["log"]:  # type: ignore[attr-defined]
        print(f"  server: {line}")
    same = cached["texts"] == plain["texts"]
    print(f"texts identical with and without the cache: {same} ({len(cached['texts'])} completions)")  # type: ignore[arg-type]
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
