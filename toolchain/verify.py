"""The verification gate: the compiled graph must match the eager model before publishing.

Prefill of a left-padded batch of two prompts compares logits and every present tensor
at the real (non-pad) positions; then both models decode greedily through the real
generation loop and must pick the same token at every step, with logits in tolerance.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from runners.errors import GenerationError, ParityError
from runners.generate import empty_cache, forward, generate_steps, left_pad
from runners.sampling import SamplingParams
from runners.session import Session


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# One table for every comparison the gate makes, keyed by the compute dtype of the graph.
TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(atol=1e-4, rtol=1e-3),
    "float16": Tolerance(atol=2e-2, rtol=2e-2),
    "bfloat16": Tolerance(atol=1e-1, rtol=5e-2),
}

_PROMPT_LENGTHS = (7, 4)  # unequal, so the second row is left-padded


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs: float
    max_rel: float
    within: bool


@dataclass
class ParityReport:
    dtype: str
    tolerance: Tolerance
    prefill: list[OutputError] = field(default_factory=list)
    decode: list[OutputError] = field(default_factory=list)
    decode_steps: int = 0
    first_diverging_step: int | None = None
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
        worst = max(self.prefill + self.decode, key=lambda e: e.max_abs)
        verdict = "passed" if self.passed else "FAILED"
        diverged = (
            ""
            if self.first_diverging_step is None
            else f", greedy tokens diverge at decode step {self.first_diverging_step}"
        )
        return (
            f"parity {verdict} ({self.dtype}, atol {self.tolerance.atol:g}, rtol {self.tolerance.rtol:g}): "
            f"worst {worst.name} max abs {worst.max_abs:.3g}, max rel {worst.max_rel:.3g}; "
            f"{self.decode_steps} decode steps{diverged}"
        )

    def failures(self) -> str:
        bad = [e for e in self.prefill + self.decode if not e.within]
        parts = [f"{e.name}: max abs {e.max_abs:.3g}, max rel {e.max_rel:.3g}" for e in bad[:5]]
        if self.first_diverging_step is not None:
            parts.append(
                f"greedy tokens diverge at step {self.first_diverging_step}: "
                f"eager {self.reference_tokens[-1]} vs compiled {self.candidate_tokens[-1]}"
            )
        return "; ".join(parts)


def compare(name: str, reference: np.ndarray, candidate: np.ndarray, tol: Tolerance) -> OutputError:
    if reference.shape != candidate.shape:
        return OutputError(f"{name} shape {candidate.shape} != {reference.shape}", float("inf"), float("inf"), False)
    ref = reference.astype(np.float64)
    diff = np.abs(candidate.astype(np.float64) - ref)
    if diff.size == 0:
        return OutputError(name, 0.0, 0.0, True)
    if not (np.isfinite(candidate).all() and np.isfinite(reference).all()):
        # NaN/Inf in the weights or the graph: no tolerance can vouch for such an output
        side = "compiled" if not np.isfinite(candidate).all() else "eager"
        return OutputError(f"{name} (NaN or Inf in the {side} model's output)", float("inf"), float("inf"), False)
    within = bool((diff <= tol.atol + tol.rtol * np.abs(ref)).all())
    rel = diff / np.maximum(np.abs(ref), tol.atol)
    return OutputError(name, float(diff.max()), float(rel.max()), within)


def check_parity(
    reference: Session,
    candidate: Session,
    *,
    max_positions: int,
    dtype: str = "float32",
    decode_steps: int = 8,
    seed: int = 0,
) -> ParityReport:
    """Compare `candidate` (the compiled graph) with `reference` (the eager model)."""
    tol = TOLERANCES[dtype]
    report = ParityReport(dtype, tol)
    prompts = _prompts(reference.io.vocab_size, seed)
    report.prefill = list(_prefill_errors(reference, candidate, prompts, tol))
    if all(e.within for e in report.prefill):  # decoding from a wrong prefill only repeats the failure
        _decode(report, reference, candidate, prompts, max_positions, decode_steps, seed)
    return report


def _decode(
    report: ParityReport,
    reference: Session,
    candidate: Session,
    prompts: list[list[int]],
    max_positions: int,
    decode_steps: int,
    seed: int,
) -> None:
    """Greedy decode on both through the runner's loop; stop at the first diverging token."""
    steps = zip(
        *(
            generate_steps(
                s,
                prompts,
                max_new_tokens=decode_steps,
                max_positions=max_positions,
                params=SamplingParams(temperature=0.0),
                rng=np.random.default_rng(seed),
            )
            for s in (reference, candidate)
        )
    )
    try:
        for index, (ref_step, cand_step) in enumerate(steps):
            report.decode_steps = index + 1
            report.reference_tokens.append(ref_step.tokens.tolist())
            report.candidate_tokens.append(cand_step.tokens.tolist())
            report.decode.append(
                compare(f"decode step {index} logits", ref_step.logits, cand_step.logits, report.tolerance)
            )
            if not np.array_equal(ref_step.tokens, cand_step.tokens):
                report.first_diverging_step = index
                return
    except GenerationError as e:  # non-finite logits: the runner refuses to sample from them
        report.decode.append(OutputError(f"decode: {e}", float("inf"), float("inf"), False))


def require_parity(report: ParityReport, where: str) -> None:
    if not report.passed:
        raise ParityError(f"{where}: compiled model does not match the eager model: {report.failures()}")


def _prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n).tolist() for n in _PROMPT_LENGTHS]


def _prefill_errors(
    reference: Session, candidate: Session, prompts: list[list[int]], tol: Tolerance
) -> Iterable[OutputError]:
    io = reference.io
    ids, mask = left_pad(prompts, pad_id=0)
    total = ids.shape[1]
    ref_logits, ref_cache = forward(reference, ids, mask, empty_cache(io, len(prompts), total))
    cand_logits, cand_cache = forward(candidate, ids, mask, empty_cache(candidate.io, len(prompts), total))
    real = mask.astype(bool)  # [batch, seq]; pad positions are never read, so not compared
    if candidate.io.logits_positions == "last":
        yield compare("logits (last position)", ref_logits[:, -1:], cand_logits, tol)
    else:
        yield compare("logits", ref_logits[real], cand_logits[real], tol)
    for past, present in zip(io.past_names, io.present_names):
        # [batch, heads, total, dim] -> [real positions, heads, dim]; a shared buffer's valid part
        ref_kv, cand_kv = (c[past][:, :, :total].transpose(0, 2, 1, 3)[real] for c in (ref_cache, cand_cache))
        yield compare(present, ref_kv, cand_kv, tol)
