"""`kvforge build --tune`: each quantized weight's MatMulNBits form, chosen by measuring.

For every distinct weight shape (N, K) of the graph, each candidate form (block size along K,
`accuracy_level`) is timed on this machine in a session of one `MatMulNBits` node over random
data of that shape, with as many threads as a runner takes (`runners.session.usable_cpus`):
M = 1 (a decode step) and, under `full`, also M = PREFILL_ROWS (a prefill chunk). The candidate
with the lowest score (the geometric mean over those M of its median time relative to the
default form's) is chosen only when it beats the default form by MARGIN; otherwise the weight
keeps the default form (`--block-size`, accuracy level 4), so noise does not flip a choice.

Timings are kept in a cache file (`cache_path`: KVFORGE_TUNE_CACHE, else
$XDG_CACHE_HOME/kvforge/tune.json, else ~/.cache/kvforge/tune.json), keyed by the CPU model,
the number of usable cores and the onnxruntime version; a shape measured once on a machine is
never timed again there. The artifact records only the chosen forms (the manifest's `kernels`)
and the mode (`flags.tune`): two builds with the same cache are byte-identical, and `off`, the
default, is byte-identical on any machine, cache or none.
"""

from __future__ import annotations

import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runners.errors import ArtifactError

if TYPE_CHECKING:  # the CLI reads MODES without loading the graph passes
    from passes.quantize import KernelForm, WeightQuantization

log = logging.getLogger(__name__)

MODES = ("off", "fast", "full")
DEFAULT_MODE = "off"  # deterministic without any cache: the same bytes on every machine
MARGIN = 0.05  # a candidate replaces the default form only when at least this much faster
PREFILL_ROWS = 128  # M of the prefill timing under `full`
CACHE_ENV = "KVFORGE_TUNE_CACHE"
CACHE_VERSION = 1
# Timing of one candidate: runs before timing, then timed runs (the median is kept)
WARMUP_RUNS = 3
TIMED_RUNS = 15
MIN_SAMPLE_S = 1e-3  # a timed sample repeats runs until it lasts at least this long (at most 64 runs)

# (bits, symmetric, N, K, M, form) -> seconds per run, one sample per timed run
Timer = Callable[[int, bool, int, int, int, "KernelForm"], Sequence[float]]


def candidates(mode: str, weights: WeightQuantization) -> tuple[KernelForm, ...]:
    """The forms `mode` compares, the default form first (it wins ties). `fast`: every block
    size at the default accuracy level; `full`: every block size at accuracy levels 4 and 0."""
    from passes.quantize import KERNEL_BLOCK_SIZES, KernelForm

    default = weights.default_form
    levels = (default.accuracy_level,) if mode == "fast" else tuple(dict.fromkeys((default.accuracy_level, 4, 0)))
    forms = [KernelForm(block, level) for level in levels for block in KERNEL_BLOCK_SIZES]
    return (default, *(form for form in forms if form != default))


def rows(mode: str) -> tuple[int, ...]:
    """The M (activation rows) each candidate is timed at."""
    return (1,) if mode == "fast" else (1, PREFILL_ROWS)


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ArtifactError(f"unknown tune mode {mode!r}; choose one of {', '.join(MODES)}")


