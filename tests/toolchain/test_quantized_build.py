"""Quantized builds end to end: each target's representation, the distribution gate, verify, refusal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto

import kvforge.passes.quantize as quantize_module
from kvforge.passes.quantize import WeightQuantization
from kvforge.passes.targets import TARGETS
from kvforge.runners.bench import weight_bytes_per_step
from kvforge.runners.engine import Engine
from kvforge.runners.errors import ArtifactError, ParityError
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain.build import BuildOptions, build, verify
from kvforge.toolchain.footprint import QUANT_BLOCK, QuantLayout, footprint, quantized_weight_bytes
from kvforge.toolchain.spec import DecoderSpec

pytestmark = pytest.mark.slow


def parameter_bytes(model_path: Path, only: Callable[[TensorProto], bool] | None = None) -> int:
    """Bytes of the initializers that hold the checkpoint's parameters (named after them), or
    of those `only` picks."""
    model = onnx.load(model_path, load_external_data=False)
    bits = {
        TensorProto.FLOAT: 32,
        TensorProto.FLOAT16: 16,
        TensorProto.UINT8: 8,
        TensorProto.INT8: 8,
        TensorProto.INT4: 4,
        TensorProto.UINT4: 4,
    }
    total = 0
    for tensor in model.graph.initializer:
        if (only or _named_after_a_parameter)(tensor):
            total += (int(np.prod(tensor.dims)) * bits[tensor.data_type] + 7) // 8
    return total


def _named_after_a_parameter(tensor: TensorProto) -> bool:
    return tensor.name.startswith(("model.", "lm_head.")) and "rotary_emb" not in tensor.name


def lookup_only(model_path: Path, vocab: int) -> Callable[[TensorProto], bool]:
    """Picks the [vocab, ...] initializers only the token lookup reads (Gather, GatherBlockQuantized),
    directly or through a Cast (float16 scales)."""
    model = onnx.load(model_path, load_external_data=False)
    readers: dict[str, set[str]] = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    for node in model.graph.node:
        if node.op_type == "Cast":
            source = readers[node.input[0]]
            readers[node.input[0]] = (source - {"Cast"}) | readers.get(node.output[0], set())
    lookups = {"Gather", "GatherBlockQuantized"}
    return lambda t: bool(t.dims) and t.dims[0] == vocab and bool(readers.get(t.name)) and readers[t.name] <= lookups


def float_tables(model_path: Path, shape: list[int]) -> list[str]:
    """Float initializers of `shape` ([vocab, hidden]: an embedding table left in float)."""
    model = onnx.load(model_path, load_external_data=False)
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)
    return [t.name for t in model.graph.initializer if t.data_type in floats and list(t.dims) == shape]


@pytest.mark.parametrize(
    "target, model_type, weights, op",
    [
        ("ort-cpu", "llama", WeightQuantization(4), "com.microsoft::MatMulNBits"),
        ("ort-cpu", "llama", WeightQuantization(4, mix="none"), "com.microsoft::MatMulNBits"),
        ("ort-cpu", "qwen2", WeightQuantization(4), "com.microsoft::MatMulNBits"),  # tied
        ("ort-cpu", "qwen2", WeightQuantization(8), "com.microsoft::MatMulNBits"),  # tied, every weight 8-bit
        ("onnx", "llama", WeightQuantization(4), "DequantizeLinear"),
        ("onnx", "qwen2", WeightQuantization(8, block_size=64, symmetric=False), "DequantizeLinear"),  # tied
        ("tensorrt", "llama", WeightQuantization(4), "DequantizeLinear"),  # block-wise, through the parser's checker
        ("tensorrt", "llama", WeightQuantization(8), "DequantizeLinear"),  # per channel, as TensorRT takes int8
    ],
)
def test_quantized_build_passes_the_distribution_gate_and_generates(
    target: str,
    model_type: str,
    weights: WeightQuantization,
    op: str,
    tmp_path: Path,
    tiny_checkpoint: Callable[..., Path],
) -> None:
    checkpoint = tiny_checkpoint(model_type)
    options = BuildOptions(target=TARGETS[target], weights=weights)
    # int4 takes zero points where the target's kernel reads them, unless the recipe says otherwise
    zero_points = weights.bits == 4 and target != "tensorrt" if weights.symmetric is None else not weights.symmetric
    assert options.weights is not None and options.weights.symmetric is not zero_points
    result = build(checkpoint, tmp_path / "out", options)
    manifest = result.manifest
    assert manifest["flags"]["weights"] == options.weights.to_dict()
    parity = manifest["parity"]
    assert parity["passed"] and parity["precision"] == weights.name and parity["positions"] > 0
    assert 0 <= parity["kl_mean"] <= parity["threshold"]["max_kl"]
    layers = manifest["spec"]["num_layers"]
    after = manifest["passes"]["histogram_after"]
    assert after.get(op, 0) >= 4 * layers  # q/k/v/o and the MLP's projections (packed or not)
    # every projection is quantized: each MatMul left reads a dequantized weight, or none is left;
    # on `onnx` one more DequantizeLinear dequantizes the looked-up embedding rows
    lookups = {"ort-cpu": 0, "onnx": 1, "tensorrt": 0}[target]
    assert after.get("MatMul", 0) == (after[op] - lookups if op == "DequantizeLinear" else 0)
    # the embedding table is quantized, except on tensorrt, which gathers float tables only
    spec = manifest["spec"]
    tables = float_tables(tmp_path / "out" / "model.onnx", [spec["vocab_size"], spec["hidden_size"]])
    assert len(tables) == (1 if target == "tensorrt" else 0)
    assert after.get("com.microsoft::GatherBlockQuantized", 0) == (1 if target == "ort-cpu" else 0)
    lookup = [r["fusions"] for r in manifest["passes"]["passes"] if r["name"] == "QuantizeEmbedding"]
    # a tied table, where the lookup reads MatMulNBits' codes: the head's own 8-bit codes, one
    # matrix for both (an int8 build, the default int4 mix); else a table of its own
    shared = target == "ort-cpu" and model_type == "qwen2" and (weights.bits == 8 or weights.mixed == "all_attention")
    assert lookup == ([] if target == "tensorrt" else [{"shared": 1} if shared else {"quantized": 1}])
    if shared:
        graph_proto = onnx.load(tmp_path / "out" / "model.onnx", load_external_data=False)
        (gather,) = [n for n in graph_proto.graph.node if n.op_type == "GatherBlockQuantized"]
        heads = [n for n in graph_proto.graph.node if n.op_type == "MatMulNBits" and n.input[1] == gather.input[0]]
        assert len(heads) == 1 and {a.name: a.i for a in heads[0].attribute}["bits"] == 8
        assert len(heads[0].input) == 3  # symmetric: no zero points
    # the weights really are smaller than the checkpoint's float32 ones
    weights_bytes = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    assert (tmp_path / "out" / "model.onnx.data").stat().st_size < 0.7 * weights_bytes
    # `kvforge inspect`'s figure for this recipe is the artifact's parameter bytes, exactly (on
    # `onnx` at int4, plus the half byte per value of the table's 8-bit codes), the default mix's
    # 8-bit weights included; the default recipe's is the figure of inspect's table
    recipe = options.weights
    if target != "tensorrt" and weights.block_size == QUANT_BLOCK:
        ckpt = checkpoints.load(checkpoint)
        decoder = DecoderSpec.from_config(ckpt.config)
        # `onnx`'s DequantizeLinear reads float32 scales (the table's lookup, float16 ones), and
        # its 8-bit weights in the recipe's blocks, where MatMulNBits reads them in blocks of 128
        nbits = target != "onnx"
        layout = QuantLayout(
            recipe.bits,
            zero_points=not recipe.symmetric,
            mix=recipe.mixed,
            scale_bytes=2 if nbits else 4,
            wide_blocks=nbits,
            # ort-cpu looks a 4-bit table up in blocks of 16, or in a tied head's codes
            table_block=16 if target == "ort-cpu" and recipe.bits == 4 else None,
            tied_lookup=target == "ort-cpu",
        )
        expected = quantized_weight_bytes(ckpt, decoder, layout)
        if weights.mix is None and target != "onnx":
            assert expected == footprint(ckpt, decoder, batch=1, seq=1).weight_bytes_at[weights.name]
        if target == "onnx" and weights.bits == 4:
            expected += spec["vocab_size"] * spec["hidden_size"] // 2
            if not recipe.symmetric:  # and a byte per block's zero point where the 4-bit ones take half
                blocks = -(-spec["hidden_size"] // QUANT_BLOCK)
                expected += spec["vocab_size"] * (blocks - -(-blocks // 2))
        assert parameter_bytes(tmp_path / "out" / "model.onnx") == expected
    # `kvforge bench` counts every weight byte but the lookup's own (tied, a quantized lookup has
    # codes of its own, unless it reads the head's, which every step reads)
    data = (tmp_path / "out" / "model.onnx.data").stat().st_size
    graph = tmp_path / "out" / "model.onnx"
    table = parameter_bytes(graph, lookup_only(graph, spec["vocab_size"]))
    if shared:  # the head reads every code the lookup does (a tiny table's scales are folded into a copy)
        assert weight_bytes_per_step(tmp_path / "out", manifest) == data
    else:
        assert table > 0
        assert weight_bytes_per_step(tmp_path / "out", manifest) == data - table
    engine = Engine.load(tmp_path / "out")
    tokens = engine.generate_tokens([engine.encode("def main():")], max_new_tokens=6, temperature=0.0)[0]
    assert len(tokens) >= 1
    assert verify(tmp_path / "out", checkpoint).passed


def test_a_quantization_that_breaks_the_model_fails_the_gate_and_publishes_nothing(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = quantize_module.matmul_nbits_inputs

    def wrong_scales(q):  # type: ignore[no-untyped-def]
        b, scales, zero_points = real(q)
        return b, np.ascontiguousarray(scales[::-1]) * 4, zero_points  # scales of other blocks, and too large

    monkeypatch.setattr(quantize_module, "matmul_nbits_inputs", wrong_scales)
    out = tmp_path / "out"
    with pytest.raises(ParityError, match="distribution FAILED"):
        build(tiny_checkpoint("llama"), out, BuildOptions(weights=WeightQuantization(4)))
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_asymmetric_weights_for_tensorrt_are_refused_before_any_work(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    with pytest.raises(ArtifactError, match="symmetric"):
        build(
            tiny_checkpoint("llama"),
            tmp_path / "out",
            BuildOptions(target=TARGETS["tensorrt"], weights=WeightQuantization(4, symmetric=False)),
        )
    assert list(tmp_path.iterdir()) == []


def test_a_mixed_int4_build_keeps_the_named_weights_at_int8(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """`--weights int4 --int8 ... --mix none` through the CLI: the down projections, the LM head and the
    table at 8 bits, every other projection at 4; the gate passes and the manifest records the recipe."""
    from click.testing import CliRunner

    from kvforge.cli import main

    out = tmp_path / "out"
    mixed = ["--int8", "*down_proj*", "--int8", "lm_head", "--int8", "embeddings", "--mix", "none"]
    result = CliRunner().invoke(
        main, ["build", str(tiny_checkpoint("llama")), "-o", str(out), "--weights", "int4", *mixed]
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["flags"]["weights"]["int8"] == ["*down_proj*", "lm_head", "embeddings"]
    assert manifest["parity"]["passed"]
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    bits = {
        n.input[1]: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"
    }
    layers = manifest["spec"]["num_layers"]
    wide = sorted(name for name, b in bits.items() if b == 8)
    assert len(wide) == layers + 1 and all("down_proj" in name or name.startswith("lm_head") for name in wide)
    assert sum(b == 4 for b in bits.values()) == len(bits) - layers - 1 >= 3 * layers
    (lookup,) = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert next(a.i for a in lookup.attribute if a.name == "bits") == 8


def test_a_plain_int4_build_keeps_the_attention_inputs_and_down_of_more_bits_layers_at_int8(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """`--weights int4` alone: every layer's packed q/k/v at 8 bits, and the down projection in the
    layers llama.cpp's `use_more_bits` picks; everything else at 4, the table looked up in blocks
    of 16; the gate passes and the manifest records the mix."""
    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.passes.storage import more_bits

    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(tiny_checkpoint("llama")), "-o", str(out), "--weights", "int4"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["flags"]["weights"]["mix"] == "all_attention" and manifest["parity"]["passed"]
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    bits = {
        n.input[1]: next(a.i for a in n.attribute if a.name == "bits") for n in graph.node if n.op_type == "MatMulNBits"
    }
    layers = manifest["spec"]["num_layers"]
    picked = [i for i in range(layers) if more_bits(i, layers)]
    assert picked and len(picked) < layers
    want = {f"model.layers.{i}.self_attn.qkv_proj.weight.q8" for i in range(layers)}
    want |= {f"model.layers.{i}.mlp.down_proj.weight.q8" for i in picked}
    assert sorted(name for name, b in bits.items() if b == 8) == sorted(want)
    assert sum(b == 4 for b in bits.values()) == len(bits) - len(want)
    (lookup,) = [n for n in graph.node if n.op_type == "GatherBlockQuantized"]
    assert {a.name: a.i for a in lookup.attribute if a.name in ("bits", "block_size")} == {"bits": 4, "block_size": 16}


def test_int8_without_int4_is_refused_before_any_work(tmp_path: Path, tiny_checkpoint: Callable[..., Path]) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    for weights in ([], ["--weights", "int8"]):
        args = ["build", str(tiny_checkpoint("llama")), "-o", str(tmp_path / "out"), *weights, "--int8", "lm_head"]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2 and "--int8" in result.output and "--weights int4" in result.output
    for flag in ("--asymmetric", "--symmetric"):  # how --weights quantizes, without --weights
        result = CliRunner().invoke(main, ["build", str(tiny_checkpoint("llama")), "-o", str(tmp_path / "out"), flag])
        assert result.exit_code == 2 and f"drop {flag}" in result.output and "--weights int4" in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_free_min_build_keeps_weights_on_a_free_min_grid_and_is_refused_where_it_cannot_be(
    tmp_path: Path, tiny_checkpoint: Callable[..., Path]
) -> None:
    """`--weights int4 --free-min` of a checkpoint whose matrices are dequantized 4-bit blocks with a
    free minimum (a GGUF Q4_1 file's): each block comes back as it was, so the gate's KL is the
    int8 activations' alone, far below a symmetric int4 build's, which rounds the blocks again."""
    import shutil

    from click.testing import CliRunner
    from safetensors.numpy import load_file, save_file

    from kvforge.cli import main
    from tests.passes.test_quantize import grid_blocks

    checkpoint = tmp_path / "grid"
    shutil.copytree(tiny_checkpoint("llama"), checkpoint)
    rng = np.random.default_rng(0)  # the same weights whichever tests ran before in this process
    for path in checkpoint.glob("*.safetensors"):
        tensors = load_file(path)
        for name, value in sorted(tensors.items()):
            if value.ndim == 2 and value.shape[1] % 32 == 0:
                tensors[name] = grid_blocks(*value.shape, rng=rng).astype(value.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    kl = {}
    for flags in (["--symmetric"], ["--free-min"]):
        out = tmp_path / flags[0].strip("-")
        result = CliRunner().invoke(
            main,
            [
                "build",
                str(checkpoint),
                "-o",
                str(out),
                "--weights",
                "int4",
                "--mix",
                "none",
                "-q",
                "--decode-steps",
                "2",
            ]
            + flags,
        )
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["parity"]["passed"]
        kl["--free-min" in flags] = manifest["parity"]["kl_mean"]
    assert manifest["flags"]["weights"]["free_min"] is True
    report = {r["name"]: r["fusions"] for r in manifest["passes"]["passes"]}
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert report["QuantizeWeights"]["free_min"] == len(nbits)  # every projection and the LM head
    assert len([t for t in graph.initializer if t.name.endswith(".mins")]) == len(nbits) + 1  # and the table
    assert kl[True] < 0.25 * kl[False], kl
    runner = CliRunner()
    for flags, message in (
        (["--weights", "int8"], "--weights int4"),
        (["--weights", "int4", "--asymmetric"], "drop --asymmetric"),
        (["--weights", "int4", "--target", "tensorrt"], "drop --free-min"),
    ):
        result = runner.invoke(main, ["build", str(checkpoint), "-o", str(tmp_path / "no"), "--free-min", *flags])
        assert result.exit_code != 0 and message in result.output, result.output
        assert not (tmp_path / "no").exists()
