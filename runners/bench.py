"""`kvforge bench`: first-token latency, decode speed and its roofline fraction, peak memory.

Decode on a CPU is bound by memory bandwidth: every step reads every weight once, plus the
KV cache of every row. The roofline is the machine's read bandwidth divided by those bytes;
the fraction of it that decode reaches says how much is left to gain. Decode speed counts
the steps from the first generated token to the last of one generation, so prefill is
excluded: decode tokens/s = batch × (new − 1) / the time of those steps.

Shared machines are noisy, and a neighbour's load drifts within seconds. So every figure is
taken in rounds: each round measures the read bandwidth, then runs one generation of every
configuration, their decode steps taken in turn (one step of each configuration, then the
next), so the configurations compared share every moment of the round. A configuration's
figures are medians over the rounds, its roofline fraction is the median of each round's
decode speed over that round's roofline, and the ratios between configurations (a longer
context against the shortest, a larger batch against the smallest) are medians of ratios
taken within a round. Compare ratios measured in one run, not absolute numbers across runs.
"""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvforge.runners.contract import DecoderIO
from kvforge.runners.core import run_inline, token_requests
from kvforge.runners.cpus import usable_cpus
from kvforge.runners.decoding import batch_decoders
from kvforge.runners.engine import Engine
from kvforge.runners.manifest import read_manifest
from kvforge.runners.sampling import SamplingParams

_BANDWIDTH_BYTES = 256 << 20  # far beyond any CPU cache, so the read streams from memory


@dataclass(frozen=True)
class Round:
    """One run of one configuration, and the bandwidth measured at the start of its round."""

    first_token_ms: float
    decode_tokens_per_s: float
    bandwidth: float


@dataclass(frozen=True)
class BenchResult:
    prompt: int
    batch: int
    new_tokens: int
    bytes_per_step: int
    rounds: tuple[Round, ...]

    @property
    def first_token_ms(self) -> float:
        return statistics.median(r.first_token_ms for r in self.rounds)

    @property
    def decode_tokens_per_s(self) -> float:
        return statistics.median(r.decode_tokens_per_s for r in self.rounds)

    @property
    def roofline_tokens_per_s(self) -> float:
        """batch × bandwidth ÷ bytes per step, at the median bandwidth of the rounds."""
        return self.batch * statistics.median(r.bandwidth for r in self.rounds) / self.bytes_per_step

    @property
    def roofline_fraction(self) -> float:
        """The median over rounds of decode speed ÷ that round's roofline."""
        return statistics.median(
            r.decode_tokens_per_s * self.bytes_per_step / (self.batch * r.bandwidth) for r in self.rounds
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "batch": self.batch,
            "new_tokens": self.new_tokens,
            "bytes_per_step": self.bytes_per_step,
            "first_token_ms": self.first_token_ms,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "roofline_tokens_per_s": self.roofline_tokens_per_s,
            "roofline_fraction": self.roofline_fraction,
            "rounds": [asdict(r) for r in self.rounds],
        }


@dataclass(frozen=True)
class Ratio:
    """Decode speed of `config` over that of `base` ((prompt, batch) each), the median of the
    ratios within each round."""

    config: tuple[int, int]
    base: tuple[int, int]
    ratio: float

    def describe(self) -> str:
        (prompt, batch), (base_prompt, base_batch) = self.config, self.base
        if batch == base_batch:
            return f"decode at prompt {prompt} / prompt {base_prompt} (batch {batch}): {self.ratio:.3f}x"
        return f"decode tok/s at batch {batch} / batch {base_batch} (prompt {prompt}): {self.ratio:.3f}x"


def ratios(results: Sequence[BenchResult]) -> list[Ratio]:
    """Each longer prompt against the shortest (at the smallest batch), and each larger batch
    against the smallest (at the shortest prompt)."""
    by_config = {(r.prompt, r.batch): r for r in results}
    if not by_config:
        return []
    prompt, batch = min(p for p, _ in by_config), min(b for _, b in by_config)
    base = by_config.get((prompt, batch))
    if base is None:
        return []
    out = []
    for (p, b), result in sorted(by_config.items()):
        if (p, b) != (prompt, batch) and (p == prompt or b == batch):
            within = [r.decode_tokens_per_s / s.decode_tokens_per_s for r, s in zip(result.rounds, base.rounds)]
            out.append(Ratio((p, b), (prompt, batch), statistics.median(within)))
    return out


