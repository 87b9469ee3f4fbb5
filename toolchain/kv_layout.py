"""The KV cache's layout and sliding windows read from config.json alone, without torch or
transformers, for the families whose cache is what their config says.

`kvforge.toolchain.export.cache_layout` and `layer_windows` read both off transformers' own
modeling code (a token through the model on the meta device; the cache's layer types), which is
exact for every family but loads torch and transformers: seconds before `kvforge inspect` can
answer. For the families below, every layer caches keys and values of [batch, num_kv_heads,
positions, head_dim] (the sizes `DecoderSpec.from_config` reads) and keeps no state of its own, so
the config gives the same answer at once. Every other family (multi-query and latent attention,
state layers, a layout that changed between transformers releases), and a config whose windows
only the config class's defaults would decide, goes through the modeling code.
tests/toolchain/test_architectures.py holds both readings equal on every family listed here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvforge.toolchain.spec import DecoderSpec

# Families whose config class bounds no layer by a window unless config.json says so.
PLAIN_FAMILIES = frozenset(
    {
        "bloom",
        "cohere",
        "gemma",
        "gpt2",
        "gpt_neox",
        "granite",
        "granitemoe",
        "llama",
        "mixtral",
        "olmo2",
        "opt",
        "phi",
        "phi3",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "stablelm",
        "starcoder2",
    }
)
# Families whose config class gives sliding layers by default: read here only where config.json
# spells out `layer_types` and `sliding_window` itself.
SLIDING_FAMILIES = frozenset({"gemma2", "gemma3_text", "gpt_oss"})

_KINDS = ("full_attention", "sliding_attention")
CacheLayout = tuple[DecoderSpec, tuple[int | None, ...] | None]


def from_config(fields: Mapping[str, Any], spec: DecoderSpec) -> CacheLayout | None:
    """`spec` with its cache's layout, and each layer's sliding window (None where no layer is
    bounded), as `export.cache_layout` and `export.layer_windows` would give them; None where
    only the modeling code can tell."""
    if spec.model_type not in PLAIN_FAMILIES | SLIDING_FAMILIES or spec.layers is not None:
        return None
    kinds = fields.get("layer_types")
    window = fields.get("sliding_window")
    if kinds is None:
        if spec.model_type in SLIDING_FAMILIES or window is not None or fields.get("attention_chunk_size") is not None:
            return None
        kinds = ["full_attention"] * spec.num_layers
    if not isinstance(kinds, list) or len(kinds) != spec.num_layers or not set(kinds) <= set(_KINDS):
        return None
    if spec.model_type in SLIDING_FAMILIES and "sliding_window" not in fields:
        return None
    bounded = isinstance(window, int) and 1 < window < spec.max_positions
    windows = tuple(window if bounded and kind == "sliding_attention" else None for kind in kinds)
    # as `export.layer_windows`: one window for every sliding layer, or none bounded
    sizes = {w for w in windows if w is not None}
    layout = spec.with_cache(num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, value_head_dim=spec.head_dim)
    return layout, (windows if len(sizes) == 1 else None)
