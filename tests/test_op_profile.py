"""benchmarks/op_profile.py: which group each node's kernel time counts in, and its reading of
onnxruntime's profiler trace on a real artifact's generation."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


@pytest.fixture(scope="module")
def op_profile() -> ModuleType:
    from benchmarks import op_profile

    return op_profile


def _initializer(name: str, array: np.ndarray) -> TensorProto:
    return numpy_helper.from_array(array, name)


def _nbits(name: str, inputs: list[str], output: str, k: int, n: int, bits: int, block: int) -> onnx.NodeProto:
    attributes = {"K": k, "N": n, "bits": bits, "block_size": block, "accuracy_level": 4}
    return helper.make_node("MatMulNBits", inputs, [output], name, domain="com.microsoft", **attributes)


def test_a_min_term_and_the_head_are_told_apart_from_the_projections(op_profile: ModuleType, tmp_path: Path) -> None:
    """A projection with a min term (MatMulNBits + block sums × minimums + Add), a residual Add,
    block sums that feed no min term, and an 8-bit head read through a Reshape: each node in its
    group."""
    k, vocab = 64, 50
    nodes = [
        _nbits("proj", ["x", "codes", "scales"], "product", k, k, bits=4, block=32),
        helper.make_node("Reshape", ["x", "blocks"], ["split"], "split"),
        helper.make_node("ReduceSum", ["split", "axes"], ["sums"], "sums", keepdims=0),
        helper.make_node("MatMul", ["sums", "w.mins"], ["term"], "term"),
        helper.make_node("Add", ["product", "term"], ["projected"], "term_add"),
        helper.make_node("Add", ["projected", "x"], ["residual"], "residual"),
        helper.make_node("Reshape", ["residual", "blocks"], ["other_split"], "other_split"),
        helper.make_node("ReduceSum", ["other_split", "axes"], ["other_sums"], "other_sums", keepdims=0),
        _nbits("head", ["residual", "head_codes", "head_scales"], "head_out", k, vocab, bits=8, block=16),
        helper.make_node("Reshape", ["head_out", "logits_shape"], ["logits"], "logits_shape"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "s", k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", vocab])],
        [
            _initializer("codes", np.zeros((k, 2, 16), np.uint8)),
            _initializer("scales", np.ones(k * 2, np.float32)),
            _initializer("blocks", np.array([0, 0, 2, 32], np.int64)),
            _initializer("axes", np.array([-1], np.int64)),
            _initializer("w.mins", np.zeros((2, k), np.float32)),
            _initializer("head_codes", np.zeros((vocab, 4, 16), np.uint8)),
            _initializer("head_scales", np.ones(vocab * 4, np.float32)),
            _initializer("logits_shape", np.array([1, -1, vocab], np.int64)),
        ],
    )
    path = tmp_path / "model.onnx"
    onnx.save(helper.make_model(graph), str(path))
    assert op_profile.node_groups(path, "logits") == {
        "proj": "MatMulNBits 4-bit, blocks of 32",
        "split": "min terms: block sums",
        "sums": "min terms: block sums",
        "term": "min terms: MatMul by the minimums",
        "term_add": "min terms: their Add",
        "residual": "Add",
        "other_split": "Reshape",
        "other_sums": "ReduceSum",
        "head": "LM head (MatMulNBits 8-bit, blocks of 16)",
        "logits_shape": "Reshape",
    }


@pytest.mark.slow  # the example model's build (shared), two profiled generations
def test_the_trace_gives_one_prefill_and_a_step_per_further_token(
    op_profile: ModuleType, example_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    op_profile.main([str(example_artifact), "--prompt", "12", "--new-tokens", "5", "--top", "50"])
    found = json.loads(capsys.readouterr().out)
    assert found["prefill"]["runs"] == 1 and found["decode"]["runs"] == 4
    for phase in ("prefill", "decode"):
        groups = found[phase]["groups"]
        # every kernel of a run is inside it, and the head (the example's float MatMul) is found
        assert 0 < found[phase]["kernel_ms"] <= found[phase]["run_ms"]
        assert any(name.startswith("LM head (") for name in groups), groups
        assert abs(sum(group["share"] for group in groups.values()) - 1) < 0.01
        assert not any(name.startswith("min terms") for name in groups)  # a float build has none
