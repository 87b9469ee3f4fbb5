"""What a quantized build stores, in rules that need numpy alone: which weights a 4-bit build's
mix keeps at 8 bits and the blocks they are stored in (`wide_block`), the dtype scales are
stored in (imported ones: `stored_scales`; those a float32 build chooses: `half_scales_fit`),
and which imported records int8 activations read in larger blocks (`regroup_block`). The quantization passes
(`kvforge.passes.quantize`, `.quantize_embedding`) apply them; `kvforge.toolchain.footprint`
counts the bytes by them without loading onnx (`kvforge inspect`)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvforge.passes.quantize import QuantizedWeight

# Mixes of a 4-bit build (`WeightQuantization.mix`): which weights stay at 8 bits, by name and
# layer (`mixed_to_8_bits`). `all_attention` (the default): the attention's input projections
# (q/k/v) of every layer and the feed-forward down projection of the layers llama.cpp's Q4_K_M
# gives more bits (`more_bits`), and an LM head tied to the token table where the lookup reads
# its codes (`mixed_head`): held-out mean KL against fp32 0.0122 on the 125M reference
# (Q4_K_M 0.0128) with a 4-bit table in blocks of 16 (`table_block`), within 1.05× Q4_K_M's
# bytes, and the lowest of these mixes on the example model and SmolLM2-135M too; `attention_down`
# (the default before): q/k/v of those layers and the down projection of every layer;
# `attention`: q/k/v of those layers; `q4_k_m` Q4_K_M's own choice: in its layers q/k/v (the
# value projection is packed with them) and the down projection, and the LM head, larger than
# Q4_K_M's file at 8 bits; `none` every weight at 4 bits. docs/performance.md has the figures.
MIXES = ("all_attention", "attention_down", "attention", "q4_k_m", "none")
DEFAULT_MIX = "all_attention"  # a 4-bit build's without --mix
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
    if mix == "none" or layer is None:
        return False
    if mix == "all_attention" and _matches(name, _ATTENTION_INPUT):
        return True
    if mix == "attention_down" and _matches(name, _FEED_FORWARD_DOWN):
        return True
    if not more_bits(layer, layers):
        return False
    if mix == "all_attention":
        return _matches(name, _FEED_FORWARD_DOWN)
    return _matches(name, _ATTENTION_INPUT + (_FEED_FORWARD_DOWN if mix == "q4_k_m" else ()))


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


# The block an int4 recipe's 8-bit weights (its mix's, `--int8`'s) are stored in where
# MatMulNBits reads them (`wide_block`). An 8-bit code errs by at most 1/254 of its block's
# largest weight, where a 4-bit one errs by 1/14 of its block's, so the int4 weights' error is
# the recipe's; the kernel keeps a float32 scale and a float32 block sum per block, so blocks
# of 128 read 8.5 bits a weight where blocks of 32 read 10, and its int8 GEMM takes fewer
# blocks faster. On the 125M reference the default recipe's decode step took 11% less and a 64-token
# prefill 6% less, held-out mean KL 0.01951 -> 0.01954 (docs/performance.md).
WIDE_BLOCK = 128


def wide_block(k: int, block_size: int) -> int:
    """The block of an int4 recipe's 8-bit weight of `k` inputs read by MatMulNBits:
    `WIDE_BLOCK` where `k` is whole blocks of it and the recipe's `block_size` is smaller, else
    `block_size`."""
    return WIDE_BLOCK if block_size < WIDE_BLOCK and k % WIDE_BLOCK == 0 else block_size


# The block a 4-bit token-embedding table is looked up in by `GatherBlockQuantized`
# (`table_block`). A lookup reads one row a token, so its block costs bytes, never time, and
# the table's rounding reaches every position's residual stream: on the 125M reference blocks
# of 16 instead of 32 took held-out mean KL from 0.0131 to 0.0122 (the default mix) for 0.625
# bits a table weight (docs/performance.md). The kernel takes no block below 16.
TABLE_BLOCK = 16


def table_block(form: str | None, bits: int, block_size: int, free_min: bool = False) -> int:
    """The block a table of a `bits`-bit recipe of `block_size` is looked up in by a target's
    lookup `form` (`Target.embedding_form`): `TABLE_BLOCK` where `GatherBlockQuantized` reads 4
    bits (a `--free-min` table keeps `block_size`, its minimums looked up per block beside it),
    else `block_size`."""
    if form == "gather_block_quantized" and bits == 4 and not free_min:
        return min(TABLE_BLOCK, block_size)
    return block_size


def mixed_head(mix: str, tied_lookup: bool = False) -> bool:
    """Whether `mix` keeps the LM head at 8 bits: `q4_k_m` always; the default mix where the head
    is tied to the token table and the lookup reads the head's codes (`tied_lookup`:
    GatherBlockQuantized), so that the two are one 8-bit matrix, as Q4_K_M stores a tied table
    (Q6_K, or Q8_0 where rows are not whole super-blocks), in fewer bytes than a 4-bit table and
    a 4-bit head of their own: on SmolLM2-135M's dequantized weights held-out mean KL 0.115 ->
    0.066 at 0.98x its Q4_K_M file's bytes (docs/performance.md)."""
    return mix == "q4_k_m" or (tied_lookup and mix == DEFAULT_MIX)


