"""Weight-only quantization: MatMul weights to block-wise int8 / int4, round to nearest.

One quantizer, two representations of its result:

- `matmul_nbits` (onnxruntime targets): com.microsoft `MatMulNBits(A, B, scales[, zero_points])`,
  B packed `[N, ⌈K / block⌉, block * bits / 8]` uint8 (low nibble first), scales `[N, ⌈K / block⌉]`,
  zero points packed like B, `[N, ⌈⌈K / block⌉ * bits / 8⌉]` (absent when symmetric: the kernel's
  default is the middle code). Scales and zero points are 2-D as the contrib spec has them since
  onnxruntime PR #24828 (older releases read the same bytes, not checking their shape): the layout
  `GatherBlockQuantized` reads too, so a tied embedding table can share them
  (`passes/quantize_embedding.py`).
- `dequantize_linear` (portable targets, standard opset 21+): `DequantizeLinear(Wq, scale[, zero_point],
  axis=0, block_size)` feeding the MatMul's B, with Wq `[K, N]` int4 / int8 (uint4 / uint8 with a zero
  point when asymmetric) and scale `[⌈K / block⌉, N]`. onnxruntime fuses this back into MatMulNBits.
  When K is not a multiple of the block size, the last block is shorter (both ops allow it).
- `dequantize_linear_channel`: the same with one block per output channel (a block of all
  K inputs): `DequantizeLinear(Wq, scale[N], axis=1)`, the per-channel form TensorRT takes
  for int8 weights.

Blocks run along K (the input features), as both ops define them. Symmetric: codes in
[-2^(bits-1), 2^(bits-1) - 1] (every code, the most negative one for a block whose largest
magnitude is negative) against a positive scale per block and no zero point, which TensorRT's
block-wise DequantizeLinear requires. (onnxruntime's own quantizer maps the largest magnitude to
-8 with a signed scale, which TensorRT rejects.) At 4 bits the scale is searched: of a few scales
from the one that clips nothing down to 3/4 of it (`SCALE_SEARCH`), each block takes the one
with the least squared error weighted by each weight's square, which clips a block's outliers a
little to give the rest finer steps (docs/pipeline.md gives what it does to KL against fp32).
Asymmetric: the block's
[min, max], widened to contain 0 so that 0 is exact, over 0 .. 2^bits - 1 with a zero point.
Free minimum (`free_min`, 4 bits): codes 0 .. 15 times a float step plus a float minimum per
block (`quantize_free_min`), stored as symmetric codes with the minimum added by `MinTerms`.

Only MatMuls whose B is a constant 2-D float initializer (read directly `[K, N]` or through
`Transpose` as exported, `[N, K]`) are quantized; the others stay as they are and are
counted as skipped, with the reason, in `skipped`.
"""

from __future__ import annotations

import fnmatch
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import astuple, dataclass, replace

import ml_dtypes
import numpy as np
import onnx_ir as ir
from onnx_ir.passes import InPlacePass, PassResult

from kvforge.passes.storage import (
    DEFAULT_MIX,
    MIXES,
    half_scales_fit,
    layer_count,
    mixed_head,
    mixed_to_8_bits,
    regroup_block,
    shared_head,
    stored_scales,
    wide_block,
)

BITS = (4, 8)
BLOCK_SIZES = (32, 64, 128)
# Block sizes a MatMulNBits weight may be written in when its form is chosen per weight
# (`kernel_forms`, `kvforge build --tune`); `--block-size` takes BLOCK_SIZES
KERNEL_BLOCK_SIZES = (32, 64, 128, 256)
ACCURACY_LEVELS = (0, 4)  # MatMulNBits' float path, and int8 activations
FORMS = ("matmul_nbits", "dequantize_linear", "dequantize_linear_channel")
LM_HEAD = "lm_head"  # in `keep`: the projection that produces the logits, whatever its weight is named
_MS_DOMAIN = "com.microsoft"
_Tensor = ir.TensorProtocol
FLOAT_TERM = "kvforge.float_term"  # Value.meta key of the initializers a later quantizer must leave in float
# Value.meta keys of an imported weight's codes (MatMulNBits' B): the record they hold, and the
# checkpoint's record it was made from (itself, or the one `regrouped` rounded again), which a
# lookup of the same record reads the codes for (a tied table: `kvforge.passes.quantize_embedding`)
IMPORTED_RECORD = "kvforge.imported_record"
IMPORTED_SOURCE = "kvforge.imported_source"
# On a tied LM head's 8-bit codes (`QuantizeWeights(tied_lookup=True)`): (the token table's
# initializer name, the QuantizedWeight the codes hold), for the lookup to read them
TIED_TABLE = "kvforge.tied_table"


@dataclass(frozen=True, order=True)
class KernelForm:
    """How one MatMulNBits weight is written: its block size along K and the kernel's
    `accuracy_level` (0: float activations; 4: activations quantized to int8 per block)."""

    block_size: int
    accuracy_level: int

    def __post_init__(self) -> None:
        if self.block_size not in KERNEL_BLOCK_SIZES or self.accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(
                f"unsupported MatMulNBits form: block_size={self.block_size} (one of "
                f"{', '.join(map(str, KERNEL_BLOCK_SIZES))}), accuracy_level={self.accuracy_level} "
                f"(one of {', '.join(map(str, ACCURACY_LEVELS))})"
            )

    def to_dict(self) -> dict[str, int]:
        return {"block_size": self.block_size, "accuracy_level": self.accuracy_level}


# (N, K) of a weight (out, in features) -> the form its MatMulNBits is written in
FormChooser = Callable[[int, int], KernelForm]


