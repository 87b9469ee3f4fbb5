"""`kvforge build --tune`: each quantized weight's MatMulNBits form, chosen by measuring.

For every distinct weight shape (N, K) of the graph, each candidate form (block size along K,
`accuracy_level`) is timed on this machine over random data of that shape, with as many threads
as a runner takes (`kvforge.runners.session.usable_cpus`): M = 1 (a decode step) and, under `full`, also
M = PREFILL_ROWS (a prefill chunk). A decode step streams every weight from memory once, so at
M = 1 the session holds enough copies of the weight, each its own `MatMulNBits` node, to pass
twice the last-level cache (`stream_copies`), and a run of all of them is timed: one node run
again and again would compute from the cache, and its timings ranked the forms otherwise than
decode does. A prefill chunk is bound by its arithmetic, and is timed on one node.

Each candidate is timed beside the default form (`--block-size`, accuracy level 4): both
sessions are made, and their runs alternate, so that a slower moment of a shared machine
falls on both (forms timed one after the other ranked differently from one run to the next;
docs/performance.md). Each session's threads stop spinning when its run ends, so that they
do not take a core from the other's run. A candidate's ratio at one M is the median over the
alternations of its time over the default's beside it; its score is the geometric mean of its
ratios over the M. The candidate with the lowest score is chosen only when it beats the
default form by MARGIN; otherwise the weight keeps the default form, so noise does not flip a
choice.

The ratios are kept in a cache file (`cache_path`: KVFORGE_TUNE_CACHE, else
$XDG_CACHE_HOME/kvforge/tune.json, else ~/.cache/kvforge/tune.json), keyed by the CPU model,
the number of usable cores and the onnxruntime version; a shape measured once on a machine is
never timed again there. The artifact records only the chosen forms (the manifest's `kernels`)
and the mode (`flags.tune`): two builds with the same cache are byte-identical, and `off`, the
default, is byte-identical on any machine, cache or none.
"""

from __future__ import annotations

import functools
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

from kvforge.runners.errors import ArtifactError
from kvforge.toolchain.system import user_cache

if TYPE_CHECKING:  # the CLI reads MODES without loading the graph passes
    import onnxruntime as ort

    from kvforge.passes.quantize import KernelForm, WeightQuantization

log = logging.getLogger(__name__)

MODES = ("off", "fast", "full")
DEFAULT_MODE = "off"  # deterministic without any cache: the same bytes on every machine
MARGIN = 0.05  # a candidate replaces the default form only when at least this much faster
PREFILL_ROWS = 128  # M of the prefill timing under `full`
CACHE_ENV = "KVFORGE_TUNE_CACHE"
# 1: each form's median seconds, one node run again and again (its weight in the cache), the
# forms timed one after the other
CACHE_VERSION = 2
# Timing of a candidate beside the default: runs of each before timing, then alternations
WARMUP_RUNS = 3
TIMED_RUNS = 15
MIN_SAMPLE_S = 1e-3  # a timed sample repeats runs until it lasts at least this long (at most 64 runs)
# A decode timing streams at least this many bytes of weight copies per run (twice the
# last-level cache where the OS reports it: `stream_bytes`), in at most MAX_COPIES nodes
STREAM_BYTES = 64 << 20
MAX_COPIES = 256

# (bits, symmetric, N, K, M, default form, candidate) -> the candidate's time over the
# default's, one ratio per alternation
Timer = Callable[[int, bool, int, int, int, "KernelForm", "KernelForm"], Sequence[float]]


def candidates(mode: str, weights: WeightQuantization) -> tuple[KernelForm, ...]:
    """The forms `mode` compares, the default form first (it wins ties). `fast`: every block
    size at the default accuracy level; `full`: every block size at accuracy levels 4 and 0."""
    from kvforge.passes.quantize import KERNEL_BLOCK_SIZES, KernelForm

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
    return user_cache() / "kvforge" / "tune.json"


def machine_key() -> str:
    """What timings hold for: the CPU model, the cores a runner uses, the onnxruntime version."""
    import onnxruntime as ort

    from kvforge.runners.cpus import usable_cpus

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


def measurement_key(bits: int, symmetric: bool, n: int, k: int, m: int, default: KernelForm, form: KernelForm) -> str:
    zero = "sym" if symmetric else "asym"
    return f"int{bits} {zero} N={n} K={k} M={m} {_key(form)} over {_key(default)}"


def _key(form: KernelForm) -> str:
    return f"block={form.block_size} accuracy={form.accuracy_level}"


