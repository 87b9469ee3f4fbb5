"""What a quantized KV cache buys on onnxruntime's CPU `GroupQueryAttention`, per context length.

    python benchmarks/kv_dtype.py [--contexts 4096 8192 16384 32768] [--rounds 7] [--threads 2]
    python benchmarks/kv_dtype.py --artifacts FLOAT_ART INT8_ART [--contexts ...]

onnxruntime's CPU `GroupQueryAttention` (com.microsoft) takes its past/present cache as int8 with
static `k_scale` / `v_scale` inputs (`k_quant_type` / `v_quant_type` PER_TENSOR or PER_CHANNEL,
`kv_cache_bit_width` 8): the kernel reads the codes and dequantizes them itself. (Its schema also
names a 4-bit width, two codes to a byte; that form is not timed here.) This times one decode step
(batch 1, one new position) of one attention layer with a past of N positions, float32 cache
against the quantized forms, and says how far each form's output lands from the float32 cache's.
The shapes are the 125M reference's (12 query heads, 4 key/value heads of 64). The cache holds
random keys and values with a few outlier channels, as real keys have (a handful of channels ten
times the others), and the scales are each channel's (or the whole tensor's) largest magnitude
over the cache: the static scales a build would calibrate, here fitted to the very data they
encode, so the errors are a floor.

Each form's session runs the same feeds; rounds alternate the forms and the figures are medians.
The node runs as a `concat` graph's does: its present is a new tensor of N + 1 positions, so its
time includes copying the past into it, a quarter of the bytes at int8. A `shared` artifact
(kvforge's default on `ort-cpu`) writes in place and copies nothing: `--artifacts` times that.

With `--artifacts`, the same for whole built artifacts (one built without `--kv-dtype`, one with
`--kv-dtype int8`, from one checkpoint): one decode step of the artifact's graph, batch 1, after a
past of N positions (a cache of N + 1 positions holding random values, or codes), through the
runner's `OrtSession` as generation runs it; the artifacts alternate within each round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from kvforge.runners.engine import Engine
from kvforge.runners.generate import empty_cache, forward

HEADS, KV_HEADS, HEAD_DIM = 12, 4, 64
OUTLIER_CHANNELS, OUTLIER_SCALE = 4, 10.0


@dataclass(frozen=True)
class Form:
    name: str
    bits: int  # 0: float32
    per_channel: bool = False


FORMS = (
    Form("float32", 0),
    Form("int8 per tensor", 8),
    Form("int8 per channel", 8, per_channel=True),
)


def _graph(form: Form, capacity: int) -> bytes:
    cache_type = TensorProto.INT8 if form.bits else TensorProto.FLOAT
    last = HEAD_DIM
    info = helper.make_tensor_value_info
    inputs = [
        info("query", TensorProto.FLOAT, [1, 1, HEADS * HEAD_DIM]),
        info("key", TensorProto.FLOAT, [1, 1, KV_HEADS * HEAD_DIM]),
        info("value", TensorProto.FLOAT, [1, 1, KV_HEADS * HEAD_DIM]),
        info("past_key", cache_type, [1, KV_HEADS, capacity, last]),
        info("past_value", cache_type, [1, KV_HEADS, capacity, last]),
        info("seqlens_k", TensorProto.INT32, [1]),
        info("total_sequence_length", TensorProto.INT32, []),
    ]
    names = [i.name for i in inputs]
    attributes: dict[str, Any] = {"num_heads": HEADS, "kv_num_heads": KV_HEADS}
    if form.bits:
        scales = [KV_HEADS * HEAD_DIM] if form.per_channel else [1]
        inputs += [info("k_scale", TensorProto.FLOAT, scales), info("v_scale", TensorProto.FLOAT, scales)]
        names += [""] * 5 + ["k_scale", "v_scale"]  # cos, sin, position ids, bias, head sink
        kind = "PER_CHANNEL" if form.per_channel else "PER_TENSOR"
        attributes |= {"k_quant_type": kind, "v_quant_type": kind, "kv_cache_bit_width": form.bits}
    node = helper.make_node(
        "GroupQueryAttention", names, ["output", "present_key", "present_value"], domain="com.microsoft", **attributes
    )
    outputs = [info("output", TensorProto.FLOAT, None)] + [info(n, cache_type, None) for n in node.output[1:]]
    graph = helper.make_graph([node], "attention", inputs, outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def _cache(rng: np.random.Generator, capacity: int) -> np.ndarray:
    cache = rng.standard_normal((1, KV_HEADS, capacity, HEAD_DIM)).astype(np.float32)
    cache[..., rng.choice(HEAD_DIM, OUTLIER_CHANNELS, replace=False)] *= OUTLIER_SCALE
    return cache


def _encode(cache: np.ndarray, form: Form) -> tuple[np.ndarray, np.ndarray]:
    """The cache's codes and the scales the kernel reads back."""
    top = 2 ** (form.bits - 1) - 1
    if form.per_channel:
        largest = np.abs(cache).max(axis=2, keepdims=True)  # [1, kv heads, 1, head dim]
    else:
        largest = np.abs(cache).max(keepdims=True)
    scales = np.maximum(largest, np.finfo(np.float32).tiny) / top
    codes = np.clip(np.round(cache / scales), -top - 1, top).astype(np.int8)
    return codes, scales.reshape(-1).astype(np.float32)


