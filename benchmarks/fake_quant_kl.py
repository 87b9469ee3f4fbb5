"""What rounding the weights costs, before any graph: mean KL and top-1 agreement where decisive
of a checkpoint whose weights are replaced by their quantized values, against the checkpoint.

    python benchmarks/fake_quant_kl.py CHECKPOINT [--form symmetric|asymmetric|free-min]
        [--table same|symmetric|keep] [--only SUBSTRING ...]

The eager model (transformers, float32) reads the gate's texts (`kvforge.toolchain.verify.GATE_TEXTS`,
48 tokens each) and is judged at every position after the 8th, as the distribution gate judges
a build (a position is decisive where the reference's top token beats the second by 0.5 nats).
Each nn.Linear weight (a tied head: through the table) is quantized by `kvforge.passes.quantize` in
blocks of 32 and put back dequantized; `--only` limits that to the modules whose name contains
one of the substrings; `--table` quantizes the token-embedding table in the same form, in
symmetric int4, or keeps it. Activations stay in float: a build's int8 activations (accuracy
level 4) add a little on top (SmolLM2 symmetric int4: 0.34 here, 0.36 at the gate).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from kvforge.passes.quantize import quantize_blockwise, quantize_free_min
from kvforge.runners.tokenizer import TokenizerBundle
from kvforge.toolchain.verify import GATE_TEXTS

POSITIONS = 48
PREFILL = 8
DECISIVE = 0.5


def rounded(weight: np.ndarray, form: str) -> np.ndarray:
    if form == "free-min":
        return quantize_free_min(weight, 32).dequantize()
    return quantize_blockwise(weight, 4, 32, symmetric=form == "symmetric").dequantize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--form", choices=("symmetric", "asymmetric", "free-min"), default="symmetric")
    parser.add_argument("--table", choices=("same", "symmetric", "keep"), default="same")
    parser.add_argument("--only", nargs="*", default=())
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    tokenizer = TokenizerBundle.load(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    texts = [torch.tensor([tokenizer.encode(t, add_special_tokens=False)[:POSITIONS]]) for t in GATE_TEXTS]
    with torch.inference_mode():
        reference = [torch.log_softmax(model(ids).logits[0].float(), -1) for ids in texts]
        table = model.get_input_embeddings().weight
        errors = []
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module.weight is table:
                continue
            if args.only and not any(part in name for part in args.only):
                continue
            weight = module.weight.numpy()
            if weight.shape[1] % 32:
                continue
            values = rounded(weight, args.form)
            errors.append(float(np.linalg.norm(values - weight) / np.linalg.norm(weight)))
            module.weight.copy_(torch.from_numpy(values))
        if args.table != "keep":
            values = rounded(table.numpy(), args.form if args.table == "same" else "symmetric")
            table.copy_(torch.from_numpy(values))
        kls, agree, decisive = [], 0, 0
        for ids, want in zip(texts, reference):
            got = torch.log_softmax(model(ids).logits[0].float(), -1)
            kls.append((want.exp() * (want - got)).sum(-1)[PREFILL:])
            top = want.topk(2, -1).values
            clear = (top[:, 0] - top[:, 1] >= DECISIVE)[PREFILL:]
            same = (want.argmax(-1) == got.argmax(-1))[PREFILL:]
            agree += int((same & clear).sum())
            decisive += int(clear.sum())
    print(
        f"{args.form}, table {args.table}{', only ' + ' '.join(args.only) if args.only else ''}: "
        f"mean relative weight error {np.mean(errors) if errors else 0:.4f} over {len(errors)} weights, "
        f"mean KL {torch.cat(kls).mean():.4f}, top-1 where decisive {agree}/{decisive}"
    )


if __name__ == "__main__":
    main()
