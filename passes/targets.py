"""What each target means, as one frozen record per target.

`kvforge.toolchain.build`, the CLI and `kvforge.passes.pipeline` read these records and name no target:
a new target is a new record here (and the phase factories it names in `kvforge.passes.pipeline`).
This module imports nothing heavy, so the CLI can offer the targets without loading the
graph passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

# How a target's artifact is written (kvforge.toolchain.build): the ONNX graph alone, or the graph and,
# where TensorRT and a GPU are present, the TensorRT engine built from it (kvforge.toolchain.emit.tensorrt).
ONNX = "onnx"
TENSORRT_ENGINE = "tensorrt-engine"
CPU_PROVIDER, CUDA_PROVIDER = "CPUExecutionProvider", "CUDAExecutionProvider"


@dataclass(frozen=True)
class Target:
    name: str
    summary: str  # one line for the CLI's help
    # Phase names, in order: keys of kvforge.passes.pipeline.PHASES. Quantization, when asked for, runs
    # just before the last phase.
    phases: tuple[str, ...]
    # Weight bits -> how quantized weights are written (kvforge.passes.quantize); absent: "dequantize_linear"
    quantization_forms: Mapping[int, str]
    # How the token-embedding table is looked up once quantized (kvforge.passes.quantize_embedding);
    # None: the table stays in the compute dtype
    embedding_form: str | None
    # (domain, op) of the ops that write present into the past buffer when both are bound to
    # the same memory: a graph whose every present comes from one has an in-place ("shared") cache
    in_place_cache_ops: tuple[tuple[str, str], ...]
    # Fusions that fire once per layer on every architecture; a shortfall is explained (--explain)
    per_layer_fusions: tuple[str, ...]
    # Fusions that fire once per mixture-of-experts layer (kvforge.passes.fuse_moe); a shortfall is explained
    moe_fusions: tuple[str, ...]
    # How routed experts' weights are quantized under --weights (kvforge.passes.quantize_experts): "qmoe"
    # (onnxruntime's QMoE, with int8 gathered slices where MoE did not fuse), "gather" (int8 codes
    # gathered then dequantized, standard ops), or None (left at full precision)
    expert_quantization: str | None
    fixed_capacity: bool  # the KV cache has a fixed length (--capacity), recorded in the flags
    symmetric_only: bool  # quantized weights must have a zero zero-point
    emitter: str  # ONNX or TENSORRT_ENGINE
    genai: bool  # onnxruntime-genai can drive the graph (kvforge.toolchain.emit.genai)
    # Its runner carries fixed-size layer states (convolution layers), tested end to end
    layer_states: bool = False
    # Sliding-window layers keep only their window's last positions (`DecoderIO.layer_windows`);
    # False: every layer keeps its whole history, and the mask alone applies the window
    bounded_windows: bool = False
    # Its quantized MatMul weights are onnxruntime's MatMulNBits, whose block size and accuracy
    # level `kvforge build --tune fast|full` may choose per weight by timing them (kvforge.toolchain.tune)
    kernel_tuning: bool = False
    # The compute dtype a build takes when none is asked for (`kvforge build --dtype`)
    default_dtype: str = "float32"
    # onnxruntime's execution providers the graph is for, the one it is meant to run on first:
    # a fused op is emitted only where it means the same on each (kvforge.passes.fuse_moe), and the
    # verification gate runs on the first one onnxruntime offers on the build machine
    providers: tuple[str, ...] = (CPU_PROVIDER,)
    # The graph takes `logits_to_keep` (kvforge.passes.last_position) by default: one graph for prefill
    # (the last position) and speculative verify steps (every position fed). False: the last
    # position only, unless `--logits all` is asked for
    logits_to_keep: bool = True

    @property
    def default_logits(self) -> str:
        """The logits positions a build makes unless told: "keep" where the graph takes
        `logits_to_keep`, else "last"."""
        return "keep" if self.logits_to_keep else "last"

    def expected_fusions(self, num_layers: int, moe_layers: int = 0) -> dict[str, int]:
        expected = {fusion: num_layers for fusion in self.per_layer_fusions}
        expected.update({fusion: moe_layers for fusion in self.moe_fusions if moe_layers})
        return expected

    def quantization_form(self, bits: int) -> str:
        return self.quantization_forms.get(bits, "dequantize_linear")

    @property
    def tied_lookup(self) -> bool:
        """Whether its token lookup can read a tied LM head's 8-bit `MatMulNBits` codes
        (`GatherBlockQuantized`), so that a build whose head is at 8 bits (an 8-bit build, or a mix
        keeping it there) stores one matrix for both (`kvforge.passes.storage.shared_head`)."""
        return self.embedding_form == "gather_block_quantized" and self.quantization_form(8) == "matmul_nbits"


_FROZEN_NONE: Mapping[int, str] = MappingProxyType({})

ORT_CPU = Target(
    name="ort-cpu",
    summary="onnxruntime's fused ops and an in-place KV cache",
    phases=("canonicalize", "fuse", "pack", "lower-ort", "finalize"),
    quantization_forms=MappingProxyType({4: "matmul_nbits", 8: "matmul_nbits"}),
    embedding_form="gather_block_quantized",
    in_place_cache_ops=(("com.microsoft", "GroupQueryAttention"),),
    per_layer_fusions=("attention", "attention_ort"),
    moe_fusions=("moe_ort",),
    expert_quantization="qmoe",
    fixed_capacity=False,
    symmetric_only=False,
    emitter=ONNX,
    genai=True,
    layer_states=True,
    bounded_windows=True,
    kernel_tuning=True,
)

TARGETS: Mapping[str, Target] = MappingProxyType(
    {
        target.name: target
        for target in (
            ORT_CPU,
            # The same graph for onnxruntime's CUDA provider, in its forms
            replace(
                ORT_CPU,
                name="ort-cuda",
                summary="onnxruntime's CUDA provider: fp16, its fused ops and an in-place KV cache",
                phases=("canonicalize", "fuse", "pack", "lower-ort-cuda", "finalize"),
                # Not quantized: GatherBlockQuantized is a CPU kernel; the table stays in fp16
                embedding_form=None,
                per_layer_fusions=("attention", "attention_ort", "norm_ort"),
                # Not quantized: QMoE's CUDA kernels read weights packed for their GEMMs, which
                # its CPU kernel does not, so no one graph is right on both
                expert_quantization=None,
                genai=False,
                kernel_tuning=False,  # the timings would be the CPU's kernels'
                default_dtype="float16",
                providers=(CUDA_PROVIDER, CPU_PROVIDER),
            ),
            Target(
                name="onnx",
                summary="standard ONNX ops only (portable)",
                phases=("canonicalize", "fuse", "pack", "fixed-cache", "finalize"),
                quantization_forms=_FROZEN_NONE,
                # Gather of 8-bit codes + DequantizeLinear
                embedding_form="gather_dequantize_linear",
                in_place_cache_ops=(("", "TensorScatter"),),
                per_layer_fusions=("attention", "attention_scatter"),
                moe_fusions=(),
                expert_quantization="gather",
                fixed_capacity=False,
                symmetric_only=False,
                emitter=ONNX,
                genai=True,
            ),
            Target(
                name="tensorrt",
                summary="the portable graph as TensorRT's parser takes it, plus the engine where TensorRT and a GPU "
                "are present",
                phases=("canonicalize", "fuse", "pack", "fixed-cache", "tensorrt", "finalize-tensorrt"),
                # TensorRT's int8 weights are per channel; int4 block-wise DequantizeLinear
                quantization_forms=MappingProxyType({8: "dequantize_linear_channel"}),
                # Not quantized: TensorRT's parser gathers float, int32, int64 and bool tensors only,
                # its quantized types exist only as a DequantizeLinear of a constant, and the target
                # dequantizes a weight only into a MatMul (docs/pipeline.md)
                embedding_form=None,
                in_place_cache_ops=(("", "TensorScatter"),),
                per_layer_fusions=("attention", "attention_scatter"),
                moe_fusions=(),
                # TensorRT's parser gathers float and integer tensors but dequantizes only a
                # constant into a MatMul (as for the embedding table)
                expert_quantization=None,
                fixed_capacity=True,
                symmetric_only=True,  # TensorRT requires a zero zero-point
                emitter=TENSORRT_ENGINE,
                genai=False,  # a fixed capacity, and its engine is kvforge's
                # TensorRT's parser takes an initializer that is also a graph input as a weight, so the
                # input's default could not be overridden; an engine would need it as a shape input with
                # its own profile ranges, which no test here can build
                logits_to_keep=False,
            ),
        )
    }
)
DEFAULT_TARGET = "ort-cpu"


def choices() -> str:
    return ", ".join(TARGETS)
