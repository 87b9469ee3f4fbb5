"""Checkpoints that ship their weights quantized: Hugging Face AWQ and GPTQ.

Such a checkpoint's config.json has a `quantization_config`, and each quantized Linear `P`
is stored as int32 words of packed codes instead of `P.weight`:

- AWQ (AutoAWQ's `gemm` version, which transformers and vLLM read): `P.qweight [K, N / 8]`,
  eight 4-bit codes of one input row per word, output columns in the order
  `0, 2, 4, 6, 1, 3, 5, 7` from the lowest nibble up; `P.qzeros [K / group, N / 8]` packed the
  same way; `P.scales [K / group, N]`. Weight = (code - zero) * scale.
- GPTQ (AutoGPTQ / GPTQModel, as transformers reads them): `P.qweight [K * bits / 32, N]`,
  32 / bits codes of one output column per word, consecutive input rows from the lowest bits
  up; `P.qzeros [K / group, N * bits / 32]`, consecutive output columns per word; `P.scales
  [K / group, N]`; `P.g_idx [K]`, each input row's group. The `gptq` checkpoint format stores
  each zero point minus one (the reader adds it back), `gptq_v2` stores it as is.
  Weight = (code - zero) * scale[g_idx].

`records` turns them into `kvforge.passes.quantize.QuantizedWeight` records keyed by `P.weight`
([N, K] codes as uint8, scales [N, K / group], zero points [N, K / group]), which the
quantize phase writes to MatMulNBits unchanged (`kvforge.passes.quantize.ImportQuantizedWeights`).
`dequantize_into` replaces the packed tensors of a state dict by the float weights they
stand for, so the eager model, the gate's reference, is the dequantized checkpoint.

GPTQ's act-order (`desc_act`: a `g_idx` whose groups gather input rows that are not
adjacent) is held by storing the codes in group order (`QuantizedWeight.input_order`), the
activations gathered into that order before the MatMul. A weight MatMulNBits cannot hold as
it is (groups of unequal sizes; a zero point outside the codes' range; a group size that is
not a power of two of at least 16) is imported dequantized, in float, and `records` says why.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvforge.runners.errors import CheckpointError

if TYPE_CHECKING:  # torch and the quantize pass load where weights are unpacked: reading a config needs neither
    import torch

    from kvforge.passes.quantize import QuantizedWeight

QUANTIZATION_CONFIG = "quantization_config"
METHODS = ("awq", "gptq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column of each nibble of an AWQ word, lowest first
_PACKED = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's `quantization_config`, as far as reading its tensors needs."""

    method: str  # "awq" or "gptq"
    bits: int
    group_size: int  # -1: one group of all K inputs
    zero_offset: int  # added to each stored zero point (1 for the `gptq` checkpoint format)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "bits": self.bits, "group_size": self.group_size}


