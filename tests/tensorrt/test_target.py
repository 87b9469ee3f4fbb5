"""`--target tensorrt` end to end on the CPU, per architecture: the graph TensorRT would parse
passes the checker and the verification gate (prefill + decode through the runner on
onnxruntime, greedy equal to eager), and the build says how to complete it with an engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kvforge.passes.targets import TARGETS
from kvforge.passes.tensorrt_check import check_graph
from kvforge.runners.engine import Engine
from tests.tiny import SUPPORTED, hf_greedy

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_tensorrt_graph_passes_the_checker_and_the_gate(model_type: str, tensorrt_artifact: Callable) -> None:
    result = tensorrt_artifact(model_type)
    manifest = json.loads((result.output / "manifest.json").read_text())
    assert manifest["target"] == "tensorrt" and manifest["flags"]["capacity"] == 256
    assert manifest["parity"]["passed"] is True and manifest["parity"]["decode_steps"] >= 8
    assert manifest["io"]["kv_mode"] == "shared" and manifest["io"]["capacity"] == 256

    model = ir.load(result.output / "model.onnx")
    assert [str(v) for v in check_graph(model)] == []
    assert model.opset_imports == {"": 24}
    ops = {node.op_type for node in model.graph}
    assert "TensorScatter" in ops and "Pad" not in ops
    for value in model.graph.inputs[3:]:
        assert value.shape is not None and value.shape[2] == 256  # S_max, fixed
    for node in model.graph:
        if node.op_type == "RotaryEmbedding":
            assert node.inputs[3] is not None and node.inputs[3].name == "position_ids"
        if node.op_type == "Attention":
            assert len(node.outputs) == 1 and node.attributes.get_int("is_causal", 0) == 0
            assert node.inputs[1].producer().op_type == "TensorScatter"


def test_build_without_tensorrt_stops_after_the_graph_and_names_the_next_step(tensorrt_artifact: Callable) -> None:
    result = tensorrt_artifact("llama")
    assert result.next_step is not None and f"kvforge build-engine {result.output}" in result.next_step
    assert "engine" not in result.manifest and not (result.output / "engine.plan").exists()


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_runner_greedy_equals_transformers_generate(
    model_type: str, tensorrt_artifact: Callable, tiny_checkpoint: Callable[..., Path]
) -> None:
    """The same artifact through the onnxruntime runner: the fixed S_max cache serves any request that fits."""
    from transformers import AutoModelForCausalLM

    engine = Engine.load(tensorrt_artifact(model_type).output)
    engine.eos_ids = ()
    ids = engine.encode("def fibonacci(n):")
    ours = engine.generate_tokens([ids], max_new_tokens=16, temperature=0.0)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(model_type), attn_implementation="eager").eval()
    assert ours == hf_greedy(hf, ids, 16)


def test_left_padded_batch_equals_one_by_one(tensorrt_artifact: Callable) -> None:
    engine = Engine.load(tensorrt_artifact("llama").output)
    engine.eos_ids = ()
    prompts = [engine.encode(p) for p in ["for i in range(10):", "import os"]]
    batched = engine.generate_tokens(prompts, max_new_tokens=8, temperature=0.0)
    alone = [engine.generate_tokens([p], max_new_tokens=8, temperature=0.0)[0] for p in prompts]
    assert batched == alone


def test_chunked_prefill_through_the_graph_matches_one_prefill(tensorrt_artifact: Callable) -> None:
    """What the TensorRT runner does for a long prompt (chunks, each advancing the write index),
    run on the same graph with onnxruntime: the last logits and the cache are those of one prefill."""
    from kvforge.runners.generate import empty_cache, position_ids
    from kvforge.runners.session import OrtSession
    from kvforge.runners.trt_session import chunk_feeds, prefill_chunks

    artifact = tensorrt_artifact("qwen2").output
    engine = Engine.load(artifact)
    session = OrtSession(artifact / "model.onnx", engine.session.io)
    ids = np.random.default_rng(0).integers(3, 300, (2, 11)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask, 11)}
    whole_cache = empty_cache(session.io, 2, 11)
    whole = session.run(feeds | whole_cache)
    chunk_cache = empty_cache(session.io, 2, 11)
    for start, end in prefill_chunks(11, 4):
        last = session.run(chunk_feeds(feeds, start, end) | chunk_cache)
    np.testing.assert_allclose(last["logits"], whole["logits"], atol=1e-4, rtol=1e-3)
    real = mask.astype(bool)
    for name in session.io.past_names:
        a, b = (c[name][:, :, :11].transpose(0, 2, 1, 3)[real] for c in (whole_cache, chunk_cache))
        np.testing.assert_allclose(b, a, atol=1e-4, rtol=1e-3)


def test_cli_build_passes_the_capacity_and_prints_the_build_engine_step(
    tensorrt_artifact: Callable, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    result = tensorrt_artifact("llama")
    seen = {}

    def fake_build(checkpoint: Path, output: Path, options: object) -> object:
        seen["options"] = options
        return result

    monkeypatch.setattr("kvforge.toolchain.build.build", fake_build)
    # the CLI checks the checkpoint path and -o before it builds: both real, the build faked
    args = ["build", str(tmp_path), "-o", str(tmp_path / "out"), "--target", "tensorrt", "--capacity", "128"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    assert f"kvforge build-engine {result.output}" in run.output
    options = seen["options"]
    assert options.target.name == "tensorrt" and options.capacity == 128  # type: ignore[attr-defined]


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_second_run_of_the_pipeline_changes_nothing(model_type: str, tensorrt_artifact: Callable) -> None:
    from kvforge.passes import pipeline

    model = ir.load(tensorrt_artifact(model_type).output / "model.onnx")
    report = pipeline.run(model, TARGETS["tensorrt"], capacity=256)
    assert [(r.phase, r.name) for r in report.passes if r.modified] == []
    assert report.passes[-1].name == "RequireTensorRT"  # the postcondition ran, and passed


def test_a_graph_the_parser_would_refuse_fails_the_build_naming_the_node(
    tiny_checkpoint: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With RotaryEmbedding taken out of the support data (as for an older parser), the build
    stops at the checker with one line naming a RotaryEmbedding node, and publishes nothing."""
    import copy

    from click.testing import CliRunner

    from kvforge.cli import main
    from kvforge.passes import tensorrt_check

    data = copy.deepcopy(tensorrt_check.support_data())
    del data["ops"]["RotaryEmbedding"]
    monkeypatch.setattr(tensorrt_check, "support_data", lambda: data)
    out = tmp_path / "out"
    args = ["build", str(tiny_checkpoint("llama")), "-q", "-o", str(out), "--target", "tensorrt"]  # -q: no progress
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 2
    assert "RotaryEmbedding(" in run.output and "is not supported by the TensorRT 10.15 ONNX parser" in run.output
    assert len(run.output.strip().splitlines()) == 1 and not out.exists()
