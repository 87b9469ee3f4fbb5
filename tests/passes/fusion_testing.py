"""Shared by the fusion tests: run a graph on onnxruntime with its own optimizations off,
and the canonicalized graph of a tiny checkpoint, which is what real fusions see."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from kvforge.passes.pipeline import canonicalize
from kvforge.passes.rewrite import FusionPass


def ort_outputs(model: ir.Model, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """All graph outputs, computed by onnxruntime with every graph optimization disabled,
    so a fused op is executed as written, not re-fused or re-split by onnxruntime."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    proto = ir.to_proto(model)
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return [np.asarray(v) for v in session.run(None, dict(feeds))]


def op_count(model: ir.Model, op_type: str, domain: str = "") -> int:
    nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    return sum(1 for n in nodes if n.op_type == op_type and n.domain == domain)


def check_modified_is_exact(fusion: FusionPass, model: ir.Model) -> None:
    """A fusion reports `modified` when it fired, and a second run finds nothing to do."""
    first = fusion(model)
    assert first.modified == any(fusion.counts.values())
    second = fusion(model)
    assert not second.modified and not any(fusion.counts.values())


def decoder_feeds(model: ir.Model, batch: int = 2, seq: int = 3, past: int = 4) -> dict[str, np.ndarray]:
    """Feeds for a decoder graph's inputs (the KV-cache contract's names), random but fixed."""
    rng = np.random.default_rng(0)
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.inputs:
        name = value.name or ""
        if name == "input_ids":
            feeds[name] = rng.integers(3, 300, (batch, seq), dtype=np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((batch, past + seq), dtype=np.int64)
        elif name == "position_ids":
            feeds[name] = np.tile(np.arange(past, past + seq, dtype=np.int64), (batch, 1))
        elif name.startswith("past_key_values."):
            assert value.shape is not None
            _, heads, _, head_dim = value.shape
            dtype = value.dtype.numpy() if value.dtype is not None else np.float32
            feeds[name] = rng.standard_normal((batch, heads, past, head_dim)).astype(dtype)
        else:
            raise AssertionError(f"no feed for decoder input {name}")
    return feeds


@cache
def _canonical_proto(model_type: str, directory: Path, dtype: str) -> bytes:
    import torch

    from kvforge.runners.contract import DecoderIO
    from kvforge.toolchain import checkpoint as checkpoints
    from kvforge.toolchain.export import eager_model, export_decoder
    from kvforge.toolchain.lower import to_onnx
    from kvforge.toolchain.spec import DecoderSpec
    from tests.tiny import make_checkpoint

    path = directory / model_type
    ckpt = checkpoints.load(path if (path / "config.json").exists() else make_checkpoint(path, model_type))
    spec = DecoderSpec.from_config(ckpt.config, ckpt.generation_config)
    io = DecoderIO.for_spec(spec, kv_dtype=dtype)
    model = to_onnx(export_decoder(eager_model(ckpt, spec, getattr(torch, dtype)), spec, io), io)
    for p in canonicalize():
        model = p(model).model
    return ir.to_proto(model).SerializeToString()


def canonical_graph(model_type: str, scratch: Path, dtype: str = "float32") -> ir.Model:
    """The tiny `model_type` checkpoint exported in `dtype`, lowered and canonicalized (a fresh copy each call)."""
    return ir.from_proto(onnx.load_from_string(_canonical_proto(model_type, scratch, dtype)))
