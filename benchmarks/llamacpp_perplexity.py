"""llama.cpp's perplexity on a GGUF file over the same windows `benchmarks/perplexity.py` scores.

    $KVF_EVAL_ROOT/llamacpp/venv/bin/python benchmarks/llamacpp_perplexity.py GGUF CHECKPOINT FILE [FILE ...]
        [--window 256]

Run it with the python of llama-cpp-python (`../shared/bench/setup_llamacpp.sh` builds one); it
needs llama_cpp, tokenizers and numpy, not kvforge. The windows are made as `perplexity.py`
makes them: each file encoded with CHECKPOINT's tokenizer.json (no special tokens) and followed
by its first end-of-text id (generation_config.json, else config.json), one stream cut into
non-overlapping windows. Each window is evaluated in one llama.cpp batch with every position's
logits; position i predicts token i + 1, so the first token is given and the last predicts past
the window, exactly as the runner's measurement does. The GGUF file must hold the same
vocabulary as the checkpoint (the checkpoints of tests/real are converted from these files).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import llama_cpp
import numpy as np
from tokenizers import Tokenizer
from window_scores import WindowScores, add_arguments


def first_eos(checkpoint: Path) -> int:
    for name in ("generation_config.json", "config.json"):
        path = checkpoint / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return int(eos[0] if isinstance(eos, list) else eos)
    raise SystemExit(f"{checkpoint}: no eos_token_id in generation_config.json or config.json")


def windows(checkpoint: Path, texts: list[str], window: int) -> np.ndarray:
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    stream: list[int] = []
    for text in texts:
        stream += tokenizer.encode(text, add_special_tokens=False).ids + [first_eos(checkpoint)]
    count = len(stream) // window
    return np.asarray(stream[: count * window], dtype=np.int64).reshape(count, window)


def score(gguf: Path, rows: np.ndarray, scores: WindowScores) -> None:
    window = rows.shape[1]
    llm = llama_cpp.Llama(
        model_path=str(gguf), n_ctx=window, n_batch=window, n_ubatch=window, logits_all=True, verbose=False
    )
    for row in rows:
        llm.reset()
        llm.eval(row.tolist())
        scores.add(np.asarray(llm.scores[: window - 1], dtype=np.float64), row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--window", type=int, default=256)
    add_arguments(parser)
    args = parser.parse_args()
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in args.files]
    rows = windows(args.checkpoint, texts, args.window)[: args.windows]
    vocab = llama_cpp.Llama(model_path=str(args.gguf), vocab_only=True, verbose=False).n_vocab()
    scores = WindowScores(len(rows), args.window, vocab, args.save_logprobs, args.kl_against)
    score(args.gguf, rows, scores)
    print(scores.report(args.gguf))


if __name__ == "__main__":
    main()
