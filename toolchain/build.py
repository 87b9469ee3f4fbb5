"""`kvforge build` and `kvforge verify` as plain functions over the pipeline's stages.

A build writes into a locked staging sibling of the output directory, verifies the graph
from the files it just wrote, writes the manifest last, and only then swaps the directory
into place (`toolchain.publish`). Any failure removes the staging directory: nothing is
published, and a previous artifact stays as it was.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx_ir as ir

from passes import pipeline
from passes.pipeline import PassReport
from runners.contract import DecoderIO
from runners.errors import ArtifactError
from runners.manifest import MANIFEST, read_manifest, verify_files
from runners.session import OrtSession
from runners.torch_session import TorchSession
from toolchain import checkpoint as checkpoints
from toolchain import emit, manifest
from toolchain.export import DecoderWrapper, eager_model, export_decoder
from toolchain.lower import OPSET, apply_contract, to_onnx
from toolchain.publish import check_output, publish, staged
from toolchain.spec import DecoderSpec
from toolchain.verify import ParityReport, check_parity, require_parity

log = logging.getLogger(__name__)

DEFAULT_TARGET = "ort-cpu"
COMPUTE_DTYPE = "float32"


@dataclass(frozen=True)
class BuildOptions:
    force: bool = False
    allow_pickle: bool = False
    decode_steps: int = 8
    target: str = DEFAULT_TARGET

    def flags(self) -> dict[str, Any]:
        """What determines the artifact's bytes (not `force`, which only says where they may go)."""
        return {
            "target": self.target,
            "dtype": COMPUTE_DTYPE,
            "opset": OPSET,
            "allow_pickle": self.allow_pickle,
            "decode_steps": self.decode_steps,
        }


@dataclass
class BuildResult:
    output: Path
    manifest: dict[str, Any]
    parity: ParityReport
    passes: PassReport
    seconds: dict[str, float] = field(default_factory=dict)


def build(checkpoint_dir: Path, output: Path, options: BuildOptions = BuildOptions()) -> BuildResult:
    output = Path(os.path.abspath(output))
    if options.target not in pipeline.TARGETS:
        raise ArtifactError(f"unknown target {options.target!r}; choose one of {', '.join(pipeline.TARGETS)}")
    check_output(output, options.force)
    seconds: dict[str, float] = {}
    ckpt = checkpoints.load(checkpoint_dir, allow_pickle=options.allow_pickle)
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    checkpoints.check_against_spec(ckpt, spec)
    io = DecoderIO.for_spec(spec)
    with _timed(seconds, "load"):
        model = eager_model(ckpt, spec)
    with _timed(seconds, "export"):
        program = export_decoder(model, spec, io)
    with _timed(seconds, "lower"):
        onnx_model = to_onnx(program, io)
    del program
    with _timed(seconds, "passes"):
        pass_report = pipeline.run(onnx_model, options.target, expected_fusions(spec))
    graph_io = _graph_contract(onnx_model, io)
    try:
        with staged(output) as staging:
            with _timed(seconds, "emit"):
                emit.write_onnx(onnx_model, staging)
                del onnx_model
                emit.copy_tokenizer(ckpt, staging)
                emit.write_generation_config(ckpt, spec, staging)
            with _timed(seconds, "verify"):
                report = check_parity(
                    TorchSession(DecoderWrapper(model, spec.num_layers), io),
                    OrtSession(staging / emit.MODEL_FILE, graph_io),
                    max_positions=spec.max_positions,
                    dtype=COMPUTE_DTYPE,
                    decode_steps=options.decode_steps,
                )
                require_parity(report, str(checkpoint_dir))
            written = manifest.write(
                staging,
                spec=spec,
                io=graph_io,
                sources=ckpt.source_hashes(),
                flags=options.flags(),
                passes=pass_report.to_dict(timings=False),
                parity=report.to_dict(),
            )
            publish(staging, output)
    except OSError as e:  # a full disk, a read-only or vanished directory: nothing was published
        where = e.filename or output.parent
        raise ArtifactError(f"{where}: cannot write the artifact ({e.strerror or e}); nothing was published") from e
    log.info("published %s (%s)", output, report.summary())
    return BuildResult(output, written, report, pass_report, seconds)


def verify(artifact: Path, checkpoint_dir: Path, *, allow_pickle: bool = False) -> ParityReport:
    """Re-run the parity gate of a published artifact against its checkpoint."""
    recorded = read_manifest(artifact)
    verify_files(artifact, recorded)
    ckpt = checkpoints.load(checkpoint_dir, allow_pickle=allow_pickle)
    if ckpt.source_hashes() != recorded.get("sources"):
        raise ArtifactError(
            f"{checkpoint_dir}: files differ from the checkpoint {artifact} was built from "
            f"(see sources in {artifact / MANIFEST}); pass the original checkpoint"
        )
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    checkpoints.check_against_spec(ckpt, spec)
    io = DecoderIO.from_dict(recorded["io"])
    model = eager_model(ckpt, spec)
    report = check_parity(
        TorchSession(DecoderWrapper(model, spec.num_layers), replace(io, kv_mode="concat")),
        OrtSession(artifact / emit.MODEL_FILE, io),
        max_positions=spec.max_positions,
        dtype=recorded["flags"]["dtype"],
        decode_steps=recorded["flags"]["decode_steps"],
    )
    require_parity(report, str(artifact))
    return report


def expected_fusions(spec: DecoderSpec) -> dict[str, int]:
    """How often each fusion should fire on this architecture; shortfalls are explained."""
    return {"attention": spec.num_layers, "attention_ort": spec.num_layers, "attention_scatter": spec.num_layers}


def _graph_contract(model: ir.Model, io: DecoderIO) -> DecoderIO:
    """The contract the passes made of the exported one, applied to the graph's I/O:
    `shared` KV when every present tensor comes from an op that updates the cache in
    place, `last` logits when the LM head only sees the last position."""
    outputs = {v.name: v for v in model.graph.outputs}
    producers = {name: v.producer() for name, v in outputs.items()}
    in_place = all(
        (node := producers.get(name)) is not None and (node.domain, node.op_type) in _IN_PLACE_CACHE_OPS
        for name in io.present_names
    )
    logits_shape = outputs["logits"].shape
    last_only = logits_shape is not None and len(logits_shape) == 3 and logits_shape[1] == 1
    final = replace(io, kv_mode="shared" if in_place else "concat", logits_positions="last" if last_only else "all")
    apply_contract(model.graph, final)
    return final


# Ops that write present into the past buffer when both are bound to the same memory.
_IN_PLACE_CACHE_OPS = (("com.microsoft", "GroupQueryAttention"), ("", "TensorScatter"))


@contextmanager
def _timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    log.info("%s...", stage)
    start = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - start
