"""The parity gate's sessions, and `kvforge verify`, which re-runs the gate of a published
artifact against its checkpoint.

The build (`kvforge.toolchain.build`) records the eager side of the gate with `record_gate` before it
compiles, and runs the compiled side in the session `verifiable` opens on the files it wrote.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from kvforge.passes.widen import WidenFloats
from kvforge.runners import runtime as runtimes
from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import ArtifactError
from kvforge.runners.manifest import MANIFEST, read_manifest, verify_files
from kvforge.runners.session import OrtSession, Session
from kvforge.runners.tokenizer import TokenizerBundle
from kvforge.runners.torch_session import TorchSession
from kvforge.toolchain import checkpoint as checkpoints
from kvforge.toolchain import emit
from kvforge.toolchain.export import DecoderWrapper, eager_model, read_spec
from kvforge.toolchain.spec import DecoderSpec
from kvforge.toolchain.verify import (
    DistributionReport,
    ParityReport,
    check_distribution,
    compare_with_reference,
    gate_tokens,
    record_reference,
    reference_log_probs,
    require_parity,
)


def verify(
    artifact: Path,
    checkpoint_dir: Path | str,
    *,
    allow_pickle: bool = False,
    revision: str | None = None,
    runtime: str = "ort",
    tolerance: float | None = None,
) -> ParityReport | DistributionReport:
    """Re-run the parity gate of a published artifact against its checkpoint (a directory or a
    cached Hub id), in the session `runtime` chooses (`kvforge.runners.runtime`; "ort", onnxruntime's
    CPU provider, as the build's gate), with the tolerance it was built with (its flags), or
    `tolerance` in its place."""
    recorded = read_manifest(artifact)
    verify_files(artifact, recorded)
    flags = dict(recorded["flags"])
    check_tolerance(tolerance, flags.get("weights") is not None)
    if tolerance is not None:
        flags["tolerance"] = tolerance
    choice = runtimes.choose(runtime, recorded, runtimes.Environment.detect(), str(artifact))
    ckpt = checkpoints.load(checkpoint_dir, allow_pickle=allow_pickle, revision=revision)
    if ckpt.source_hashes() != recorded.get("sources"):
        raise ArtifactError(
            f"{checkpoint_dir}: files differ from the checkpoint {artifact} was built from "
            f"(see sources in {artifact / MANIFEST}); pass the original checkpoint"
        )
    spec = read_spec(ckpt, flags.get("context"))
    io = DecoderIO.from_dict(recorded["io"])
    model = eager_model(ckpt, spec, getattr(torch, flags.get("dtype", "float32")))
    eager = eager_session(model, spec, replace(io, kv_mode="concat"))
    gate = record_gate(eager, flags, spec, artifact)
    del model, eager
    gc.collect()
    if choice.runtime == "ort":
        unquantized = flags.get("weights") is None and "imported_weights" not in recorded
        with verifiable(artifact, io, unquantized) as session:
            report = gate(session)
    else:
        report = gate(_device_session(artifact, recorded, io, choice))
    require_parity(report, str(artifact))
    return report


def _device_session(artifact: Path, recorded: dict[str, Any], io: DecoderIO, choice: runtimes.Choice) -> Session:
    """The artifact on a GPU runtime; a TensorRT session copies its cache back, which the gate compares."""
    if choice.runtime == "tensorrt":
        from kvforge.runners.trt_session import TrtSession

        return TrtSession(artifact, mirror_cache=True)
    return runtimes.open_session(artifact, recorded, io, choice)


@contextmanager
def verifiable(
    directory: Path, io: DecoderIO, unquantized: bool, provider: str = runtimes.CPU_PROVIDER
) -> Iterator[OrtSession]:
    """The session the gate runs the artifact in: on a GPU `provider`, the artifact itself; on
    onnxruntime's CPU provider (for an unquantized graph, without prepacked weights: `OrtSession`'s
    `prepack`): the artifact itself, or, for a half-precision graph, which that provider cannot
    compute (bfloat16) or computes only from float32 copies of every weight made at load (fp16),
    the graph computed in float32 with its weights cast as they are read (`kvforge.passes.widen`). That
    graph is written to a temporary directory beside a hard link to the artifact's weights (a
    copy where the file system has no links), and removed afterwards."""
    if provider != runtimes.CPU_PROVIDER:
        yield OrtSession(directory / emit.MODEL_FILE, io, (provider, runtimes.CPU_PROVIDER))
        return
    narrow = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}.get(io.kv_dtype)
    if narrow is None:
        yield OrtSession(directory / emit.MODEL_FILE, io, prepack=not unquantized)
        return
    model = ir.load(directory / emit.MODEL_FILE)  # the weights stay in the file, referenced
    WidenFloats(narrow).call(model)
    with _scratch_directory(directory) as temporary:
        path = Path(temporary) / emit.MODEL_FILE
        ir.save(model, path)
        del model
        data = directory / emit.DATA_FILE
        if data.exists():
            try:
                os.link(data, path.parent / emit.DATA_FILE)
            except OSError:
                shutil.copyfile(data, path.parent / emit.DATA_FILE)
        yield OrtSession(path, replace(io, kv_dtype="float32"), weights_cast_per_run=True)


def _scratch_directory(near: Path) -> tempfile.TemporaryDirectory[str]:
    """A temporary directory beside `near` (on its file system, where a hard link to it
    works), or in the system's temporary directory where `near`'s parent is not writable
    (a published artifact in a read-only place)."""
    try:
        return tempfile.TemporaryDirectory(prefix=".kvforge-verify-", dir=near.parent)
    except OSError:
        return tempfile.TemporaryDirectory(prefix="kvforge-verify-")


def eager_session(model: torch.nn.Module, spec: DecoderSpec, io: DecoderIO) -> TorchSession:
    """The eager model behind the runner's Session interface, its cache in the model's dtype
    (float32 across numpy for bfloat16, which numpy cannot hold)."""
    dtype = next(model.parameters()).dtype
    transport = replace(io, kv_dtype="float32") if dtype == torch.bfloat16 else io
    return TorchSession(DecoderWrapper(model, spec.num_layers, io), transport, dtype)


def record_gate(
    reference: Session, flags: dict[str, Any], spec: DecoderSpec, tokenizer_dir: Path
) -> Callable[[Session], ParityReport | DistributionReport]:
    """The verification gate the build's flags call for, its eager side run now: returns the
    check of a compiled session against what the eager model gave. Within the dtype's
    tolerance, or, for quantized weights or an int8 cache, the same next-token distributions on the
    gate texts."""
    weights = flags.get("weights")
    if weights is None and flags.get("kv_dtype") is None:
        reference_run = record_reference(
            reference, max_positions=spec.max_positions, decode_steps=flags["decode_steps"]
        )
        return lambda candidate: compare_with_reference(
            reference_run,
            candidate,
            max_positions=spec.max_positions,
            dtype=flags["dtype"],
            tolerance=flags.get("tolerance"),
        )
    tokens = gate_tokens(TokenizerBundle.load(tokenizer_dir).encode)
    expected = reference_log_probs(reference, tokens)
    # an int8 cache beside float weights is judged by int8's bounds
    precision = f"int{weights['bits']}" if weights is not None else str(flags["kv_dtype"])
    return lambda candidate: check_distribution(expected, candidate, tokens, precision)


def check_tolerance(tolerance: float | None, quantized: bool) -> None:
    if tolerance is None:
        return
    if quantized:
        raise ArtifactError(
            f"--tolerance {tolerance:g} sets the parity gate of an unquantized build; a --weights build is judged "
            "by its next-token distributions instead (AGREEMENT in toolchain/verify.py): drop --tolerance"
        )
    if not 0 < tolerance < 1:
        raise ArtifactError(
            f"--tolerance {tolerance:g} must be a fraction of each output's scale between 0 and 1 "
            "(the defaults: TOLERANCES in toolchain/verify.py)"
        )