def measure(capacity: int, rounds: int, threads: int) -> dict[str, tuple[float, float]]:
    """Each form's median step time (ms) and its output's largest error relative to the float cache's."""
    rng = np.random.default_rng(capacity)
    keys, values = _cache(rng, capacity), _cache(rng, capacity)
    step = {
        "query": rng.standard_normal((1, 1, HEADS * HEAD_DIM)).astype(np.float32),
        "key": rng.standard_normal((1, 1, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "value": rng.standard_normal((1, 1, KV_HEADS * HEAD_DIM)).astype(np.float32),
        "seqlens_k": np.array([capacity - 1], dtype=np.int32),  # the new position is the buffer's last
        "total_sequence_length": np.array(capacity, dtype=np.int32),
    }
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    sessions, feeds = {}, {}
    for form in FORMS:
        sessions[form] = ort.InferenceSession(_graph(form, capacity), options, providers=["CPUExecutionProvider"])
        if form.bits:
            (past_key, k_scale), (past_value, v_scale) = _encode(keys, form), _encode(values, form)
            feeds[form] = step | {
                "past_key": past_key,
                "past_value": past_value,
                "k_scale": k_scale,
                "v_scale": v_scale,
            }
        else:
            feeds[form] = step | {"past_key": keys.copy(), "past_value": values.copy()}
    outputs = {form: sessions[form].run(["output"], feeds[form])[0] for form in FORMS}
    times: dict[Form, list[float]] = {form: [] for form in FORMS}
    for _ in range(rounds):
        for form in FORMS:
            start = time.perf_counter()
            sessions[form].run(["output"], feeds[form])
            times[form].append(time.perf_counter() - start)
    reference = outputs[FORMS[0]]
    scale = float(np.abs(reference).max())
    return {
        form.name: (statistics.median(times[form]) * 1e3, float(np.abs(outputs[form] - reference).max()) / scale)
        for form in FORMS
    }


def measure_artifacts(paths: list[Path], capacity: int, rounds: int) -> list[float]:
    """Each artifact's median decode step (ms) after `capacity - 1` cached positions."""
    sessions = []
    for path in paths:
        sessions.append(Engine.load(path).session)
    rng = np.random.default_rng(capacity)
    feeds = []
    for session in sessions:
        io = session.io
        cache = empty_cache(io, 1, capacity)
        for name in io.cache_names:
            tensor = cache[name]
            if io.kv_dtype == "int8":
                tensor[...] = rng.integers(-127, 128, size=tensor.shape, dtype=np.int8)
            else:
                tensor[...] = rng.standard_normal(tensor.shape).astype(tensor.dtype)
        mask = np.ones((1, capacity), dtype=np.int64)
        ids = np.array([[3]], dtype=np.int64)
        feeds.append((ids, mask, cache))
    times: list[list[float]] = [[] for _ in paths]
    for _ in range(rounds):
        for index, (session, (ids, mask, cache)) in enumerate(zip(sessions, feeds)):
            start = time.perf_counter()
            forward(session, ids, mask, cache)
            times[index].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--artifacts", type=Path, nargs="+", help="time built artifacts instead of one node")
    args = parser.parse_args()
    if args.artifacts:
        names = [str(p) for p in args.artifacts]
        print(f"decode step after N cached positions, median of {args.rounds}")
        print("| context | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for capacity in args.contexts:
            steps = measure_artifacts(args.artifacts, capacity, args.rounds)
            cells = [f"{steps[0]:.1f} ms"] + [f"{t:.1f} ms ({steps[0] / t:.2f}×)" for t in steps[1:]]
            print(f"| {capacity} | " + " | ".join(cells) + " |")
        return
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, median of {args.rounds}")
    print("| context | " + " | ".join(f.name for f in FORMS) + " |")
    print("|---|" + "---|" * len(FORMS))
    for capacity in args.contexts:
        figures = measure(capacity, args.rounds, args.threads)
        base = figures[FORMS[0].name][0]
        cells = [f"{figures[FORMS[0].name][0]:.2f} ms"]
        cells += [f"{t:.2f} ms ({base / t:.2f}×, err {e:.1e})" for t, e in (figures[f.name] for f in FORMS[1:])]
        print(f"| {capacity} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
