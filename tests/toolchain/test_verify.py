"""The gate's comparisons on crafted arrays and fake sessions (no model needed)."""

from __future__ import annotations

import numpy as np

from kvforge.runners.contract import DecoderIO
from kvforge.runners.session import Session
from kvforge.toolchain.verify import (
    TOLERANCES,
    ParityReport,
    check_distribution,
    compare,
    compare_with_reference,
    record_reference,
    reference_log_probs,
)

TOL = TOLERANCES["float32"]


def check_parity(
    reference: Session, candidate: Session, *, max_positions: int, decode_steps: int, tolerance: float | None = None
) -> ParityReport:
    """The build's gate: the eager side recorded, then the compiled side compared with it."""
    recorded = record_reference(reference, max_positions=max_positions, decode_steps=decode_steps)
    return compare_with_reference(recorded, candidate, max_positions=max_positions, tolerance=tolerance)


def test_compare_judges_logits_by_each_rows_spread_and_a_present_tensor_by_its_rms() -> None:
    rows = np.array([[0.0, 1.0, 2.0, 3.0], [100.0, 110.0, 120.0, 130.0]], dtype=np.float32)
    spread = rows.astype(np.float64).std(axis=-1)  # 1.118 and 11.18
    near_zero = rows + np.array([[0.9 * TOL.relative * spread[0], 0, 0, 0], [0, 0, 0, 0]])
    assert compare("logits", rows, near_zero, TOL, rows=True).within  # an error at 0 judged on the row's scale
    # the same absolute error fails on the narrow row; the wide row's offset of 100 buys nothing
    off = rows + np.array([[0, 0, 0, 0], [0, 0, 0, 2 * TOL.relative * spread[0]]])
    assert compare("logits", rows, off, TOL, rows=True).within
    off = rows + np.array([[2 * TOL.relative * spread[0], 0, 0, 0], [0, 0, 0, 0]])
    error = compare("logits", rows, off, TOL, rows=True)
    assert not error.within and abs(error.scale - spread[0]) < 1e-6
    np.testing.assert_allclose(error.error, 2 * TOL.relative, rtol=1e-4)
    shifted = rows + 50.0  # a constant offset leaves each row's spread, and the bound, as it was
    assert compare("logits", shifted, shifted + (near_zero - rows), TOL, rows=True).within
    tensor = np.array([3.0, -4.0, 0.0, 0.0, 40.0], dtype=np.float32)  # RMS 18.1
    rms = float(np.sqrt(np.mean(tensor.astype(np.float64) ** 2)))
    assert compare("present.0.key", tensor, tensor + [0, 0, 0.9 * TOL.relative * rms, 0, 0], TOL, rows=False).within
    late = compare("present.0.key", tensor, tensor + [0, 0, 1.1 * TOL.relative * rms, 0, 0], TOL, rows=False)
    assert not late.within and abs(late.scale - rms) < 1e-4  # a value near zero: judged on the RMS
    # the outlier channel is judged on its own magnitude, 40, which is more than the RMS
    assert compare("present.0.key", tensor, tensor + [0, 0, 0, 0, 0.9 * TOL.relative * 40], TOL, rows=False).within
    assert not compare("present.0.key", tensor, tensor + [0, 0, 0, 0, 1.1 * TOL.relative * 40], TOL, rows=False).within


def test_compare_refuses_non_finite_and_shape_mismatch() -> None:
    ref = np.ones(3, dtype=np.float32)
    bad = ref.copy()
    bad[1] = np.nan
    error = compare("logits", ref, bad, TOL, rows=True)
    assert not error.within and "NaN or Inf in the compiled" in error.name
    assert not compare("logits", ref, np.ones(4, np.float32), TOL, rows=True).within


