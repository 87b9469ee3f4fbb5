"""`kvforge build` and `kvforge verify` as plain functions over the pipeline's stages.

A build writes into a temporary sibling of the output directory, verifies the graph
from the files it just wrote, writes the manifest last, and only then renames the
directory into place. Any failure removes the temporary directory: nothing is published.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runners.contract import DecoderIO
from runners.errors import ArtifactError
from runners.manifest import MANIFEST, read_manifest, verify_files
from runners.session import OrtSession
from runners.torch_session import TorchSession
from toolchain import checkpoint as checkpoints
from toolchain import emit, manifest
from toolchain.export import DecoderWrapper, eager_model, export_decoder
from toolchain.lower import OPSET, to_onnx
from toolchain.spec import DecoderSpec
from toolchain.verify import ParityReport, check_parity, require_parity

log = logging.getLogger(__name__)

TARGET = "onnx"
COMPUTE_DTYPE = "float32"


@dataclass(frozen=True)
class BuildOptions:
    force: bool = False
    allow_pickle: bool = False
    decode_steps: int = 8

    def flags(self) -> dict[str, Any]:
        """What determines the artifact's bytes (not `force`, which only says where they may go)."""
        return {
            "target": TARGET,
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
    seconds: dict[str, float] = field(default_factory=dict)


def build(checkpoint_dir: Path, output: Path, options: BuildOptions = BuildOptions()) -> BuildResult:
    output = Path(os.path.abspath(output))
    _check_output(output, options.force)
    seconds: dict[str, float] = {}
    ckpt = checkpoints.load(checkpoint_dir, allow_pickle=options.allow_pickle)
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    io = DecoderIO.for_spec(spec)
    with _timed(seconds, "load"):
        model = eager_model(ckpt, spec)
    with _timed(seconds, "export"):
        program = export_decoder(model, spec, io)
    with _timed(seconds, "lower"):
        onnx_model = to_onnx(program, io)
    del program
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.partial-"))
    staging.chmod(0o755)  # mkdtemp makes it private; the published artifact is an ordinary directory
    try:
        with _timed(seconds, "emit"):
            emit.write_onnx(onnx_model, staging)
            del onnx_model
            emit.copy_tokenizer(ckpt, staging)
            emit.write_generation_config(ckpt, spec, staging)
        with _timed(seconds, "verify"):
            report = check_parity(
                TorchSession(DecoderWrapper(model, spec.num_layers), io),
                OrtSession(staging / emit.MODEL_FILE, io),
                max_positions=spec.max_positions,
                dtype=COMPUTE_DTYPE,
                decode_steps=options.decode_steps,
            )
            require_parity(report, str(checkpoint_dir))
        written = manifest.write(
            staging, spec=spec, io=io, sources=ckpt.source_hashes(), flags=options.flags(), parity=report.to_dict()
        )
        _publish(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("published %s (%s)", output, report.summary())
    return BuildResult(output, written, report, seconds)


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
    io = DecoderIO.from_dict(recorded["io"])
    model = eager_model(ckpt, spec)
    report = check_parity(
        TorchSession(DecoderWrapper(model, spec.num_layers), io),
        OrtSession(artifact / emit.MODEL_FILE, io),
        max_positions=spec.max_positions,
        dtype=recorded["flags"]["dtype"],
        decode_steps=recorded["flags"]["decode_steps"],
    )
    require_parity(report, str(artifact))
    return report


def _check_output(output: Path, force: bool) -> None:
    if not output.exists():
        return
    if not force:
        raise ArtifactError(f"{output}: already exists; pass --force to replace it")
    if not output.is_dir() or (any(output.iterdir()) and not (output / MANIFEST).is_file()):
        raise ArtifactError(
            f"{output}: exists and is not a kvforge artifact; refusing to replace it, choose another -o"
        )


def _publish(staging: Path, output: Path) -> None:
    """Rename the complete directory into place; a previous artifact is moved aside first."""
    if not output.exists():
        staging.rename(output)
        return
    retired = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.old-"))
    output.rename(retired / output.name)
    staging.rename(output)
    shutil.rmtree(retired, ignore_errors=True)


@contextmanager
def _timed(seconds: dict[str, float], stage: str) -> Iterator[None]:
    log.info("%s...", stage)
    start = time.perf_counter()
    yield
    seconds[stage] = time.perf_counter() - start
