"""GGUF's quantized tensors as pre-quantized records (`kvforge.passes.quantize.QuantizedWeight`).

A GGUF matrix of ggml dims (K, N) is the [N, K] weight of a Linear, quantized in blocks along
K, as MatMulNBits' blocks run. Where a MatMulNBits form holds a tensor type as it is, its codes
and scales are imported unchanged (`exact`):

- Q4_0: weight = d * (q - 8), q 4-bit, blocks of 32: 4-bit codes, symmetric (the kernel's
  default zero point is 8).
- Q8_0: d * q, q int8, blocks of 32; Q5_0: d * (q - 16), q 5-bit: 8-bit codes, symmetric.
- Q6_K: (d * scale) * (q - 32), q 6-bit, an int8 scale per 16 values: 8-bit codes in blocks
  of 16, each block's scale d * scale (computed as the gguf package computes it, so the product
  is the same float).

The free-minimum types have a float minimum per block of 32 that no integer zero point holds:
Q4_1 and Q5_1, weight = d * q + m; Q4_K and Q5_K, weight = (d * sc) * q - dmin * m per
32-value sub-block (d * sc and dmin * m computed as the gguf package computes them, its
`Q4_K.get_scale_min` reading the 6-bit fields). Their codes are imported as they are, centred
as symmetric codes (q - 8 for 4-bit codes, q - 16 for 5-bit ones, these at 8 bits), with the
block's scale and a `mins` term per block (m plus what the centring took away), which the
import pass adds through the block sums of the input: exact, a symmetric MatMulNBits and a
float MatMul 1/32 its size (docs/pipeline.md).

The types left (Q2_K, Q3_K, the i-quants...) have no such form here: `form` chooses what they
become: `int4`, round to nearest 4-bit with an integer zero point in blocks of 32 (its loss
the rounding's), or `int8`, the same at 8 bits (within half an 8-bit step, larger and
slower). `float` keeps them dequantized, for the build's `--weights` recipe to decide.

A record that is not exact changes what the model computes: it belongs in a build judged by
the distribution gate (`--weights`), while the exact ones also pass the float gate (the
`exact` records alone, as `kvforge.toolchain.build` imports a Hugging Face checkpoint's).

The codes of Q8_0, Q4_0 and Q4_1 are read from the blocks as they lie (int8 bytes after the
fp16 scale; nibbles, the low ones the block's first 16 values, as the package's dequantization
reads them): a plain copy, where dequantizing a table of millions of values and dividing it
again took seconds. The other types' codes come from the gguf package's own dequantization
(its public `gguf.quants.dequantize`), divided by each block's scale read from the block's
bytes: their bit layouts (5-bit high bits, 6-bit packed scales) are the package's, never a
second copy of them. The tests hold every type's record to the package's values.

The names are left to the caller: `records` takes GGUF tensor names to Hugging Face weight
names, the interface the GGUF front door joins on.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import Q4_K, dequantize

from kvforge.passes.quantize import QuantizedWeight, ScaleFactors, quantize_blockwise
from kvforge.toolchain.prequantized import Imported

FORMS = ("int4", "int8", "float")
DEFAULT_FORM = "int4"  # the types with no exact form: the fast form, as today's int4 builds decode

_T = GGMLQuantizationType
# type -> (bytes per block, offset of its fp16 d, offset of its int8 sub-block scales or -1,
# values per scale, the MatMulNBits bits that hold its codes)
_EXACT: dict[GGMLQuantizationType, tuple[int, int, int, int, int]] = {
    _T.Q4_0: (18, 0, -1, 32, 4),
    _T.Q8_0: (34, 0, -1, 32, 8),
    _T.Q5_0: (22, 0, -1, 32, 8),
    _T.Q6_K: (210, 208, 192, 16, 8),
}
# type -> (bytes per block, the width of its codes, whether it is a k-quant: d, dmin and 6-bit
# sub-block scales and mins; else d and m, fp16, per block of 32)
_FREE_MINIMUM: dict[GGMLQuantizationType, tuple[int, int, bool]] = {
    _T.Q4_1: (20, 4, False),
    _T.Q5_1: (24, 5, False),
    _T.Q4_K: (144, 4, True),
    _T.Q5_K: (176, 5, True),
}
_FLOAT = (_T.F32, _T.F16, _T.BF16)
# type -> (offset of its codes in a block of 32, whether they are 4-bit nibbles, else int8 bytes):
# the layouts read as they lie (`_stored_codes`)
_PLAIN_CODES: dict[GGMLQuantizationType, tuple[int, bool]] = {
    _T.Q8_0: (2, False),
    _T.Q4_0: (2, True),
    _T.Q4_1: (4, True),
}


def decode(
    raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int], form: str = DEFAULT_FORM
) -> Imported | None:
    """The record of one GGUF tensor's blocks (`raw`, its bytes) of an [N, K] weight; None for a
    float tensor (F32, F16, BF16: nothing to import) or a quantized one kept in float (`form`)."""
    if form not in FORMS:
        raise ValueError(f"GGUF import form {form!r}: one of {', '.join(FORMS)}")
    if qtype in _FLOAT:
        return None
    n, k = shape
    if qtype in _EXACT:
        return Imported(_exact(raw, qtype, shape), True)
    if qtype in _FREE_MINIMUM:
        return Imported(_with_mins(raw, qtype, shape), True)
    if form == "float":
        return None
    values = _values(raw, qtype, shape)
    bits = 4 if form == "int4" else 8
    q = quantize_blockwise(values, bits, 32, symmetric=False)
    return Imported(
        q, False, f"{qtype.name} has no exact MatMulNBits form here: rounded to {bits}-bit codes with zero points"
    )


def _values(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray:
    """The [N, K] float32 weight the package dequantizes `raw` to."""
    return dequantize(raw, qtype).reshape(shape).astype(np.float32)


def _stored_codes(blocks: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> np.ndarray | None:
    """The [N, K] codes as the blocks of 32 store them (int8 bytes; 4-bit ones 0..15), for the
    types whose layout is read as it lies (`_PLAIN_CODES`); None for the others."""
    found = _PLAIN_CODES.get(qtype)
    if found is None:
        return None
    at, nibbles = found
    data = blocks[:, at:]
    codes = np.concatenate([data & 0x0F, data >> 4], axis=1).astype(np.int8) if nibbles else data.view(np.int8)
    return codes.reshape(shape)


def _exact(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    block_bytes, d_at, scales_at, per_scale, bits = _EXACT[qtype]
    n, k = shape
    blocks = raw.reshape(-1).view(np.uint8).reshape(-1, block_bytes)
    d = blocks[:, d_at : d_at + 2].copy().view(np.float16)
    scales, factors = d.astype(np.float32), None
    if scales_at >= 0:  # d * each sub-block's scale, as the package multiplies them
        sub = 256 // per_scale  # sub-blocks of a 256-value super-block
        multipliers = blocks[:, scales_at : scales_at + sub].copy().view(np.int8)
        scales = scales * multipliers.astype(np.float32)
        factors = ScaleFactors(d.reshape(n, -1), multipliers.reshape(n, -1, sub))
    scales = scales.reshape(n, k // per_scale)
    stored = _stored_codes(blocks, qtype, shape)
    if stored is not None:  # Q4_0's codes are centred on 8 (the kernel's default zero point)
        codes = stored - np.int8(8) if bits == 4 else stored
        return QuantizedWeight(codes, scales, None, bits, per_scale)
    step = np.repeat(scales, per_scale, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step != 0, np.rint(_values(raw, qtype, shape) / step), 0).astype(np.int8)
    return QuantizedWeight(codes, scales, None, bits, per_scale, factors=factors)


def _with_mins(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """Codes q centred to symmetric ones, the scale s and the term m + offset * s of each block
    of 32, where the package's weight is s * q + m."""
    block_bytes, width, k_quant = _FREE_MINIMUM[qtype]
    n, k = shape
    blocks = raw.reshape(-1).view(np.uint8).reshape(-1, block_bytes)
    d16, second16 = blocks[:, 0:2].copy().view(np.float16), blocks[:, 2:4].copy().view(np.float16)
    d, second = d16.astype(np.float32), second16.astype(np.float32)  # second: m, or dmin for a k-quant
    offset = 2 ** (width - 1)
    factors = None
    if k_quant:  # 8 sub-blocks of 32 per 256-value block, as the package's Q4_K / Q5_K dequantize
        sc, mn = Q4_K.get_scale_min(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE].copy())
        scales = d * sc.astype(np.float32)
        low = -(second * mn.astype(np.float32))
        sub = sc.shape[-1]
        factors = ScaleFactors(
            d16.reshape(n, -1), sc.reshape(n, -1, sub), second16.reshape(n, -1), mn.reshape(n, -1, sub), offset
        )
    else:
        scales, low = d, second
    scales, low = scales.reshape(n, k // 32), low.reshape(n, k // 32)
    stored = _stored_codes(blocks, qtype, shape)
    if stored is not None:
        codes = stored - np.int8(offset)
    else:
        step = np.repeat(scales, 32, axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            shifted = _values(raw, qtype, shape) - np.repeat(low, 32, axis=1)
            q = np.where(step != 0, np.rint(shifted / step), 0)
        codes = (np.clip(q, 0, 2**width - 1) - offset).astype(np.int8)
    bits = 4 if width == 4 else 8
    return QuantizedWeight(codes, scales, None, bits, 32, mins=low + offset * scales, factors=factors)


def records(reader: GGUFReader, names: Mapping[str, str], form: str = DEFAULT_FORM) -> dict[str, Imported]:
    """The quantized 2-D tensors of a GGUF file by Hugging Face weight name: `names` maps a GGUF
    tensor name to the weight it is (a tensor it does not name is not imported)."""
    found: dict[str, Imported] = {}
    for tensor in reader.tensors:
        if tensor.name not in names or len(tensor.shape) != 2:
            continue
        k, n = (int(d) for d in tensor.shape)  # ggml dims: the contiguous one first
        imported = decode(np.asarray(tensor.data), GGMLQuantizationType(tensor.tensor_type), (n, k), form)
        if imported is not None:
            found[names[tensor.name]] = imported
    return found
