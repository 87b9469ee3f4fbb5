"""onnxruntime-genai's own greedy loop, the reference the genai tests compare kvforge with."""

from __future__ import annotations

from typing import Any


def genai_greedy(og: Any, model: Any, ids: list[int], new_tokens: int) -> list[int]:
    """`new_tokens` greedy ids after `ids` from onnxruntime-genai's Generator (module `og`)."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    tokens: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens
