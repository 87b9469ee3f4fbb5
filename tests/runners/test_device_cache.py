"""The runner with its cache on a device, checked on the CPU.

A device copies host memory when it is bound: onnxruntime's IOBinding copies an input to the
session's device at bind time, so a binding kept across steps feeds the values the input had
then. A runner that binds its host cache once and counts on the provider to read and write it in
place generates wrong tokens on a GPU while passing every CPU test. Here the CPU provider is made
to behave as a device does (every host array bound is copied when bound) and the session keeps
its cache where a device session does (`OrtValue`s in memory onnxruntime owns, `OrtDevice`):
greedy tokens must equal the plain CPU session's, which the gate compares with the eager model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from kvforge.runners.cache import HOST, Cache, OrtDevice
from kvforge.runners.core import logit_steps
from kvforge.runners.decoding import batch_decoders
from kvforge.runners.engine import Engine
from kvforge.runners.sampling import SamplingParams
from kvforge.runners.session import OrtSession

PROMPTS = [[5, 9, 2, 7, 11, 3], [8, 1, 4]]
NEW_TOKENS = 12


@contextlib.contextmanager
def copied_at_bind() -> Iterator[None]:
    """`bind_cpu_input` binds a copy of the array, as a device session's binding does."""
    original = ort.IOBinding.bind_cpu_input

    def bind_copy(self: ort.IOBinding, name: str, array: np.ndarray) -> None:
        copy = np.array(array, copy=True)
        self.__dict__.setdefault("_copies", []).append(copy)  # alive as long as the binding
        original(self, name, copy)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ort.IOBinding, "bind_cpu_input", bind_copy)
        yield


def _session(artifact: Path, on_device: bool) -> tuple[OrtSession, int]:
    engine = Engine.load(artifact, runtime="ort", huge_pages=False)
    session = engine.session
    assert isinstance(session, OrtSession)
    if on_device:
        session.device = OrtDevice("cpu", 0)
    return session, engine.max_positions


def _greedy(session: OrtSession, max_positions: int, prompts: list[list[int]]) -> np.ndarray:
    steps = logit_steps(
        session,
        prompts,
        max_new_tokens=NEW_TOKENS,
        max_positions=max_positions,
        decoders=batch_decoders(SamplingParams(temperature=0.0), prompts),
    )
    return np.stack([step.tokens for step in steps])


def _tokens(artifact: Path, on_device: bool) -> list[np.ndarray]:
    """Greedy tokens of the batch, then of each prompt alone."""
    session, max_positions = _session(artifact, on_device)
    return [_greedy(session, max_positions, PROMPTS)] + [_greedy(session, max_positions, [p]) for p in PROMPTS]


@pytest.fixture(scope="module")
def artifacts(built_artifact: Callable[..., Path], tiny_checkpoint: Callable[..., Path], tmp_path_factory: Any) -> Any:
    from kvforge import BuildOptions, build
    from kvforge.passes.targets import TARGETS

    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            if kind == "onnx":  # the portable target: TensorScatter writes the cache
                out = tmp_path_factory.mktemp("device-onnx") / "out"
                made[kind] = build(tiny_checkpoint("llama"), out, BuildOptions(target=TARGETS["onnx"])).output
            elif kind == "fp16":
                out = tmp_path_factory.mktemp("device-fp16") / "out"
                made[kind] = build(tiny_checkpoint("llama"), out, BuildOptions(dtype="float16")).output
            else:
                made[kind] = built_artifact(kind)
        return made[kind]

    return get


# llama: GroupQueryAttention's shared buffer; onnx: TensorScatter's; fp16: a half-precision cache;
# gemma3_text: layers bounded by a sliding window; qwen3_5_text: fixed-size recurrent states
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "onnx", "fp16", "gemma3_text", "qwen3_5_text"])
def test_a_device_resident_cache_generates_the_host_tokens(artifacts: Any, kind: str) -> None:
    artifact = artifacts(kind)
    on_host = _tokens(artifact, on_device=False)  # as the CPU provider runs it: in place, no copy
    with copied_at_bind():
        on_device = _tokens(artifact, on_device=True)
    for got, want in zip(on_device, on_host):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_binding_the_host_cache_once_is_what_a_device_breaks(artifacts: Any) -> None:
    """The check above can fail: the host path binds its cache buffers once and reuses the binding,
    which is right on the CPU provider only. Under a device's copy-at-bind it goes wrong."""
    artifact = artifacts("llama")
    on_host = _tokens(artifact, on_device=False)
    with copied_at_bind():
        broken = _tokens(artifact, on_device=False)
    assert any(not np.array_equal(got, want) for got, want in zip(broken, on_host))


