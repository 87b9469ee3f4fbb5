"""q and k rotated inside GroupQueryAttention (`RotaryInAttention`: ort-cpu builds where onnxruntime
has `query_seqlens`, 1.32 on): the packed q/k/v read as it is, against the same model built with
its own RotaryEmbedding nodes, on a left-padded first prompt (the case GroupQueryAttention's own
positions get wrong without `query_seqlens`), decode steps, and a batch of several new tokens per
row after a past, which only the new form takes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kvforge import build
from kvforge.passes.fuse_attention import RotaryInAttention
from kvforge.runners.engine import Engine
from kvforge.runners.generate import empty_cache, forward, left_pad
from kvforge.runners.session import Session
from kvforge.toolchain import build as build_module
from kvforge.toolchain.requirements import ROTARY_IN_ATTENTION, installed_at_least
from tests.tiny import make_checkpoint

pytestmark = pytest.mark.skipif(
    not installed_at_least("onnxruntime", ROTARY_IN_ATTENTION),
    reason=f"GroupQueryAttention takes query_seqlens from onnxruntime {ROTARY_IN_ATTENTION} on",
)

PROMPTS = ([5, 17, 42, 8, 99, 23], [61, 7, 30])  # left-padded by 3 in the batch
CAPACITY = 32
# both graphs compute in float32; the rotation's tables are numpy's cos/sin where the other
# graph runs onnxruntime's Cos/Sin: a last-bit difference, as a fraction of the logits' scale
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def own_rotations(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny llama built as on an onnxruntime without query_seqlens: its own RotaryEmbedding nodes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build_module, "installed_at_least", lambda package, minimum: False)
        return build(tiny_checkpoint("llama"), tmp_path_factory.mktemp("own-rotations") / "out").output


def _ops(artifact: Path) -> list[ir.Node]:
    return list(ir.load(artifact / "model.onnx").graph)


def _close(ours: np.ndarray, theirs: np.ndarray, what: str) -> None:
    scale = float(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=RELATIVE * scale, err_msg=what)


def test_the_rotations_move_into_group_query_attention(
    built_artifact: Callable[..., Path], own_rotations: Path
) -> None:
    fused, own = _ops(built_artifact("llama")), _ops(own_rotations)
    layers = sum(n.op_type == "GroupQueryAttention" for n in own)
    assert layers == 2 and sum(n.op_type == "RotaryEmbedding" for n in own) == 2 * layers
    assert not any(n.op_type == "RotaryEmbedding" for n in fused)
    # the gate/up Split stays; the q/k/v Split is gone
    assert sum(n.op_type == "Split" for n in fused) == sum(n.op_type == "Split" for n in own) - layers
    spec = json.loads((built_artifact("llama") / "manifest.json").read_text())["spec"]
    for node in (n for n in fused if n.op_type == "GroupQueryAttention"):
        assert node.attributes["do_rotary"].value == 1
        assert node.inputs[1] is None and node.inputs[2] is None  # q/k/v packed in input 0
        cos = node.inputs[7]
        assert cos is not None and cos.const_value is not None
        assert list(cos.const_value.shape) == [spec["max_positions"], spec["head_dim"] // 2]
        assert node.inputs[9] is not None and node.inputs[9].name == "position_ids"
        assert node.inputs[16] is not None  # query_seqlens


def _sessions(built_artifact: Callable[..., Path], own_rotations: Path) -> tuple[Session, Session]:
    return Engine.load(built_artifact("llama")).session, Engine.load(own_rotations).session


def test_a_left_padded_batch_and_its_decode_steps_equal_the_graph_with_its_own_rotations(
    built_artifact: Callable[..., Path], own_rotations: Path
) -> None:
    fused, own = _sessions(built_artifact, own_rotations)
    ids, mask = left_pad(PROMPTS, pad_id=0)
    caches = [empty_cache(s.io, len(PROMPTS), CAPACITY) for s in (fused, own)]
    real = mask.astype(bool)
    for step in range(4):
        (ours, caches[0]), (theirs, caches[1]) = (
            forward(s, ids, mask, c, every_position=True) for s, c in zip((fused, own), caches, strict=True)
        )
        rows = real[:, -ids.shape[1] :]
        _close(ours[rows], theirs[rows], f"logits at step {step}")
        for name in fused.io.past_names:  # the cache as written, at every real position
            _close(
                caches[0][name][:, :, : mask.shape[1]].transpose(0, 2, 1, 3)[real],
                caches[1][name][:, :, : mask.shape[1]].transpose(0, 2, 1, 3)[real],
                f"{name} at step {step}",
            )
        ids = ours[:, -1].argmax(-1)[:, None].astype(np.int64)
        mask = np.concatenate([mask, np.ones((len(PROMPTS), 1), np.int64)], axis=1)
        real = mask.astype(bool)


def test_several_rows_of_several_new_tokens_after_a_past_equal_one_token_at_a_time(
    built_artifact: Callable[..., Path], own_rotations: Path
) -> None:
    """GroupQueryAttention without query_seqlens refuses this batch; with it, each new token
    attends to its row's past and the chunk's earlier tokens, as single steps do."""
    fused, own = _sessions(built_artifact, own_rotations)
    ids, mask = left_pad(PROMPTS, pad_id=0)
    chunk = np.array([[3, 14, 15], [92, 65, 35]], np.int64)
    _, cache = forward(fused, ids, mask, empty_cache(fused.io, 2, CAPACITY))
    mask_after = np.concatenate([mask, np.ones((2, 3), np.int64)], axis=1)
    ours, _ = forward(fused, chunk, mask_after, cache, every_position=True)
    _, cache = forward(own, ids, mask, empty_cache(own.io, 2, CAPACITY))
    for position in range(3):
        theirs, cache = forward(
            own, chunk[:, position : position + 1], mask_after[:, : mask.shape[1] + position + 1], cache
        )
        _close(ours[:, position], theirs[:, -1], f"new token {position}")


def test_tables_beyond_the_bound_leave_the_rotations_where_they_are(own_rotations: Path) -> None:
    model = ir.load(own_rotations / "model.onnx")
    too_long = RotaryInAttention.MAX_TABLE_BYTES // 8  # positions x head_dim/2 x 2 tables x 4 bytes > bound
    assert not RotaryInAttention(too_long)(model).modified
    assert sum(n.op_type == "RotaryEmbedding" for n in model.graph) == 4
    fused = RotaryInAttention(64)(model)
    assert fused.modified and not any(n.op_type == "RotaryEmbedding" for n in model.graph)


def test_a_partial_rotation_of_sixteen_channels_moves_in_and_passes_the_gate(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """phi rotates the first half of each head: 16 of 32 channels here (onnxruntime's kernel takes
    tables of a multiple of 8 columns); the gate compares a left-padded batch with the eager model."""
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("phi-partial"), "phi", hidden_size=128)
    result = build(checkpoint, tmp_path_factory.mktemp("phi-partial-art") / "out")
    assert result.parity.passed
    nodes = _ops(result.output)
    assert not any(n.op_type == "RotaryEmbedding" for n in nodes)
    for node in (n for n in nodes if n.op_type == "GroupQueryAttention"):
        assert node.attributes["do_rotary"].value == 1
        assert node.inputs[7] is not None and list(node.inputs[7].shape or []) == [256, 8]
    engine = Engine.load(result.output)
    engine.eos_ids = ()
    batched = engine.generate_tokens([list(p) for p in PROMPTS], max_new_tokens=6, temperature=0.0)
    assert batched == [engine.generate_tokens([list(p)], max_new_tokens=6, temperature=0.0)[0] for p in PROMPTS]
