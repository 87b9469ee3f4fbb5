"""Decode speed through `kvforge serve` with and without --speculative, on edit-like and open prompts.

    python benchmarks/serve_speculative.py ARTIFACT [--new 96] [--rounds 5] [--draft-tokens 8]
                                           [--speculative prompt-lookup|draft:PATH] [--speculative-rows 1]

ARTIFACT is built with `kvforge build` (the defaults). Two servers run side by side on free
loopback ports, one plain and one with `--speculative`. Per round and per prompt set (the
edit-like and open prompts of benchmarks/speculative.py), each server gets the set's prompts
one after another (concurrency 1) and then all at once (concurrency 4), greedy and streamed
through the official `openai` client, every reply running to --new tokens (`ignore_eos`).
A round measures both servers in turn (which one goes first alternates), so the machine's
load reaches both alike. Decode speed is the completion tokens after each reply's first
streamed chunk over the time from that chunk to the last, summed over the replies of a run;
the report is the median over rounds of each server and their ratio, the acceptance
(accepted / drafted tokens, from the speculative server's /metrics), and whether every text
equals the plain server's (the run fails otherwise).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.prefix_cache import metric, start  # noqa: E402
from benchmarks.speculative import EDIT, OPEN  # noqa: E402


def reply(client: Any, model: str, prompt: str, new: int) -> tuple[str, int, float]:
    """(text, tokens after the first chunk, seconds from the first chunk to the last)."""
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    first = last = 0.0
    parts: list[str] = []
    for chunk in stream:
        if chunk.choices:
            last = time.perf_counter()
            first = first or last
            parts.append(chunk.choices[0].text)
    return "".join(parts), new - 1, last - first


def run_set(client: Any, model: str, prompts: list[str], new: int, concurrent: bool) -> tuple[float, list[str]]:
    """Decode tokens per second over the set's replies, and their texts."""
    results: list[tuple[str, int, float] | None] = [None] * len(prompts)

    def one(index: int) -> None:
        results[index] = reply(client, model, prompts[index], new)

    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        for index in range(len(prompts)):
            one(index)
    done = [r for r in results if r is not None]
    assert len(done) == len(prompts)
    if concurrent:  # tokens over the time the replies overlapped with decoding
        return sum(r[1] for r in done) / max(r[2] for r in done), [r[0] for r in done]
    return sum(r[1] for r in done) / sum(r[2] for r in done), [r[0] for r in done]


def main() -> None:
    import openai

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--new", type=int, default=96, help="new tokens per reply")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--speculative", default="prompt-lookup")
    parser.add_argument("--speculative-rows", type=int, default=1, help="the server's --speculative-rows")
    args = parser.parse_args()
    model = Path(args.artifact).resolve().name
    common = ["--prefix-cache-bytes", "0", "--max-num-seqs", "4"]
    spec_flags = ["--speculative", args.speculative, "--draft-tokens", str(args.draft_tokens)]
    spec_flags += ["--speculative-rows", str(args.speculative_rows)]
    servers = {"plain": start(args.artifact, common), "speculative": start(args.artifact, common + spec_flags)}
    clients = {
        name: openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        for name, (_, url, _) in servers.items()
    }
    cases = [(s, c) for s in ("edit-like", "open") for c in (False, True)]
    speeds: dict[tuple[str, bool, str], list[float]] = {(s, c, n): [] for s, c in cases for n in servers}
    drafted: dict[str, float] = {"edit-like": 0.0, "open": 0.0}
    accepted: dict[str, float] = {"edit-like": 0.0, "open": 0.0}
    try:
        for client in clients.values():
            reply(client, model, "def warm():", 8)
        spec_url = servers["speculative"][1]
        for round_ in range(args.rounds):
            for name_set, concurrent in cases:
                prompts = list((EDIT if name_set == "edit-like" else OPEN).values())
                order = ["plain", "speculative"] if round_ % 2 == 0 else ["speculative", "plain"]
                texts = {}
                for name in order:
                    before = (
                        metric(spec_url, "spec_decode_num_draft_tokens_total"),
                        metric(spec_url, "spec_decode_num_accepted_tokens_total"),
                    )
                    speed, texts[name] = run_set(clients[name], model, prompts, args.new, concurrent)
                    speeds[(name_set, concurrent, name)].append(speed)
                    if name == "speculative":
                        drafted[name_set] += metric(spec_url, "spec_decode_num_draft_tokens_total") - before[0]
                        accepted[name_set] += metric(spec_url, "spec_decode_num_accepted_tokens_total") - before[1]
                if texts["plain"] != texts["speculative"]:
                    raise SystemExit(f"texts differ with --speculative ({name_set}, concurrent {concurrent})")
    finally:
        for process, _, _ in servers.values():
            process.send_signal(signal.SIGTERM)
            process.wait(60)
    print(
        f"{args.artifact}: {args.speculative}, K={args.draft_tokens}, --speculative-rows {args.speculative_rows}, "
        f"{args.new} new tokens, median of {args.rounds}"
    )
    for name_set, concurrent in cases:
        plain = statistics.median(speeds[(name_set, concurrent, "plain")])
        fast = statistics.median(speeds[(name_set, concurrent, "speculative")])
        rate = accepted[name_set] / drafted[name_set] if drafted[name_set] else 0.0
        print(
            f"  {name_set:<9} concurrency {4 if concurrent else 1}: plain {plain:7.1f} tok/s  speculative "
            f"{fast:7.1f} tok/s  {fast / plain:5.2f}x  acceptance {rate:4.0%} (whole set)"
        )
    print("texts identical with and without --speculative: True")


if __name__ == "__main__":
    main()
