"""The portable targets' graphs (`onnx`, `tensorrt`) run by the ONNX reference implementation
(`onnx.reference.ReferenceEvaluator`, the specification every runtime implements, TensorRT's
parser included) over a prefill and decode steps, against onnxruntime on the same artifact.

The cache is fed back as the runner does: each step's `present` tensors become the next step's
`past` inputs, which in the in-place mode (TensorScatter into a buffer of the whole capacity)
are the full buffers. Both runtimes get the same feeds at every step, each its own cache, so a
runtime that writes a step's keys and values anywhere else parts from the other at the next
step. Where no GPU is at hand, this is the evidence that the graph TensorRT and the CUDA
provider take computes what the specification says.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator
from onnx.reference.ops import load_op

from kvforge import BuildOptions, build
from kvforge.passes.targets import TARGETS
from kvforge.runners.contract import DecoderIO

# Two left-padded prompts (the runner's batch form), then greedy decode steps fed to both runtimes
PROMPTS = ([5, 17, 42, 8, 99, 23], [61, 7, 30])
DECODE_STEPS = 3
CAPACITY = 16  # the tensorrt target's fixed cache length: prompt + decode steps fit
# Largest difference allowed, as a fraction of the output's scale (max |value| of onnxruntime's):
# both compute in float32, in different orders
RELATIVE = 1e-4
# (family, target): llama on both portable targets; a mixture of experts (gather form, standard ops)
CASES = [("llama", "onnx"), ("llama", "tensorrt"), ("qwen3_moe", "onnx")]

Run = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@pytest.fixture(scope="module")
def portable_artifact(
    tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    built: dict[tuple[str, str], Path] = {}

    def get(model_type: str, target: str) -> Path:
        if (model_type, target) not in built:
            capacity = CAPACITY if target == "tensorrt" else None
            out = tmp_path_factory.mktemp(f"ref-{model_type}-{target}") / "out"
            built[model_type, target] = build(
                tiny_checkpoint(model_type), out, BuildOptions(target=TARGETS[target], capacity=capacity)
            ).output
        return built[model_type, target]

    return get


def _io(artifact: Path) -> DecoderIO:
    return DecoderIO.from_dict(json.loads((artifact / "manifest.json").read_text())["io"])


def _ort(artifact: Path) -> Run:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(artifact / "model.onnx"), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(names, feeds), strict=True))


def _reference(artifact: Path, new_ops: list[type] | None = None) -> Run:
    model = onnx.load(str(artifact / "model.onnx"))  # the external weights beside it, loaded
    evaluator = ReferenceEvaluator(model, new_ops=new_ops)
    names = [o.name for o in model.graph.output]
    return lambda feeds: dict(zip(names, evaluator.run(None, feeds), strict=True))


def _steps(io: DecoderIO, runs: tuple[Run, Run]) -> Iterator[tuple[str, list[dict[str, np.ndarray]]]]:
    """Prefill the left-padded prompts, then DECODE_STEPS greedy steps (the first runtime's
    tokens, fed to both); yields each step's name and both runtimes' outputs."""
    batch, width = len(PROMPTS), max(len(p) for p in PROMPTS)
    ids = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, width), np.int64)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    length = (io.capacity or CAPACITY) if io.shared_kv else 0
    empty = {name: np.zeros(io.kv_shape(name, batch, length), io.kv_dtype) for name in io.past_names}
    caches = [dict(empty), dict(empty)]
    for step in range(DECODE_STEPS + 1):
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, -ids.shape[1] :]
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        if io.keeps_logits and step == 0:  # the prefill's every position, as a verify step asks; then the default
            feeds["logits_to_keep"] = np.array([ids.shape[1]], np.int64)
        outputs = [run(feeds | cache) for run, cache in zip(runs, caches, strict=True)]
        yield ("prefill" if step == 0 else f"decode {step}"), outputs
        caches = [
            {past: out[present] for past, present in zip(io.past_names, io.present_names, strict=True)}
            for out in outputs
        ]
        ids = outputs[0]["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)


def _differences(io: DecoderIO, runs: tuple[Run, Run]) -> list[tuple[str, str, float]]:
    """(step, output, largest difference as a fraction of the output's scale) over every step."""
    found = []
    for step, (ours, reference) in _steps(io, runs):
        assert ours["logits"].shape == reference["logits"].shape
        if io.keeps_logits:  # every prompt position at the prefill, one at each decode step
            assert ours["logits"].shape[1] == (max(len(p) for p in PROMPTS) if step == "prefill" else 1)
        for name in ("logits", *io.present_names):
            scale = float(np.abs(ours[name]).max()) or 1.0
            found.append((step, name, float(np.abs(ours[name] - reference[name]).max()) / scale))
    return found


@pytest.mark.slow  # builds each tiny artifact once (export and gate), then runs the graph by the spec
@pytest.mark.parametrize(("model_type", "target"), CASES)
def test_the_reference_implementation_computes_what_onnxruntime_does(
    model_type: str, target: str, portable_artifact: Callable[[str, str], Path]
) -> None:
    artifact = portable_artifact(model_type, target)
    io = _io(artifact)
    graph = onnx.load(str(artifact / "model.onnx"), load_external_data=False).graph
    ops = {node.op_type for node in graph.node}
    assert io.shared_kv and "TensorScatter" in ops  # the in-place cache, written by standard ops
    assert all(node.domain in ("", "ai.onnx") for node in graph.node)
    assert io.keeps_logits == (target != "tensorrt")  # tensorrt: the last position only
    differences = _differences(io, (_ort(artifact), _reference(artifact)))
    assert len(differences) == (DECODE_STEPS + 1) * (1 + len(io.present_names))
    worst = max(differences, key=lambda d: d[2])
    assert worst[2] < RELATIVE, f"{target} {model_type}: {worst[1]} at {worst[0]} differs by {worst[2]:.2e} of scale"


def _off_by_one_scatter() -> type:
    """The spec's TensorScatter writing one position past where it is told: a runtime with this bug
    (the reference evaluator takes an op by its class name)."""
    spec = load_op("", "TensorScatter", 24)

    class TensorScatter(spec):  # type: ignore[valid-type,misc]
        def _run(self, past_cache: Any, update: Any, write_indices: Any = None, **attributes: Any) -> Any:
            shifted = None if write_indices is None else write_indices + 1
            return super()._run(past_cache, update, shifted, **attributes)

    return TensorScatter


@pytest.mark.slow
def test_a_runtime_that_writes_the_cache_one_position_off_is_caught(
    portable_artifact: Callable[[str, str], Path],
) -> None:
    artifact = portable_artifact("llama", "onnx")
    io = _io(artifact)
    differences = _differences(io, (_ort(artifact), _reference(artifact, new_ops=[_off_by_one_scatter()])))
    caught = [d for d in differences if d[2] >= RELATIVE]
    assert caught, "an off-by-one cache write went unnoticed"
    # the keys and values land elsewhere at once; the logits part from the first decode step on
    assert any(step == "prefill" and name.startswith("present.") for step, name, _ in caught)
    assert any(step.startswith("decode") and name == "logits" for step, name, _ in caught)
