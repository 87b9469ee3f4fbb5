"""Train the bundled example model: a small Llama on the Python standard library's source.

    python examples/train_example.py OUT                     # train (about 12 minutes on 2 CPU cores)
    python examples/train_example.py --evaluate CHECKPOINT   # held-out perplexity, trained vs untrained

The corpus is the top-level modules of the standard library of the Python running this
script (PSF license), less a fixed held-out set (HELD_OUT). A byte-level BPE tokenizer is
trained on the training files with `tokenizers`; then a ~4M-parameter LlamaForCausalLM
(tied embeddings) is trained with AdamW on random 256-token windows. Everything is seeded;
the checkpoint is written in Hugging Face layout with safetensors.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: when other work shares the cores, spinning
# threads slow every step several-fold. Set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 0
VOCAB_SIZE = 4096
CONTEXT = 256
SHAPE = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=CONTEXT,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
BOS, EOS = "<s>", "</s>"
# Held out from both the tokenizer and the model; the perplexity in examples/README.md is over these.
HELD_OUT = ("calendar.py", "fractions.py", "graphlib.py", "netrc.py", "queue.py", "sched.py", "shlex.py", "textwrap.py")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) from the running Python's standard library."""
    lib = Path(os.path.dirname(os.__file__))
    files = sorted(p for p in lib.glob("*.py") if p.is_file())
    held = [p for p in files if p.name in HELD_OUT]
    if len(held) != len(HELD_OUT):
        sys.exit(f"{lib}: missing some of the held-out modules {HELD_OUT}")
    return [p for p in files if p.name not in HELD_OUT], held


def read(files: list[Path]) -> list[str]:
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """One stream of token ids: each file followed by the end-of-text token."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def make_model(vocab_size: int, bos_id: int, eos_id: int) -> LlamaForCausalLM:
    torch.manual_seed(SEED)
    config = LlamaConfig(**SHAPE, vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id)
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10%


def train(model: LlamaForCausalLM, data: torch.Tensor, *, steps: int, batch: int, lr: float) -> None:
    gen = torch.Generator().manual_seed(SEED)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    model.train()
    start, running = time.perf_counter(), 0.0
    for step in range(steps):
        starts = torch.randint(0, len(data) - CONTEXT - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + CONTEXT] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        running += loss.item()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - start
            print(f"step {step + 1}/{steps}  loss {running / 50:.3f}  {elapsed / 60:.1f} min", flush=True)
            running = 0.0
    model.eval()


@torch.no_grad()
def perplexity(model: LlamaForCausalLM, data: torch.Tensor) -> float:
    """exp(mean next-token loss) over non-overlapping CONTEXT-token windows."""
    model.eval()
    usable = (len(data) // CONTEXT) * CONTEXT
    windows = data[:usable].view(-1, CONTEXT)
    total, count = 0.0, 0
    for chunk in windows.split(16):
        logits = model(input_ids=chunk).logits[:, :-1].float()
        targets = chunk[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += targets.numel()
    return math.exp(total / count)


def report(model: LlamaForCausalLM, tok: Tokenizer) -> None:
    _, held = stdlib_files()
    data = encode(tok, read(held))
    untrained = make_model(model.config.vocab_size, model.config.bos_token_id, model.config.eos_token_id)
    print(f"held-out: {len(held)} files, {len(data)} tokens ({', '.join(p.name for p in held)})")
    print(f"held-out perplexity, trained:   {perplexity(model, data):.2f}")
    print(f"held-out perplexity, untrained: {perplexity(untrained, data):.2f}  (uniform: {model.config.vocab_size})")


def save(out: Path, model: LlamaForCausalLM, tok: Tokenizer) -> None:
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE, model_max_length=CONTEXT
    ).save_pretrained(out)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=128,
    )
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", help="Checkpoint directory to write.")
    parser.add_argument("--evaluate", type=Path, metavar="CHECKPOINT", help="Only report held-out perplexity.")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    random.seed(SEED)
    torch.manual_seed(SEED)
    if args.evaluate:
        model = LlamaForCausalLM.from_pretrained(args.evaluate, dtype=torch.float32)
        report(model, Tokenizer.from_file(str(args.evaluate / "tokenizer.json")))
        return
    if args.out is None:
        parser.error("give OUT, or --evaluate CHECKPOINT")
    started = time.perf_counter()
    train_files, _ = stdlib_files()
    texts = read(train_files)
    tok = train_tokenizer(texts)
    data = encode(tok, texts)
    print(f"corpus: {len(train_files)} files, {sum(map(len, texts)) / 1e6:.1f} M chars, {len(data)} tokens")
    model = make_model(tok.get_vocab_size(), tok.token_to_id(BOS), tok.token_to_id(EOS))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    train(model, data, steps=args.steps, batch=args.batch, lr=args.lr)
    print(f"trained in {(time.perf_counter() - started) / 60:.1f} min")
    save(args.out, model, tok)
    report(model, tok)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
