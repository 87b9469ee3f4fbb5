"""How much memory a model needs: its weights at each precision, and the KV cache.

Feeds `kvforge inspect`. Everything is computed from safetensors headers and the spec; no
weight data is read, but for a checkpoint that ships quantized weights (a GGUF file), whose
records are decoded to count them as the import writes them (`imported_weight_bytes`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from kvforge.passes.storage import (
    DEFAULT_MIX,
    half_scales_counted,
    layer_count,
    mixed_head,
    mixed_to_8_bits,
    regroup_block,
    shared_head,
    stored_scales,
    table_block,
    wide_block,
)
from kvforge.passes.targets import DEFAULT_TARGET, TARGETS
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import CheckpointError, GenerationError, KvforgeError
from kvforge.toolchain.checkpoint import Checkpoint
from kvforge.toolchain.prequantized import float_metadata
from kvforge.toolchain.spec import (
    BUFFER_SUFFIXES,
    EXPERTS,
    OUTPUT_HEADS,
    POSITION_EMBEDDINGS,
    SHARED_EXPERT,
    TOKEN_EMBEDDINGS,
    DecoderSpec,
    input_first_weights,
)

if TYPE_CHECKING:
    from kvforge.passes.quantize import QuantizedWeight

logger = logging.getLogger(__name__)

QUANT_BLOCK = 32  # weights per quantization block, along the input (reduction) dimension (--block-size)
COMPUTE_BYTES = 4  # fp32 compute (the default): scales and the weights that stay unquantized are fp32
# a block's scale: float16 in either compute dtype (a float32 graph reads them through a Cast
# folded at load: `kvforge.passes.storage.half_scales_fit`)
SCALE_BYTES = 2
WEIGHT_PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")
# the cache's precisions: bytes per element. "int8" is `--kv-dtype int8`'s cache of codes (its
# per-channel scales are constants, a few kB, counted with nothing); a layer's fixed-size state
# (convolution, recurrent) stays in the compute dtype there
KV_PRECISIONS: dict[str, int] = {"fp32": 4, "fp16": 2, "int8": 1}
_KV_DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8"}
_BITS = {"int8": 8, "int4": 4}

DTYPE_BYTES: dict[str, int] = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}

# The output head, when tied to the embeddings, is the embedding matrix, counted once.
# Token-embedding tables, [vocab, hidden], are quantized in blocks along hidden, as the LM
# head reading a tied one is (the lookup and the head each hold a copy of the codes).
# Learned position tables stay in the compute dtype. (Names: kvforge.toolchain.spec.)

GIB = 1 << 30

TensorMeta = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class Footprint:
    """Weight and KV-cache memory of one model, in bytes.

    `weight_bytes_at` gives exact bytes at each precision. "fp32" / "fp16" store every
    parameter at that width. "int8" / "int4" are what `kvforge build --weights int8|int4`
    stores on the default target, ort-cpu (block 32, fp32 compute): each 2-D
    matmul weight and the token-embedding table ([vocab, hidden], blocks along hidden) is
    cut along its input dimension into blocks of 32 (the last block padded to 32, as
    MatMulNBits stores it) holding 8- or 4-bit codes plus one fp16 scale per block (int4: and
    a 4-bit zero point, packed two to a byte per row)
    (`SCALE_BYTES`; a weight of at most 1024 scales keeps fp32, as counted; a weight whose scales
    do not fit fp16, and the matmul weights of the `onnx` target's DequantizeLinear, keep fp32: a
    little more than counted) (int4:
    the weights the default mix picks at 8 bits, `kvforge.passes.storage.DEFAULT_MIX`); an
    output head tied to the embeddings holds a copy of the table's codes of its own (the
    table is counted twice); norms, biases and learned position tables stay fp32. The `onnx`
    target stores the lookup's table as 8-bit codes (under int4 too), `tensorrt` in the
    compute dtype (docs/pipeline.md).
    """

    parameters_by_dtype: dict[str, int]  # stored dtype name ("F32", "BF16", ...) -> count
    weight_bytes: int  # the parameters as stored in the checkpoint (tied weights once)
    weight_bytes_at: dict[str, int]  # "fp32", "fp16", "int8", "int4"
    kv_bytes_per_token: dict[str, int]  # "fp32", "fp16", "int8": what a token adds to the layers that keep it all
    # the cache holding batch × seq tokens: the sum of the kinds below (+ fixed state × batch)
    kv_bytes_total: dict[str, int]
    batch: int
    seq: int
    # precision -> layer kind -> bytes (`DecoderIO.kv_bytes_by_kind`): "full" layers hold every
    # token, "sliding" ones bounded by their window hold its last window - 1
    kv_bytes_by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    layer_windows: tuple[int | None, ...] | None = None
    expert_parameters: int = 0  # the routed experts' share of `parameters` (MoE)
    experts_fraction: float = 1.0  # experts per token / routed experts: the share of them a token uses
    # "fp32", "fp16" -> bytes of fixed-size layer states (convolution, recurrent) per sequence,
    # whatever its length; empty for an attention-only model
    state_bytes_per_sequence: dict[str, int] = field(default_factory=dict)
    # a GGUF file that holds quantized matrices: its default build's weights (the records as the
    # import writes them, the rest at int4: `imported_weight_bytes`); None for any other checkpoint
    imported_bytes: int | None = None

    @property
    def active_parameters(self) -> int:
        """Parameters one token computes with: all but the routed experts it is not sent to."""
        return self.parameters - round(self.expert_parameters * (1.0 - self.experts_fraction))

    @property
    def parameters(self) -> int:
        return sum(self.parameters_by_dtype.values())

    def total_bytes(self, weights: str, kv: str) -> int:
        """Weights at precision `weights` plus the whole KV cache at precision `kv`."""
        if weights not in self.weight_bytes_at:
            raise KvforgeError(f"unknown weight precision {weights!r}; choose one of {', '.join(self.weight_bytes_at)}")
        if kv not in self.kv_bytes_total:
            raise KvforgeError(f"unknown KV-cache precision {kv!r}; choose one of {', '.join(self.kv_bytes_total)}")
        return self.weight_bytes_at[weights] + self.kv_bytes_total[kv]


def footprint(
    checkpoint: Checkpoint,
    spec: DecoderSpec,
    *,
    batch: int,
    seq: int,
    compute_bytes: int = COMPUTE_BYTES,
    layer_windows: tuple[int | None, ...] | None = None,
) -> Footprint:
    """Memory for `checkpoint` running `batch` sequences of `seq` tokens (prompt + generated).
    `compute_bytes` is the width of what quantization leaves in the compute dtype (2 for a
    `--dtype fp16|bf16` build): the scales, norms, biases and position tables. `layer_windows`
    (`DecoderIO.layer_windows`, `kvforge.toolchain.export.layer_windows`) bounds the sliding layers'
    caches by their windows, as the default target keeps them; None: every layer holds every token."""
    _check_request(spec, batch, seq)
    stored = parameter_metadata(checkpoint, spec)
    params = _float_parameters(checkpoint, stored)
    by_dtype: dict[str, int] = {}
    for dtype, shape in params.values():
        by_dtype[dtype] = by_dtype.get(dtype, 0) + math.prod(shape)
    per_token = {name: spec.kv_bytes_per_token(size) for name, size in KV_PRECISIONS.items()}
    state = (
        {
            name: spec.state_bytes_per_sequence(compute_bytes if name == "int8" else size)
            for name, size in KV_PRECISIONS.items()
        }
        if spec.layers
        else {}
    )
    by_kind = {
        name: replace(DecoderIO.for_spec(spec, _KV_DTYPES[name]), layer_windows=layer_windows).kv_bytes_by_kind(
            seq, batch
        )
        for name in KV_PRECISIONS
    }
    return Footprint(
        parameters_by_dtype=dict(sorted(by_dtype.items())),
        weight_bytes=sum(_stored_bytes(name, meta, checkpoint) for name, meta in stored.items()),
        weight_bytes_at={p: _bytes_at(p, params, spec, compute_bytes) for p in WEIGHT_PRECISIONS},
        kv_bytes_per_token=per_token,
        kv_bytes_total={name: sum(kinds.values()) + state.get(name, 0) * batch for name, kinds in by_kind.items()},
        batch=batch,
        seq=seq,
        kv_bytes_by_kind=by_kind,
        layer_windows=layer_windows,
        expert_parameters=sum(math.prod(shape) for name, (_, shape) in params.items() if _is_expert(name, shape, spec)),
        experts_fraction=spec.experts_per_token / spec.num_experts if spec.num_experts else 1.0,
        state_bytes_per_sequence=state,
        # a GGUF file's (read through transformers already): another checkpoint's records are
        # read only where a build asks (`--device-memory`), so that inspect reads headers only
        imported_bytes=None
        if checkpoint.gguf is None
        else imported_weight_bytes(checkpoint, spec, QuantLayout(4), compute_bytes),
    )


def _is_expert(name: str, shape: tuple[int, ...], spec: DecoderSpec) -> bool:
    """A routed expert's weight: under `experts`, stacked over the experts in its first
    dimension (transformers' fused layout) or one tensor per expert (`experts.3.w1`)."""
    if not spec.num_experts or EXPERTS not in name or SHARED_EXPERT in name:
        return False
    stacked = len(shape) >= 2 and shape[0] == spec.num_experts
    per_expert = name.split(EXPERTS, 1)[1].split(".", 1)[0].isdigit()
    return stacked or per_expert


def parameter_metadata(checkpoint: Checkpoint, spec: DecoderSpec) -> dict[str, TensorMeta]:
    """The checkpoint's parameters: buffers dropped, a tied output head dropped (counted once)."""
    params = {}
    for name, meta in checkpoint.tensor_metadata().items():
        if name.endswith(BUFFER_SUFFIXES):
            logger.debug("%s: %s is a buffer, not a parameter", checkpoint.path, name)
        elif spec.tied_embeddings and _is_head(name):
            logger.debug("%s: %s is tied to the embeddings; counted once", checkpoint.path, name)
        else:
            params[name] = meta
    if not params:
        raise CheckpointError(f"{checkpoint.path}: the weight files hold no parameters; re-save the checkpoint")
    return params


def _check_request(spec: DecoderSpec, batch: int, seq: int) -> None:
    for name, value in (("batch", batch), ("seq", seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GenerationError(f"footprint: {name} must be a positive integer, got {value!r}")
    if seq > spec.max_positions:  # still worth a number: planning a context extension, say
        logger.warning(
            "seq %d exceeds the model's %d positions (max_position_embeddings in config.json)",
            seq,
            spec.max_positions,
        )


def _is_head(name: str) -> bool:
    return any(name == head or name.endswith("." + head) for head in OUTPUT_HEADS)


def _stored_bytes(name: str, meta: TensorMeta, checkpoint: Checkpoint) -> int:
    dtype, shape = meta
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(f"{checkpoint.path}: tensor {name!r} has unsupported dtype {dtype}")
    return DTYPE_BYTES[dtype] * math.prod(shape)


@dataclass(frozen=True)
class QuantLayout:
    """How a quantized build stores each matmul weight, as far as its bytes go: codes of
    `bits` in blocks of `block` inputs, a float16 scale per block (`SCALE_BYTES`), and per block
    an integer zero point (`--asymmetric`: packed at `bits`) or a float minimum (`--free-min`:
    the compute dtype). A 4-bit build's `mix` (`kvforge.passes.storage.MIXES`) keeps the weights
    it picks at 8 bits. `--keep` and `--int8` patterns are not counted."""

    bits: int
    block: int = QUANT_BLOCK
    zero_points: bool = False
    free_min: bool = False
    mix: str = "none"
    # a matmul weight's scale (the table's is SCALE_BYTES): 4 where a target's DequantizeLinear
    # reads float32 scales (`onnx`, `tensorrt` in a float32 graph)
    scale_bytes: int = SCALE_BYTES
    # a 4-bit build's 8-bit weights in `wide_block`s, as MatMulNBits targets store them
    wide_blocks: bool = True
    # the token-embedding table's block (`table_block`, where GatherBlockQuantized looks it up);
    # None: `block`
    table_block: int | None = None
    # the lookup can read a tied LM head's codes (GatherBlockQuantized): an 8-bit layout, or a mix
    # that keeps such a head at 8 bits, stores one symmetric 8-bit matrix for both (`shared_head`)
    tied_lookup: bool = False


def quantized_weight_bytes(
    checkpoint: Checkpoint, spec: DecoderSpec, layout: QuantLayout, compute_bytes: int = COMPUTE_BYTES
) -> int:
    """The weights' bytes quantized as `layout` says (what `--device-memory` checks a build's
    recipe against; `Footprint.weight_bytes_at` holds the default layouts' figures)."""
    params = _float_parameters(checkpoint, parameter_metadata(checkpoint, spec))
    return _quantized_total(params, spec, layout, compute_bytes)


def imported_weight_bytes(
    checkpoint: Checkpoint, spec: DecoderSpec, rest: QuantLayout | None, compute_bytes: int = COMPUTE_BYTES
) -> int | None:
    """The weights' bytes of a build that imports the checkpoint's quantized weights: each exact
    record as `ImportQuantizedWeights` writes it (`record_bytes`; one the tied LM head and the
    lookup share, once), the parameters it ships in float as `rest` quantizes them (None: in the
    compute dtype). None for a checkpoint that ships no quantized weights. A packed projection
    whose parts' forms differ stores its scales in the wider form: a little more than counted."""
    if checkpoint.quantization_header() is None:
        return None
    records = {name: found.record for name, found in checkpoint.quantized_weights().items() if found.exact}
    params = _float_parameters(checkpoint, parameter_metadata(checkpoint, spec))
    distinct = {id(q): q for q in records.values()}
    heads = {id(q) for name, q in records.items() if _is_head(name)}  # a tied table: the head's record
    total = sum(record_bytes(q, compute_bytes, id(q) in heads) for q in distinct.values())
    left = {name: meta for name, meta in params.items() if name not in records}
    if rest is None:
        return total + sum(compute_bytes * math.prod(shape) for _, shape in left.values())
    return total + _quantized_total(left, spec, rest, compute_bytes)


def record_bytes(q: QuantizedWeight, compute_bytes: int = COMPUTE_BYTES, head: bool = False) -> int:
    """Bytes of a pre-quantized record as MatMulNBits holds it in the default build (accuracy
    level 4): codes in whole blocks, packed zero points, and scales and min terms as
    `ImportQuantizedWeights` stores them (float16 where they are float16 values in a float32
    graph, or the k-quant factors they are multiplied out of; a record it `regrouped`, `head`
    the LM head's, 8-bit codes and a float16 scale per block)."""
    n, k = q.codes.shape
    block = regroup_block(q, head)
    if block is not None:
        return n * k + n * (k // block) * 2
    blocks = math.ceil(k / q.block_size)
    total = n * blocks * q.block_size * q.bits // 8
    if q.zero_points is not None:
        total += n * math.ceil(blocks * q.bits / 8)
    factors = q.factors
    if factors is not None and compute_bytes == COMPUTE_BYTES:
        parts = (factors.d, factors.multipliers, factors.dmin, factors.min_multipliers)
        return total + sum(part.nbytes for part in parts if part is not None)
    dtype = np.dtype(np.float32 if compute_bytes == COMPUTE_BYTES else np.float16)
    total += stored_scales(q.scales, dtype).nbytes
    return total + (0 if q.mins is None else stored_scales(q.mins, dtype).nbytes)


def _float_parameters(checkpoint: Checkpoint, stored: dict[str, TensorMeta]) -> dict[str, TensorMeta]:
    """The parameters the precisions count: a checkpoint that ships quantized weights, as the
    float weights they stand for."""
    return stored if checkpoint.quantization is None else float_metadata(stored, checkpoint.quantization)


def _bytes_at(precision: str, params: Mapping[str, TensorMeta], spec: DecoderSpec, compute_bytes: int) -> int:
    if precision == "fp32":
        return sum(4 * math.prod(shape) for _, shape in params.values())
    if precision == "fp16":
        return sum(2 * math.prod(shape) for _, shape in params.values())
    bits = _BITS[precision]
    mix = DEFAULT_MIX if bits == 4 else "none"
    target = TARGETS[DEFAULT_TARGET]
    table = table_block(target.embedding_form, bits, QUANT_BLOCK)
    layout = QuantLayout(bits, zero_points=bits == 4, mix=mix, table_block=table, tied_lookup=target.tied_lookup)
    return _quantized_total(params, spec, layout, compute_bytes)


def _quantized_total(
    params: Mapping[str, TensorMeta], spec: DecoderSpec, layout: QuantLayout, compute_bytes: int
) -> int:
    layers = layer_count(params)
    wider = replace(layout, bits=8, free_min=False) if layout.bits == 4 else layout  # free minimums are 4-bit
    # a tied head the lookup reads: symmetric 8-bit codes, the table's only copy
    shared = spec.tied_embeddings and shared_head(layout.bits, layout.mix, layout.tied_lookup)
    head = replace(wider, zero_points=False) if shared else wider if mixed_head(layout.mix) else layout
    total = 0
    for name, (_, shape) in params.items():
        if len(shape) != 2 or name.endswith(POSITION_EMBEDDINGS):
            total += compute_bytes * math.prod(shape)
        elif name.endswith(TOKEN_EMBEDDINGS) and shared:
            total += quantized_bytes((shape[0], shape[1]), _stored(head, layout, shape[1]), compute_bytes)
        elif name.endswith(TOKEN_EMBEDDINGS):
            table = layout if layout.table_block is None else replace(layout, block=layout.table_block)
            total += quantized_bytes((shape[0], shape[1]), table, compute_bytes, SCALE_BYTES)
            if spec.tied_embeddings:  # the tied head's codes of its own
                total += quantized_bytes((shape[0], shape[1]), _stored(head, layout, shape[1]), compute_bytes)
        else:
            picked = head if _is_head(name) else wider if mixed_to_8_bits(layout.mix, name, layers) else layout
            out_in = _out_in(name, shape, spec)
            total += quantized_bytes(out_in, _stored(picked, layout, out_in[1]), compute_bytes)
    return total


def _stored(picked: QuantLayout, layout: QuantLayout, in_features: int) -> QuantLayout:
    """`picked` (`layout`, or the 8-bit form its mix keeps a weight in) with the block a weight
    of `in_features` inputs is stored in: a 4-bit build's 8-bit weights in `wide_block`s."""
    if picked is layout or not layout.wide_blocks or layout.bits != 4:
        return picked
    return replace(picked, block=wide_block(in_features, layout.block))


def _out_in(name: str, shape: tuple[int, ...], spec: DecoderSpec) -> tuple[int, int]:
    """(out_features, in_features) of a 2-D matmul weight."""
    rows, cols = shape
    if input_first_weights(spec.model_type) and not _is_head(name):
        return cols, rows
    return rows, cols


def quantized_bytes(
    out_in: tuple[int, int], layout: QuantLayout, compute_bytes: int = COMPUTE_BYTES, scale_bytes: int | None = None
) -> int:
    """Bytes of an [out, in] weight stored as `layout`: per row, its blocks' codes and scales
    (one each, of `scale_bytes`, default the layout's; in the compute dtype for a weight of too
    few scales to store them as fp16, `half_scales_counted`), and their zero points (packed, a
    row's rounded up to a byte) or float minimums (in the compute dtype)."""
    out_features, in_features = out_in
    blocks = math.ceil(in_features / layout.block)
    scale = layout.scale_bytes if scale_bytes is None else scale_bytes
    if not half_scales_counted(out_features * blocks):
        scale = max(scale, compute_bytes)
    row = blocks * (layout.block * layout.bits // 8 + scale)
    if layout.zero_points:
        row += math.ceil(blocks * layout.bits / 8)
    if layout.free_min:
        row += blocks * compute_bytes
    return out_features * row


# --- the CLI's table ----------------------------------------------------------------------


def format_footprint(fp: Footprint, spec: DecoderSpec) -> str:
    """A human-readable table (bytes and GiB) for `kvforge inspect`."""
    heads = f"{spec.num_heads} heads ({spec.num_kv_heads} KV) × {spec.head_dim}"
    if spec.value_head_dim != spec.head_dim:  # multi-head latent attention: what its cache holds
        cache = f"{spec.num_kv_heads} × ({spec.head_dim} key + {spec.value_head_dim} value)"
        heads = f"{spec.num_heads} heads, KV cache {cache}"
    shape = f"hidden {spec.hidden_size}, vocab {spec.vocab_size:,}, max positions {spec.max_positions:,}"
    counts = ", ".join(f"{n:,} {d}" for d, n in fp.parameters_by_dtype.items())
    lines = [
        f"{spec.model_type}: {spec.num_layers} layers, {heads}, {shape}",
        f"parameters: {counts} (total {fp.parameters:,})"
        + (
            f"; {spec.num_experts} experts, {spec.experts_per_token} per token: {fp.active_parameters:,} active"
            if spec.num_experts
            else ""
        ),
        "",
        _row("weights", "bytes", "GiB"),
        _size_row(f"as stored ({'/'.join(fp.parameters_by_dtype)})", fp.weight_bytes),
    ]
    lines += [_size_row(_precision_label(p), b) for p, b in fp.weight_bytes_at.items()]
    if fp.imported_bytes is not None:
        lines.append(_size_row("as imported (the default build)", fp.imported_bytes))
    lines += ["", _row(f"KV cache, batch {fp.batch} × seq {fp.seq:,}", "per token", "total", "GiB")]
    for name, total in fp.kv_bytes_total.items():
        lines.append(_row(f"  {name}", f"{fp.kv_bytes_per_token[name]:,}", f"{total:,}", _gib(total)))
        if fp.layer_windows is not None:  # by layer kind: what bounding the sliding layers saves
            for kind, nbytes in fp.kv_bytes_by_kind[name].items():
                lines.append(_row(f"    {_kind_label(kind, fp.layer_windows)}", "", f"{nbytes:,}", _gib(nbytes)))
    if fp.state_bytes_per_sequence:  # in the totals above, once per sequence
        kinds = sorted({layer.kind for layer in spec.layers or ()} - {"attention"})
        lines.append(f"  of which fixed state per sequence ({', '.join(kinds)} layers, any length):")
        lines += [_row(f"    {name}", f"{b:,}") for name, b in fp.state_bytes_per_sequence.items()]
    lines += ["", _row("weights + KV cache", "bytes", "GiB")]
    for weights, kv in (("fp32", "fp32"), ("fp16", "fp16"), ("int8", "fp16"), ("int4", "fp16"), ("int4", "int8")):
        lines.append(_size_row(f"{weights} weights, {kv} KV", fp.total_bytes(weights, kv)))
    return "\n".join(lines)


def _kind_label(kind: str, windows: tuple[int | None, ...]) -> str:
    if kind == "full":
        return f"{sum(w is None for w in windows)} full-attention layers"
    sizes = "/".join(str(w) for w in sorted({w for w in windows if w is not None}))
    return f"{sum(w is not None for w in windows)} sliding layers (window {sizes})"


def _precision_label(precision: str) -> str:
    return precision if precision not in _BITS else f"{precision} (block {QUANT_BLOCK}, fp16 scales, fp32 rest)"


def _size_row(label: str, nbytes: int) -> str:
    return _row(f"  {label}", f"{nbytes:,}", _gib(nbytes))


def format_bytes(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.3f}"


def _row(label: str, *cells: str) -> str:
    return f"{label:<40}" + "".join(f"{c:>18}" for c in cells)
