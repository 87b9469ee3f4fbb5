"""Held-out perplexity of an artifact, computed by the runner the way generation feeds it.

    python benchmarks/perplexity.py ARTIFACT FILE [FILE ...] [--window 256] [--batch 16]

Each file is encoded with the artifact's tokenizer and followed by the end-of-text token, in
one stream cut into non-overlapping windows; each window's first token is given, and every
later token is predicted from a prefill of one token followed by one-token decode steps (so
an artifact whose logits cover only the last position is measured the same way). For the bundled example model, the
held-out files are the standard-library modules `examples/train_example.py` names in
HELD_OUT, and the windows match `train_example.py --evaluate`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runners.engine import Engine  # noqa: E402
from runners.session import Session  # noqa: E402
from toolchain.verify import teacher_forced_logits  # noqa: E402


def windows(encode: Callable[[str], list[int]], eos: int, texts: list[str], window: int) -> np.ndarray:
    """The texts as one stream of ids, each followed by `eos`, cut into non-overlapping windows."""
    stream: list[int] = []
    for text in texts:
        stream += encode(text) + [eos]
    count = len(stream) // window
    return np.asarray(stream[: count * window], dtype=np.int64).reshape(count, window)


def session_perplexity(session: Session, rows: np.ndarray, batch: int) -> tuple[float, int]:
    """(perplexity per predicted token, tokens predicted) of `session` over the windows `rows`,
    `batch` windows per call, fewer where their logits would pass 1 GiB (a 262k vocabulary)."""
    batch = max(1, min(batch, (1 << 30) // (rows.shape[1] * session.io.vocab_size * 4)))
    nll, predicted = 0.0, 0
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        logits = teacher_forced_logits(session, chunk, prefill=1)
        for row, ids in zip(logits, chunk):  # one window at a time in float64
            scores = row[:-1].astype(np.float64)  # the last position predicts past the window
            top = scores.max(axis=-1, keepdims=True)
            log_z = top[:, 0] + np.log(np.exp(scores - top).sum(axis=-1))
            nll += float((log_z - scores[np.arange(len(ids) - 1), ids[1:]]).sum())
            predicted += len(ids) - 1
    return math.exp(nll / predicted), predicted


def perplexity(artifact: Path, texts: list[str], window: int, batch: int) -> tuple[float, int]:
    """(perplexity per predicted token, tokens predicted) of the artifact over the texts."""
    engine = Engine.load(artifact)
    encode = partial(engine.tokenizer.encode, add_special_tokens=False)
    return session_perplexity(engine.session, windows(encode, engine.eos_ids[0], texts, window), batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in args.files]
    value, tokens = perplexity(args.artifact, texts, args.window, args.batch)
    print(f"{args.artifact}: perplexity {value:.2f} over {tokens} predicted tokens")


if __name__ == "__main__":
    main()