def shared_head(bits: int, mix: str, tied_lookup: bool) -> bool:
    """Whether an LM head tied to the token table and the table are stored as one matrix, the
    head's symmetric 8-bit `MatMulNBits` codes, which the lookup reads (`tied_lookup`:
    GatherBlockQuantized): in an 8-bit build, and in a 4-bit build whose mix keeps such a head at
    8 bits (`mixed_head`). On Gemma 3 270M (a tied table of 262,144 rows) an int8 build's weights
    went from 464.0 to 285.7 MB, its codes and held-out mean KL unchanged, its private memory too;
    the file's pages the head's prepacking read stay mapped beside the prepacked copy, since the
    lookup reads them (docs/performance.md)."""
    return tied_lookup and (bits == 8 or mixed_head(mix, tied_lookup=True))


def stored_scales(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Imported scales (or min terms) as the artifact stores them: float16 where the graph
    computes in float32 and every value is a float16 one (a GGUF file's own fp16 scales: half
    the bytes, the same floats), else in the graph's `dtype`."""
    if np.dtype(dtype) == np.float32:
        half = values.astype(np.float16)
        if np.array_equal(half.astype(np.float32), values):
            return half
    return values.astype(dtype)


# The least scale a block's float16 scale may be (2^-16: float16's subnormals below 2^-14 still
# hold 8 significant bits there), and the largest magnitude a weight may have for its block's
# scale to stay finite in float16 (half its largest value)
HALF_SCALE_LEAST = 2.0**-16
HALF_WEIGHT_MOST = float(np.finfo(np.float16).max) / 2
# A weight of at most this many scales keeps them in float32: the build's constant folding
# (`kvforge.passes.pipeline.FOLD_LIMIT_ELEMENTS`) would fold their Cast into float32 anyway
HALF_SCALES_FOLDED = 1024


def half_scales_counted(count: int) -> bool:
    """Whether a weight of `count` block scales stores them as float16 (where they fit)."""
    return count > HALF_SCALES_FOLDED


def half_scales_fit(weight: np.ndarray, block_size: int, bits: int) -> bool:
    """Whether every block's scale of the [N, K] weight (blocks of `block_size` along K), whatever
    scale the searches choose at `bits`, is a finite float16 of 8 significant bits at least: each
    block that is not all zeros spans (its largest magnitude, or max - min where that is less)
    at least 2^(bits + 1) * HALF_SCALE_LEAST, and no weight exceeds HALF_WEIGHT_MOST. A float32
    build stores such a weight's scales as float16 (half their bytes), chosen as float16 values;
    a weight that does not fit, or of too few scales (`half_scales_counted`), keeps float32 scales."""
    n, k = weight.shape
    pad = -k % block_size
    if not half_scales_counted(n * -(-k // block_size)):
        return False
    least = 2.0 ** (bits + 1) * HALF_SCALE_LEAST
    for start in range(0, n, 1024):  # float32 temporaries a chunk of rows at a time
        rows = weight[start : start + 1024].astype(np.float32)
        blocks = np.pad(rows, ((0, 0), (0, pad))).reshape(rows.shape[0], -1, block_size)
        high, low = blocks.max(axis=-1), blocks.min(axis=-1)
        largest = np.maximum(high, -low)
        if not np.isfinite(largest).all() or largest.max(initial=0.0) > HALF_WEIGHT_MOST:
            return False
        extent = np.minimum(largest, high - low)
        extent = np.where(high - low > 0, extent, largest)  # a block of one value: its magnitude
        if ((extent > 0) & (extent < least)).any():
            return False
    return True


# The blocks MatMulNBits' int8-activation kernel (accuracy level 4) reads an imported record's
# 8-bit codes in (`regroup_block`). It keeps a float32 scale and a float32 block sum per block:
# blocks of 16 cost 12 bits per weight, 32 10, 128 8.5. Blocks of 16 (GGUF's Q6_K) become blocks
# of 32 everywhere; the LM head's (a table tied to it too) become blocks of 128, where rounding
# moves only the logits and the lookup's rows, not weights inside the layers: on Gemma 3 270M's
# Q4_K_M file the head at 128 decoded 1.25x as fast at mean KL 0.0147 against the float import
# (0.0109 at 32; llama.cpp 0.0210), where every layer's 8-bit matrices at 128 measured 0.0425
# (docs/performance.md)
INT8_ACTIVATION_BLOCK = 32
HEAD_INT8_ACTIVATION_BLOCK = 128


def regroup_block(q: QuantizedWeight, head: bool = False) -> int | None:
    """The block `regrouped` rounds `q` again in, or None where it keeps its own: 8-bit
    symmetric codes with no other terms, in blocks smaller than the target that divide it, K
    whole blocks of the target (`head`: the LM head's target, else the layers')."""
    if q.bits != 8 or q.zero_points is not None or q.mins is not None or q.input_order is not None:
        return None
    k = q.codes.shape[1]
    targets = (HEAD_INT8_ACTIVATION_BLOCK, INT8_ACTIVATION_BLOCK) if head else (INT8_ACTIVATION_BLOCK,)
    for block in targets:
        if q.block_size < block and block % q.block_size == 0 and k % block == 0:
            return block
    return None
