"""The verification gate: the compiled graph must match the eager model before publishing.

Prefill of a left-padded batch of two prompts compares logits and every present tensor
at the real (non-pad) positions; then both models decode greedily through the real
generation loop and must pick the same token at every step, with logits in tolerance.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvforge.runners.cache import Cache, device_of
from kvforge.runners.contract import DecoderIO
from kvforge.runners.core import Step, logit_steps
from kvforge.runners.decoding import batch_decoders
from kvforge.runners.errors import GenerationError, ParityError
from kvforge.runners.generate import empty_cache, forward, left_pad
from kvforge.runners.sampling import SamplingParams
from kvforge.runners.session import Session


@dataclass(frozen=True)
class Tolerance:
    """The largest error the gate allows, as a fraction of the scale of what it compares.

    A logits row is judged against its own standard deviation over the vocabulary: what
    sampling and the argmax see are differences between logits, which a constant offset does
    not change, and the spread of the row is what those differences are measured in. A
    present tensor's element is judged against its own magnitude, or the tensor's root mean
    square where that is larger: keys and values are read by the attention as vectors whose
    size is the RMS, and a few channels of a layer hold values many times that (rounded, in a
    half type, in proportion to their size), whose error matters in proportion to them.
    Element-wise bounds against zero (an absolute atol) fail wherever rounding after many
    layers lands on a value near zero, and pass a wrong tensor whose values are all large."""

    relative: float


# One table for every comparison the gate makes (prefill logits, present tensors, each decode
# step's logits, near ties), keyed by the compute dtype of the graph. float32's bound sits above
# a correct graph's rounding and below the smallest real bug measured; float16's and bfloat16's
# above the eager model's own rounding in the half type (the gate runs the graph in float32
# from the same weights), so a half-precision build cannot tell a bug of that size from
# rounding, and the float32 build of the same checkpoint can. The measurements behind each
# number: docs/pipeline.md, "The gate's tolerances".
#
# `--tolerance` overrides the number for one build (recorded in the manifest's flags).
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(relative=2e-4),
    "float16": Tolerance(relative=0.1),
    "bfloat16": Tolerance(relative=0.3),
}

_PROMPT_LENGTHS = (7, 4)  # unequal, so the second row is left-padded


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs: float  # the largest element-wise difference
    error: float  # the largest difference relative to the scale it is judged on (the gated figure)
    scale: float  # that scale: of the row (logits) or the element (present) where `error` is largest
    within: bool


@dataclass
class ParityReport:
    dtype: str
    tolerance: Tolerance
    prefill: list[OutputError] = field(default_factory=list)
    decode: list[OutputError] = field(default_factory=list)
    decode_steps: int = 0
    first_diverging_step: int | None = None
    # The step where the models picked different tokens between which the eager model could
    # not choose within the tolerance (a near tie): the sequences part there, and that passes.
    near_tie_step: int | None = None
    reference_tokens: list[list[int]] = field(default_factory=list)
    candidate_tokens: list[list[int]] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.first_diverging_step is None and all(e.within for e in self.prefill + self.decode)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data

    def summary(self) -> str:
        worst = max(self.prefill + self.decode, key=lambda e: e.error)
        verdict = "passed" if self.passed else "FAILED"
        diverged = ""
        if self.first_diverging_step is not None:
            diverged = f", greedy tokens diverge at decode step {self.first_diverging_step}"
        elif self.near_tie_step is not None:
            diverged = f", the tokens parting at step {self.near_tie_step} on a near tie the tolerance allows"
        return (
            f"parity {verdict} ({self.dtype}, tolerance {self.tolerance.relative:g} of each output's scale): "
            f"worst {worst.name} {worst.error:.3g} of its scale {worst.scale:.3g} (max abs {worst.max_abs:.3g}); "
            f"{self.decode_steps} decode steps{diverged}"
        )

    def failures(self) -> str:
        """The first diverging output, in the order the model computes them (the prefill's
        present tensors layer by layer, its logits, then each decode step), then the others."""
        bad = [e for e in _in_model_order(self.prefill) + self.decode if not e.within]
        parts = [f"{e.name}: {e.error:.3g} of its scale {e.scale:.3g} (max abs {e.max_abs:.3g})" for e in bad[:5]]
        if parts:
            parts[0] = f"first diverging output {parts[0]}"
        if self.first_diverging_step is not None:
            parts.append(
                f"greedy tokens diverge at step {self.first_diverging_step}: "
                f"eager {self.reference_tokens[-1]} vs compiled {self.candidate_tokens[-1]}"
            )
        limit = f"tolerance {self.tolerance.relative:g} of the scale ({self.dtype})"
        return "; ".join(parts) + f" [{limit}]"


def _in_model_order(errors: list[OutputError]) -> list[OutputError]:
    return sorted(errors, key=lambda e: not e.name.startswith("present."))  # stable: layer order kept


def compare(name: str, reference: np.ndarray, candidate: np.ndarray, tol: Tolerance, *, rows: bool) -> OutputError:
    """The largest difference relative to the scale of the reference: of each row along the
    last axis (`rows`, logits: its standard deviation), or, in a tensor, of each element (its
    magnitude, but never less than the tensor's RMS)."""
    if reference.shape != candidate.shape:
        return OutputError(f"{name} shape {candidate.shape} != {reference.shape}", _INF, _INF, 0.0, False)
    if reference.size == 0:
        return OutputError(name, 0.0, 0.0, 0.0, True)
    if not (np.isfinite(candidate).all() and np.isfinite(reference).all()):
        # NaN/Inf in the weights or the graph: no tolerance can vouch for such an output
        side = "compiled" if not np.isfinite(candidate).all() else "eager"
        return OutputError(f"{name} (NaN or Inf in the {side} model's output)", _INF, _INF, 0.0, False)
    ref = reference.astype(np.float64)
    diff = np.abs(candidate.astype(np.float64) - ref)
    if rows:
        ref, diff = ref.reshape(-1, ref.shape[-1]), diff.reshape(-1, ref.shape[-1])
        scales = ref.std(axis=-1, keepdims=True)
    else:
        scales = np.maximum(np.abs(ref), np.sqrt(np.mean(ref * ref)))
    errors = diff / np.maximum(scales, _TINY)
    at = np.unravel_index(int(errors.argmax()), errors.shape)
    scale = scales[at[0], 0] if rows else scales[at]
    within = bool((diff <= tol.relative * scales).all())
    return OutputError(name, float(diff.max()), float(errors[at]), float(scale), within)


_INF = float("inf")
_TINY = float(np.finfo(np.float32).tiny)  # an all-zero reference: any difference is an error


@dataclass
class ReferenceRun:
    """What the eager model gives on the gate's inputs, recorded so that it can be freed
    before the compiled model is loaded (the two never hold their weights at once)."""

    prompts: list[list[int]]
    prefill_logits: np.ndarray
    prefill_cache: dict[str, np.ndarray]
    steps: list[Step]  # greedy decode through the engine core
    error: str = ""  # the eager model's own logits were not finite


def record_reference(reference: Session, *, max_positions: int, decode_steps: int = 8, seed: int = 0) -> ReferenceRun:
    prompts = _prompts(reference.io.vocab_size, seed)
    logits, cache = _prefill(reference, prompts)
    # a copy: nothing the session runs next may write into what the comparison reads
    run = ReferenceRun(prompts, logits, {name: array.copy() for name, array in cache.host().items()}, [])
    try:
        for step in _greedy(reference, prompts, decode_steps, max_positions):
            run.steps.append(step)
    except GenerationError as e:
        run.error = f"the eager model: {e}"
    return run


def compare_with_reference(
    reference: ReferenceRun,
    candidate: Session,
    *,
    max_positions: int,
    dtype: str = "float32",
    tolerance: float | None = None,
) -> ParityReport:
    """The prefill within tolerance, then the same greedy tokens with logits in tolerance.
    `tolerance` replaces the table's number for `dtype`."""
    tol = TOLERANCES[dtype] if tolerance is None else Tolerance(tolerance)
    report = ParityReport(dtype, tol)
    new_tokens = max(len(reference.steps), 1)
    prefilled = _prefill(candidate, reference.prompts, every_position=True)
    report.prefill = list(_prefill_errors(reference, candidate.io, (prefilled[0], prefilled[1].host()), tol))
    if candidate.io.keeps_logits:  # and as generation prefills: logits_to_keep 1, the last position
        last, _ = _prefill(candidate, reference.prompts)
        report.prefill.append(
            compare("logits (logits_to_keep 1)", reference.prefill_logits[:, -1:], last, tol, rows=True)
        )
    if all(e.within for e in report.prefill):  # decoding from a wrong prefill only repeats the failure
        _decode(report, reference, candidate, max_positions, new_tokens)
    return report


def _prefill(session: Session, prompts: list[list[int]], every_position: bool = False) -> tuple[np.ndarray, Cache]:
    """The gate's prompts in one step, left-padded into one batch, into a cache of their width:
    what the prefill comparison reads (the decode is the engine core's, `_greedy`). `every_position`:
    the logits of every position where the graph takes `logits_to_keep` (what a verify step reads)."""
    ids, mask = left_pad(prompts, pad_id=0)
    cache = empty_cache(session.io, len(prompts), ids.shape[1], device_of(session))
    return forward(session, ids, mask, cache, every_position=every_position)


def _greedy(session: Session, prompts: list[list[int]], new_tokens: int, max_positions: int) -> Iterator[Step]:
    """The runner's own greedy generation of `prompts` (the engine core: each prompt prefilled
    alone, then decoded as one batch), with each step's logits."""
    decoders = batch_decoders(SamplingParams(temperature=0.0), prompts)
    return logit_steps(session, prompts, max_new_tokens=new_tokens, max_positions=max_positions, decoders=decoders)


def _decode(
    report: ParityReport,
    reference: ReferenceRun,
    candidate: Session,
    max_positions: int,
    new_tokens: int,
) -> None:
    """Greedy generation through the engine core, as the eager model's was made; stop at the
    first token that differs from the eager model's."""
    steps = _greedy(candidate, reference.prompts, new_tokens, max_positions)
    try:
        for index, (ref_step, cand_step) in enumerate(zip(reference.steps, steps)):
            report.decode_steps = index + 1
            report.reference_tokens.append(ref_step.tokens.tolist())
            report.candidate_tokens.append(cand_step.tokens.tolist())
            report.decode.append(
                compare(f"decode step {index} logits", ref_step.logits, cand_step.logits, report.tolerance, rows=True)
            )
            if not np.array_equal(ref_step.tokens, cand_step.tokens):
                if _near_tie(ref_step.logits, ref_step.tokens, cand_step.tokens, report.tolerance):
                    report.near_tie_step = index
                else:
                    report.first_diverging_step = index
                return
    except GenerationError as e:  # non-finite logits: the runner refuses to sample from them
        report.decode.append(OutputError(f"decode: {e}", _INF, _INF, 0.0, False))
    if reference.error:
        report.decode.append(OutputError(f"decode: {reference.error}", _INF, _INF, 0.0, False))


def _near_tie(logits: np.ndarray, expected: np.ndarray, picked: np.ndarray, tol: Tolerance) -> bool:
    """Whether every row's different pick scores, in the eager logits, within twice the tolerance of the
    eager pick, on that row's scale: each of the two logits may be off by the tolerance, which can flip
    the argmax."""
    rows = np.arange(len(expected))
    row_logits = logits.astype(np.float64)
    top, other = row_logits[rows, expected], row_logits[rows, picked]
    return bool((top - other <= 2 * tol.relative * row_logits.std(axis=-1)).all())


def require_parity(report: ParityReport | DistributionReport, where: str) -> None:
    if not report.passed:
        raise ParityError(
            f"{where}: compiled model does not match the eager model: {report.failures()}", report.to_dict()
        )


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in _PROMPT_LENGTHS]