@dataclass
class Tuner:
    """The `choose` of `kvforge.passes.quantize.QuantizeWeights`: (N, K) -> the form to write it in.

    `timer` times a candidate beside the default form (`time_against_default` by default;
    tests pass a fake one); `timed` counts the measurements made (not taken from the cache)."""

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
        default = forms[0]
        scores = {default: 1.0} | {
            form: math.exp(statistics.fmean(math.log(self._ratio(n, k, m, default, form)) for m in rows(self.mode)))
            for form in forms[1:]
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

    def _ratio(self, n: int, k: int, m: int, default: KernelForm, form: KernelForm) -> float:
        key = measurement_key(self.weights.bits, self.weights.without_zero_points, n, k, m, default, form)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        timer = self.timer or time_against_default
        ratio = float(
            statistics.median(timer(self.weights.bits, self.weights.without_zero_points, n, k, m, default, form))
        )
        self.timed += 1
        self.cache.put(key, ratio)
        return ratio


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


@functools.cache
def stream_bytes() -> int:
    """Bytes a decode timing streams per run: twice the last-level cache the OS reports for
    CPU 0 (Linux sysfs), at least STREAM_BYTES."""
    caches = Path("/sys/devices/system/cpu/cpu0/cache")
    largest = 0
    for size in caches.glob("index*/size"):
        try:
            text = size.read_text().strip()
            largest = max(largest, int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(STREAM_BYTES, 2 * largest)


def stream_copies(weight_bytes: int, target: int | None = None) -> int:
    """Copies of a weight of `weight_bytes` that one decode timing runs: enough to stream
    `target` bytes (default `stream_bytes()`), at most MAX_COPIES."""
    target = stream_bytes() if target is None else target
    return max(1, min(MAX_COPIES, -(-target // max(weight_bytes, 1))))


def time_against_default(
    bits: int, symmetric: bool, n: int, k: int, m: int, default: KernelForm, form: KernelForm
) -> list[float]:
    """The time per MatMulNBits node of `form` over the default form's, [m, K] x the weight
    [K, N] on random data, each in a session with a runner's threads: one ratio per each of
    TIMED_RUNS alternations (which of the two runs first alternates too), after WARMUP_RUNS
    runs of each. A sample repeats a session's run until it lasts MIN_SAMPLE_S."""
    import numpy as np

    feeds = {"A": np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)}
    timed = [_matmul_nbits_session(bits, symmetric, n, k, m, f) for f in (default, form)]
    repeats = []
    for session, _ in timed:
        for _ in range(WARMUP_RUNS):
            session.run(None, feeds)
        start = time.perf_counter()
        session.run(None, feeds)
        repeats.append(max(1, min(64, int(MIN_SAMPLE_S / max(time.perf_counter() - start, 1e-7)))))

    def per_node(which: int) -> float:
        session, copies = timed[which]
        start = time.perf_counter()
        for _ in range(repeats[which]):
            session.run(None, feeds)
        return (time.perf_counter() - start) / repeats[which] / copies

    ratios = []
    for alternation in range(TIMED_RUNS):
        order = (0, 1) if alternation % 2 == 0 else (1, 0)
        seconds = {which: per_node(which) for which in order}
        ratios.append(seconds[1] / seconds[0])
    return ratios


def _matmul_nbits_session(
    bits: int, symmetric: bool, n: int, k: int, m: int, form: KernelForm
) -> tuple[ort.InferenceSession, int]:
    """A session of MatMulNBits nodes [m, K] x a random [K, N] weight quantized in `form`, and
    how many nodes it has: at m = 1 `stream_copies` copies of the weight, each its own node
    and initializers (onnxruntime prepacks each apart), as a decode step streams its weights
    from memory; at larger m one."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from kvforge.passes.quantize import matmul_nbits_inputs, quantize_blockwise
    from kvforge.runners.cpus import usable_cpus

    weight = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32) * 0.02
    b, scales, zero_points = matmul_nbits_inputs(quantize_blockwise(weight, bits, form.block_size, symmetric))
    tensors = {"B": b, "scales": scales.astype(np.float32)}
    if zero_points is not None:
        tensors["zero_points"] = zero_points
    copies = stream_copies(sum(t.nbytes for t in tensors.values())) if m == 1 else 1
    attributes: dict[str, Any] = {"K": k, "N": n, "bits": bits, "block_size": form.block_size}
    if form.accuracy_level:
        attributes["accuracy_level"] = form.accuracy_level
    initializers, nodes, outputs = [], [], []
    for copy in range(copies):
        names = [f"{name}{copy}" for name in tensors]
        initializers += [numpy_helper.from_array(t, name) for t, name in zip(tensors.values(), names)]
        nodes.append(helper.make_node("MatMulNBits", ["A", *names], [f"Y{copy}"], domain="com.microsoft", **attributes))
        outputs.append(helper.make_tensor_value_info(f"Y{copy}", TensorProto.FLOAT, [m, n]))
    graph = helper.make_graph(
        nodes, "tune", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])], outputs, initializers
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = usable_cpus()
    # The two sessions' runs alternate: each one's threads stop spinning when its run ends,
    # or they take a core from the other's run
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), copies