class FakeSession:
    """A deterministic 'model': logits depend on the last input id; `shift` perturbs them."""

    def __init__(self, shift: float = 0.0, nan_after: int | None = None) -> None:
        self.io = DecoderIO(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=11)
        self.shift, self.nan_after, self.calls = shift, nan_after, 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        ids = feeds["input_ids"]
        batch, seq = ids.shape
        logits = np.zeros((batch, seq, 11), np.float32)
        for b in range(batch):
            for s in range(seq):
                logits[b, s, (ids[b, s] * 7 + 3) % 11] = 5.0
        logits[..., 4] += self.shift
        if self.nan_after is not None and self.calls > self.nan_after:
            logits[:] = np.nan
        out = {"logits": logits}
        for past, present in zip(self.io.past_names, self.io.present_names):
            new = np.zeros((batch, 1, seq, 2), np.float32)
            out[present] = np.concatenate([feeds[past], new], axis=2)
        return out


def test_identical_sessions_pass_with_all_decode_steps() -> None:
    report = check_parity(FakeSession(), FakeSession(), max_positions=64, decode_steps=8)
    assert report.passed and report.decode_steps == 8 and report.first_diverging_step is None


def test_each_side_prefills_the_batch_once_then_generates_as_the_engine_does() -> None:
    """The compared prefill is one call over the left-padded prompts; the decode is the engine
    core's (each prompt prefilled alone, then one batch step per new token after the first), on
    the eager side and on the compiled one."""
    reference, candidate = FakeSession(), FakeSession()
    report = check_parity(reference, candidate, max_positions=64, decode_steps=8)
    assert report.passed and report.decode_steps == 8
    prompts = len(record_reference(FakeSession(), max_positions=64, decode_steps=8).prompts)
    # the eighth token is chosen from the seventh decode step's logits
    assert (reference.calls, candidate.calls) == (1 + prompts + 7, 1 + prompts + 7)


def test_a_shifted_logit_is_reported_with_the_first_diverging_step() -> None:
    report = check_parity(FakeSession(), FakeSession(shift=6.0), max_positions=64, decode_steps=8)
    assert not report.passed
    assert report.prefill[0].max_abs == 6.0 and not report.prefill[0].within
    assert report.decode == []  # no decoding from a prefill that already failed
    assert report.failures().startswith("first diverging output logits: ")


def test_the_first_diverging_output_is_named_in_the_order_the_model_computes_it() -> None:
    from kvforge.toolchain.verify import OutputError

    report = ParityReport("float32", TOL)
    report.prefill = [
        OutputError("logits", 1.0, 0.5, 2.0, False),
        OutputError("present.0.key", 0.0, 0.0, 1.0, True),
        OutputError("present.1.key", 0.1, 0.01, 10.0, False),
        OutputError("present.2.key", 0.2, 0.02, 10.0, False),
    ]
    message = report.failures()
    assert message.startswith("first diverging output present.1.key: 0.01 of its scale 10")
    assert message.index("present.2.key") < message.index("logits")
    assert message.endswith("[tolerance 0.0002 of the scale (float32)]")


def test_a_tolerance_override_replaces_the_table() -> None:
    strict = check_parity(FakeSession(), FakeSession(shift=0.01), max_positions=64, decode_steps=2)
    assert not strict.passed
    loose = check_parity(FakeSession(), FakeSession(shift=0.01), max_positions=64, decode_steps=2, tolerance=0.5)
    assert loose.passed and loose.tolerance.relative == 0.5


def test_nan_during_decode_is_a_failed_report_not_an_exception() -> None:
    report = check_parity(FakeSession(), FakeSession(nan_after=2), max_positions=64, decode_steps=8)
    assert not report.passed
    assert "decode" in report.failures()


def test_a_near_tie_may_part_the_tokens_a_clear_lead_may_not() -> None:
    from kvforge.toolchain.verify import TOLERANCES, _near_tie

    tol = TOLERANCES["float16"]
    logits = np.array([[0.0, 5.0, 4.8], [1.0, 0.0, 0.0]], np.float32)
    allowed = 2 * tol.relative * logits[0].astype(np.float64).std()  # each logit may be off by the bound
    logits[0, 2] = 5.0 - 0.9 * allowed
    assert _near_tie(logits, np.array([1, 0]), np.array([2, 0]), tol)
    logits[0, 2] = 5.0 - 1.2 * allowed
    assert not _near_tie(logits, np.array([1, 0]), np.array([2, 0]), tol)  # a real difference