def memory_bandwidth(size_bytes: int = _BANDWIDTH_BYTES, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes per second the machine reads: a streaming read over a large float32 array on
    every core, the best of `repeats`. Decode reads its weights and never writes them, so
    the roofline is a read, not a copy (which also writes, and streams slower). The
    read is a dot product of each core's part with itself, BLAS's vectorized loop, one
    multiply-add per element: a NumPy sum is slower than the memory (slower than fp32 decode
    streams its weights), and a roofline that a kernel beats is no roofline (the figures:
    docs/performance.md, "The roofline reads"). On a shared machine every disturbance only
    makes a read slower, hence the best.

    onnxruntime decodes with a thread per core, so a one-thread read would understate what
    the machine can stream.
    """
    threads = threads or usable_cpus()
    source = np.ones(size_bytes // 4, dtype=np.float32)
    parts = np.array_split(source, threads)
    with ThreadPoolExecutor(threads) as pool:  # numpy releases the GIL in BLAS

        def read() -> float:
            start = time.perf_counter()
            list(pool.map(lambda part: part.dot(part), parts))
            return time.perf_counter() - start

        read()  # touch every page first
        return source.nbytes / min(read() for _ in range(repeats))


def weight_bytes_per_step(artifact: Path, manifest: dict[str, Any]) -> int:
    """Weight bytes one decode step reads: every weight, except the rows of embedding
    tables it does not gather (the input embedding, unless the LM head reads it: tied and
    left in float, or a tied head's quantized codes that the lookup reads too; learned
    position tables)."""
    spec, flags = manifest["spec"], manifest["flags"]
    itemsize = np.dtype(flags["dtype"]).itemsize
    passes = manifest.get("passes", {}).get("passes", [])
    lookup = next((r for r in passes if r.get("name") == "QuantizeEmbedding" and r["fusions"].get("quantized")), None)
    gathered_only = 0
    if not spec["tied_embeddings"] or lookup is not None:  # a quantized lookup has codes of its own
        gathered_only += _input_table_bytes(spec, lookup, itemsize)
    if spec["position_embedding"] == "learned":
        gathered_only += spec["max_positions"] * spec["hidden_size"] * itemsize
    return (artifact / "model.onnx.data").stat().st_size - gathered_only - _idle_expert_bytes(manifest)


def _idle_expert_bytes(manifest: dict[str, Any]) -> int:
    """The routed experts' weights a decode step of one token does not read (the manifest's
    `experts`, written by a build of a mixture of experts): all but `per_token` of `routed`."""
    experts = manifest.get("experts")
    if not isinstance(experts, dict):
        return 0
    routed, per_token, nbytes = (experts.get(k) for k in ("routed", "per_token", "weight_bytes"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (routed, per_token, nbytes)):
        return 0
    assert isinstance(routed, int) and isinstance(per_token, int) and isinstance(nbytes, int)
    return 0 if routed == 0 else nbytes * (routed - per_token) // routed


def _input_table_bytes(spec: dict[str, Any], lookup: dict[str, Any] | None, itemsize: int) -> int:
    """Bytes of the token-embedding table as stored: in the compute dtype, or as the pass
    report's QuantizeEmbedding record `lookup` says it was written (passes/quantize_embedding.py):
    codes (whole blocks of packed codes for GatherBlockQuantized, a byte each for Gather), a
    scale per block of each row (of the record's `scale_bytes`; where it has none, in the compute
    dtype), and zero points when asymmetric."""
    rows, hidden = spec["vocab_size"], spec["hidden_size"]
    if lookup is None:
        return rows * hidden * itemsize
    config = lookup["config"]
    bits, block = config["bits"], config["block_size"]
    blocks = -(-hidden // block)
    packed = config["form"] == "gather_block_quantized"
    codes = blocks * block * bits // 8 if packed else hidden
    zero_points = 0 if config["symmetric"] else (-(-blocks * bits // 8) if packed else blocks)
    return rows * (codes + blocks * config.get("scale_bytes", itemsize) + zero_points)


def kv_bytes_per_step(io: DecoderIO, context: int, batch: int) -> int:
    """K and V of every attention layer for `context` positions of every row, read once per step
    (a layer bounded by a sliding window holds and reads only its last window - 1:
    `DecoderIO.kv_bytes_by_kind`), and each row's fixed-size layer states (none for an
    attention-only model)."""
    return sum(io.kv_bytes_by_kind(context, batch).values()) + io.state_bytes_per_sequence() * batch


def peak_memory_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure_round(engine: Engine, batches: Sequence[list[list[int]]], new_tokens: int) -> list[tuple[float, float]]:
    """(first token seconds, decode tokens/s over the batch) of one generation per batch of prompts.

    Each generation is the engine core's batch (`run_inline`, greedy, no eos: every row runs
    its full length). Every generation is first run to its first tokens (each prompt prefilled
    alone, as `Engine` does), then their decode steps are taken in turn, one step of each, so
    configurations compared with each other are timed within milliseconds of each other rather
    than seconds. A generation's decode time is the sum of its own steps from the first
    generated token to the last: exactly `new_tokens - 1` steps, prefill excluded.
    """
    generations, firsts = [], []
    for prompts in batches:
        decoders = batch_decoders(SamplingParams(temperature=0.0), prompts)
        requests = token_requests(prompts, new_tokens, decoders)
        steps = run_inline(engine.session, requests, max_positions=engine.max_positions)
        start = time.perf_counter()
        while not all(r.generated for r in requests):  # every prompt prefilled: the first tokens
            next(steps)
        firsts.append(time.perf_counter() - start)
        generations.append(steps)
    spent = [0.0] * len(generations)
    for _ in range(new_tokens - 1):
        for index, steps in enumerate(generations):
            start = time.perf_counter()
            next(steps)
            spent[index] += time.perf_counter() - start
    return [(first, len(prompts) * (new_tokens - 1) / time_) for first, prompts, time_ in zip(firsts, batches, spent)]


def bench(
    artifact: Path,
    *,
    prompts: Sequence[int] = (128, 1024),
    batches: Sequence[int] = (1, 8),
    new_tokens: int = 32,
    repeats: int = 3,
    bandwidth: float | None = None,
    runtime: str = "auto",
) -> tuple[list[BenchResult], list[str], float]:
    """Results per (prompt, batch), the configurations skipped and why, and the median
    bandwidth of the rounds (`bandwidth`, when given, stands for every round's)."""
    engine = Engine.load(artifact, runtime=runtime)
    weights = weight_bytes_per_step(artifact, read_manifest(artifact))
    rng = np.random.default_rng(0)
    configs, skipped = [], []
    for prompt in prompts:
        if prompt + new_tokens > engine.max_positions:
            skipped.append(f"prompt {prompt}: + {new_tokens} new tokens exceeds the context of {engine.max_positions}")
            continue
        for batch in batches:
            rows = [rng.integers(0, engine.session.io.vocab_size, prompt).tolist() for _ in range(batch)]
            configs.append((prompt, batch, rows))
    rounds: list[list[Round]] = [[] for _ in configs]
    bandwidths = []
    for _ in range(repeats):
        bandwidths.append(bandwidth or memory_bandwidth())
        measured = measure_round(engine, [rows for _, _, rows in configs], new_tokens)
        for runs, (first, decode) in zip(rounds, measured):
            runs.append(Round(first * 1000, decode, bandwidths[-1]))
    results = [
        BenchResult(
            prompt,
            batch,
            new_tokens,
            weights + kv_bytes_per_step(engine.session.io, prompt + new_tokens // 2, batch),
            tuple(runs),
        )
        for (prompt, batch, _), runs in zip(configs, rounds)
    ]
    return results, skipped, statistics.median(bandwidths)


def format_results(results: Sequence[BenchResult], skipped: Sequence[str], bandwidth: float) -> str:
    lines = [
        f"memory bandwidth (read, median of the rounds): {bandwidth / 1e9:.2f} GB/s; "
        f"peak memory {peak_memory_bytes() / 2**20:.0f} MiB",
        f"{'prompt':>6} {'batch':>5} {'first token':>12} {'decode tok/s':>13} {'roofline tok/s':>15} {'fraction':>9}",
    ]
    for r in results:
        lines.append(
            f"{r.prompt:>6} {r.batch:>5} {r.first_token_ms:>9.0f} ms {r.decode_tokens_per_s:>13.1f} "
            f"{r.roofline_tokens_per_s:>15.1f} {r.roofline_fraction:>8.0%}"
        )
    lines += [ratio.describe() for ratio in ratios(results)]
    lines += [f"skipped {reason}" for reason in skipped]
    return "\n".join(lines)
