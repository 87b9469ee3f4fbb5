"""Traceable forms of the recurrences that linear-attention layers run.

transformers' reference kernel for a gated delta net's prefill (`torch_chunk_gated_delta_rule`)
loops in Python over `ceil(seq / 64)` chunks, so it cannot be traced over a dynamic sequence
length, and its one-token form is chosen by `seq_len == 1`, which a graph of dynamic sequence
length does not see. While a decoder is exported, the modeling modules' kernels named in
`TRACEABLE` are replaced by a token-by-token recurrence written as `scan`, which torch.export
keeps as one loop and torch.onnx lowers to an ONNX `Scan`: one graph for prefill, chunked
prefill and decode, equal to transformers' recurrent kernel step for step (the gate compares it
with transformers' own chunked kernel).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# torch has no public scan yet (torch.cond and torch.while_loop are public); torch.export and
# torch.onnx document and lower this one, to ONNX Scan. A while_loop would need its outputs
# preallocated and written by index, a longer graph for the same loop.
from torch._higher_order_ops.scan import scan


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over [batch, seq, heads, size] inputs, one token per scan step; the
    signature of transformers' (and flash-linear-attention's) `chunk_gated_delta_rule`."""
    del chunk_size, kwargs  # one token at a time: the result does not depend on the chunk size
    dtype = query.dtype
    batch, _, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    if key_heads != value_heads:  # each query/key head serves consecutive value heads
        query = query.repeat_interleave(value_heads // key_heads, dim=2)
        key = key.repeat_interleave(value_heads // key_heads, dim=2)
    query, key, value, g, beta = (x.to(torch.float32) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * key_dim**-0.5
    if initial_state is None:
        state = torch.zeros(batch, value_heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
    else:
        state = initial_state.to(torch.float32)

    def step(state: torch.Tensor, token: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v, decay, rate = token  # [batch, heads, size] and [batch, heads]
        state = state * decay.exp()[..., None, None]
        remembered = (state * k.unsqueeze(-1)).sum(dim=-2)
        delta = (v - remembered) * rate.unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        return state, (state * q.unsqueeze(-1)).sum(dim=-2)

    # the outputs are stacked along the scanned dimension: [batch, seq, heads, value size]
    final, out = scan(step, state, (query, key, value, g, beta), dim=1)
    return out.to(dtype), (final if output_final_state else None)


def selective_scan(
    module: Any,  # the Mamba mixer: A_log, D, dt_proj, layer_idx
    hidden_states: torch.Tensor,
    time_step: torch.Tensor,
    B: torch.Tensor,  # noqa: N803 (the state space model's names)
    C: torch.Tensor,  # noqa: N803
    gate: torch.Tensor,
    cache: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """A Mamba-1 layer's selective scan from the state its cache holds, one token per scan step;
    the signature of transformers' `mamba_scan_forward` (jamba's Mamba layers): `hidden_states`,
    `time_step` and `gate` are [batch, channels, seq], `B` and `C` [batch, seq, state size]; the
    layer's `A_log`, `D` and `dt_proj.bias` are read from `module`, and its recurrent state
    [batch, channels, state size] from and back into `cache`.

    transformers' own form starts every prompt of more than one token from a zero state (its
    full-sequence kernel takes no initial state) and takes the one-token update where
    `seq_len == 1`; this one starts from the cached state at any length, which is the same
    for a prompt after an empty cache and for one-token decoding, and right for a chunked prefill.
    """
    del kwargs
    dtype = hidden_states.dtype
    layer = module.layer_idx
    state = cache.get_recurrent_state(layer, state_idx=0) if cache is not None else None
    A = -torch.exp(module.A_log.float())  # noqa: N806  [channels, state size]
    dt = time_step.float()
    bias = module.dt_proj.bias
    if bias is not None:
        dt = dt + bias.float()[:, None]
    dt = torch.nn.functional.softplus(dt).transpose(1, 2)  # [batch, seq, channels]
    x = hidden_states.float().transpose(1, 2)
    # discretized per token, as transformers' full-sequence kernel does: [batch, seq, channels, state size]
    decay = torch.exp(dt[..., None] * A)
    update = (dt * x)[..., None] * B.float()[:, :, None, :]
    if state is None:
        state = torch.zeros(x.shape[0], *A.shape, dtype=torch.float32, device=x.device)

    def step(state: torch.Tensor, token: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        decay, update, c = token  # [batch, channels, state size] twice, [batch, state size]
        state = decay * state + update
        return state, (state * c[:, None, :]).sum(dim=-1)

    final, out = scan(step, state.float(), (decay, update, C.float()), dim=1)  # out: [batch, seq, channels]
    out = (out + x * module.D.float()).transpose(1, 2) * torch.nn.functional.silu(gate.float())
    if cache is not None:
        cache.update_recurrent_state(final.to(state.dtype), layer)
    return out.to(dtype)


# Kernels of transformers' modeling modules replaced while a decoder is traced, by name. A
# family whose modeling code calls one of these names is traced with the replacement.
TRACEABLE: dict[str, Callable[..., Any]] = {
    "torch_chunk_gated_delta_rule": gated_delta_rule,
    "mamba_scan_forward": selective_scan,
}


@contextlib.contextmanager
def traceable_kernels(model: torch.nn.Module) -> Iterator[list[str]]:
    """Within the block, the modeling modules of `model`'s layers call the traceable kernels;
    yields the `module.name`s replaced, and restores them on exit."""
    modules = {type(m).__module__ for m in model.modules()}
    saved: list[tuple[Any, str, Any]] = []
    try:
        for name in sorted(modules):
            module = sys.modules.get(name)
            for kernel, replacement in TRACEABLE.items():
                if module is not None and hasattr(module, kernel):
                    saved.append((module, kernel, getattr(module, kernel)))
                    setattr(module, kernel, replacement)
        yield [f"{module.__name__}.{kernel}" for module, kernel, _ in saved]
    finally:
        for module, kernel, original in reversed(saved):
            setattr(module, kernel, original)
