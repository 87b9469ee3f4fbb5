"""`kvforge build --tune`: the choice of each weight's MatMulNBits form, its cache, and the artifact.

Timings come from a fake timer (durations it is told), so nothing here depends on this
machine's speed; one test runs the real timer for what it returns, not for how fast.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from kvforge import BuildOptions, build
from kvforge.cli import main
from kvforge.passes.quantize import KernelForm, WeightQuantization
from kvforge.passes.targets import TARGETS
from kvforge.runners.errors import ArtifactError
from kvforge.toolchain import tune

DEFAULT = KernelForm(32, 4)


class FakeTimer:
    """Seconds per run by form (1.0 for a form not listed); each timing of a candidate beside
    the default gives their ratio with outliers. Records what it timed: (bits, symmetric, N,
    K, M, candidate)."""

    def __init__(self, seconds: dict[KernelForm, float]) -> None:
        self.seconds = seconds
        self.calls: list[tuple[int, bool, int, int, int, KernelForm]] = []

    def __call__(
        self, bits: int, symmetric: bool, n: int, k: int, m: int, default: KernelForm, form: KernelForm
    ) -> Sequence[float]:
        assert default == DEFAULT
        self.calls.append((bits, symmetric, n, k, m, form))
        ratio = self.ratio(m, form) / self.ratio(m, default)
        return [ratio * 1.5, ratio, ratio * 0.99, ratio, ratio * 40]  # median: the ratio, whatever the outliers

    def ratio(self, m: int, form: KernelForm) -> float:
        return self.seconds.get(form, 1.0)


def make_tuner(path: Path, timer: FakeTimer, mode: str = "fast", machine: str = "cpu | 2 cores | ort") -> tune.Tuner:
    return tune.Tuner(mode, WeightQuantization(4, symmetric=True), tune.TimingCache(path, machine), timer)


def test_the_candidate_the_timer_makes_fastest_is_chosen(tmp_path: Path) -> None:
    timer = FakeTimer({KernelForm(128, 4): 0.5, KernelForm(256, 4): 0.7})
    tuner = make_tuner(tmp_path / "tune.json", timer)
    assert tuner(768, 2304) == KernelForm(128, 4)
    # fast: every other block size at the default accuracy level beside the default, at M = 1
    timed = [(call[5], call[4]) for call in timer.calls]
    assert sorted(timed) == [(KernelForm(block, 4), 1) for block in (64, 128, 256)]
    assert all(call[:4] == (4, True, 768, 2304) for call in timer.calls)


def test_the_default_form_stays_unless_a_candidate_beats_it_by_the_margin(tmp_path: Path) -> None:
    just_inside = 1 - tune.MARGIN + 0.01  # 4% faster: noise, as far as the choice goes
    tuner = make_tuner(tmp_path / "tune.json", FakeTimer({KernelForm(64, 4): just_inside}))
    assert tuner(256, 256) == DEFAULT
    clear = 1 - tune.MARGIN - 0.01  # 6% faster: chosen
    tuner = make_tuner(tmp_path / "other.json", FakeTimer({KernelForm(64, 4): clear}))
    assert tuner(256, 256) == KernelForm(64, 4)
    # a slower default everywhere else: still the default when nothing is clearly faster
    tuner = make_tuner(tmp_path / "third.json", FakeTimer({}))
    assert tuner(256, 256) == DEFAULT


def test_full_also_times_the_prefill_and_the_float_path(tmp_path: Path) -> None:
    # the float path twice as slow: not chosen
    timer = FakeTimer({KernelForm(32, 0): 2.0})
    tuner = make_tuner(tmp_path / "tune.json", timer, mode="full")
    assert tuner(256, 256) == DEFAULT
    assert {call[4] for call in timer.calls} == {1, tune.PREFILL_ROWS}
    assert {call[5].accuracy_level for call in timer.calls} == {0, 4}
    assert len(timer.calls) == 2 * 7  # 7 candidates beside the default at 2 rows each

    class PrefillFaster(FakeTimer):
        def ratio(self, m: int, form: KernelForm) -> float:
            return 0.5 if (form == KernelForm(256, 0) and m > 1) else 1.0

    assert make_tuner(tmp_path / "prefill.json", PrefillFaster({}), mode="full")(256, 256) == KernelForm(256, 0)


def test_timings_are_cached_per_machine_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "tune.json"
    first = FakeTimer({KernelForm(256, 4): 0.5})
    tuner = make_tuner(path, first)
    assert tuner(512, 256) == tuner(512, 256) == KernelForm(256, 4)
    assert len(first.calls) == 3 and tuner.timed == 3  # one shape, timed once
    stored = json.loads(path.read_text())
    assert stored["version"] == tune.CACHE_VERSION
    assert len(stored["machines"]["cpu | 2 cores | ort"]) == 3
    # a second build on the same machine times nothing, and chooses the same
    again = FakeTimer({})
    tuner = make_tuner(path, again)
    assert tuner(512, 256) == KernelForm(256, 4) and again.calls == [] and tuner.timed == 0
    # another machine (CPU, cores or onnxruntime version) times afresh, and keeps the first one's
    other = FakeTimer({})
    assert make_tuner(path, other, machine="another cpu | 64 cores | ort")(512, 256) == DEFAULT
    assert len(other.calls) == 3
    assert set(json.loads(path.read_text())["machines"]) == {"cpu | 2 cores | ort", "another cpu | 64 cores | ort"}


def test_an_unreadable_cache_is_started_afresh(tmp_path: Path) -> None:
    path = tmp_path / "tune.json"
    path.write_text("{not json")
    timer = FakeTimer({})
    assert make_tuner(path, timer)(256, 256) == DEFAULT and len(timer.calls) == 3
    assert json.loads(path.read_text())["version"] == tune.CACHE_VERSION


def test_the_cache_path_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(tune.CACHE_ENV, str(tmp_path / "mine.json"))
    assert tune.cache_path() == tmp_path / "mine.json"
    monkeypatch.delenv(tune.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tune.cache_path() == tmp_path / "xdg" / "kvforge" / "tune.json"


def test_the_real_timer_times_each_candidate_form_beside_the_default() -> None:
    for form in (KernelForm(64, 4), KernelForm(256, 0)):
        for symmetric in (True, False):
            ratios = tune.time_against_default(4, symmetric, 64, 200, 2, DEFAULT, form)  # K not a multiple of the block
            assert len(ratios) == tune.TIMED_RUNS and all(r > 0 for r in ratios)


def test_a_decode_timing_streams_more_than_the_cache_holds() -> None:
    assert tune.stream_bytes() >= tune.STREAM_BYTES
    assert tune.stream_copies(1 << 20, target=64 << 20) == 64
    assert tune.stream_copies(3 << 20, target=64 << 20) == 22  # 22 copies pass 64 MiB, 21 do not
    assert tune.stream_copies(100, target=64 << 20) == tune.MAX_COPIES
    assert tune.stream_copies(1 << 30, target=64 << 20) == 1


def test_the_real_timer_copies_the_weight_for_decode_only_and_stops_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []

    def copies(weight_bytes: int, target: int | None = None) -> int:
        asked.append(weight_bytes)
        return 3

    monkeypatch.setattr(tune, "stream_copies", copies)
    nodes: list[int] = []
    real_session = ort.InferenceSession

    def session(model: bytes, options: ort.SessionOptions, **kwargs: object) -> ort.InferenceSession:
        nodes.append(len(onnx.load_from_string(model).graph.node))
        # the two sessions alternate: neither's threads may spin on into the other's run
        assert options.get_session_config_entry("session.force_spinning_stop") == "1"
        return real_session(model, options, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", session)
    tune.time_against_default(4, True, 64, 256, 1, DEFAULT, KernelForm(64, 4))
    tune.time_against_default(4, True, 64, 256, 8, DEFAULT, KernelForm(64, 4))
    # 64 x 256 at 4 bits: 8192 bytes of codes, and 64 x 8 (block 32) or 64 x 4 float32 scales
    assert asked == [64 * 256 // 2 + 64 * 8 * 4, 64 * 256 // 2 + 64 * 4 * 4]
    assert nodes == [3, 3, 1, 1]


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ArtifactError, match="unknown tune mode 'fastest'; choose one of off, fast, full"):
        tune.check_mode("fastest")
    with pytest.raises(ValueError, match="unsupported MatMulNBits form: block_size=16"):
        KernelForm(16, 4)


# --- builds ------------------------------------------------------------------------------


def matmul_nbits_forms(model_path: Path, bits: int | None = None) -> dict[str, tuple[int, int]]:
    """Each MatMulNBits' codes initializer -> (block_size, accuracy_level), as written (only those
    of `bits` when given)."""
    return {name: form for name, (form, _) in matmul_nbits_nodes(model_path, bits).items()}


def matmul_nbits_nodes(model_path: Path, bits: int | None = None) -> dict[str, tuple[tuple[int, int], int]]:
    """Each MatMulNBits' codes initializer -> ((block_size, accuracy_level), K), as written."""
    model = onnx.load(model_path, load_external_data=False)
    forms = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attributes = {a.name: a.i for a in node.attribute}
            if bits is None or attributes["bits"] == bits:
                form = (attributes["block_size"], attributes.get("accuracy_level", 0))
                forms[node.input[1]] = (form, attributes["K"])
    return forms