def _prefill_errors(
    reference: ReferenceRun, io: DecoderIO, prefilled: tuple[np.ndarray, dict[str, np.ndarray]], tol: Tolerance
) -> Iterable[OutputError]:
    _, mask = left_pad(reference.prompts, pad_id=0)
    total = mask.shape[1]
    ref_logits, ref_cache = reference.prefill_logits, reference.prefill_cache
    cand_logits, cand_cache = prefilled
    real = mask.astype(bool)  # [batch, seq]; pad positions are never read, so not compared
    if io.logits_positions == "last":
        yield compare("logits (last position)", ref_logits[:, -1:], cand_logits, tol, rows=True)
    else:
        yield compare("logits", ref_logits[real], cand_logits[real], tol, rows=True)
    for past, present in zip(io.past_names, io.present_names):
        # [batch, heads, total, dim] -> [real positions, heads, dim]; a shared buffer's valid part,
        # the last positions of a layer bounded by its window
        kept = io.kept_positions(past, total)
        ref_kv, cand_kv = (
            c[past][:, :, :total][:, :, total - kept :].transpose(0, 2, 1, 3)[real[:, total - kept :]]
            for c in (ref_cache, cand_cache)
        )
        yield compare(present, ref_kv, cand_kv, tol, rows=False)
    for past, present in zip(io.state_names, io.state_present_names):
        # a fixed-size state ([batch, ...], no positions): every row whole
        yield compare(present, ref_cache[past], cand_cache[past], tol, rows=False)


