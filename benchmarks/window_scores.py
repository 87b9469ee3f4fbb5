"""Perplexity over windows of a text, and KL divergence against a reference run's log-probabilities.

Shared by `perplexity.py` (kvforge artifacts) and `llamacpp_perplexity.py` (llama.cpp GGUF files,
run with llama-cpp-python's own python): NumPy only. A run can save every position's
log-probabilities (`save`, float32 [windows, window - 1, vocab]); a later run over the same
windows and vocabulary reads them back (`reference`) and reports the mean KL(reference ||
this run) per predicted token beside its perplexity: how far a quantized model's next-token
distributions move from the fp32 model's, the same figure for kvforge and llama.cpp.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--windows", type=int, default=None, help="score only the first N windows")
    parser.add_argument("--save-logprobs", type=Path, default=None, help="write every position's log-probabilities")
    parser.add_argument("--kl-against", type=Path, default=None, help="a --save-logprobs file of a reference run")


class WindowScores:
    """Accumulates one window at a time: `add(logits, ids)` with logits [len(ids) - 1, vocab]
    (position i predicting ids[i + 1])."""

    def __init__(self, count: int, window: int, vocab: int, save: Path | None, reference: Path | None) -> None:
        self.nll, self.predicted, self.kl, self.index = 0.0, 0, 0.0, 0
        shape = (count, window - 1, vocab)
        self.saved = None if save is None else np.lib.format.open_memmap(save, mode="w+", dtype=np.float32, shape=shape)
        self.reference = None if reference is None else np.load(reference, mmap_mode="r")
        if self.reference is not None and self.reference.shape[1:] != shape[1:]:
            theirs = self.reference.shape[1:]
            raise SystemExit(f"{reference}: log-probabilities of shape {theirs}, this run's are {shape[1:]}")
        if self.reference is not None and self.reference.shape[0] < count:
            raise SystemExit(f"{reference}: {self.reference.shape[0]} windows, this run scores {count}")

    def add(self, logits: np.ndarray, ids: np.ndarray) -> None:
        scores = logits.astype(np.float64)
        top = scores.max(axis=-1, keepdims=True)
        logprobs = scores - (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))
        self.nll -= float(logprobs[np.arange(len(ids) - 1), ids[1:]].sum())
        self.predicted += len(ids) - 1
        if self.saved is not None:
            self.saved[self.index] = logprobs
        if self.reference is not None:
            ref = np.asarray(self.reference[self.index], dtype=np.float64)
            self.kl += float((np.exp(ref) * (ref - logprobs)).sum())
        self.index += 1

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.predicted)

    def report(self, name: Path) -> str:
        if self.saved is not None:
            self.saved.flush()
        text = f"{name}: perplexity {self.perplexity:.2f} over {self.predicted} predicted tokens"
        if self.reference is not None:
            text += f", mean KL against the reference {self.kl / self.predicted:.5f}"
        return text
