"""Decode speed with and without exact speculative decoding, on edit-like and open prompts.

    python benchmarks/speculative.py ARTIFACT [--new 96] [--repeats 5] [--draft-tokens 4 8]
                                     [--speculative prompt-lookup|draft:PATH]

ARTIFACT is built with `kvforge build` (the defaults; `--logits last` is refused). Each prompt is generated greedily
plain and with speculation, in turn, --repeats times; the decode speed of one run is
`GenerationStats.decode_tokens_per_s` (tokens after the first per second after the first),
and a prompt's ratio is the median speculative speed over the median plain speed. The
texts must be identical (the run stops otherwise). Per prompt set: the median ratio, the
acceptance rate (accepted / drafted) and tokens per verify step over its prompts.

Edit-like prompts ask the model to repeat or lightly modify code that is in the prompt
(refactoring, copying with a change): the reply copies long spans of it. Open prompts
start code from a line, and the reply copies little.
"""

from __future__ import annotations

import argparse
import statistics

from kvforge import Engine

ADD = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
STACK = (
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        return self.items.pop()\n"
)
LOOP = "def total(values):\n    result = 0\n    for value in values:\n        result += value\n    return result\n"
FIB = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"

EDIT = {
    "copy-functions": f"{ADD}\n\n# The same functions again:\n{ADD[:15]}",
    "copy-class": f"{STACK}\n\n# A copy of the class above:\n{STACK[:13]}",
    "rename": f"{LOOP}\n\n# The same function, named sum_all:\ndef sum_all(values):\n",
    "reformat": f"{FIB}\n\n# The same function with a docstring:\ndef fib(n):\n",
}
OPEN = {
    "fibonacci": "def fibonacci(n):",
    "main": "import os\nimport sys\n\n\ndef main():",
    "class": "class Config:",
    "parse": "def parse_args(argv):\n    ",
}


def speeds(engine: Engine, prompt: str, new: int, repeats: int, speculative: str, k: int) -> dict[str, float]:
    plain: list[float] = []
    fast: list[float] = []
    accepted = drafted = verified = steps = 0
    for _ in range(repeats):
        stream = engine.stream(prompt, max_new_tokens=new, temperature=0.0)
        text = "".join(stream)
        plain.append(stream.stats.decode_tokens_per_s)
        stream = engine.stream(prompt, max_new_tokens=new, temperature=0.0, speculative=speculative, draft_tokens=k)
        if "".join(stream) != text:
            raise SystemExit(f"speculative text differs from plain text for {prompt!r}")
        fast.append(stream.stats.decode_tokens_per_s)
        spec = stream.stats.speculation
        assert spec is not None
        accepted, drafted = accepted + spec.accepted_tokens, drafted + spec.drafted_tokens
        verified, steps = verified + spec.verified_tokens, steps + spec.verify_steps
    return {
        "plain": statistics.median(plain),
        "speculative": statistics.median(fast),
        "acceptance": accepted / drafted if drafted else 0.0,
        "per_step": verified / steps if steps else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--new", type=int, default=96, help="new tokens per reply")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[8])
    parser.add_argument("--speculative", default="prompt-lookup")
    args = parser.parse_args()
    engine = Engine.load(args.artifact)
    engine.eos_ids = ()  # every reply runs to --new tokens: the same work plain and speculative
    engine.generate("def warm():", max_new_tokens=8, temperature=0.0)
    print(f"{args.artifact}: {args.speculative}, {args.new} new tokens, median of {args.repeats}")
    for k in args.draft_tokens:
        for name, prompts in (("edit-like", EDIT), ("open", OPEN)):
            ratios, acceptance, per_step = [], [], []
            for label, prompt in prompts.items():
                r = speeds(engine, prompt, args.new, args.repeats, args.speculative, k)
                ratio = r["speculative"] / r["plain"]
                ratios.append(ratio)
                acceptance.append(r["acceptance"])
                per_step.append(r["per_step"])
                print(
                    f"  K={k} {name:<9} {label:<15} plain {r['plain']:7.1f} tok/s  speculative "
                    f"{r['speculative']:7.1f} tok/s  {ratio:5.2f}x  acceptance {r['acceptance']:4.0%}  "
                    f"{r['per_step']:4.2f} tokens/step"
                )
            print(
                f"K={k} {name}: median speedup {statistics.median(ratios):.2f}x, acceptance "
                f"{statistics.median(acceptance):.0%}, {statistics.median(per_step):.2f} tokens/step"
            )


if __name__ == "__main__":
    main()