@pytest.mark.parametrize("shared", [True, False])
def test_cache_layout_operations_agree_on_host_and_device(shared: bool) -> None:
    """`Cache.after` (a window-bounded layer cut to its window) and `Cache.drop_last` give the same
    tensors whether the cache is numpy on the host or OrtValues on a device."""
    from kvforge.runners.contract import DecoderIO

    io = DecoderIO(
        num_layers=2,
        num_kv_heads=1,
        head_dim=2,
        vocab_size=8,
        kv_mode="shared" if shared else "concat",
        layer_windows=(None, 3),
    )
    rng = np.random.default_rng(0)
    results = []
    for device in (HOST, OrtDevice("cpu", 0)):
        cache = Cache.empty(io, 1, 6, device)
        presents = {
            present: device.from_host(
                rng.standard_normal(io.kv_shape(present, 1, 6 if io.window_of(present) is None else 5)).astype(
                    np.float32
                )
            )
            for present in io.cache_present_names
        }
        rng = np.random.default_rng(0)  # the same values for the next device
        after = cache.after(presents, extra=1)
        dropped = after.drop_last(1, 5)
        results.append((after.host(), dropped.host()))
    for host, device_side in zip(results[0], results[1]):
        assert host.keys() == device_side.keys()
        for name in host:
            np.testing.assert_array_equal(host[name], device_side[name])
    # the bounded layer keeps window - 1 + extra positions, then one fewer
    assert results[0][0]["past_key_values.1.key"].shape[2] == 3
    assert results[0][1]["past_key_values.1.key"].shape[2] == 2


def test_device_block_copies_equal_numpy_slicing() -> None:
    """`OrtDevice.copy` (a copy graph over byte spans bound by address) writes what numpy slice
    assignment writes, for blocks between tensors and overlapping blocks within one, and through
    `rows` views."""
    rng = np.random.default_rng(3)
    device = OrtDevice("cpu", 0)
    shape = (3, 2, 9, 4)
    for _ in range(40):
        src = rng.standard_normal(shape).astype(np.float32)
        dst = rng.standard_normal(shape).astype(np.float32)
        extent = tuple(int(rng.integers(0, n + 1)) for n in shape)
        src_start = tuple(int(rng.integers(0, n - e + 1)) for n, e in zip(shape, extent))
        dst_start = tuple(int(rng.integers(0, n - e + 1)) for n, e in zip(shape, extent))
        same = bool(rng.integers(2))
        want = src.copy() if same else dst.copy()
        region = [tuple(slice(s, s + e) for s, e in zip(start, extent)) for start in (src_start, dst_start)]
        want[region[1]] = src[region[0]]
        on_src = device.from_host(src)
        on_dst = on_src if same else device.from_host(dst)
        device.copy(on_src, src_start, on_dst, dst_start, extent)
        np.testing.assert_array_equal(device.to_host(on_dst), want)
    tensor = device.from_host(np.arange(24, dtype=np.float32).reshape(4, 3, 2))
    np.testing.assert_array_equal(device.to_host(device.rows(tensor, 1, 2)), np.arange(6, 18).reshape(2, 3, 2))


def test_the_copy_graph_is_identity_over_bytes_as_onnx_builds_it() -> None:
    """The runtime carries the copy graph serialized (it has no onnx package): the bytes are the
    model onnx's helpers make, and the checker accepts it."""
    import onnx
    from onnx import TensorProto, helper

    from kvforge.runners.cache import COPY_GRAPH

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "copy",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, ["n"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(onnx.load_from_string(COPY_GRAPH))
    assert onnx.load_from_string(COPY_GRAPH) == model