def tree_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.slow
def test_a_tuned_build_records_its_forms_passes_the_gate_and_rebuilds_byte_identical(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the float path at block 128 made fastest: the choice that changes the numerics most
    timer = FakeTimer({KernelForm(128, 0): 0.5})
    monkeypatch.setattr(tune, "time_against_default", timer)
    monkeypatch.setattr(tune, "machine_key", lambda: "test machine")
    cache = tmp_path / "tune.json"
    options = BuildOptions(weights=WeightQuantization(4), tune="full", tune_cache=cache)
    checkpoint = tiny_checkpoint("llama")
    first = build(checkpoint, tmp_path / "first", options)
    manifest = first.manifest
    assert manifest["parity"]["passed"]
    assert manifest["flags"]["tune"] == "full" and manifest["flags"]["weights"] == options.weights.to_dict()
    kernels = manifest["kernels"]
    assert kernels["tune"] == "full" and kernels["margin"] == tune.MARGIN
    written = matmul_nbits_forms(tmp_path / "first" / "model.onnx", bits=4)
    assert written and set(written.values()) == {(128, 0)}
    # the weights the default mix keeps at 8 bits are not tuned: blocks of 128 where K is whole
    # blocks of it, else the recipe's 32, at accuracy level 4
    mixed = matmul_nbits_nodes(tmp_path / "first" / "model.onnx", bits=8)
    assert mixed and all(form == (128 if k % 128 == 0 else 32, 4) for form, k in mixed.values())
    recorded = {name: (f["block_size"], f["accuracy_level"]) for f in kernels["forms"] for name in f["weights"]}
    assert recorded == written
    assert "seconds" not in json.dumps(kernels) and str(cache) not in json.dumps(manifest)
    shapes = {(f["n"], f["k"]) for f in kernels["forms"]}
    assert len(timer.calls) == len(shapes) * 7 * 2  # each distinct shape, 7 candidates, decode and prefill

    # the same cache: nothing timed, the same bytes
    timer.calls.clear()
    second = build(checkpoint, tmp_path / "second", options)
    assert timer.calls == []
    assert tree_bytes(first.output) == tree_bytes(second.output)


@pytest.mark.slow
def test_tune_off_writes_the_default_form_and_records_no_kernels(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_timing(*args: object) -> list[float]:
        raise AssertionError("--tune off times nothing")

    monkeypatch.setattr(tune, "time_against_default", no_timing)
    weights = WeightQuantization(4, block_size=64)
    result = build(tiny_checkpoint("llama"), tmp_path / "out", BuildOptions(weights=weights, tune="off"))
    assert "kernels" not in result.manifest and "tune" not in result.manifest["flags"]
    assert set(matmul_nbits_forms(tmp_path / "out" / "model.onnx", bits=4).values()) == {(64, 4)}
    wide = matmul_nbits_nodes(tmp_path / "out" / "model.onnx", bits=8)  # the mix's: 128 where K allows
    assert wide and all(form == (128 if k % 128 == 0 else 64, 4) for form, k in wide.values())
    assert np.isfinite(result.manifest["parity"]["kl_mean"])


@pytest.mark.parametrize(
    "options, message",
    [
        (BuildOptions(tune="fast"), "--tune fast chooses the kernel form of quantized weights; add --weights"),
        (
            BuildOptions(target=TARGETS["onnx"], weights=WeightQuantization(4), tune="full"),
            "--tune full: --target onnx writes no kernel-specific forms to choose from",
        ),
        (BuildOptions(weights=WeightQuantization(4), tune="always"), "unknown tune mode 'always'"),
    ],
)
def test_a_tune_with_nothing_to_choose_is_refused_before_any_work(
    options: BuildOptions, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ArtifactError, match=message):
        build(tmp_path / "no-checkpoint-needed", tmp_path / "out", options)
    assert not (tmp_path / "out").exists()


def test_a_bad_tune_value_is_a_clear_click_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["build", str(tmp_path), "-o", str(tmp_path / "out"), "--tune", "fastest"])
    assert result.exit_code == 2
    assert "Invalid value for '--tune'" in result.output and "'fastest' is not one of 'off', 'fast', 'full'" in (
        result.output
    )


def test_the_cli_offers_the_tuner_modes() -> None:
    result = CliRunner().invoke(main, ["build", "--help"])
    assert "--tune [off|fast|full]" in result.output and "[default: off]" in result.output


class FailedReport:
    passed = False

    def failures(self) -> str:
        return "distribution FAILED (int4): top-1 agreement 0.000"

    def to_dict(self) -> dict[str, object]:  # what a refusal carries to --json
        return {"passed": False}


def test_a_tuned_build_the_gate_refuses_says_to_build_with_tune_off() -> None:
    from kvforge.runners.errors import ParityError
    from kvforge.toolchain.build import _require_parity

    with pytest.raises(ParityError, match=r"distribution FAILED .*the kernel forms --tune fast chose .*--tune off$"):
        _require_parity(FailedReport(), "ckpt", "fast")  # type: ignore[arg-type]
    with pytest.raises(ParityError) as refused:
        _require_parity(FailedReport(), "ckpt", "off")  # type: ignore[arg-type]
    assert "--tune" not in str(refused.value)