def cache_path() -> Path:
    """Where timings are kept: KVFORGE_TUNE_CACHE, else the user's cache directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvforge" / "tune.json"


def machine_key() -> str:
    """What timings hold for: the CPU model, the cores a runner uses, the onnxruntime version."""
    import onnxruntime as ort

    from runners.session import usable_cpus

    return f"{cpu_model()} | {usable_cpus()} cores | onnxruntime {ort.__version__}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


class TimingCache:
    """Median seconds per measurement, for one machine key, in a JSON file shared by every machine
    key (other machines' entries are kept as they are). A file that cannot be read is started
    afresh; one that cannot be written leaves the timings in memory, with a warning."""

    def __init__(self, path: Path, machine: str) -> None:
        self.path = path
        self.machine = machine
        self._all = self._read()
        entries = self._all.setdefault("machines", {}).setdefault(machine, {})
        self.entries: dict[str, float] = entries

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {"version": CACHE_VERSION}
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable tuning cache (%s); timing afresh", self.path, e)
            return {"version": CACHE_VERSION}
        version = data.get("version") if isinstance(data, dict) else None
        if version != CACHE_VERSION or not isinstance(data.get("machines"), dict):
            log.warning("%s: not a version %d tuning cache; timing afresh", self.path, CACHE_VERSION)
            return {"version": CACHE_VERSION}
        machines = data["machines"]
        if not isinstance(machines.get(self.machine, {}), dict):
            machines[self.machine] = {}
        return data

    def get(self, key: str) -> float | None:
        value = self.entries.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def put(self, key: str, seconds: float) -> None:
        self.entries[key] = seconds

    def save(self) -> None:
        """Written whole to a temporary sibling, then renamed over the file (never half written)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=self.path.parent)
            with os.fdopen(fd, "w") as f:
                json.dump(self._all, f, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except OSError as e:
            log.warning("%s: cannot write the tuning cache (%s); the timings are not kept", self.path, e)


def measurement_key(bits: int, symmetric: bool, n: int, k: int, m: int, form: KernelForm) -> str:
    zero = "sym" if symmetric else "asym"
    return f"int{bits} {zero} N={n} K={k} M={m} block={form.block_size} accuracy={form.accuracy_level}"


@dataclass
class Tuner:
    """The `choose` of `passes.quantize.QuantizeWeights`: (N, K) -> the form to write it in.

    `timer` times one candidate (`time_matmul_nbits` by default; tests pass a fake one);
    `timed` counts the measurements made (not taken from the cache)."""

    mode: str
    weights: WeightQuantization
    cache: TimingCache
    timer: Timer | None = None
    margin: float = MARGIN
    timed: int = 0
    choices: dict[tuple[int, int], KernelForm] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_mode(self.mode)
        if self.mode == "off":
            raise ValueError("a Tuner tunes: with --tune off every weight takes the default form")

    def __call__(self, n: int, k: int) -> KernelForm:
        if (n, k) not in self.choices:
            self.choices[(n, k)] = self._choose(n, k)
            self.cache.save()
        return self.choices[(n, k)]

    def _choose(self, n: int, k: int) -> KernelForm:
        forms = candidates(self.mode, self.weights)
        medians = {form: [self._median(n, k, m, form) for m in rows(self.mode)] for form in forms}
        default = forms[0]
        scores = {
            form: math.exp(statistics.fmean(math.log(t / d) for t, d in zip(times, medians[default])))
            for form, times in medians.items()
        }
        best = min(forms, key=lambda form: scores[form])  # the first of equal scores: the default, or the earlier
        chosen = best if scores[best] < 1 - self.margin else default
        log.info(
            "tune %s: N=%d K=%d: %s (%s)",
            self.mode,
            n,
            k,
            _describe(chosen),
            ", ".join(f"{_describe(f)} {scores[f]:.2f}" for f in forms),
        )
        return chosen

    def _median(self, n: int, k: int, m: int, form: KernelForm) -> float:
        key = measurement_key(self.weights.bits, self.weights.symmetric, n, k, m, form)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        timer = self.timer or time_matmul_nbits
        samples = timer(self.weights.bits, self.weights.symmetric, n, k, m, form)
        median = float(statistics.median(samples))
        self.timed += 1
        self.cache.put(key, median)
        return median


def _describe(form: KernelForm) -> str:
    return f"block {form.block_size} accuracy {form.accuracy_level}"


def tuner(mode: str, weights: WeightQuantization, path: Path | None = None, timer: Timer | None = None) -> Tuner:
    """A tuner for `mode` over the timing cache at `path` (default: `cache_path()`)."""
    return Tuner(mode, weights, TimingCache(path or cache_path(), machine_key()), timer)


def kernels_entry(mode: str, forms: Mapping[str, tuple[KernelForm, tuple[int, int]]]) -> dict[str, Any]:
    """The manifest's `kernels`: the mode and, per distinct (bits, N, K) and chosen form, the
    quantized weights (their codes' initializers) written in it. No timings."""
    groups: dict[tuple[int, int, KernelForm], list[str]] = {}
    for name, (form, (n, k)) in forms.items():
        groups.setdefault((n, k, form), []).append(name)
    return {
        "tune": mode,
        "margin": MARGIN,
        "forms": [
            {"n": n, "k": k, **form.to_dict(), "weights": sorted(names)}
            for (n, k, form), names in sorted(groups.items())
        ],
    }


def time_matmul_nbits(bits: int, symmetric: bool, n: int, k: int, m: int, form: KernelForm) -> list[float]:
    """Seconds per run of one MatMulNBits node, [m, K] x the weight [K, N] quantized in `form`,
    on random data, in a session with a runner's threads; TIMED_RUNS samples after WARMUP_RUNS."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from passes.quantize import matmul_nbits_inputs, quantize_blockwise
    from runners.session import usable_cpus

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((n, k), dtype=np.float32) * 0.02
    q = quantize_blockwise(weight, bits, form.block_size, symmetric)
    b, scales, zero_points = matmul_nbits_inputs(q)
    initializers = [numpy_helper.from_array(b, "B"), numpy_helper.from_array(scales.astype(np.float32), "scales")]
    inputs = ["A", "B", "scales"]
    if zero_points is not None:
        initializers.append(numpy_helper.from_array(zero_points, "zero_points"))
        inputs.append("zero_points")
    attributes: dict[str, Any] = {"K": k, "N": n, "bits": bits, "block_size": form.block_size}
    if form.accuracy_level:
        attributes["accuracy_level"] = form.accuracy_level
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", **attributes)
    graph = helper.make_graph(
        [node],
        "tune",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [m, n])],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = usable_cpus()
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"A": rng.standard_normal((m, k), dtype=np.float32)}
    for _ in range(WARMUP_RUNS):
        session.run(None, feeds)
    # runs repeated within each sample, so a sample lasts long enough to time
    start = time.perf_counter()
    session.run(None, feeds)
    repeats = max(1, min(64, int(MIN_SAMPLE_S / max(time.perf_counter() - start, 1e-7))))
    samples = []
    for _ in range(TIMED_RUNS):
        start = time.perf_counter()
        for _ in range(repeats):
            session.run(None, feeds)
        samples.append((time.perf_counter() - start) / repeats)
    return samples
