"""What rounding the weights costs, before any graph: mean KL and top-1 agreement where decisive
of a checkpoint whose weights are replaced by their quantized values, against the checkpoint.

    python benchmarks/fake_quant_kl.py CHECKPOINT [--form symmetric|asymmetric|free-min]
        [--table same|symmetric|keep] [--only SUBSTRING ...] [--mix all_attention|attention_down|attention|q4_k_m|none]
        [--text FILE ... [--windows N]]

The eager model (transformers, float32) reads the gate's texts (`kvforge.toolchain.verify.GATE_TEXTS`,
48 tokens each) and is judged at every position after the 8th, as the distribution gate judges
a build (a position is decisive where the reference's top token beats the second by 0.5 nats).
Each nn.Linear weight (a tied head: through the table) is quantized by `kvforge.passes.quantize` in
blocks of 32 and put back dequantized; `--only` limits that to the modules whose name contains
one of the substrings; `--table` quantizes the token-embedding table in the same form, in
symmetric int4, or keeps it. Activations stay in float: a build's int8 activations (accuracy
level 4) add a little on top (SmolLM2 symmetric int4: 0.34 here, 0.36 at the gate). `--mix`
rounds the weights a `--weights int4 --mix` build keeps at 8 bits to symmetric int8 in blocks of
32 (`kvforge.passes.storage.mixed_to_8_bits`, the LM head by `mixed_head`; default none). With
`--text`, the measure is instead the mean KL over every position of the windows of 256 tokens
`benchmarks/perplexity.py` scores (the first `--windows`), as its `--kl-against` the fp32 run
measures an artifact.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

from kvforge.passes.quantize import quantize_blockwise, quantize_free_min
from kvforge.passes.storage import MIXES, layer_count, mixed_head, mixed_to_8_bits
from kvforge.runners.tokenizer import TokenizerBundle
from kvforge.toolchain.verify import GATE_TEXTS

POSITIONS = 48
PREFILL = 8
DECISIVE = 0.5


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.perplexity import windows  # noqa: E402


def rounded(weight: np.ndarray, form: str) -> np.ndarray:
    if form == "int8":
        return quantize_blockwise(weight, 8, 32, symmetric=True).dequantize()
    if form == "free-min":
        return quantize_free_min(weight, 32).dequantize()
    return quantize_blockwise(weight, 4, 32, symmetric=form == "symmetric").dequantize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--form", choices=("symmetric", "asymmetric", "free-min"), default="symmetric")
    parser.add_argument("--table", choices=("same", "symmetric", "keep"), default="same")
    parser.add_argument("--only", nargs="*", default=())
    parser.add_argument("--mix", choices=MIXES, default="none")
    parser.add_argument("--text", type=Path, nargs="*", default=())
    parser.add_argument("--windows", type=int, default=12)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    tokenizer = TokenizerBundle.load(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    texts = [torch.tensor([tokenizer.encode(t, add_special_tokens=False)[:POSITIONS]]) for t in GATE_TEXTS]
    prefill, end = PREFILL, None
    if args.text:
        encode = partial(tokenizer.encode, add_special_tokens=False)
        eos = model.config.eos_token_id
        stream = [f.read_text(encoding="utf-8", errors="replace") for f in args.text]
        rows = windows(encode, eos if isinstance(eos, int) else eos[0], stream, 256)[: args.windows]
        texts, prefill, end = [torch.from_numpy(row)[None] for row in rows], 0, -1  # the last predicts past it
    with torch.inference_mode():
        reference = [torch.log_softmax(model(ids).logits[0].float(), -1) for ids in texts]
        table = model.get_input_embeddings().weight
        head = model.get_output_embeddings()
        layers = layer_count(name for name, _ in model.named_modules())
        errors = []
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or module.weight is table:
                continue
            if args.only and not any(part in name for part in args.only):
                continue
            weight = module.weight.numpy()
            if weight.shape[1] % 32:
                continue
            wide = mixed_to_8_bits(args.mix, f"{name}.weight", layers) or (module is head and mixed_head(args.mix))
            values = rounded(weight, "int8" if wide else args.form)
            errors.append(float(np.linalg.norm(values - weight) / np.linalg.norm(weight)))
            module.weight.copy_(torch.from_numpy(values))
        if args.table != "keep":
            values = rounded(table.numpy(), args.form if args.table == "same" else "symmetric")
            table.copy_(torch.from_numpy(values))
        kls, agree, decisive = [], 0, 0
        for ids, want in zip(texts, reference):
            got = torch.log_softmax(model(ids).logits[0].float(), -1)
            kls.append((want.exp() * (want - got)).sum(-1)[prefill:end])
            top = want.topk(2, -1).values
            clear = (top[:, 0] - top[:, 1] >= DECISIVE)[prefill:end]
            same = (want.argmax(-1) == got.argmax(-1))[prefill:end]
            agree += int((same & clear).sum())
            decisive += int(clear.sum())
    print(
        f"{args.form}, mix {args.mix}, table {args.table}{', only ' + ' '.join(args.only) if args.only else ''}: "
        f"mean relative weight error {np.mean(errors) if errors else 0:.4f} over {len(errors)} weights, "
        f"mean KL {torch.cat(kls).mean():.4f}, top-1 where decisive {agree}/{decisive}"
    )


if __name__ == "__main__":
    main()
