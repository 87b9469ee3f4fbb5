"""The distribution gate's figures for several `--weights` recipes of one checkpoint.

    python benchmarks/quantize_recipes.py CHECKPOINT RECIPE [RECIPE ...]

    python benchmarks/quantize_recipes.py CHECKPOINT RECIPE ... --text FILE [--text FILE ...]

A recipe is the build's flags, e.g. "int4", "int4 --mix none", "int4 --asymmetric --block-size 128",
"int4 --keep embeddings --keep lm_head", "int4 --int8 lm_head", "int4 --free-min", or "fp32" (no
quantization). The checkpoint is
lowered once; each recipe runs the target's passes on a copy of that graph and the same
check a build runs (`check_distribution` on the gate texts). With --text, each recipe's
perplexity over those files is measured too, on the windows `benchmarks/perplexity.py`
scores (window 256), whether or not the recipe passes the gate (a build would not publish
one that fails). Prints one markdown row per recipe.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import tempfile
from functools import partial
from pathlib import Path

import onnx_ir as ir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perplexity import session_perplexity, windows  # noqa: E402
from benchmarks.window_scores import WindowScores  # noqa: E402
from kvforge.passes import pipeline  # noqa: E402
from kvforge.passes.quantize import WeightQuantization  # noqa: E402
from kvforge.passes.storage import MIXES  # noqa: E402
from kvforge.passes.targets import TARGETS  # noqa: E402
from kvforge.runners.contract import DecoderIO  # noqa: E402
from kvforge.runners.session import OrtSession  # noqa: E402
from kvforge.runners.tokenizer import TokenizerBundle  # noqa: E402
from kvforge.toolchain import checkpoint as checkpoints  # noqa: E402
from kvforge.toolchain import emit  # noqa: E402
from kvforge.toolchain.build import _graph_contract, read_spec  # noqa: E402
from kvforge.toolchain.export import eager_model, export_decoder  # noqa: E402
from kvforge.toolchain.gate import eager_session  # noqa: E402
from kvforge.toolchain.lower import to_onnx  # noqa: E402
from kvforge.toolchain.verify import check_distribution, gate_tokens, reference_log_probs  # noqa: E402


def recipe(text: str) -> WeightQuantization | None:
    if text == "fp32":
        return None
    parser = argparse.ArgumentParser(prog=text)
    parser.add_argument("weights", choices=["int8", "int4"])
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--asymmetric", action="store_true")
    parser.add_argument("--keep", action="append", default=[])
    parser.add_argument("--int8", action="append", default=[])
    parser.add_argument("--free-min", action="store_true")
    parser.add_argument("--mix", choices=MIXES, default=None)
    args = parser.parse_args(shlex.split(text))
    bits, symmetric = int(args.weights[3:]), not args.asymmetric
    return WeightQuantization(
        bits, args.block_size, symmetric, tuple(args.keep), int8=tuple(args.int8), free_min=args.free_min, mix=args.mix
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("recipes", nargs="+")
    parser.add_argument("--target", default="ort-cpu")
    parser.add_argument("--text", type=Path, action="append", default=[], help="a file to measure perplexity on")
    args = parser.parse_args()
    ckpt = checkpoints.load(args.checkpoint)
    spec = read_spec(ckpt)
    io = DecoderIO.for_spec(spec)
    model = eager_model(ckpt, spec)
    tokenizer = TokenizerBundle.load(ckpt.path)
    tokens = gate_tokens(tokenizer.encode)
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in args.text]
    rows = windows(partial(tokenizer.encode, add_special_tokens=False), spec.eos_token_ids[0], texts, 256)
    expected = reference_log_probs(eager_session(model, spec, io), tokens)
    with tempfile.TemporaryDirectory() as scratch:
        lowered = Path(scratch) / "lowered.onnx"
        ir.save(to_onnx(export_decoder(model, spec, io), io), lowered, external_data="lowered.onnx.data")
        del model
        header = "recipe | top-1 (decisive) | top-1 (all) | mean KL | max KL | perplexity eager → compiled "
        header += "| weights | gate" + (f" | perplexity, {rows.size - len(rows)} tokens of --text" if texts else "")
        print(f"| {header} |")
        print("|---" * (8 + bool(texts)) + "|")
        for text in args.recipes:
            graph = ir.load(lowered)
            target = TARGETS[args.target]
            pipeline.run(graph, target, target.expected_fusions(spec.num_layers), recipe(text))
            out = Path(scratch) / "variant"
            out.mkdir(exist_ok=True)
            emit.write_onnx(graph, out)
            graph_io = _graph_contract(graph, io, target)
            del graph
            size = sum(f.stat().st_size for f in out.glob("model.onnx*")) / 1e6
            session = OrtSession(out / "model.onnx", graph_io)
            # fp32 has the parity gate, not this one: its row shows the distribution's figures only
            r = check_distribution(expected, session, tokens, text.split()[0] if text != "fp32" else "int8")
            held_out = ""
            if texts:
                scores = WindowScores(len(rows), rows.shape[1], graph_io.vocab_size, None, None)
                session_perplexity(session, rows, 16, scores)
                held_out = f" {scores.perplexity:.2f} |"
            print(
                f"| `{text}` | {r.top1_decisive:.3f} | {r.top1:.3f} | {r.kl_mean:.4f} | {r.kl_max:.2f} "
                f"| {math.exp(r.nll_eager):.2f} → {math.exp(r.nll_compiled):.2f} | {size:.0f} MB "
                f"| {'—' if text == 'fp32' else 'pass' if r.passed else 'FAIL'} |{held_out}",
                flush=True,
            )
            del session
            for f in out.iterdir():
                f.unlink()


if __name__ == "__main__":
    main()