def read_config(config: Mapping[str, Any], file: Path) -> Quantization | None:
    """The checkpoint's quantization, None when its weights are not quantized; a method or
    setting kvforge cannot read is refused, naming the field."""
    fields = config.get(QUANTIZATION_CONFIG)
    if fields is None:
        return None
    where = f"{file}: {QUANTIZATION_CONFIG}"
    if not isinstance(fields, dict):
        raise CheckpointError(f"{where} is not an object; fix or remove it")
    method = str(fields.get("quant_method", "")).lower()
    if method not in METHODS:
        raise CheckpointError(
            f"{where}.quant_method {fields.get('quant_method')!r} is not one kvforge imports ({', '.join(METHODS)}); "
            "save the model dequantized (float weights, no quantization_config) and build that"
        )
    bits = _integer(fields, ("bits", "w_bit"), where)
    group_size = _integer(fields, ("group_size", "q_group_size"), where)
    if method == "awq":
        version = str(fields.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4 or fields.get("zero_point", True) is not True:
            raise CheckpointError(
                f"{where}: AWQ version {version!r}, {bits} bits, zero_point {fields.get('zero_point', True)}: kvforge "
                "reads AWQ's gemm layout of 4-bit codes with zero points; export the model with version='gemm'"
            )
        return Quantization(method, bits, group_size, 0)
    layout = str(fields.get("checkpoint_format", fields.get("format", "gptq"))).lower()
    if bits not in (4, 8) or layout not in ("gptq", "gptq_v2"):
        raise CheckpointError(
            f"{where}: GPTQ of {bits} bits in checkpoint_format {layout!r}: kvforge reads 4- and 8-bit codes in "
            "the gptq and gptq_v2 formats; quantize to 4 or 8 bits"
        )
    return Quantization(method, bits, group_size, 1 if layout == "gptq" else 0)


def _integer(fields: Mapping[str, Any], names: tuple[str, ...], where: str) -> int:
    value = next((fields[name] for name in names if name in fields), None)
    if not isinstance(value, int) or isinstance(value, bool) or value == 0 or value < -1:
        raise CheckpointError(f"{where}.{names[0]} is {value!r}; it must be a positive integer (or -1)")
    return value


@dataclass(frozen=True)
class Imported:
    """What became of one quantized weight: its record, or why it is imported in float."""

    record: QuantizedWeight
    exact: bool  # MatMulNBits holds the record as it is
    reason: str = ""  # why not, when not
    stored_as: str = ""  # the checkpoint's own type for the tensor, where it names one (GGUF's Q4_K...)


def records(tensors: Mapping[str, Any], quantization: Quantization, file: Path) -> dict[str, Imported]:
    """The quantized weights among `tensors` (name -> tensor, torch or numpy), by `P.weight`."""
    prefixes = sorted(name[: -len(".qweight")] for name in tensors if name.endswith(".qweight"))
    return {f"{prefix}.weight": _unpack(prefix, tensors, quantization, file) for prefix in prefixes}


def dequantize_into(
    tensors: MutableMapping[str, torch.Tensor], quantization: Quantization, file: Path, dtype: torch.dtype | None
) -> dict[str, Imported]:
    """Replace each quantized weight's packed tensors in `tensors` by `P.weight`, the float
    weight they stand for (in `dtype`, float32 when None), computed in float32; returns the records."""
    import torch

    found = records(tensors, quantization, file)
    for name, imported in found.items():
        prefix = name[: -len(".weight")]
        for part in _PACKED:
            tensors.pop(f"{prefix}.{part}", None)
        tensors[name] = torch.from_numpy(imported.record.dequantize()).to(dtype or torch.float32)
    return found


def _unpack(prefix: str, tensors: Mapping[str, Any], quantization: Quantization, file: Path) -> Imported:
    from kvforge.passes.quantize import QuantizedWeight, holds_block

    bits = quantization.bits
    arrays = {part: _numpy(tensors.get(f"{prefix}.{part}")) for part in _PACKED}
    for part in ("qweight", "qzeros", "scales"):
        if arrays[part] is None:
            raise CheckpointError(f"{file}: {prefix}.qweight has no {prefix}.{part}; the checkpoint is incomplete")
    qweight, qzeros, scales = (arrays[p] for p in ("qweight", "qzeros", "scales"))
    assert qweight is not None and qzeros is not None and scales is not None
    for part, array, kinds in (("qweight", qweight, "i"), ("qzeros", qzeros, "i"), ("scales", scales, "f")):
        if array.ndim != 2 or array.dtype.kind != kinds or (kinds == "i" and array.dtype.itemsize != 4):
            what = "int32" if kinds == "i" else "float"
            raise CheckpointError(
                f"{file}: {prefix}.{part} is {array.dtype} {list(array.shape)}; {quantization.method.upper()} stores "
                f"it as a 2-D {what} tensor: check that the checkpoint is not damaged"
            )
    per_word = 32 // bits
    if quantization.method == "awq":
        k = qweight.shape[0]
        codes = _unpack_columns(qweight, bits, AWQ_ORDER).T  # [N, K]
        zeros = _unpack_columns(qzeros, bits, AWQ_ORDER)
    else:
        k = qweight.shape[0] * per_word
        codes = _unpack_rows(qweight, bits)  # [N, K]
        zeros = _unpack_columns(qzeros, bits, tuple(range(per_word)))
    n = codes.shape[0]
    group = k if quantization.group_size == -1 else quantization.group_size
    if n % per_word:
        raise CheckpointError(
            f"{file}: {prefix} has {n} output features, not a multiple of the {per_word} codes an int32 of "
            f"{prefix}.qzeros holds; the checkpoint is damaged"
        )
    groups = -(-k // group)
    expected = {"qzeros": (groups, n // per_word), "scales": (groups, n)}
    for part, shape in expected.items():
        if arrays[part].shape != shape:  # type: ignore[union-attr]
            raise CheckpointError(
                f"{file}: {prefix}.{part} has shape {list(arrays[part].shape)}, but {prefix}.qweight "  # type: ignore[union-attr]
                f"{list(qweight.shape)} with group_size {quantization.group_size} needs {list(shape)}; "
                "check that config.json's quantization_config belongs to these weights"
            )
    zero_points = zeros.T.astype(np.int16) + quantization.zero_offset  # [N, groups]
    scale = np.ascontiguousarray(scales.T)
    g_idx = arrays["g_idx"]
    contiguous = np.arange(k) // group
    if g_idx is not None and (g_idx.shape != (k,) or np.any(g_idx < 0) or np.any(g_idx >= groups)):
        raise CheckpointError(f"{file}: {prefix}.g_idx must be [{k}] group indices below {groups}")
    in_range = bool(np.all(zero_points <= 2**bits - 1))
    stored = np.clip(zero_points, 0, 255).astype(np.uint8)
    record = QuantizedWeight(codes, scale, stored, bits, group)
    if g_idx is not None and not np.array_equal(g_idx, contiguous):
        # act-order: a group's input rows lie apart; stored in group order, with the activations
        # gathered into that order, MatMulNBits' blocks of adjacent rows hold them as they are
        order = np.argsort(g_idx, kind="stable")
        if not np.array_equal(g_idx[order], contiguous):
            return Imported(_regrouped(codes, scale, zero_points, g_idx, bits), False, "g_idx groups of unequal sizes")
        record = QuantizedWeight(np.ascontiguousarray(codes[:, order]), scale, stored, bits, group, order)
    if not in_range:
        return Imported(record, False, f"a zero point is {int(zero_points.max())}, beyond {bits}-bit codes")
    if not holds_block(group) or k % group:
        return Imported(record, False, f"group size {group} is not a MatMulNBits block size for K={k}")
    return Imported(record, True)


def _regrouped(
    codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, g_idx: np.ndarray, bits: int
) -> QuantizedWeight:
    """A record whose `dequantize` gives weight[n, k] = (code - zero[g_idx[k]]) * scale[g_idx[k]]:
    one block per input row."""
    from kvforge.passes.quantize import QuantizedWeight

    zero_points = zeros[:, g_idx]
    return QuantizedWeight(codes, scales[:, g_idx], zero_points.astype(np.int16), bits, 1)


def _numpy(tensor: Any) -> np.ndarray | None:
    if tensor is None:
        return None
    torch = sys.modules.get("torch")  # a torch tensor comes only from a process that loaded torch
    if torch is not None and isinstance(tensor, torch.Tensor):
        return tensor.numpy() if tensor.dtype != torch.bfloat16 else tensor.float().numpy()
    return np.asarray(tensor)


def _unpack_columns(words: np.ndarray, bits: int, order: tuple[int, ...]) -> np.ndarray:
    """[R, C] int32 words, each holding 32 / bits codes of adjacent columns (the code of column
    `order[i]` of the word's group in bits i * bits ...), -> [R, C * 32 / bits] uint8."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    values = (words.astype(np.int32).view(np.uint32)[:, :, None] >> shifts) & (2**bits - 1)
    out = np.empty_like(values)
    out[:, :, list(order)] = values
    return out.reshape(words.shape[0], -1).astype(np.uint8)


def _unpack_rows(words: np.ndarray, bits: int) -> np.ndarray:
    """[R, N] int32 words, each holding 32 / bits codes of adjacent rows of one column (lowest
    bits first), -> the codes transposed, [N, R * 32 / bits] uint8."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    values = (words.astype(np.int32).view(np.uint32)[:, None, :] >> shifts[:, None]) & (2**bits - 1)
    return np.ascontiguousarray(values.reshape(-1, words.shape[1]).T).astype(np.uint8)


def manifest_entry(
    header: Mapping[str, Any],
    found: Mapping[str, Imported],
    graph_forms: Mapping[str, Mapping[str, Any]],
    requantized: bool,
) -> dict[str, Any]:
    """`imported_weights` of the manifest: the checkpoint's quantization (`header`: its
    `Quantization.to_dict()`, or what a GGUF file's entry says of the file), and for each of its
    quantized weights the form it has in the graph (`graph_forms`: what the import pass wrote,
    by graph weight, with the checkpoint weights each holds), or `float` and why."""
    placed: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for weight, form in graph_forms.items():
        for source in form["from"]:
            placed.setdefault(source, []).append((weight, form))
    weights: dict[str, Any] = {}
    for name in sorted(found):
        imported = found[name]
        stored = {"stored_as": imported.stored_as} if imported.stored_as else {}
        if name in placed:  # a tied table is the LM head's weight and the lookup's: the first, then `also`
            forms = [
                {k: v for k, v in form.items() if k != "from"} | ({"graph_weight": weight} if weight != name else {})
                for weight, form in placed[name]
            ]
            exact = imported.exact and not any(name in form.get("regrouped", ()) for form in forms)
            weights[name] = stored | forms[0] | {"exact": exact} | ({"also": forms[1:]} if forms[1:] else {})
            continue
        if imported.exact:
            why = "the graph reads it in no MatMul the import writes (or the target keeps imported weights float)"
        else:
            why = imported.reason or "the target reads no zero points in blocks"
        weights[name] = stored | {
            "form": "quantized again (--weights)" if requantized else "float",
            "exact": False,
            "reason": why,
        }
    return dict(header) | {"weights": weights}


def float_metadata(
    metadata: Mapping[str, tuple[str, tuple[int, ...]]], quantization: Quantization
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) as the model sees the weights: each quantized Linear's
    packed tensors replaced by `P.weight` [N, K] in its scales' dtype (headers only)."""
    per_word = 32 // quantization.bits
    found = dict(metadata)
    for name, (_, shape) in metadata.items():
        prefix = name[: -len(".qweight")] if name.endswith(".qweight") and len(shape) == 2 else None
        if prefix is None or f"{prefix}.scales" not in metadata:
            continue
        rows, cols = shape
        k, n = (rows, cols * per_word) if quantization.method == "awq" else (rows * per_word, cols)
        dtype = metadata[f"{prefix}.scales"][0]
        for part in _PACKED:
            found.pop(f"{prefix}.{part}", None)
        found[f"{prefix}.weight"] = (dtype, (n, k))
    return found
