"""What a quantized build stores, in rules that need numpy alone: which weights a 4-bit build's
mix keeps at 8 bits, and the dtype imported scales are stored in. The quantization passes
(`kvforge.passes.quantize`, `.quantize_embedding`) apply them; `kvforge.toolchain.footprint`
counts the bytes by them without loading onnx (`kvforge inspect`)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable

import numpy as np

# Mixes of a 4-bit build (`WeightQuantization.mix`): which weights stay at 8 bits, by name and
# layer (`mixed_to_8_bits`). In the layers llama.cpp's Q4_K_M gives more bits (`more_bits`):
# `attention` (the default) the attention's input projections, which cost 4 bits the most on the
# 125M reference at the fewest bytes; `q4_k_m` also the down projection and the LM head, Q4_K_M's
# own choice (with q and k, which the value projection is packed with), larger than Q4_K_M's file
# at 8 bits; `none` every weight at 4 bits. docs/performance.md has the figures.
MIXES = ("attention", "q4_k_m", "none")
DEFAULT_MIX = "attention"  # a 4-bit build's without --mix
# Graph weight names (packed projections are named after the pack) of the attention's input
# projections (the value projection is packed with the query and key: its MatMul is theirs) and
# of the feed-forward down projection, as the families name them
_ATTENTION_INPUT = ("*q_proj*", "*k_proj*", "*v_proj*", "*qkv_proj*", "*query_key_value*", "*c_attn*")
_FEED_FORWARD_DOWN = ("*down_proj*", "*dense_4h_to_h*", "*fc2*", "*mlp.c_proj*")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits` (src/llama-quant.cpp): the first and the last eighth of the
    layers and every third layer between them, where Q4_K_M keeps the value and down
    projections at 6 bits."""
    eighth = layers // 8
    return layer < eighth or layer >= 7 * layers // 8 or (layer - eighth) % 3 == 2


def layer_index(name: str) -> int | None:
    """The decoder layer a weight's name places it in (`model.layers.3.mlp...`: 3), or None."""
    found = _LAYER_INDEX.search(name)
    return int(found.group(1)) if found else None


def layer_count(names: Iterable[str]) -> int:
    """The layers that weights of these names span (the highest index, plus one)."""
    return 1 + max((i for i in map(layer_index, names) if i is not None), default=-1)


def mixed_to_8_bits(mix: str, name: str, layers: int) -> bool:
    """Whether `mix` keeps the weight `name` of a model of `layers` layers at 8 bits (the LM head
    aside: `q4_k_m` keeps it at 8 bits too, `mixed_head`)."""
    layer = layer_index(name)
    if mix == "none" or layer is None or not more_bits(layer, layers):
        return False
    patterns = _ATTENTION_INPUT + (_FEED_FORWARD_DOWN if mix == "q4_k_m" else ())
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def mixed_head(mix: str) -> bool:
    """Whether `mix` keeps the LM head at 8 bits."""
    return mix == "q4_k_m"


def stored_scales(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Imported scales (or min terms) as the artifact stores them: float16 where the graph
    computes in float32 and every value is a float16 one (a GGUF file's own fp16 scales: half
    the bytes, the same floats), else in the graph's `dtype`."""
    if np.dtype(dtype) == np.float32:
        half = values.astype(np.float16)
        if np.array_equal(half.astype(np.float32), values):
            return half
    return values.astype(dtype)