# --- The distribution gate (quantized builds) ---------------------------------------------------------------
#
# A quantized graph cannot match the eager model within a float tolerance; it must instead
# predict nearly the same next-token distribution. Both models read the same fixed texts
# (prose, code, a list); at every compared position the gate measures whether the most
# likely token agrees (top-1) and the KL divergence of the compiled distribution from the
# eager one, and fails the build past the precision's thresholds.

GATE_TEXTS = (
    "The river rose slowly through the night, and by morning the low fields near the mill were under water. "
    "Farmers moved their animals to the hills and waited for the rain to stop.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n",
    "Ingredients: two cups of flour, one teaspoon of salt, three eggs, a cup of milk and a little butter. "
    "Mix the dry ingredients first, then add the eggs one at a time.",
    "import json\nfrom pathlib import Path\n\n\ndef load_config(path):\n    with open(path) as f:\n"
    "        return json.load(f)\n\n\nclass Cache:\n    def __init__(self, size):\n",
)
GATE_TOKENS = 48  # positions per text at most (the shortest text's token count when fewer)
_GATE_PREFILL = 8  # the first positions go in one prefill; every later one is a teacher-forced decode step


# Top-1 agreement is judged where the eager model has a clear favourite: its most likely
# token beats the second by this many nats. Where two tokens are nearly tied (everywhere, in
# a model with random weights) any rounding may swap them, and KL alone says how close the
# two distributions are.
DECISIVE_MARGIN = 0.5


@dataclass(frozen=True)
class Agreement:
    min_top1: float  # fraction of decisive positions whose most likely token is the eager model's
    max_kl: float  # mean KL(eager || compiled) per position, in nats


# One table for every precision the distribution gate judges.
AGREEMENT: dict[str, Agreement] = {
    "int8": Agreement(min_top1=0.97, max_kl=0.01),
    "int4": Agreement(min_top1=0.90, max_kl=0.10),
}


@dataclass
class DistributionReport:
    precision: str
    threshold: Agreement
    positions: int = 0
    top1: float = 0.0  # over every position, for information
    decisive_positions: int = 0
    top1_decisive: float = 1.0  # over the decisive positions: the gated figure
    kl_mean: float = float("inf")
    kl_max: float = float("inf")
    nll_eager: float = float("inf")  # mean negative log-likelihood of the texts' next tokens
    nll_compiled: float = float("inf")

    @property
    def passed(self) -> bool:
        return bool(self.top1_decisive >= self.threshold.min_top1 and self.kl_mean <= self.threshold.max_kl)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return data

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"distribution {verdict} ({self.precision}, top-1 >= {self.threshold.min_top1:g} where decisive, "
            f"mean KL <= {self.threshold.max_kl:g}): top-1 agreement {self.top1_decisive:.3f} at "
            f"{self.decisive_positions} decisive positions ({self.top1:.3f} at all {self.positions}), "
            f"mean KL {self.kl_mean:.4f} (max {self.kl_max:.3f}); perplexity eager "
            f"{np.exp(self.nll_eager):.2f}, compiled {np.exp(self.nll_compiled):.2f}"
        )

    def failures(self) -> str:
        return self.summary() + _ADVICE.get(self.precision, "")


# The int4 recipe for a model the default int4 costs too much: the default mix (q/k/v at 8 bits,
# zero points, a tied head shared with the lookup at 8 bits) and the weights whose error costs
# most besides, with fewer bytes than int8 (the real checkpoints of tests/real, dequantized:
# SmolLM2-135M passes it at gate mean KL 0.064, Gemma 3 270M at 0.082; docs/performance.md).
INT4_PASSING_RECIPE = "--weights int4 --int8 lm_head --int8 '*down_proj*'"

# What to build instead when a quantized build fails its gate (docs/performance.md has the figures).
_ADVICE = {
    "int4": (
        "; int4 costs too much accuracy on this model: build with --weights int8, or keep the weights whose error "
        f"costs most at int8: {INT4_PASSING_RECIPE} (about three quarters of int8's bytes on SmolLM2-135M "
        "and Gemma 3 270M)"
    ),
    "int8": "; build without --weights (fp32), or keep the most sensitive weights at full precision (--keep lm_head)",
}


