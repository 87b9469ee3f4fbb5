"""Embed a compiled artifact in an application, with only the runner installed.

    python examples/embed_app.py ARTIFACT

`runners` needs onnxruntime, tokenizers, jinja2 and numpy; it never imports torch or
transformers, so an app that ships an artifact does not ship them either. This script
shows the four things an app usually does: load (every file is checked against the
manifest first), stream tokens as they come, end generation at a stop string, and
format a chat turn with the tokenizer's own chat template.
"""

from __future__ import annotations

import sys

from kvforge import Engine, KvforgeError


def stream_completion(engine: Engine, prompt: str) -> None:
    """Print the continuation of `prompt` chunk by chunk, then the stream's statistics.

    Sampled and seeded: the same seed gives the same text.
    """
    stream = engine.stream(prompt, max_new_tokens=48, temperature=0.7, top_p=0.9, seed=1)
    print(prompt, end="", flush=True)
    for chunk in stream:  # text only at complete UTF-8 boundaries
        print(chunk, end="", flush=True)
    s = stream.stats
    print(f"\n[{s.new_tokens} tokens, first after {s.first_token_s * 1000:.0f} ms, finish: {s.finish_reason}]")


def complete_until_blank_line(engine: Engine, prompt: str) -> str:
    """Cut at the first blank line.

    The stop string itself is never returned, even when it arrives split across tokens.
    """
    text = engine.generate(prompt, max_new_tokens=96, stop=["\n\n"], temperature=0.8, top_p=0.95, seed=7)
    assert isinstance(text, str)
    return text


def chat_reply(engine: Engine, question: str) -> str:
    """One chat turn: the prompt is rendered with the artifact's chat template (sandboxed Jinja).

    The generation then starts after the template's assistant header.
    """
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    print(f"chat prompt as the model sees it: {rendered!r}")
    reply = engine.generate(
        question, chat=True, max_new_tokens=32, stop=["<|user|>", "\n\n"], temperature=0.7, top_p=0.9, seed=1
    )
    assert isinstance(reply, str)
    return reply


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        engine = Engine.load(argv[1])
    except KvforgeError as e:  # one line naming the file and what to do
        print(f"embed_app: {e}", file=sys.stderr)
        return 2

    print("== streaming")
    stream_completion(engine, 'def read_config(path):\n    """')

    print("== stop string")
    prompt = 'class Stack:\n    """'
    print(prompt + complete_until_blank_line(engine, prompt) + "<stop>")

    print("== chat")
    print(chat_reply(engine, "How do I open a file?"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
