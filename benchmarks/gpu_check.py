"""On a GPU machine: are kvforge's artifacts right on onnxruntime's CUDA provider, and how fast
do they decode next to transformers? One run, no network, one JSON report.

    python benchmarks/gpu_check.py REPORT.json [--workdir DIR] [--only matrix|bench] [--rows NAME...]
        [--budget SECONDS] [--cpu-dry-run]

1. The correctness matrix. Each artifact (the example model at fp32 / fp16 / int4; tiny
   checkpoints made in code: llama at fp32 / fp16 / bf16 / int8 / int4, one of each family the
   suite builds, and llama for the `onnx`, `tensorrt` and `ort-cuda` targets) is built here, then
   generates greedily, 3 prompts x 24 tokens, as one batch and one by one, on the CUDA provider
   and on the CPU (the artifact as the verification gate computes it there: a half-precision
   graph in float32). A row passes where every sequence is the same, or parts only at a near tie:
   where the CPU's logits score the CUDA pick within twice the dtype's tolerance (the gate's
   table, `kvforge.toolchain.verify.TOLERANCES`; quantized: fp16's) of the CPU pick, on that row's scale.
2. The benchmark: a Llama-3.1-8B-shaped checkpoint of 4 layers (1.9B parameters, random
   weights; `benchmarks/make_8b.py --layers 4`, made here) built for `--target ort-cuda` at fp16
   and at int4, decode tokens/s at batch 1 and 8 (t(65 tokens) - t(1 token), greedy), beside
   transformers' static-cache `generate` at bf16 and fp16, eager and `torch.compile`d, each as a
   fraction of the HBM roofline: batch x bandwidth / bytes of weights read per step. The
   bandwidth is read from the machine (the device's memory clock and bus width where torch
   reports them, and a measured device-to-device copy); NVIDIA's H200 datasheet states 4.8 TB/s,
   recorded beside it for reference only.

`--cpu-dry-run` runs the same code on this machine's CPU: a tiny matrix (llama fp32 and
`--target onnx`), the "device" side a second CPU session, and the benchmark on the tiny llama
(onnxruntime and transformers eager on the CPU, no roofline). Each row records its error instead
of stopping the run; a row not started within `--budget` seconds is recorded as not run.
Built artifacts and checkpoints stay in `--workdir`, so a second run measures without building.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXAMPLE = ROOT / "examples" / "model"
CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 9, 13)
H200_NOMINAL_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet (HBM3e, SXM): a reference, never the roofline
BENCH_NEW = 65
BENCH_BATCHES = (1, 8)


@dataclass(frozen=True)
class Row:
    name: str
    source: str  # "example", a checkpoint directory, or a tiny checkpoint's model_type (tests/tiny.py)
    target: str = "ort-cpu"
    dtype: str = "float32"
    bits: int | None = None  # weight-only quantization
    capacity: int | None = None  # a fixed-capacity target's cache length


FAMILIES = ("qwen3", "gemma3_text", "gpt_oss", "qwen3_moe", "mixtral", "deepseek_v3", "qwen3_5_text", "lfm2")
MATRIX = (
    Row("example fp32", "example"),
    Row("example fp16", "example", dtype="float16"),
    Row("example int4", "example", bits=4),
    Row("llama fp32", "llama"),
    Row("llama fp16", "llama", dtype="float16"),
    Row("llama bf16", "llama", dtype="bfloat16"),
    Row("llama int8", "llama", bits=8),
    Row("llama int4", "llama", bits=4),
    *(Row(family, family) for family in FAMILIES),
    Row("granitemoehybrid", "granitemoehybrid"),
    Row("llama --target onnx", "llama", target="onnx"),
    Row("llama --target tensorrt", "llama", target="tensorrt", capacity=64),
    Row("llama --target ort-cuda", "llama", target="ort-cuda", dtype="float16"),
)
DRY_MATRIX = (Row("llama fp32", "llama"), Row("llama --target onnx", "llama", target="onnx"))


@dataclass
class Report:
    started: float = field(default_factory=time.time)
    machine: dict[str, Any] = field(default_factory=dict)
    matrix: list[dict[str, Any]] = field(default_factory=list)
    bench: dict[str, Any] = field(default_factory=dict)

    def write(self, path: Path) -> None:
        body = {
            "machine": self.machine,
            "matrix": self.matrix,
            "bench": self.bench,
            "seconds": round(time.time() - self.started, 1),
        }
        path.write_text(json.dumps(body, indent=2, default=str) + "\n")


def machine(dry: bool) -> dict[str, Any]:
    import onnxruntime

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "providers": onnxruntime.get_available_providers(),
        "cpus": os.cpu_count(),
        "dry_run": dry,
    }
    try:
        import torch
        import transformers

        info |= {"torch": torch.__version__, "transformers": transformers.__version__}
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError as e:
        info["torch"] = f"unavailable: {e}"
    return info


# --- building ---------------------------------------------------------------------------------


def checkpoint(source: str, workdir: Path) -> Path:
    """The example model, a checkpoint directory, or a tiny checkpoint made here by model type."""
    if source == "example":
        return EXAMPLE
    if Path(source).is_dir():
        return Path(source)
    from tests.tiny import make_checkpoint

    path = workdir / "checkpoints" / source
    if not (path / "config.json").exists():
        path.mkdir(parents=True, exist_ok=True)
        make_checkpoint(path, source)
    return path


def build_row(row: Row, workdir: Path) -> Path:
    from kvforge import BuildOptions, build
    from kvforge.passes.quantize import WeightQuantization
    from kvforge.passes.targets import TARGETS

    out = workdir / "artifacts" / row.name.replace(" ", "_").replace("-", "")
    if (out / "manifest.json").exists():
        return out
    weights = None if row.bits is None else WeightQuantization(row.bits)
    target = TARGETS[row.target]
    options = BuildOptions(target=target, dtype=row.dtype, weights=weights, capacity=row.capacity, force=True)
    return build(checkpoint(row.source, workdir), out, options).output


# --- the correctness matrix ---------------------------------------------------------------------


@contextmanager
def sessions(artifact: Path, device: str) -> Iterator[tuple[Any, Any]]:
    """(the CPU's session as the gate computes the artifact, the device's session)."""
    from kvforge.runners.contract import DecoderIO
    from kvforge.runners.session import OrtSession
    from kvforge.toolchain.gate import verifiable

    manifest = json.loads((artifact / "manifest.json").read_text())
    io = DecoderIO.from_dict(manifest["io"])
    unquantized = manifest["flags"].get("weights") is None
    with verifiable(artifact, io, unquantized) as cpu:
        providers = (CPU,) if device == CPU else (CUDA, CPU)
        yield cpu, OrtSession(artifact / "model.onnx", io, providers)


def greedy(session: Any, prompts: Sequence[Sequence[int]], max_positions: int) -> tuple[list[list[int]], list[Any]]:
    """Each prompt's NEW_TOKENS greedy tokens and each step's last-position logits."""
    from kvforge.runners.core import logit_steps
    from kvforge.runners.decoding import batch_decoders
    from kvforge.runners.sampling import SamplingParams

    decoders = batch_decoders(SamplingParams(temperature=0.0), prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits = []
    steps = logit_steps(session, prompts, max_new_tokens=NEW_TOKENS, max_positions=max_positions, decoders=decoders)
    for step in steps:
        for row, token in enumerate(step.tokens):
            tokens[row].append(int(token))
        logits.append(np.asarray(step.logits, dtype=np.float64))
    return tokens, logits


def parting(
    cpu: tuple[list[list[int]], list[Any]], device: tuple[list[list[int]], list[Any]], relative: float
) -> list[dict[str, Any]]:
    """Where each row's device tokens part from the CPU's, and whether on a near tie."""
    found = []
    for row, (ours, theirs) in enumerate(zip(cpu[0], device[0], strict=True)):
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if step is None:
            continue
        scores = cpu[1][step][row]
        gap = float(scores[ours[step]] - scores[theirs[step]])
        scale = float(scores.std())
        found.append({"row": row, "step": step, "gap": gap, "scale": scale, "near_tie": gap <= 2 * relative * scale})
    return found


def check_row(row: Row, workdir: Path, device: str) -> dict[str, Any]:
    from kvforge.runners.manifest import read_max_positions
    from kvforge.toolchain.verify import TOLERANCES

    entry: dict[str, Any] = {"name": row.name, "target": row.target, "dtype": row.dtype, "bits": row.bits}
    start = time.perf_counter()
    try:
        artifact = build_row(row, workdir)
        manifest = json.loads((artifact / "manifest.json").read_text())
        entry["verified_on"] = manifest["parity"].get("verified_on")
        max_positions = read_max_positions(artifact, manifest)
        relative = TOLERANCES["float16" if row.bits else row.dtype].relative
        rng = np.random.default_rng(0)
        vocab = int(manifest["io"]["vocab_size"])
        prompts = [[int(t) for t in rng.integers(3, vocab, n)] for n in PROMPT_LENGTHS]
        with sessions(artifact, device) as (cpu, dev):
            first = {"batch": [prompts], "one by one": [[p] for p in prompts]}
            for mode, groups in first.items():
                parts = []
                for group in groups:
                    offset = prompts.index(group[0])
                    found = parting(greedy(cpu, group, max_positions), greedy(dev, group, max_positions), relative)
                    parts += [p | {"row": p["row"] + offset} for p in found]
                entry[mode] = {"parts": parts, "equal": not parts, "near_ties_only": all(p["near_tie"] for p in parts)}
        entry["passed"] = all(entry[mode]["near_ties_only"] for mode in first)
    except Exception as e:  # a row's failure is its result; the matrix goes on
        entry |= {"passed": False, "error": f"{type(e).__name__}: {e}"}
    entry["seconds"] = round(time.perf_counter() - start, 1)
    return entry


# --- the benchmark ------------------------------------------------------------------------------


def bandwidth(dry: bool) -> dict[str, Any]:
    """The device's memory bandwidth: from its memory clock and bus width (where torch reports
    them; double data rate) and as measured by a device-to-device copy."""
    if dry:
        return {"device": "cpu", "bytes_per_s": None}
    import torch

    props = torch.cuda.get_device_properties(0)
    found: dict[str, Any] = {"device": props.name, "nominal_h200_bytes_per_s": H200_NOMINAL_BYTES_PER_S}
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        found["theoretical_bytes_per_s"] = 2 * clock_khz * 1e3 * bus_bits / 8
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, runs = time.perf_counter(), 20
    for _ in range(runs):
        y.copy_(x)
    torch.cuda.synchronize()
    found["copy_bytes_per_s"] = 2 * x.numel() * runs / (time.perf_counter() - start)  # read + write
    found["bytes_per_s"] = found.get("theoretical_bytes_per_s", found["copy_bytes_per_s"])
    del x, y
    return found


def decode_rate(run: Callable[[int], object], batch: int, new: int) -> float | None:
    """Tokens/s of decode: `batch` x (new - 1) tokens over t(new) - t(1), each time the best of
    3 after a warm-up (None where noise leaves no positive difference)."""
    run(new)
    times: dict[int, list[float]] = {1: [], new: []}
    for _ in range(3):
        for n in times:
            start = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - start)
    decode = min(times[new]) - min(times[1])
    return batch * (new - 1) / decode if decode > 0 else None


def ort_rates(artifact: Path, device: str, new: int) -> dict[str, Any]:
    from kvforge.runners.engine import Engine

    engine = Engine.load(artifact, runtime="ort-cuda" if device == CUDA else "ort")
    engine.eos_ids = ()
    weight_bytes = sum(p.stat().st_size for p in artifact.iterdir() if p.name.startswith("model.onnx"))
    rates: dict[str, Any] = {"weight_bytes": weight_bytes}
    for batch in BENCH_BATCHES:
        prompts = [[5 + row, 17, 42, 8, 99, 23, 61, 7] for row in range(batch)]
        rates[f"batch {batch}"] = decode_rate(functools.partial(_ort_tokens, engine, prompts), batch, new)
    return rates


def _ort_tokens(engine: Any, prompts: list[list[int]], new: int) -> list[list[int]]:
    return engine.generate_tokens(prompts, max_new_tokens=new, temperature=0.0)  # type: ignore[no-any-return]


def transformers_rates(ckpt: Path, dtype: str, compiled: bool, dry: bool, new: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    device = "cpu" if dry else "cuda"
    model: Any = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    model.generation_config.cache_implementation = "static"
    if compiled:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rates: dict[str, Any] = {"weight_bytes": weight_bytes}
    for batch in BENCH_BATCHES:
        ids = torch.tensor([[5 + row, 17, 42, 8, 99, 23, 61, 7] for row in range(batch)], device=device)

        def run(n: int, ids: Any = ids) -> None:
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            if not dry:
                torch.cuda.synchronize()

        rates[f"batch {batch}"] = decode_rate(run, batch, new)
    return rates


def with_roofline(rates: dict[str, Any], bytes_per_s: float | None) -> dict[str, Any]:
    if not bytes_per_s:
        return rates
    for batch in BENCH_BATCHES:
        key = f"batch {batch}"
        if isinstance(rates.get(key), float):
            roofline = batch * bytes_per_s / rates["weight_bytes"]
            rates[f"{key} roofline"] = roofline
            rates[f"{key} fraction"] = rates[key] / roofline
    return rates


def bench(workdir: Path, dry: bool, report: Report, path: Path) -> None:
    device = CPU if dry else CUDA
    new = 17 if dry else BENCH_NEW
    report.bench["bandwidth"] = bw = bandwidth(dry)
    if dry:
        ckpt = checkpoint("llama", workdir)
        builds = {"ort fp32": DRY_MATRIX[0]}  # the matrix's artifact, built once
        references = [("float32", False)]
    else:
        ckpt, grid_ckpt = workdir / "llama-1.9b", workdir / "llama-1.9b-int4-grid"
        for out, extra in ((ckpt, []), (grid_ckpt, ["--int4-grid"])):
            if not (out / "config.json").exists():
                subprocess.run(
                    [sys.executable, str(ROOT / "benchmarks" / "make_8b.py"), str(out), "--layers", "4", *extra],
                    check=True,
                )
        builds = {
            "ort fp16": Row("bench fp16", str(ckpt), target="ort-cuda", dtype="float16"),
            "ort int4": Row("bench int4", str(grid_ckpt), target="ort-cuda", dtype="float16", bits=4),
        }
        references = [("bfloat16", False), ("float16", False), ("bfloat16", True), ("float16", True)]
    report.bench["model"] = str(ckpt)
    for name, row in builds.items():
        try:
            report.bench[name] = with_roofline(ort_rates(build_row(row, workdir), device, new), bw["bytes_per_s"])
        except Exception as e:  # one variant's failure is its result
            report.bench[name] = {"error": f"{type(e).__name__}: {e}"}
        report.write(path)
    for dtype, compiled in references:
        name = f"transformers {dtype} {'torch.compile' if compiled else 'eager'}"
        try:
            report.bench[name] = with_roofline(transformers_rates(ckpt, dtype, compiled, dry, new), bw["bytes_per_s"])
        except Exception as e:
            report.bench[name] = {"error": f"{type(e).__name__}: {e}"}
        if not dry:
            import torch

            torch.cuda.empty_cache()  # the model is gone with the call: its memory back before the next
        report.write(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("report", type=Path, help="where the JSON report goes")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvforge-gpu-check"))
    parser.add_argument("--only", choices=("matrix", "bench"), default=None)
    parser.add_argument("--cpu-dry-run", action="store_true", help="the tiny matrix and benchmark, CPU against CPU")
    parser.add_argument("--rows", nargs="+", default=None, help="only these matrix rows, by name")
    parser.add_argument(
        "--budget",
        type=float,
        default=300.0,
        help="seconds after which no new matrix row starts (default 300; the benchmark follows)",
    )
    args = parser.parse_args(argv)
    dry = args.cpu_dry_run
    if not dry:
        import onnxruntime

        if CUDA not in onnxruntime.get_available_providers():
            print("onnxruntime offers no CUDAExecutionProvider here: install onnxruntime-gpu, or pass --cpu-dry-run")
            return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = Report(machine=machine(dry))
    if args.only in (None, "matrix"):
        rows = [r for r in (DRY_MATRIX if dry else MATRIX) if args.rows is None or r.name in args.rows]
        for row in rows:
            if time.time() - report.started > args.budget:
                report.matrix.append({"name": row.name, "passed": False, "error": "not run: --budget spent"})
                continue
            report.matrix.append(check_row(row, args.workdir, CPU if dry else CUDA))
            report.write(args.report)
            print(f"{row.name}: {'ok' if report.matrix[-1]['passed'] else 'FAILED'}", flush=True)
    if args.only in (None, "bench"):
        bench(args.workdir, dry, report, args.report)
    report.write(args.report)
    failed = [r["name"] for r in report.matrix if not r["passed"]]
    print(f"report: {args.report}; matrix rows failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
