"""AWQ and GPTQ checkpoints, made here and packed as those libraries pack, import exactly.

The packing functions below are written from the libraries' documented layouts, not from
`kvforge.toolchain.prequantized`: AutoAWQ's gemm layout (`awq/utils/packing_utils.py`: eight 4-bit
codes of one input row per int32, output columns in the order 0 2 4 6 1 3 5 7 from the
lowest nibble) and AutoGPTQ's (`QuantLinear.pack`: 32 / bits codes of consecutive input
rows per int32 of `qweight`, consecutive output columns per int32 of `qzeros`, each zero
point stored minus one).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors.torch import load_file, save_file

from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import CheckpointError
from kvforge.runners.generate import empty_cache, forward
from kvforge.runners.session import OrtSession
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain.build import BuildOptions, build, verify

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def quantize(weight: np.ndarray, bits: int, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric round-to-nearest of a [N, K] weight per group of K: integer codes [N, K],
    fp16 scales and integer zero points [N, K / group], as both libraries produce them."""
    n, k = weight.shape
    blocks = weight.reshape(n, k // group, group)
    low, high = blocks.min(-1), blocks.max(-1)
    top = 2**bits - 1
    scales = ((high - low) / top).astype(np.float16)
    zeros = np.clip(np.round(-low / scales.astype(np.float32)), 0, top).astype(np.int64)
    # a zero point at the edge of the range stays inside it: GPTQ's stored zero - 1 must not be -1
    zeros = np.clip(zeros, 1, top)
    codes = np.clip(np.round(blocks / scales[..., None].astype(np.float32)) + zeros[..., None], 0, top)
    return codes.reshape(n, k).astype(np.int64), scales, zeros


def dequantize(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, group: int) -> np.ndarray:
    repeat = np.repeat
    return ((codes - repeat(zeros, group, axis=1)) * repeat(scales.astype(np.float32), group, axis=1)).astype(
        np.float32
    )


def pack_awq(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> dict[str, torch.Tensor]:
    """AutoAWQ gemm: intweight [K, N] -> qweight [K, N / 8]; zeros [groups, N] -> qzeros [groups, N / 8]."""

    def pack(values: np.ndarray) -> np.ndarray:  # [R, C] -> [R, C / 8]
        packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
        for col in range(packed.shape[1]):
            for i in range(8):
                packed[:, col] |= values[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (4 * i)
        return packed.view(np.int32)

    return {
        "qweight": torch.from_numpy(pack(codes.T)),
        "qzeros": torch.from_numpy(pack(zeros.T)),
        "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
    }


def pack_gptq(
    codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, g_idx: np.ndarray
) -> dict[str, torch.Tensor]:
    """AutoGPTQ: intweight [K, N] -> qweight [K * bits / 32, N] (rows packed), zeros - 1 [groups, N] ->
    qzeros [groups, N * bits / 32] (columns packed), g_idx [K] (each input row's group)."""
    per_word = 32 // bits
    intweight = codes.T.astype(np.uint32)
    qweight = np.zeros((intweight.shape[0] // per_word, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per_word):
            qweight[row] |= intweight[row * per_word + j] << (bits * j)
    stored = (zeros.T - 1).astype(np.uint32)
    qzeros = np.zeros((stored.shape[0], stored.shape[1] // per_word), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per_word):
            qzeros[:, col] |= stored[:, col * per_word + j] << (bits * j)
    return {
        "qweight": torch.from_numpy(qweight.view(np.int32)),
        "qzeros": torch.from_numpy(qzeros.view(np.int32)),
        "scales": torch.from_numpy(np.ascontiguousarray(scales.T)),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }


def make_quantized(
    source: Path, directory: Path, method: str, bits: int = 4, act_order: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """`source`'s checkpoint with every layer projection quantized and packed by `method`;
    returns each projection's integer codes and the float weights they stand for. `act_order`
    (GPTQ's desc_act): each group gathers input rows in an order of their own, shared by the
    projections that read the same input (GPTQ orders them by the same Hessian)."""
    directory.mkdir()
    for file in source.iterdir():
        if file.name not in ("model.safetensors", "config.json"):
            (directory / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    codes_of: dict[str, np.ndarray] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        prefix = name[: -len(".weight")]
        weight = tensors.pop(name).numpy()
        k = weight.shape[1]
        reads = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
        seed = sum(map(ord, prefix.rsplit(".", 1)[0] + reads.get(prefix.rsplit(".", 1)[1], prefix)))
        order = np.random.default_rng(seed).permutation(k) if act_order else np.arange(k)
        ordered, scales, zeros = quantize(weight[:, order], bits, GROUP)  # groups of rows in `order`
        codes = np.empty_like(ordered)
        codes[:, order] = ordered
        g_idx = np.empty(k, np.int64)
        g_idx[order] = np.arange(k) // GROUP
        codes_of[name] = codes
        float_weight = np.empty_like(weight)
        float_weight[:, order] = dequantize(ordered, scales, zeros, GROUP)
        dequantized[name] = torch.from_numpy(float_weight)
        packed = pack_awq(codes, scales, zeros) if method == "awq" else pack_gptq(codes, scales, zeros, bits, g_idx)
        tensors.update({f"{prefix}.{part}": tensor for part, tensor in packed.items()})
    save_file(tensors, directory / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
        if method == "awq"
        else {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": act_order, "sym": False}
    )
    (directory / "config.json").write_text(json.dumps(config))
    return codes_of, dequantized


def matmul_nbits_codes(model: onnx.ModelProto, directory: Path) -> dict[str, np.ndarray]:
    """Each MatMulNBits' codes [N, K] as the artifact stores them (unpacked here: low nibble first)."""
    initializers = {t.name: t for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        b = numpy_helper.to_array(initializers[node.input[1]], base_dir=str(directory))
        n, k, bits = attrs["N"], attrs["K"], attrs["bits"]
        if bits == 4:
            b = np.stack([b & 0x0F, b >> 4], axis=-1)
        found[node.input[1]] = b.reshape(n, -1)[:, :k].astype(np.int64)
    return found


@pytest.mark.slow
@pytest.mark.parametrize(
    "method, bits, act_order", [("awq", 4, False), ("gptq", 4, False), ("gptq", 8, False), ("gptq", 4, True)]
)
def test_a_prequantized_checkpoint_imports_its_own_codes_exactly(
    method: str, bits: int, act_order: bool, tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    source = tiny_checkpoint("llama")
    checkpoint = tmp_path / method
    codes_of, dequantized = make_quantized(source, checkpoint, method, bits, act_order)
    result = build(checkpoint, tmp_path / "out", BuildOptions())
    manifest = result.manifest
    parity = manifest["parity"]
    assert (
        parity["passed"] and parity["dtype"] == "float32" and parity["tolerance"]["relative"] == 2e-4
    )  # the float gate
    imported = manifest["imported_weights"]
    assert imported["method"] == method and set(imported["weights"]) == set(codes_of)
    assert all(
        w["exact"] and w["form"] == "matmul_nbits" and w["block_size"] == GROUP for w in imported["weights"].values()
    )
    assert manifest["passes"]["histogram_after"].get("MatMul", 0) == 1  # the float LM head only

    # the artifact's codes are the checkpoint's, packed projections being their parts stacked along N
    model = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    stored = matmul_nbits_codes(model, tmp_path / "out")
    assert len(stored) == 2 * 4  # per layer: qkv, o, gate_up, down
    orders = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name.endswith(".input_order")}
    assert len(orders) == (len(stored) if act_order else 0)  # act-order: each gathers its activations once
    for name, entry in imported["weights"].items():
        graph_weight = entry.get("graph_weight", name)
        parts = [n for n, e in imported["weights"].items() if e.get("graph_weight", n) == graph_weight]
        expected = np.concatenate(
            [codes_of[part] for part in sorted(parts, key=lambda part: PROJECTIONS.index(part.split(".")[-2]))]
        )
        order = orders.get(f"{graph_weight}.q{bits}.input_order", np.arange(expected.shape[1]))
        np.testing.assert_array_equal(stored[f"{graph_weight}.q{bits}"], expected[:, order])  # in the order stored

    # logits equal transformers' on the dequantized weights (computed here) within the float32 gate's tolerance
    from transformers import AutoConfig, AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32).eval()
    state = load_file(source / "model.safetensors") | dequantized
    reference.load_state_dict(state, strict=False)
    prompt = [[1, 17, 42, 99, 5, 230, 77, 8]]
    with torch.no_grad():
        expected = reference(torch.tensor(prompt)).logits[:, -1].numpy()
    io = DecoderIO.from_dict(manifest["io"])
    ids = np.array(prompt, dtype=np.int64)
    logits, _ = forward(
        OrtSession(tmp_path / "out" / "model.onnx", io), ids, np.ones_like(ids), empty_cache(io, 1, len(prompt[0]))
    )
    scale = np.abs(expected).max()
    np.testing.assert_allclose(logits[:, -1], expected, rtol=0, atol=2e-4 * scale)
    # and not by chance: the float checkpoint's own logits differ from them by more than that
    with torch.no_grad():
        reference.load_state_dict(load_file(source / "model.safetensors"))
        unquantized = reference(torch.tensor(prompt)).logits[:, -1].numpy()
    assert np.abs(unquantized - expected).max() > 10 * 2e-4 * scale
    assert verify(tmp_path / "out", checkpoint).passed  # `kvforge verify` reruns the same float gate


def test_the_checkpoint_dequantizes_its_weights_for_the_eager_model(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """`state_dict` gives the float weights a GPTQ checkpoint's codes stand for, without its packed tensors."""
    _, dequantized = make_quantized(tiny_checkpoint("llama"), tmp_path / "gptq", "gptq")
    ckpt = checkpoints.load(tmp_path / "gptq")
    state = ckpt.state_dict(torch.float32)
    assert not any(name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for name in state)
    for name, weight in dequantized.items():
        torch.testing.assert_close(state[name], weight, rtol=0, atol=0)
    records = ckpt.quantized_weights()
    assert set(records) == set(dequantized) and all(r.exact for r in records.values())


def test_act_order_groups_are_held_in_group_order_and_unequal_groups_stay_float(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    codes_of, dequantized = make_quantized(tiny_checkpoint("llama"), tmp_path / "gptq", "gptq", act_order=True)
    ckpt = checkpoints.load(tmp_path / "gptq")
    name = "model.layers.0.mlp.down_proj.weight"
    found = ckpt.quantized_weights()[name]
    assert found.exact and found.record.input_order is not None
    np.testing.assert_array_equal(found.record.codes, codes_of[name][:, found.record.input_order])
    torch.testing.assert_close(ckpt.state_dict(torch.float32)[name], dequantized[name], rtol=0, atol=0)
    # groups of unequal sizes: no block size holds them, the weight is float (and still right)
    tensors = load_file(tmp_path / "gptq" / "model.safetensors")
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    moved = g_idx.clone()
    moved[g_idx == 0] = 1  # group 0 empty, group 1 twice as large; scale and zero of group 1
    tensors["model.layers.0.mlp.down_proj.g_idx"] = moved
    save_file(tensors, tmp_path / "gptq" / "model.safetensors")
    ckpt = checkpoints.load(tmp_path / "gptq")
    found = ckpt.quantized_weights()[name]
    assert not found.exact and "unequal" in found.reason
    scales = tensors["model.layers.0.mlp.down_proj.scales"].float().numpy()  # [groups, N]
    weight = ckpt.state_dict(torch.float32)[name].numpy()
    rows = np.flatnonzero(g_idx.numpy() == 0)
    ratio = weight[:, rows] / scales[1][:, None]  # (code - zero) of group 1's scale: whole numbers
    np.testing.assert_allclose(ratio, np.round(ratio), atol=1e-3)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "is not one kvforge imports"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "GPTQ of 3 bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": "128"}, "group_size is '128'"),
    ],
)
def test_a_quantization_kvforge_cannot_read_is_refused_naming_the_field(
    fields: dict[str, object], words: str, tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for file in tiny_checkpoint("llama").iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"quantization_config": fields}))
    with pytest.raises(CheckpointError, match="quantization_config") as error:
        checkpoints.load(directory)
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_a_weights_recipe_keeps_the_imported_codes_and_quantizes_only_the_float_weights(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """`--weights int4` on an AWQ checkpoint: its projections keep their codes (at the recipe's
    accuracy level, judged by the distribution gate), the float LM head and table are quantized."""
    from kvforge.passes.quantize import WeightQuantization

    codes_of, _ = make_quantized(tiny_checkpoint("llama"), tmp_path / "awq", "awq")
    manifest = build(tmp_path / "awq", tmp_path / "out", BuildOptions(weights=WeightQuantization(4))).manifest
    assert manifest["parity"]["passed"] and manifest["parity"]["precision"] == "int4"
    assert all(w["exact"] for w in manifest["imported_weights"]["weights"].values())
    model = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
    levels = {
        node.input[1]: {a.name: a.i for a in node.attribute}.get("accuracy_level", 0)
        for node in model.graph.node
        if node.op_type == "MatMulNBits"
    }
    assert len(levels) == 2 * 4 + 1 and set(levels.values()) == {4}  # the imported projections and the LM head
    stored = matmul_nbits_codes(model, tmp_path / "out")
    np.testing.assert_array_equal(
        stored["model.layers.1.mlp.down_proj.weight.q4"], codes_of["model.layers.1.mlp.down_proj.weight"]
    )
    assert manifest["passes"]["histogram_after"].get("com.microsoft::GatherBlockQuantized", 0) == 1


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda t: t.flatten(), "2-D int32"),
        (lambda t: t.to(torch.int16), "2-D int32"),
        (lambda t: t[:, :-1].contiguous(), "qzeros has shape"),
    ],
)
def test_damaged_packed_tensors_are_refused_naming_the_tensor(
    damage: Callable[[torch.Tensor], torch.Tensor], words: str, tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    make_quantized(tiny_checkpoint("llama"), tmp_path / "awq", "awq")
    tensors = load_file(tmp_path / "awq" / "model.safetensors")
    name = "model.layers.1.self_attn.o_proj.qweight"
    tensors[name] = damage(tensors[name])
    save_file(tensors, tmp_path / "awq" / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.o_proj") as error:
        checkpoints.load(tmp_path / "awq").state_dict(torch.float32)
    assert words in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_the_footprint_counts_the_weights_the_codes_stand_for(
    method: str, tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """`kvforge inspect`: the precisions' bytes are the float model's, the stored bytes the file's."""
    from kvforge.toolchain.footprint import footprint
    from kvforge.toolchain.spec import DecoderSpec

    source = tiny_checkpoint("llama")
    make_quantized(source, tmp_path / method, method)
    quantized, original = checkpoints.load(tmp_path / method), checkpoints.load(source)
    spec = DecoderSpec.from_config(original.config)
    got, want = (footprint(c, spec, batch=1, seq=8) for c in (quantized, original))
    assert got.weight_bytes_at == want.weight_bytes_at
    stored = sum(t.numel() * t.element_size() for t in load_file(tmp_path / method / "model.safetensors").values())
    assert got.weight_bytes == stored < want.weight_bytes