def test_distribution_metrics_match_a_whole_array_computation_and_the_reference_is_spilled() -> None:
    """KL, top-1 and perplexities a text at a time equal torch's over the whole batch; the eager
    log-probabilities live in a read-only file mapping, not in the build's memory."""
    import torch

    tokens = [[(3 * i + row) % 11 for i in range(20)] for row in range(3)]
    expected = reference_log_probs(FakeSession(), tokens)
    assert isinstance(expected, np.memmap) and not expected.flags.writeable
    assert expected.shape == (3, 20 - 7, 11) and expected.dtype == np.float32
    candidate = FakeSession(shift=1.5)
    report = check_distribution(expected, candidate, tokens, "int4")

    ids = torch.tensor(tokens)
    want = torch.log_softmax(torch.from_numpy(FakeSession().run(_prefill(tokens))["logits"]).double(), -1)[:, 7:]
    got = torch.log_softmax(torch.from_numpy(candidate.run(_prefill(tokens))["logits"]).double(), -1)[:, 7:]
    kl = torch.nn.functional.kl_div(got, want, log_target=True, reduction="none").sum(-1)
    assert report.positions == kl.numel()
    np.testing.assert_allclose(report.kl_mean, kl.mean().item(), rtol=1e-5)
    np.testing.assert_allclose(report.kl_max, kl.max().item(), rtol=1e-5)
    assert report.top1 == (want.argmax(-1) == got.argmax(-1)).double().mean().item()
    targets = ids[:, 8:, None]
    np.testing.assert_allclose(report.nll_eager, -want[:, :-1].gather(-1, targets).mean().item(), rtol=1e-5)
    np.testing.assert_allclose(report.nll_compiled, -got[:, :-1].gather(-1, targets).mean().item(), rtol=1e-5)
    assert check_distribution(expected, FakeSession(), tokens, "int4").kl_mean < 1e-6  # float32 storage


def _prefill(tokens: list[list[int]]) -> dict[str, np.ndarray]:
    """Feeds for one pass over whole texts (FakeSession's logits depend on each position's id only)."""
    ids = np.asarray(tokens, dtype=np.int64)
    io = FakeSession().io
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    return feeds | {past: np.zeros((len(ids), 1, 0, 2), np.float32) for past in io.past_names}


class KeepSession(FakeSession):
    """FakeSession as a `keep` graph: logits for the last `logits_to_keep` positions (0: every one);
    `wrong_last` shifts the logits of a one-position request only (a bug in that path alone)."""

    def __init__(self, wrong_last: float = 0.0) -> None:
        super().__init__()
        self.io = DecoderIO(num_layers=1, num_kv_heads=1, head_dim=2, vocab_size=11, logits_positions="keep")
        self.wrong_last = wrong_last
        self.kept: list[int] = []

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().run(feeds)
        keep = int(feeds["logits_to_keep"][0])
        self.kept.append(keep)
        out["logits"] = out["logits"][:, -keep:] if keep else out["logits"]
        if keep == 1:
            out["logits"][..., 4] += self.wrong_last
        return out


def test_a_keep_graph_is_gated_on_every_position_and_on_the_last_alone() -> None:
    candidate = KeepSession()
    report = check_parity(FakeSession(), candidate, max_positions=64, decode_steps=4)
    assert report.passed
    widest = max(len(p) for p in record_reference(FakeSession(), max_positions=64, decode_steps=4).prompts)
    # the prefill asked for every position, then for the last as generation does; then the engine
    # core's prefill of each prompt and its decode steps, one position each
    prompts = len(record_reference(FakeSession(), max_positions=64, decode_steps=4).prompts)
    assert candidate.kept == [widest, 1] + [1] * prompts + [1, 1, 1]
    assert [e.name for e in report.prefill][0] == "logits" and report.prefill[-1].name == "logits (logits_to_keep 1)"

    broken = check_parity(FakeSession(), KeepSession(wrong_last=6.0), max_positions=64, decode_steps=4)
    assert not broken.passed
    assert [e.name for e in broken.prefill if not e.within] == ["logits (logits_to_keep 1)"]
