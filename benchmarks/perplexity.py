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
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.window_scores import WindowScores, add_arguments  # noqa: E402
from kvforge.runners.engine import Engine  # noqa: E402
from kvforge.runners.session import Session  # noqa: E402
from kvforge.toolchain.verify import teacher_forced_logits  # noqa: E402


def windows(encode: Callable[[str], list[int]], eos: int, texts: list[str], window: int) -> np.ndarray:
    """The texts as one stream of ids, each followed by `eos`, cut into non-overlapping windows."""
    stream: list[int] = []
    for text in texts:
        stream += encode(text) + [eos]
    count = len(stream) // window
    return np.asarray(stream[: count * window], dtype=np.int64).reshape(count, window)


def session_perplexity(session: Session, rows: np.ndarray, batch: int, scores: WindowScores) -> None:
    """Score `session` over the windows `rows` into `scores`, `batch` windows per call, fewer
    where their logits would pass 1 GiB (a 262k vocabulary)."""
    batch = max(1, min(batch, (1 << 30) // (rows.shape[1] * session.io.vocab_size * 4)))
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        logits = teacher_forced_logits(session, chunk, prefill=1)
        for row, ids in zip(logits, chunk):  # the last position predicts past the window
            scores.add(row[:-1], ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    add_arguments(parser)
    args = parser.parse_args()
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in args.files]
    engine = Engine.load(args.artifact)
    encode = partial(engine.tokenizer.encode, add_special_tokens=False)
    rows = windows(encode, engine.eos_ids[0], texts, args.window)[: args.windows]
    scores = WindowScores(len(rows), args.window, engine.session.io.vocab_size, args.save_logprobs, args.kl_against)
    session_perplexity(engine.session, rows, args.batch, scores)
    print(scores.report(args.artifact))


if __name__ == "__main__":
    main()
