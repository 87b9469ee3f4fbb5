"""A float checkpoint rewritten as an AWQ or GPTQ one (round to nearest, asymmetric, per group),
packed as AutoAWQ's gemm layout / AutoGPTQ pack it, to measure imported builds.

    python benchmarks/make_prequantized.py CHECKPOINT OUT [--method awq|gptq] [--group 128] [--bits 4]

Every layer projection (`*_proj.weight` of 2 dimensions under `layers.`) is quantized; the
embedding table and LM head stay float, as AutoAWQ and AutoGPTQ leave them. The codes come
from plain round to nearest, not from AWQ's activation-aware scaling or GPTQ's error
feedback: the layout and its cost are what is measured, not those methods' quality.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def round_to_nearest(weight: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, K] -> codes [N, K], fp16 scales and zero points [N, K / group] (zero points 1 .. 2^bits - 1,
    so GPTQ's stored zero - 1 stays in range)."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // group, group).astype(np.float32)
    top = 2**bits - 1
    low, high = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
    scales = np.maximum((high - low) / top, 1e-8).astype(np.float16)
    zeros = np.clip(np.round(-low / scales.astype(np.float32)), 1, top)
    codes = np.clip(np.round(blocks / scales[..., None].astype(np.float32)) + zeros[..., None], 0, top)
    return codes.reshape(n, k).astype(np.uint32), scales, zeros.astype(np.uint32)


def pack_awq(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> dict[str, torch.Tensor]:
    def pack(values: np.ndarray) -> np.ndarray:  # [R, C] -> [R, C / 8], columns in AWQ's order
        grouped = values.reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
        return (grouped << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32).view(np.int32)

    return {
        "qweight": torch.from_numpy(pack(np.ascontiguousarray(codes.T))),
        "qzeros": torch.from_numpy(pack(np.ascontiguousarray(zeros.T))),
        "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
    }


def pack_gptq(
    codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, group: int
) -> dict[str, torch.Tensor]:
    per_word = 32 // bits
    shifts = bits * np.arange(per_word, dtype=np.uint32)
    rows = codes.T.reshape(-1, per_word, codes.shape[0])  # consecutive input rows per word
    qweight = (rows << shifts[None, :, None]).sum(1, dtype=np.uint32)
    stored = (zeros.T - 1).reshape(zeros.shape[1], -1, per_word)  # consecutive output columns per word
    qzeros = (stored << shifts).sum(-1, dtype=np.uint32)
    k = codes.shape[1]
    return {
        "qweight": torch.from_numpy(qweight.view(np.int32)),
        "qzeros": torch.from_numpy(qzeros.view(np.int32)),
        "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
        "g_idx": torch.from_numpy((np.arange(k) // group).astype(np.int32)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--method", choices=("awq", "gptq"), default="awq")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--bits", type=int, default=4, choices=(4, 8))
    args = parser.parse_args()
    if args.method == "awq" and args.bits != 4:
        parser.error("AWQ is 4-bit")
    args.out.mkdir(parents=True, exist_ok=False)
    for file in args.checkpoint.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors") and file.name != "config.json":
            shutil.copy(file, args.out / file.name)
    tensors = load_file(args.checkpoint / "model.safetensors")
    projections = [n for n in tensors if ".layers." in n and n.endswith("_proj.weight") and tensors[n].dim() == 2]
    # a projection whose inputs are not whole groups stays float, as those libraries leave it
    for name in [n for n in projections if tensors[n].shape[1] % args.group == 0 and tensors[n].shape[0] % 8 == 0]:
        codes, scales, zeros = round_to_nearest(tensors.pop(name).float().numpy(), args.bits, args.group)
        prefix = name[: -len(".weight")]
        packed = (
            pack_awq(codes, scales, zeros)
            if args.method == "awq"
            else pack_gptq(codes, scales, zeros, args.bits, args.group)
        )
        tensors.update({f"{prefix}.{part}": tensor.contiguous() for part, tensor in packed.items()})
    save_file(tensors, args.out / "model.safetensors")
    config = json.loads((args.checkpoint / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": args.group, "zero_point": True, "version": "gemm"}
        if args.method == "awq"
        else {"quant_method": "gptq", "bits": args.bits, "group_size": args.group, "desc_act": False, "sym": False}
    )
    (args.out / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    main()
