"""Stream text from a kvforge artifact with onnxruntime-genai's runtime (no kvforge code).

    python examples/genai/genai_stream.py ARTIFACT [PROMPT] [MAX_NEW_TOKENS]

kvforge writes genai_config.json into every ort-cpu and onnx artifact, so onnxruntime-genai
opens the directory as it is. Greedy decoding, so the text is what `kvforge generate
ARTIFACT PROMPT --temperature 0` writes.
"""

from __future__ import annotations

import sys

import onnxruntime_genai as og


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(f"usage: {argv[0]} ARTIFACT [PROMPT] [MAX_NEW_TOKENS]", file=sys.stderr)
        return 2
    prompt = argv[2] if len(argv) > 2 else "def read_config(path):"
    new_tokens = int(argv[3]) if len(argv) > 3 else 64
    model = og.Model(argv[1])
    tokenizer = og.Tokenizer(model)
    stream = tokenizer.create_stream()
    ids = tokenizer.encode(prompt)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
        print(stream.decode(generator.get_next_tokens()[0]), end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