def gate_tokens(encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The gate texts as token ids, all cut to one length (so no row needs padding)."""
    encoded = [encode(text)[:GATE_TOKENS] for text in GATE_TEXTS]
    length = min(len(ids) for ids in encoded)
    if length < _GATE_PREFILL + 2:
        raise ParityError(
            f"the tokenizer encodes a gate text to only {length} tokens (at least {_GATE_PREFILL + 2} are needed); "
            "check tokenizer.json"
        )
    return [ids[:length] for ids in encoded]


def reference_log_probs(reference: Session, tokens: list[list[int]]) -> np.ndarray:
    """The eager model's log-probabilities at every compared position: [batch, positions, vocab].

    Computed on their own, so the eager model can be freed before the compiled one is loaded,
    in float32, and kept through the rest of the build in an unlinked temporary file mapped
    read-only: its pages are in memory only while the comparison reads them (21 MB for a
    32k vocabulary, 100 MB for 152k, that the passes need instead)."""
    ids = np.asarray(tokens, dtype=np.int64)
    mask = np.ones_like(ids)
    logits, _ = forward(reference, ids, mask, empty_cache(reference.io, len(ids), ids.shape[1]))
    logits = logits[:, _GATE_PREFILL - 1 :]
    with tempfile.TemporaryFile(prefix="kvforge-gate-") as spill:
        for row in logits:  # one row at a time: the float64 working copies stay small
            spill.write(_log_softmax(row).astype(np.float32).tobytes())
        spill.flush()
        return np.memmap(spill, dtype=np.float32, mode="r", shape=logits.shape)  # the mapping keeps the file


def check_distribution(
    expected: np.ndarray, candidate: Session, tokens: list[list[int]], precision: str
) -> DistributionReport:
    """Compare the compiled model's next-token distributions with `expected` (from
    `reference_log_probs`): a prefill, then one teacher-forced decode step per position,
    so the decode path and its cache are what is judged. Compared a text at a time."""
    report = DistributionReport(precision, AGREEMENT[precision])
    ids = np.asarray(tokens, dtype=np.int64)
    logits = teacher_forced_logits(candidate, ids, _GATE_PREFILL)
    kl, agree, decisive, nll_eager, nll_compiled = [], [], [], [], []
    with np.errstate(invalid="ignore"):  # NaN logits make NaN metrics, which fail the thresholds
        for row, (want, row_logits) in enumerate(zip(expected, logits)):
            want = np.asarray(want, dtype=np.float64)
            got = _log_softmax(row_logits)
            kl.append((np.exp(want) * (want - got)).sum(axis=-1))
            agree.append(want.argmax(-1) == got.argmax(-1))
            top2 = np.sort(np.partition(want, -2, axis=-1)[..., -2:], axis=-1)
            decisive.append(top2[..., 1] - top2[..., 0] >= DECISIVE_MARGIN)
            targets = ids[row, _GATE_PREFILL:, None]  # the token each compared position predicts, but the last
            nll_eager.append(-np.take_along_axis(want[:-1], targets, -1))
            nll_compiled.append(-np.take_along_axis(got[:-1], targets, -1))
        kl_all, agree_all, decisive_all = np.concatenate(kl), np.concatenate(agree), np.concatenate(decisive)
        report.positions = int(kl_all.size)
        report.top1 = float(agree_all.mean())
        report.decisive_positions = int(decisive_all.sum())
        report.top1_decisive = float(agree_all[decisive_all].mean()) if decisive_all.any() else 1.0
        report.kl_mean, report.kl_max = float(kl_all.mean()), float(kl_all.max())
        report.nll_eager = float(np.concatenate(nll_eager).mean())
        report.nll_compiled = float(np.concatenate(nll_compiled).mean())
    return report


def teacher_forced_logits(session: Session, ids: np.ndarray, prefill: int) -> np.ndarray:
    """Next-token logits at positions prefill - 1 .. L - 1 of `ids` [batch, L] (no padding):
    the first `prefill` tokens in one step, then each later token as a one-token decode step,
    as generation feeds them. Works whatever positions the session's logits cover."""
    batch, length = ids.shape
    mask = np.ones_like(ids)
    cache = empty_cache(session.io, batch, length, device_of(session))
    logits, cache = forward(session, ids[:, :prefill], mask[:, :prefill], cache)
    steps = [logits[:, -1]]
    for column in range(prefill, length):
        logits, cache = forward(session, ids[:, column : column + 1], mask[:, : column + 1], cache)
        steps.append(logits[:, -1])
    return np.stack(steps, axis=1)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def gate_provider(providers: Sequence[str]) -> str:
    """The first of a target's onnxruntime `providers` that this machine's onnxruntime offers
    (the CPU's where none of them is): the provider the verification gate runs the artifact on,
    recorded as the manifest's `parity.verified_on`."""
    import onnxruntime

    available = set(onnxruntime.get_available_providers())
    return next((p for p in providers if p in available), "CPUExecutionProvider")