@dataclass(frozen=True)
class ScaleFactors:
    """A record's scales as a k-quant stores them: a float16 `d` per super-block times a small
    integer per block (`scales == d * multipliers`, float32 products), and, where the record has
    min terms, `mins == offset * scales - dmin * min_multipliers`. The graph multiplies them out
    from these (`factored_scales`: Casts and Muls of constants, which onnxruntime folds when it
    loads the model), the same floats in a quarter of float32 scales' bytes."""

    d: np.ndarray  # [N, S] float16, S super-blocks per row
    multipliers: np.ndarray  # [N, S, blocks per super-block], int8 or uint8
    dmin: np.ndarray | None = None  # [N, S] float16
    min_multipliers: np.ndarray | None = None  # [N, S, blocks per super-block] uint8
    offset: int = 0

    def rows(self, order: np.ndarray) -> ScaleFactors:
        """The factors of the weight's rows taken in `order`."""
        dmin = None if self.dmin is None else self.dmin[order]
        mins = None if self.min_multipliers is None else self.min_multipliers[order]
        return replace(self, d=self.d[order], multipliers=self.multipliers[order], dmin=dmin, min_multipliers=mins)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight (out, in features) in blocks of `block_size` along K."""

    codes: np.ndarray  # [N, K]: int8 signed codes (symmetric) or uint8 0 .. 2^bits - 1 (asymmetric)
    scales: np.ndarray  # [N, ⌈K / block⌉], the weight's float dtype or float16 (`half_scales_fit`)
    zero_points: np.ndarray | None  # [N, ⌈K / block⌉] uint8 in 0 .. 2^bits - 1; None when symmetric
    bits: int
    block_size: int
    # The input features in the order the codes store them (column j of `codes` is input
    # feature input_order[j]: a GPTQ act-order checkpoint's groups); None: their own order
    input_order: np.ndarray | None = None
    # [N, ⌈K / block⌉] float32: a term added to every weight of its block (a GGUF free-minimum
    # type's min, with what the codes' offset takes away), None: none. The graph computes it as
    # ReduceSum of each block of inputs times these (`ImportQuantizedWeights`)
    mins: np.ndarray | None = None
    # `scales` and `mins` as products of smaller factors (a GGUF k-quant's), None: as they are
    factors: ScaleFactors | None = None

    def dequantize(self) -> np.ndarray:
        """The [N, K] float weight the codes stand for, its input features in their own order."""
        n, k = self.codes.shape
        codes = self.padded_codes().reshape(n, -1, self.block_size).astype(np.float32)
        if self.zero_points is not None:
            codes = codes - self.zero_points[..., None]
        stored = codes * self.scales[..., None].astype(np.float32)
        if self.mins is not None:
            stored = stored + self.mins[..., None].astype(np.float32)
        stored = stored.reshape(n, -1)[:, :k]
        if self.input_order is None:
            return stored
        weight = np.empty_like(stored)
        weight[:, self.input_order] = stored
        return weight

    def padded_codes(self) -> np.ndarray:
        """[N, ⌈K / block⌉ * block]: the codes, the last block filled up with the code of 0."""
        n, k = self.codes.shape
        pad = -k % self.block_size
        if not pad:
            return self.codes
        zero = np.zeros((n, 1), self.codes.dtype) if self.zero_points is None else self.zero_points[:, -1:]
        return np.concatenate([self.codes, np.repeat(zero.astype(self.codes.dtype), pad, axis=1)], axis=1)


def quantize_blockwise(
    weight: np.ndarray,
    bits: int,
    block_size: int,
    symmetric: bool,
    rows_per_chunk: int = 1024,
    scale_dtype: np.dtype | None = None,
) -> QuantizedWeight:
    """Round-to-nearest block-wise quantization of a [N, K] weight; a last block shorter than
    `block_size` is quantized as if filled up with zeros. The scales are chosen as values of
    `scale_dtype` (default: the weight's) and stored in it.

    Rows are quantized `rows_per_chunk` at a time, so the float32 temporaries stay small next
    to the weight however large it is (an LM head of 150k rows), the chunks spread over the
    usable CPUs (numpy's arithmetic runs outside the GIL). Each chunk's result depends on its
    rows only, so the codes are the same however many threads ran them."""
    if bits not in BITS or block_size < 2 or weight.ndim != 2:
        raise ValueError(f"cannot quantize a {weight.shape} weight to {bits} bits in blocks of {block_size}")
    n, k = weight.shape
    pad = -k % block_size
    count = (k + pad) // block_size
    stored = weight.dtype if scale_dtype is None else np.dtype(scale_dtype)
    codes = np.empty((n, k), np.int8 if symmetric else np.uint8)
    scales = np.empty((n, count), np.float32)
    zero_points = None if symmetric else np.empty((n, count), np.uint8)

    def quantize_rows(start: int) -> None:
        rows = slice(start, min(start + rows_per_chunk, n))
        chunk_weight = weight[rows].astype(np.float32)
        if pad:
            chunk_weight = np.pad(chunk_weight, ((0, 0), (0, pad)))
        blocks = chunk_weight.reshape(-1, count, block_size)
        if symmetric:
            scale, chunk = _symmetric(blocks, bits, stored)
        else:
            scale, zero, chunk = _asymmetric(blocks, bits, stored)
            zero_points[rows] = zero  # type: ignore[index]
        codes[rows] = chunk.reshape(-1, k + pad)[:, :k]
        scales[rows] = scale

    _run_chunks(quantize_rows, range(0, n, rows_per_chunk))
    return QuantizedWeight(codes, scales.astype(stored), zero_points, bits, block_size)


# Threads that quantize a weight's chunks; 0: one per usable CPU.
QUANTIZE_THREADS = 0

# Steps tried per block by `quantize_free_min`, as the block's max - min over this many codes: a
# block whose values lie on a grid of 2^bits steps uses some of them (a GGUF Q4_1 / Q4_K block
# dequantized), and the candidate of its span finds that grid exactly
FREE_MIN_SPANS = (15, 14, 13, 12, 11, 10, 9, 8)
FREE_MIN_REFITS = 2  # least-squares refits of the best (step, min) to the codes it rounds to


def quantize_free_min(
    weight: np.ndarray, block_size: int, rows_per_chunk: int = 1024, dtype: np.dtype | None = None
) -> QuantizedWeight:
    """4-bit codes 0 .. 15 of a [N, K] weight (K whole blocks) with a float step and minimum per
    block, as GGUF's Q4_1 holds a block: weight = step * code + min. Stored as `QuantizedWeight`
    holds the min term: symmetric codes (code - 8), scales = step, mins = min + 8 * step.

    Each block takes, of the steps (max - min) / span for each span in `FREE_MIN_SPANS` (the
    minimum the block's), the one with the least squared error weighted by each weight's square
    (as the symmetric scale search weighs it); then the step and minimum are refitted
    `FREE_MIN_REFITS` times by least squares against the codes they round to, each refit kept
    where it lowers that error. Weights that are a dequantized 4-bit grid with a free
    minimum come back exactly; others round to a grid that need not contain 0. Steps are stored
    in `dtype` (default: the weight's)."""
    n, k = weight.shape
    stored = weight.dtype if dtype is None else dtype
    if k % block_size:
        raise ValueError(f"a free minimum needs whole blocks: K={k} is not a multiple of {block_size}")
    count = k // block_size
    codes = np.empty((n, k), np.int8)
    steps = np.empty((n, count), np.float32)
    mins = np.empty((n, count), np.float32)

    def quantize_rows(start: int) -> None:
        rows = slice(start, min(start + rows_per_chunk, n))
        blocks = weight[rows].astype(np.float32).reshape(-1, count, block_size)
        low, high = blocks.min(axis=-1), blocks.max(axis=-1)
        importance = np.square(blocks) + np.float32(1e-30)
        best_error = np.full(low.shape, np.inf, np.float32)
        best_step, best_min = np.ones_like(low), low.copy()

        def codes_of(step: np.ndarray, minimum: np.ndarray) -> np.ndarray:
            return np.clip(np.rint((blocks - minimum[..., None]) / step[..., None]), 0, 15)

        def consider(step: np.ndarray, minimum: np.ndarray) -> None:
            nonlocal best_error, best_step, best_min
            q = codes_of(step, minimum)
            error = (np.square(q * step[..., None] + minimum[..., None] - blocks) * importance).sum(axis=-1)
            better = error < best_error
            best_error = np.where(better, error, best_error)
            best_step, best_min = np.where(better, step, best_step), np.where(better, minimum, best_min)

        for span in FREE_MIN_SPANS:
            consider(_stored((high - low) / span, stored), low)
        for _ in range(FREE_MIN_REFITS):
            consider(*_refit(blocks, codes_of(best_step, best_min), importance, best_step, best_min, stored))
        # a block of one value is its minimum at code 0 with any step: one of its own size, so
        # that min + 8 * step, stored in the weight's dtype, keeps the minimum's precision
        flat = high == low
        best_step = np.where(flat, _stored(np.abs(low) / 8, stored), best_step)
        best_min = np.where(flat, low, best_min)
        codes[rows] = (codes_of(best_step, best_min) - 8).reshape(-1, k)
        steps[rows] = best_step
        mins[rows] = best_min + 8 * best_step

    _run_chunks(quantize_rows, range(0, n, rows_per_chunk))
    return QuantizedWeight(codes, steps.astype(stored), None, 4, block_size, mins=mins)


def _refit(
    blocks: np.ndarray, q: np.ndarray, importance: np.ndarray, step: np.ndarray, minimum: np.ndarray, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """(step, min) per block minimizing the weighted squared error of step * q + min against the
    block; a block whose fit is degenerate or gives no positive step keeps its own."""
    sw, sq, sqq = importance.sum(-1), (importance * q).sum(-1), (importance * q * q).sum(-1)
    sx, sqx = (importance * blocks).sum(-1), (importance * q * blocks).sum(-1)
    det = sw * sqq - sq * sq
    usable = det > 0
    safe = np.where(usable, det, 1.0)
    fitted_step = _stored(np.where(usable, (sw * sqx - sq * sx) / safe, step), dtype)
    fitted_min = np.where(usable, (sqq * sx - sq * sqx) / safe, minimum)
    usable &= fitted_step > 0
    return np.where(usable, fitted_step, step), np.where(usable, fitted_min, minimum).astype(np.float32)


def _run_chunks(work: Callable[[int], None], starts: range) -> None:
    """`work(start)` for every start, spread over the usable CPUs (`QUANTIZE_THREADS`)."""
    threads = min(len(starts), QUANTIZE_THREADS or _usable_cpus())
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(work, starts))  # list: a chunk's exception is raised here
    else:
        for start in starts:
            work(start)


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a container's cpuset narrows).

    `kvforge.runners.cpus.usable_cpus` counts the same way; passes import nothing of the runners."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


# Scales tried per block, as fractions of the one that clips nothing: the scale that gives the
# block the least squared error, each weight's error weighted by its square, wins. Clipping a
# block's outliers a little buys finer steps for the rest; the weighting (llama.cpp's choice for
# its quantizers) keeps the large weights, which trained models rely on, close.
SCALE_SEARCH = {4: (1.0, 0.95, 0.9, 0.85, 0.8, 0.75), 8: (1.0,)}


def symmetric_scales(blocks: np.ndarray, bits: int, dtype: np.dtype) -> np.ndarray:
    """The scale per block of `blocks` [..., block] that round-to-nearest takes (SCALE_SEARCH),
    as stored in `dtype`: what a calibrated quantizer starts each block from."""
    return _symmetric(blocks, bits, dtype)[0]


def quantize_with_scales(weight: np.ndarray, scales: np.ndarray, bits: int, block_size: int) -> QuantizedWeight:
    """Symmetric block-wise codes of a [N, K] weight against given scales [N, ⌈K / block⌉] (a
    calibrated weight's: its values are its codes times these scales, so rounding gives them back)."""
    n, k = weight.shape
    pad = -k % block_size
    qmax = 2 ** (bits - 1) - 1
    stored = scales.astype(weight.dtype)
    codes = np.empty((n, k), np.int8)
    for start in range(0, n, 1024):  # float32 temporaries a chunk of rows at a time
        rows = slice(start, min(start + 1024, n))
        chunk = np.pad(weight[rows].astype(np.float32), ((0, 0), (0, pad))).reshape(-1, scales.shape[1], block_size)
        step = stored[rows].astype(np.float32)[..., None]
        codes[rows] = np.clip(np.rint(chunk / step), -qmax - 1, qmax).reshape(-1, k + pad)[:, :k]
    return QuantizedWeight(codes, stored, None, bits, block_size)


def _symmetric(blocks: np.ndarray, bits: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(scale per block, codes in -2^(bits-1) .. 2^(bits-1) - 1) of `blocks` [..., block]: every
    code is used (the most negative one for a block whose largest magnitude is negative), with
    the scale of SCALE_SEARCH that gives the block the least squared error weighted by w²."""
    qmax = 2 ** (bits - 1) - 1
    unclipped = np.maximum(-blocks.min(axis=-1) / (qmax + 1), blocks.max(axis=-1) / qmax)
    first, *others = SCALE_SEARCH[bits]
    best_scale = _stored(unclipped * first, dtype)
    if others:  # the codes are a function of the scale: compare errors, round once at the end
        importance = np.square(blocks)
        work = np.empty_like(blocks)

        def error(scale: np.ndarray) -> np.ndarray:
            np.divide(blocks, scale[..., None], out=work)
            np.clip(np.rint(work, out=work), -qmax - 1, qmax, out=work)
            np.multiply(work, scale[..., None], out=work)
            np.subtract(work, blocks, out=work)
            np.square(work, out=work)
            return np.multiply(work, importance, out=work).sum(axis=-1)

        best_error = error(best_scale)
        for fraction in others:
            scale = _stored(unclipped * fraction, dtype)
            error_now = error(scale)
            better = error_now < best_error
            best_scale = np.where(better, scale, best_scale)
            best_error = np.where(better, error_now, best_error)
    return best_scale, np.clip(np.rint(blocks / best_scale[..., None]), -qmax - 1, qmax)


# Spans tried per block by the asymmetric search, as fractions of the codes' range: the step
# (max - min) / (range * fraction), a fraction below 1 clipping the block's extremes a little
ASYMMETRIC_SPANS = {4: (1.0, 14 / 15, 13 / 15, 12 / 15, 11 / 15, 10 / 15, 9 / 15, 8 / 15), 8: (1.0,)}
ASYMMETRIC_REFITS = {4: 2, 8: 0}  # least-squares refits of the best step to the codes it rounds to


def _asymmetric(blocks: np.ndarray, bits: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale, zero point, codes 0 .. 2^bits - 1) per block of `blocks` [..., block], weight =
    scale * (code - zero point). Of the steps (max - min) / span (ASYMMETRIC_SPANS), the zero point
    the block's minimum rounds to, the one with the least squared error weighted by `_importance`;
    then the step is refitted by least squares to the codes it gives (ASYMMETRIC_REFITS), kept
    where that lowers the error. The zero point is a code, so 0 is always exact. The arithmetic
    runs in place in one scratch block array (a search of ten steps over a weight)."""
    top = 2**bits - 1
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    importance = _importance(blocks)
    best_error = np.full(low.shape, np.inf, np.float32)
    best_scale, best_zero = np.ones_like(low), np.zeros_like(low)
    work = np.empty_like(blocks)

    def centred(scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
        """code - zero point of each weight, in `work`."""
        np.divide(blocks, scale[..., None], out=work)
        np.rint(work, out=work)
        np.maximum(work, -zero[..., None], out=work)
        return np.minimum(work, (top - zero)[..., None], out=work)

    def consider(scale: np.ndarray) -> None:
        nonlocal best_error, best_scale, best_zero
        scale = _stored(scale, dtype)
        zero = np.clip(np.rint(-low / scale), 0, top)
        q = centred(scale, zero)
        np.multiply(q, scale[..., None], out=q)
        np.subtract(q, blocks, out=q)
        # each block's weighted sum (einsum's: over a short last axis numpy's sum is the slow one)
        error = np.einsum("...k,...k->...", np.square(q, out=q), importance)
        better = error < best_error
        best_error = np.where(better, error, best_error)
        best_scale, best_zero = np.where(better, scale, best_scale), np.where(better, zero, best_zero)

    for fraction in ASYMMETRIC_SPANS[bits]:
        consider((high - low) / (top * fraction))
    for _ in range(ASYMMETRIC_REFITS[bits]):
        q = centred(best_scale, best_zero)
        weighted = importance * q
        fitted, norm = np.einsum("...k,...k->...", weighted, blocks), np.einsum("...k,...k->...", weighted, q)
        consider(np.where(norm > 0, fitted / np.where(norm > 0, norm, 1.0), best_scale))
    return best_scale, best_zero, centred(best_scale, best_zero) + best_zero[..., None]


def _importance(blocks: np.ndarray) -> np.ndarray:
    """How much each weight's squared error counts in the asymmetric search: the block's root mean
    square plus the weight's magnitude (llama.cpp's weighting for its k-quants without an
    importance matrix), between plain squared error and the symmetric search's w²."""
    return np.sqrt(np.square(blocks).mean(axis=-1, keepdims=True)) + np.abs(blocks)


def _stored(scale: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The scale as it will be stored (the weight's dtype), so the codes are rounded against
    the very scale that dequantizes them; an all-zero block, for which any scale is exact,
    or one whose scale underflows the dtype, gets 1."""
    rounded = scale.astype(dtype).astype(np.float32)
    return np.where(rounded > 0, rounded, np.float32(1.0))


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Pairs along the last axis into bytes, the first of each pair in the low nibble (odd lengths padded)."""
    values = values.astype(np.uint8) & 0x0F
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    packed: np.ndarray = values[..., 0::2] | (values[..., 1::2] << 4)
    return packed


def matmul_nbits_inputs(q: QuantizedWeight) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(B `[N, blocks, block * bits / 8]`, scales `[N, blocks]`, zero points `[N, ⌈blocks * bits / 8⌉]`)
    as MatMulNBits reads them."""
    codes = q.padded_codes()
    n, k = codes.shape
    blocks = k // q.block_size
    # Stored unsigned: symmetric codes move up by the kernel's default zero point (8 or 128).
    unsigned = codes.astype(np.int16) + (2 ** (q.bits - 1) if q.zero_points is None else 0)
    unsigned = unsigned.astype(np.uint8).reshape(n, blocks, q.block_size)
    b = _pack_nibbles(unsigned) if q.bits == 4 else unsigned
    if q.zero_points is None:
        return b, q.scales, None
    zero_points = q.zero_points.astype(np.uint8)
    return b, q.scales, _pack_nibbles(zero_points) if q.bits == 4 else zero_points


def dequantize_linear_inputs(q: QuantizedWeight) -> tuple[_Tensor, _Tensor, _Tensor | None]:
    """(x, scale, zero_point) of DequantizeLinear over axis 0 of the [K, N] weight MatMul reads."""
    signed = q.zero_points is None
    dtype = {(4, True): ml_dtypes.int4, (4, False): ml_dtypes.uint4, (8, True): np.int8, (8, False): np.uint8}[
        (q.bits, signed)
    ]
    codes = ir.tensor(np.ascontiguousarray(q.codes.T).astype(dtype))
    scales = ir.tensor(np.ascontiguousarray(q.scales.T))
    zero_points = None if signed else ir.tensor(np.ascontiguousarray(q.zero_points.T).astype(dtype))  # type: ignore[union-attr]
    return codes, scales, zero_points


class QuantizeWeights(InPlacePass):
    """Quantize the constant weight of every eligible MatMul; `counts` says what happened to each.

    `keep` holds glob patterns of weight names left at full precision (`lm_head` also names
    the projection that produces the logits, which tied-embedding models read from the
    embedding table).

    `int8` holds glob patterns (and `lm_head`) of weights quantized to 8 bits when `bits` is 4,
    in `int8_form` (a target's representation of 8-bit weights): a mixed recipe that spends
    bits where rounding costs most, as llama.cpp's K-quant mixes do.

    `choose` (MatMulNBits only): picks each weight's block size and accuracy level from its
    (N, K) in place of `block_size` and `accuracy_level` (`kvforge.toolchain.tune`, measured on the
    build machine); `forms` then says what each quantized weight got. Weights at 8 bits in a
    4-bit build keep the default form.
    """

    def __init__(
        self,
        bits: int,
        block_size: int = 32,
        symmetric: bool = True,
        form: str = "matmul_nbits",
        keep: tuple[str, ...] = (),
        accuracy_level: int = 0,
        choose: FormChooser | None = None,
        int8: tuple[str, ...] = (),
        int8_form: str | None = None,
        scales: Mapping[str, np.ndarray] | None = None,
        free_min: bool = False,
        mix: str = "none",
        tied_lookup: bool = False,
    ) -> None:
        super().__init__()
        if bits not in BITS or block_size not in BLOCK_SIZES or form not in FORMS or mix not in MIXES:
            raise ValueError(
                f"unsupported quantization: bits={bits}, block_size={block_size}, form={form!r}, mix={mix!r}"
            )
        mixed = mix != "none"
        if (int8 or mixed) and (bits != 4 or int8_form not in FORMS):
            raise ValueError(f"8-bit weights within a {bits}-bit quantization need bits=4 and an int8_form")
        self.mix = mix
        if free_min and (bits != 4 or not symmetric or form == "dequantize_linear_channel"):
            raise ValueError("a free minimum per block is a 4-bit block-wise form, without zero points")
        self.free_min = free_min
        self.int8 = ",".join(int8)
        # a mix that keeps the LM head at 8 bits does as an `--int8 lm_head` would
        self._int8 = int8 + ((LM_HEAD,) if mixed_head(mix) and LM_HEAD not in int8 else ())
        self._int8_form = int8_form or form
        # the token lookup reads a tied LM head's codes (GatherBlockQuantized): where the head is
        # at 8 bits (an 8-bit build, or a mix that keeps it there), symmetric, one matrix for both
        # (`shared_head`)
        self._tied_lookup = tied_lookup and form == "matmul_nbits" and self._int8_form == "matmul_nbits"
        self._tied_head: str | None = None
        self.bits = bits
        self.block_size = block_size
        self.symmetric = symmetric
        self.form = form
        self.keep = ",".join(keep)
        self.accuracy_level = accuracy_level
        self._keep = keep
        self._choose = choose if form == "matmul_nbits" else None
        self.counts: Counter[str] = Counter()
        self.skipped: dict[str, str] = {}  # weight name -> why it stayed at full precision
        self.wider: list[str] = []  # weight names quantized to 8 bits by `int8`
        # quantized initializer (codes) name -> its form, (N, K), when `choose` picked it
        self.forms: dict[str, tuple[KernelForm, tuple[int, int]]] = {}
        # weight name -> scales [N, ⌈K / block⌉] chosen against activations (`kvforge.toolchain.calibration`),
        # for symmetric 4-bit blocks of `block_size`; `calibrated` names the weights that took them
        self._scales = {} if scales is None or bits != 4 or not symmetric else scales
        self.calibrated: list[str] = []
        # quantized initializer (codes) name -> its min term (`free_min`)
        self._mins: dict[str, ir.Value] = {}
        self._min_terms = MinTerms()

    def call(self, model: ir.Model) -> PassResult:
        self.counts = Counter()
        self.skipped = {}
        self.wider = []
        self.forms = {}
        self.calibrated = []
        self._mins = {}
        self._min_terms = MinTerms()
        graph = model.graph
        shared = shared_head(self.bits, self.mix, self._tied_lookup)
        head = _lm_head(graph) if LM_HEAD in self._keep + self._int8 or shared else None
        kept_head = head if LM_HEAD in self._keep else None
        # 8 bits is a property of the weight, whichever MatMul reads it: the LM head's by name
        found_head = _constant_weight(head) if head is not None and kept_head is None else None
        tied = shared and found_head is not None and _looked_up(found_head[0])
        wide_head = found_head[0].name if found_head is not None and (LM_HEAD in self._int8 or tied) else None
        self._tied_head = wide_head if tied else None
        layers = layer_count(graph.initializers)
        # a weight read by several MatMuls the same way is quantized once; read both directly and
        # through Transpose, it is two different [N, K] matrices
        quantized: dict[tuple[str, bool], tuple[ir.Value, ...]] = {}
        for node, weight, transpose in constant_matmuls(graph):
            name = weight.name or ""
            reason = self._skip_reason(node, weight, kept_head)
            if reason:
                self.skipped[name] = reason
                self.counts["kept" if reason.startswith("kept") else "skipped"] += 1
                continue
            key = (name, transpose is not None)
            wide = (
                name == wide_head
                or any(fnmatch.fnmatchcase(name, pattern) for pattern in self._int8)
                or mixed_to_8_bits(self.mix, name, layers)
            )
            bits, form = (8, self._int8_form) if wide else (self.bits, self.form)
            if key not in quantized:
                quantized[key] = self._quantized_inputs(graph, weight, key[1], bits, form)
                if wide and self.bits == 4 and name not in self.wider:
                    self.wider.append(name)
            rows, cols = weight.const_value.shape.numpy()  # type: ignore[union-attr]
            self._replace(graph, node, quantized[key], (cols, rows) if key[1] else (rows, cols), bits, form)
            self.counts["quantized"] += 1
            for stale in (transpose, weight):
                _remove_if_unused(graph, stale)
        if quantized and "matmul_nbits" in (self.form, self._int8_form):
            model.opset_imports.setdefault(_MS_DOMAIN, 1)
        return PassResult(model, modified=bool(quantized))

    def _skip_reason(self, node: ir.Node, weight: ir.Value, head: ir.Node | None) -> str:
        name = weight.name or ""
        if node is head or any(fnmatch.fnmatchcase(name, pattern) for pattern in self._keep):
            return "kept at full precision (--keep)"
        tensor = weight.const_value
        assert tensor is not None
        if tensor.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16):
            return f"weight dtype {tensor.dtype} is not a float"
        return ""

    def _quantized_inputs(
        self, graph: ir.Graph, weight: ir.Value, transposed: bool, bits: int, form: str
    ) -> tuple[ir.Value, ...]:
        """Initializers of the weight quantized to `bits` in `form`, named after it (a free
        minimum's min term in `_mins`, where K is whole blocks)."""
        array = weight.const_value.numpy()  # type: ignore[union-attr]
        kernel = array if transposed else array.T  # [N, K], in the weight's dtype: widened chunk by chunk
        per_channel = form == "dequantize_linear_channel"
        n, k = kernel.shape
        chosen = self._choose(n, k) if self._choose is not None and bits == self.bits else None
        calibrated = self._calibrated_scales(weight, n, k) if bits == 4 and not per_channel else None
        if calibrated is not None:  # the calibrated codes keep their blocks; a chosen form, its accuracy level
            chosen = None if chosen is None else KernelForm(self.block_size, chosen.accuracy_level)
            self.calibrated.append(weight.name or "")
            self.counts["calibrated"] += 1
        block = k if per_channel else self.block_size if chosen is None else chosen.block_size
        if bits == 8 and self.bits == 4 and form == "matmul_nbits":  # a 4-bit recipe's 8-bit weight
            block = wide_block(k, block)
        # a float32 graph's MatMulNBits reads float16 scales through a Cast that onnxruntime folds
        # at load: half the scale bytes, chosen as float16 values (`half_scales_fit`)
        half = (
            form == "matmul_nbits"
            and kernel.dtype == np.float32
            and calibrated is None
            and half_scales_fit(kernel, block, bits)
        )
        scale_dtype = np.dtype(np.float16) if half else kernel.dtype
        if self.free_min and bits == 4 and k % block == 0:
            # a calibrated weight's values lie on its grid, which the search finds again
            q = quantize_free_min(kernel, block, dtype=scale_dtype)
            self.counts["free_min"] += 1
        elif calibrated is not None:
            q = quantize_with_scales(kernel, calibrated, bits, self.block_size)
        else:
            # a tied head the lookup reads is symmetric: GatherBlockQuantized reads its B and scales
            symmetric = self.symmetric or weight.name == self._tied_head
            q = quantize_blockwise(kernel, bits, block, symmetric, scale_dtype=scale_dtype)
        base = f"{weight.name}.q{bits}"
        if base in graph.initializers:  # the same weight, already quantized as read the other way
            base += ".t"
        if chosen is not None:
            self.forms[base] = (chosen, (n, k))
        if form == "matmul_nbits":
            b, scales, zero_points = matmul_nbits_inputs(q)
            tensors = [ir.tensor(b), ir.tensor(scales), None if zero_points is None else ir.tensor(zero_points)]
        else:
            codes, scale, zero_point = dequantize_linear_inputs(q)
            if per_channel:  # [1, N] -> [N]
                scale = ir.tensor(scale.numpy().reshape(-1))
                zero_point = None if zero_point is None else ir.tensor(zero_point.numpy().reshape(-1))
            tensors = [codes, scale, zero_point]
        if q.mins is not None:
            self._mins[base] = register_mins(graph, base, q.mins, kernel.dtype)
        registered = register_quantized(graph, base, tensors)
        if half:
            registered[1] = read_as(graph, registered[1], ir.DataType.FLOAT)
        if weight.name == self._tied_head and transposed:  # a head at 8 bits: MatMulNBits (`_tied_lookup`)
            registered[0].meta[TIED_TABLE] = (weight.name, q)
        return tuple(registered)

    def _calibrated_scales(self, weight: ir.Value, n: int, k: int) -> np.ndarray | None:
        """The calibrated scales of the [N, K] weight (a packed weight's: its parts', stacked), or
        None where it has none (or they do not fit its shape: it is rounded to nearest)."""
        if not self._scales:
            return None
        name = weight.name or ""
        sources = [name] if name in self._scales else list(getattr(weight.const_value, "sources", ()))
        if not sources or any(source not in self._scales for source in sources):
            return None
        scales = np.concatenate([self._scales[source] for source in sources])
        return scales if scales.shape == (n, -(-k // self.block_size)) else None

    def _replace(
        self, graph: ir.Graph, node: ir.Node, inputs: tuple[ir.Value, ...], kn: tuple[int, int], bits: int, form: str
    ) -> None:
        x = node.inputs[0]
        assert x is not None
        mins = self._mins.get(inputs[0].name or "")
        chosen = self.forms.get(inputs[0].name or "")
        block_size, accuracy_level = (self.block_size, self.accuracy_level) if chosen is None else astuple(chosen[0])
        if form.startswith("dequantize_linear"):
            per_channel = form == "dequantize_linear_channel"
            attributes = {"axis": 1} if per_channel else {"axis": 0, "block_size": self.block_size}
            dq = ir.node("DequantizeLinear", list(inputs), attributes)
            graph.insert_before(node, dq)
            if mins is None:
                node.replace_input_with(1, dq.outputs[0])
                return
            product = ir.node("MatMul", [x, dq.outputs[0]])
        else:
            k, n = kn
            codes = inputs[0].shape  # [N, blocks, block · bits / 8]: the block the codes were made in
            assert codes is not None
            block_size = codes.numpy()[2] * 8 // bits
            attributes = {"K": k, "N": n, "bits": bits, "block_size": block_size}
            if accuracy_level:
                attributes["accuracy_level"] = accuracy_level
            product = ir.node("MatMulNBits", [x, *inputs], attributes, domain=_MS_DOMAIN)
        graph.insert_before(node, product)
        result = product.outputs[0]
        if mins is not None:
            result = self._min_terms.add(graph, node, x, result, mins, kn[0], block_size)
        replace_node(graph, node, result)


def register_initializer(graph: ir.Graph, name: str, data: np.ndarray | _Tensor) -> ir.Value:
    """`data` as the graph's initializer `name`."""
    tensor = ir.tensor(data) if isinstance(data, np.ndarray) else data
    tensor.name = name
    value = ir.Value(
        name=name, shape=ir.Shape(tensor.shape.numpy()), type=ir.TensorType(tensor.dtype), const_value=tensor
    )
    graph.register_initializer(value)
    return value


def register_quantized(graph: ir.Graph, base: str, parts: Sequence[np.ndarray | _Tensor | None]) -> list[ir.Value]:
    """A quantized weight's initializers: codes `{base}`, `{base}.scales`, `{base}.zero_points`
    (an absent part, None, is skipped)."""
    return [
        register_initializer(graph, base + suffix, part)
        for suffix, part in zip(("", ".scales", ".zero_points"), parts)
        if part is not None
    ]


def replace_node(graph: ir.Graph, node: ir.Node, new: ir.Value) -> None:
    """`new` takes the place of `node`'s single output (its name, type, shape and readers);
    `node` goes."""
    old = node.outputs[0]
    new.shape, new.type = old.shape, old.type
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    new.name = old.name
    graph.remove(node, safe=True)


def constant_matmuls(graph: ir.Graph) -> Iterator[tuple[ir.Node, ir.Value, ir.Node | None]]:
    """Each standard MatMul whose B is a constant 2-D float weight (`_constant_weight`): the node,
    the weight, and the Transpose it is read through (None: read directly)."""
    for node in list(graph):
        if node.op_type == "MatMul" and node.domain == "":
            found = _constant_weight(node)
            if found is not None:
                yield node, *found


def _constant_weight(node: ir.Node) -> tuple[ir.Value, ir.Node | None] | None:
    """(the 2-D initializer B reads, the Transpose it is read through or None), for a constant B."""
    b = node.inputs[1] if len(node.inputs) > 1 else None
    if b is None:
        return None
    transpose = None
    producer = b.producer()
    if producer is not None:
        if producer.op_type != "Transpose" or producer.domain != "":
            return None
        perm = producer.attributes.get_ints("perm", None)
        if perm is not None and list(perm) != [1, 0]:
            return None
        transpose, b = producer, producer.inputs[0]
        if b is None:
            return None
    if not b.is_initializer() or b.is_graph_input() or b.const_value is None or len(b.const_value.shape) != 2:
        return None
    if b.meta.get(FLOAT_TERM):  # an imported weight's min term: part of its exact form, never quantized
        return None
    return b, transpose


def _remove_if_unused(graph: ir.Graph, item: ir.Value | ir.Node | None) -> None:
    if isinstance(item, ir.Node):
        if not any(output.uses() for output in item.outputs):
            graph.remove(item, safe=True)
    elif item is not None and not item.uses() and item.name is not None and item.name in graph.initializers:
        del graph.initializers[item.name]


def _looked_up(weight: ir.Value) -> bool:
    """Whether a `Gather` looks rows of `weight` up (a token table tied to the LM head)."""
    return any(user.op_type == "Gather" and user.domain == "" and index == 0 for user, index in weight.uses())


def _lm_head(graph: ir.Graph) -> ir.Node | None:
    """The MatMul that produces the logits: walk back from the `logits` output through the ops
    that follow it (softcapping, casts, reshapes: their first input)."""
    value = next((v for v in graph.outputs if v.name == "logits"), None)
    for _ in range(16):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type == "MatMul" and node.domain == "":
            return node
        value = node.inputs[0] if node.inputs else None
    return None


@dataclass(frozen=True)
class WeightQuantization:
    """What `kvforge build --weights int8|int4` asks for; the target decides the representation."""

    bits: int
    block_size: int = 32
    # False: an integer zero point per block; None (the default): the target's choice, made by
    # `resolved` before any weight is quantized
    symmetric: bool | None = None
    keep: tuple[str, ...] = ()
    # MatMulNBits only: 4 quantizes the activations to int8 per block and multiplies in
    # integers, as onnxruntime-genai builds for the CPU; 0 (unset) takes onnxruntime's float
    # path, measured several times slower (docs/performance.md, "Kernel choices behind the passes").
    accuracy_level: int = 4
    # weights quantized to 8 bits in a 4-bit build (glob patterns; `lm_head` names the LM head)
    int8: tuple[str, ...] = ()
    # 4-bit blocks with a float step and minimum (`quantize_free_min`), the min added by `MinTerms`
    free_min: bool = False
    # which weights of a 4-bit build are kept at 8 bits besides `int8` (MIXES); None: the
    # default, `attention` at 4 bits
    mix: str | None = None

    def __post_init__(self) -> None:
        if self.mix is not None and self.mix not in MIXES:
            raise ValueError(f"unknown mix {self.mix!r}: one of {', '.join(MIXES)}")
        if self.mix not in (None, "none") and self.bits != 4:
            raise ValueError(
                f"--mix {self.mix} picks weights to keep at int8 in an int4 build; this build is int{self.bits}"
            )
        if self.int8 and self.bits != 4:
            raise ValueError(f"--int8 picks weights to keep at 8 bits in an int4 build; this build is int{self.bits}")
        if self.free_min and (self.bits != 4 or self.symmetric is False):
            raise ValueError(
                "--free-min is a 4-bit form with a float minimum per block: it needs --weights int4 and "
                "takes no --asymmetric (an integer zero point)"
            )

    def resolved(self, symmetric_only: bool, calibrated: bool) -> WeightQuantization:
        """The recipe with its zero points decided where it leaves them to the target
        (`symmetric` None): a 4-bit recipe takes an integer zero point per block where the
        target's kernel reads one (not `symmetric_only`) and its weights are neither calibrated
        (the calibration chooses codes without zero points) nor given a float minimum; every
        other recipe is symmetric. On the 125M reference the zero points took held-out mean KL
        from 0.0195 to 0.0150 for 0.125 bits a weight, the decode step unchanged
        (docs/performance.md, "The default int4 mix")."""
        if self.symmetric is not None:
            return self
        zero_points = self.bits == 4 and not (symmetric_only or calibrated or self.free_min)
        return replace(self, symmetric=not zero_points)

    @property
    def without_zero_points(self) -> bool:
        """`symmetric` once `resolved`: nothing is quantized before the target has chosen."""
        if self.symmetric is None:
            raise ValueError(
                "zero points are the target's choice: quantize the recipe WeightQuantization.resolved gives"
            )
        return self.symmetric

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def mixed(self) -> str:
        """The mix this recipe applies (`none` at 8 bits)."""
        if self.mix is not None:
            return self.mix
        return DEFAULT_MIX if self.bits == 4 else "none"

    def to_dict(self) -> dict[str, object]:
        recipe: dict[str, object] = {
            "bits": self.bits,
            "block_size": self.block_size,
            "symmetric": self.symmetric,
            "keep": list(self.keep),
            "accuracy_level": self.accuracy_level,
        }
        if self.int8:  # absent otherwise, so earlier recipes keep their bytes
            recipe["int8"] = list(self.int8)
        if self.free_min:
            recipe["free_min"] = True
        if self.mixed != "none":  # absent for a plain recipe, which keeps its earlier bytes
            recipe["mix"] = self.mixed
        return recipe

    @property
    def default_form(self) -> KernelForm:
        """The MatMulNBits form every weight gets unless its form is chosen (`kvforge build --tune off`)."""
        return KernelForm(self.block_size, self.accuracy_level)

    def make_pass(
        self,
        form: str,
        choose: FormChooser | None = None,
        int8_form: str | None = None,
        scales: Mapping[str, np.ndarray] | None = None,
        tied_lookup: bool = False,
    ) -> QuantizeWeights:
        """The pass for this recipe in `form`; `tied_lookup`: the target's token lookup can read a
        tied LM head's codes (GatherBlockQuantized), which an 8-bit build and the default mix then
        store as one 8-bit matrix (`shared_head`)."""
        return QuantizeWeights(
            self.bits,
            self.block_size,
            self.without_zero_points,
            form,
            self.keep,
            self.accuracy_level,
            choose,
            self.int8,
            int8_form if self.int8 or self.mixed != "none" else None,
            scales,
            self.free_min,
            self.mixed,
            tied_lookup,
        )


# Block sizes MatMulNBits reads: a power of two of at least 16 (the contrib op's spec)
def holds_block(block_size: int) -> bool:
    """Whether MatMulNBits (and block-wise DequantizeLinear) can hold blocks of `block_size` as they are."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


class ImportQuantizedWeights(InPlacePass):
    """Write the MatMuls whose weights a checkpoint ships quantized with the checkpoint's own
    codes, scales and zero points, never quantizing them again but to blocks that int8
    activations read faster (below).

    `imported` maps a weight's name (as the graph names its initializer: the checkpoint's) to
    its record, [N, K] in blocks along K, as `QuantizedWeight` holds any weight. A weight the
    packing passes made of several (`StackedRows` of q/k/v, gate/up) is the parts' records
    stacked along N, when each part is imported with the same bits, block and zero-point kind.
    Codes and zero points reach MatMulNBits (or DequantizeLinear) unchanged, but at accuracy
    level 4 (int8 activations, a build judged by distributions) 8-bit codes are rounded again in
    the blocks that kernel reads faster (`regrouped`: Q6_K's blocks of 16 in blocks of 32, the LM
    head's in blocks of 128; listed as `regrouped` in `imported_forms`); scales (and min terms)
    are stored as float16 where the graph computes in float32 and they are float16 values
    (`stored_scales`: a GGUF file's own), read through a Cast, else cast to the graph's float
    dtype. `imported_forms` says what each weight got, `counts` how many.
    Weights not in `imported` are left for `QuantizeWeights` (or stay float).

    A record with `mins` (a float term per block, which no integer zero point holds) adds it
    through the block sums of the input (`MinTerms`).
    """

    def __init__(
        self, imported: dict[str, QuantizedWeight], form: str = "matmul_nbits", accuracy_level: int = 0
    ) -> None:
        super().__init__()
        if form not in ("matmul_nbits", "dequantize_linear"):
            raise ValueError(f"pre-quantized weights go to matmul_nbits or dequantize_linear, not {form!r}")
        self._imported = imported
        self.form = form
        self.accuracy_level = accuracy_level
        self.counts: Counter[str] = Counter()
        # graph weight name -> its form and the checkpoint weights it holds
        self.imported_forms: dict[str, dict[str, object]] = {}
        self._min_terms = MinTerms()

    def call(self, model: ir.Model) -> PassResult:
        self.counts = Counter()
        self.imported_forms = {}
        self._min_terms = MinTerms()
        graph = model.graph
        done: dict[tuple[str, bool], tuple[tuple[ir.Value, ...], QuantizedWeight, ir.Value | None]] = {}
        head = _lm_head(graph)
        for node, weight, transpose in constant_matmuls(graph):
            name = weight.name or ""
            key = (name, transpose is not None)
            if key not in done:
                record = self._record(weight, transposed=key[1], head=node is head)
                if record is None:
                    continue
                q, sources, moved = record
                if q.mins is not None and q.codes.shape[1] % q.block_size:
                    self.counts["skipped"] += 1  # K not whole blocks: no block sums
                    continue
                tensor = weight.const_value
                assert tensor is not None
                codes_of = q  # the record the codes hold (`IMPORTED_RECORD`), before its scales are cast
                q = replace(q, scales=stored_scales(q.scales, tensor.dtype.numpy()))
                base = f"{name}.q{q.bits}" + (".t" if f"{name}.q{q.bits}" in graph.initializers else "")
                if self.form == "matmul_nbits":
                    parts: list[np.ndarray | _Tensor | None] = list(matmul_nbits_inputs(q))
                else:
                    parts = list(dequantize_linear_inputs(q))
                factored = q.factors is not None and self.form == "matmul_nbits" and tensor.dtype == ir.DataType.FLOAT
                if factored:
                    parts[1] = None  # the scales are multiplied out of their factors
                registered = register_quantized(graph, base, parts)
                registered[0].meta[IMPORTED_RECORD] = codes_of
                registered[0].meta[IMPORTED_SOURCE] = self._imported.get(name, codes_of)
                mins = None
                if factored:
                    assert q.factors is not None
                    scales, mins = factored_scales(graph, base, q.factors, tensor.dtype)
                    registered.insert(1, scales)
                else:
                    registered[1] = read_as(graph, registered[1], tensor.dtype)
                if q.input_order is not None:  # the activations' features in the codes' order
                    order = q.input_order.astype(np.int64)
                    registered.append(register_initializer(graph, f"{base}.input_order", order))
                if q.mins is not None and mins is None:
                    stored = stored_scales(q.mins, tensor.dtype.numpy())
                    mins = read_as(graph, register_mins(graph, base, stored, stored.dtype), tensor.dtype)
                done[key] = (tuple(registered), q, mins)
                self.imported_forms[name] = {
                    "form": self.form,
                    "bits": q.bits,
                    "block_size": q.block_size,
                    "zero_points": q.zero_points is not None,
                    "from": sources,
                }
                if q.input_order is not None:
                    self.imported_forms[name]["input_order"] = True
                if q.mins is not None:
                    self.imported_forms[name]["mins"] = True
                if moved:
                    self.imported_forms[name]["regrouped"] = moved
            inputs, q, mins = done[key]
            self._replace(graph, node, inputs, q, mins)
            self.counts["imported"] += 1
            for stale in (transpose, weight):
                _remove_if_unused(graph, stale)
        if done and self.form == "matmul_nbits":
            model.opset_imports.setdefault(_MS_DOMAIN, 1)
        return PassResult(model, modified=bool(done))

    def _record(
        self, weight: ir.Value, transposed: bool, head: bool
    ) -> tuple[QuantizedWeight, list[str], list[str]] | None:
        """The [N, K] record of the weight the MatMul reads (`head`: the LM head's), the checkpoint
        weights it is made of, and those of them `regrouped` for accuracy level 4."""
        name = weight.name or ""
        tensor = weight.const_value
        # a packed weight (passes/pack_matmul.py) is its parts, when every one of them is imported alike
        sources = [name] if name in self._imported else list(getattr(tensor, "sources", ()))
        records = [self._imported[source] for source in sources if source in self._imported]
        regrouping = self.accuracy_level == 4 and self.form == "matmul_nbits"  # int8 activations' fast blocks
        moved = [source for source, r in zip(sources, records) if regrouping and regroup_block(r, head)]
        records = [regrouped(r, head) if regrouping else r for r in records]
        q = stack_rows(records) if records and len(records) == len(sources) else None
        if q is None:
            return None
        rows, cols = tensor.shape.numpy()  # type: ignore[union-attr]
        n, k = (rows, cols) if transposed else (cols, rows)
        if q.codes.shape != (n, k):
            raise ValueError(f"{name}: pre-quantized codes are {list(q.codes.shape)}, the graph reads [{n}, {k}]")
        return q, sources, moved

    def _replace(
        self, graph: ir.Graph, node: ir.Node, inputs: tuple[ir.Value, ...], q: QuantizedWeight, mins: ir.Value | None
    ) -> None:
        x = node.inputs[0]
        assert x is not None
        if q.input_order is not None:
            *weights, order = inputs
            inputs = tuple(weights)
            gather = ir.node("Gather", [x, order], {"axis": -1})
            graph.insert_before(node, gather)
            x = gather.outputs[0]
            x.shape = node.inputs[0].shape  # type: ignore[union-attr]
            node.replace_input_with(0, x)
        if self.form == "dequantize_linear":
            dq = ir.node("DequantizeLinear", list(inputs), {"axis": 0, "block_size": q.block_size})
            graph.insert_before(node, dq)
            if mins is None:
                node.replace_input_with(1, dq.outputs[0])
                return
            product = ir.node("MatMul", [x, dq.outputs[0]])
        else:
            n, k = q.codes.shape
            attributes = {"K": k, "N": n, "bits": q.bits, "block_size": q.block_size}
            if self.accuracy_level:
                attributes["accuracy_level"] = self.accuracy_level
            product = ir.node("MatMulNBits", [x, *inputs], attributes, domain=_MS_DOMAIN)
        graph.insert_before(node, product)
        result = product.outputs[0]
        if mins is not None:
            result = self._min_terms.add(graph, node, x, result, mins, q.codes.shape[1], q.block_size)
        replace_node(graph, node, result)


def read_as(graph: ir.Graph, value: ir.Value, dtype: ir.DataType, before: ir.Node | None = None) -> ir.Value:
    """The initializer `value` as `dtype`: itself, or a Cast of it before `before` (default: at the
    top of the graph, before any reader it gets). A Cast of an initializer is constant-folded when onnxruntime loads the
    model (any optimization level but ORT_DISABLE_ALL), so the kernels that pack their scales
    at load (MatMulNBits) see a constant, and the file keeps the narrow bytes."""
    if value.dtype == dtype:
        return value
    cast = ir.node("Cast", [value], {"to": dtype})
    cast.outputs[0].type = ir.TensorType(dtype)
    cast.outputs[0].shape = value.shape
    graph.insert_before(next(iter(graph)) if before is None else before, cast)
    return cast.outputs[0]


def factored_scales(
    graph: ir.Graph, base: str, factors: ScaleFactors, dtype: ir.DataType
) -> tuple[ir.Value, ir.Value | None]:
    """A weight's scales `[N, blocks]` and min terms `[blocks, N]` (as `register_mins` gives
    them; None without) multiplied out of `factors`, by constant nodes at the top of the graph::

        d [N, S, 1] f16 ─► Cast ─┐
        multipliers [N, S, per] ─► Cast ─► Mul ─► Reshape [N, S·per] ─► scales
                                        └─► Mul(offset) ─► Add ─► Reshape ─► Transpose ─► mins
        dmin [N, S, 1] f16 ─► Cast ─┐                       ▲
        min_multipliers ─► Cast ─► Mul ─► Neg ─────────────┘
    """
    top = next(iter(graph))

    def constant(name: str, data: np.ndarray) -> ir.Value:
        return read_as(graph, register_initializer(graph, f"{base}.{name}", data), dtype, top)

    def add(op: str, inputs: list[ir.Value], attributes: dict[str, list[int]] | None = None) -> ir.Value:
        node = ir.node(op, inputs, attributes or {})
        node.outputs[0].type = ir.TensorType(dtype)
        graph.insert_before(top, node)
        return node.outputs[0]

    n, supers, per = factors.multipliers.shape
    shape = register_initializer(graph, f"{base}.scales.shape", np.array([n, supers * per], np.int64))
    products = add(
        "Mul", [constant("scales.d", factors.d[..., None]), constant("scales.multipliers", factors.multipliers)]
    )
    scales = add("Reshape", [products, shape])
    if factors.dmin is None or factors.min_multipliers is None:
        return scales, None
    low = add(
        "Neg",
        [
            add(
                "Mul",
                [constant("mins.dmin", factors.dmin[..., None]), constant("mins.multipliers", factors.min_multipliers)],
            )
        ],
    )
    offset = register_initializer(graph, f"{base}.mins.offset", np.array(factors.offset, np.float32))
    mins = add("Add", [low, add("Mul", [products, offset])])
    transposed = add("Transpose", [add("Reshape", [mins, shape])], {"perm": [1, 0]})
    transposed.meta[FLOAT_TERM] = True
    return scales, transposed


def register_mins(graph: ir.Graph, base: str, mins: np.ndarray, dtype: np.dtype) -> ir.Value:
    """`{base}.mins`: a weight's min term [⌈K / block⌉, N] (as MatMul reads its B) from its
    record's mins [N, ⌈K / block⌉], marked so that no quantizer after this one rounds it."""
    value = register_initializer(graph, f"{base}.mins", np.ascontiguousarray(mins.T).astype(dtype))
    value.meta[FLOAT_TERM] = True
    return value


class MinTerms:
    """The min term of weights stored as symmetric codes plus a float term per block
    (`QuantizedWeight.mins`): x @ W^T = sum over blocks b of (x_b @ codes_b^T) * scale_b +
    sum(x_b) * min_b, so::

        x ──> MatMulNBits(codes, scales) ─────────────────────────────> Add ──> y
         └──> Reshape([..., K / block, block]) ─> ReduceSum ─> MatMul(mins) ─┘

    a float MatMul 1/block the size of the weight after the block sums. The block sums are made
    once per input and shared by every weight that reads it, by a Reshape into blocks and a
    ReduceSum (K work per row); an input of unknown rank is summed by a MatMul with a block
    indicator [K, K / block] instead (a constant of ones and zeros, K² / block work per row: 3%
    of a 64-token prefill's kernel time on the 125M reference's Q4_K_M import, against under 1%
    for the ReduceSum). One per pass run."""

    def __init__(self) -> None:
        self._block_sums: dict[tuple[str, int], ir.Value] = {}

    def add(
        self, graph: ir.Graph, node: ir.Node, x: ir.Value, product: ir.Value, mins: ir.Value, k: int, block_size: int
    ) -> ir.Value:
        """`product` plus the min term of `x` [..., k] (before `node`): the Add's output."""
        term = ir.node("MatMul", [self._block_sum(graph, node, x, k, block_size, mins.dtype), mins])
        add = ir.node("Add", [product, term.outputs[0]])
        graph.insert_before(node, term)
        graph.insert_before(node, add)
        return add.outputs[0]

    def _block_sum(
        self, graph: ir.Graph, node: ir.Node, x: ir.Value, k: int, block_size: int, dtype: ir.DataType | None
    ) -> ir.Value:
        """[..., K / block]: the sum of each block of `x`'s last axis, made once per input."""
        key = (x.name or str(id(x)), block_size)
        if key in self._block_sums:
            return self._block_sums[key]
        assert dtype is not None and k % block_size == 0
        name = f"kvforge.block_sum.{k}_{block_size}"
        if x.shape is not None:  # rank known: Reshape into blocks (0 keeps a leading axis), ReduceSum
            blocks = [0] * (len(x.shape) - 1) + [k // block_size, block_size]
            shape = register_once(graph, f"{name}.rank{len(x.shape)}", np.array(blocks, np.int64))
            axes = register_once(graph, f"{name}.axes", np.array([-1], np.int64))
            split = ir.node("Reshape", [x, shape])
            total = ir.node("ReduceSum", [split.outputs[0], axes], attributes={"keepdims": 0})
            graph.insert_before(node, split)
        else:
            indicator = np.zeros((k, k // block_size), dtype.numpy())
            indicator[np.arange(k), np.arange(k) // block_size] = 1
            ones = register_once(graph, f"{name}.{dtype.name.lower()}", indicator)
            ones.meta[FLOAT_TERM] = True  # a MatMul's B that no quantizer may round
            total = ir.node("MatMul", [x, ones])
        graph.insert_before(node, total)
        self._block_sums[key] = total.outputs[0]
        return total.outputs[0]


def register_once(graph: ir.Graph, name: str, data: np.ndarray) -> ir.Value:
    """The initializer `name`: an existing one of that name, else `data` registered under it
    (the small constants several nodes share: shapes, axes)."""
    if name in graph.initializers:
        return graph.initializers[name]
    return register_initializer(graph, name, data)


def regrouped(q: QuantizedWeight, head: bool = False) -> QuantizedWeight:
    """`q` as the int8-activation kernel reads it fastest: where `regroup_block` gives a block,
    its weights rounded again to 8-bit codes in blocks of that size, each block's scale a
    float16 value (the symmetric 8-bit search), so each weight moves by at most half the new
    block's step, 1/254 of the block's largest magnitude (a Q6_K block's own step is 1/31 of
    its 16 values' largest); else `q` itself. A chunk of rows at a time: the float weights of a
    large LM head never exist whole."""
    block = regroup_block(q, head)
    if block is None:
        return q
    n, k = q.codes.shape
    codes = np.empty((n, k), np.int8)
    scales = np.empty((n, k // block), np.float32)
    for start in range(0, n, 1024):
        rows = slice(start, min(start + 1024, n))
        part = replace(q, codes=q.codes[rows], scales=q.scales[rows], factors=None)
        step, values = _symmetric(part.dequantize().reshape(-1, k // block, block), 8, np.dtype(np.float16))
        scales[rows], codes[rows] = step, values.reshape(-1, k)
    return QuantizedWeight(codes, scales, None, 8, block)


def stack_rows(records: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    """The records of weights stacked along N (packed projections) as one, or None where they
    differ in K, input order, or (with zero points) in bits, block size or whether they have them.

    Symmetric records of different bits or block sizes (a GGUF file's 4-bit q and 8-bit v, in
    blocks of 32 and 16) stack in the widest bits and the smallest block, when each block is a
    whole number of those: a 4-bit code is the same 8-bit code, a block's scale (and min term)
    the scale of each of its parts, so the stacked record stands for the same weights."""
    first = records[0]
    if len(records) == 1:
        return first
    k = first.codes.shape[1]
    if not all(r.codes.shape[1] == k and _same_order(r.input_order, first.input_order) for r in records):
        return None
    if all(r.zero_points is None for r in records):
        bits, block = max(r.bits for r in records), min(r.block_size for r in records)
        if any(r.block_size % block for r in records):
            return None
        records = [_widened(r, bits, block) for r in records]
    first = records[0]
    alike = all(
        r.bits == first.bits
        and r.block_size == first.block_size
        and (r.zero_points is None) == (first.zero_points is None)
        and r.codes.dtype == first.codes.dtype
        for r in records
    )
    if not alike:
        return None
    zero_points = None if first.zero_points is None else np.concatenate([r.zero_points for r in records])  # type: ignore[misc]
    mins = None
    if any(r.mins is not None for r in records):  # a part without a min term adds zeros
        mins = np.concatenate([np.zeros(r.scales.shape, np.float32) if r.mins is None else r.mins for r in records])
    return QuantizedWeight(
        np.concatenate([r.codes for r in records]),
        np.concatenate([r.scales for r in records]),
        zero_points,
        first.bits,
        first.block_size,
        first.input_order,
        mins,
    )


def _widened(q: QuantizedWeight, bits: int, block: int) -> QuantizedWeight:
    """A symmetric record in `bits` (at least its own) and blocks of `block` (dividing its own)."""
    if (q.bits, q.block_size) == (bits, block):
        return q
    blocks = -(-q.codes.shape[1] // block)
    split = q.block_size // block

    def per_block(values: np.ndarray) -> np.ndarray:
        return np.repeat(values, split, axis=1)[:, :blocks]

    mins = None if q.mins is None else per_block(q.mins)
    codes = q.codes.astype(np.int8)
    return replace(q, codes=codes, scales=per_block(q.scales), bits=bits, block_size=block, mins=mins, factors=None)


def _same_order(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
