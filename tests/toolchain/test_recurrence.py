"""The traceable recurrences (`kvforge.toolchain.recurrence`) against transformers' own kernels, in eager
mode: the same outputs and states for a prompt from an empty cache and for one-token decoding,
and a prompt prefilled in chunks equal to one shot."""

from __future__ import annotations

import pytest
import torch

from kvforge.toolchain.recurrence import traceable_kernels
from tests.tiny import _COMMON, GENERIC_CONFIGS

TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def jamba() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("jamba", **{**_COMMON, **GENERIC_CONFIGS["jamba"]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # as tests/tiny.py: decisive logits, a state that matters
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(2.0)
    return model


def _run(model: torch.nn.Module, chunks: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of every chunk fed in turn through one cache, and the Mamba layers' states after."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        for chunk in chunks:
            logits.append(model(input_ids=chunk, past_key_values=cache).logits)
    states = [t for layer in cache.layers if hasattr(layer, "recurrent_states") for t in (layer.recurrent_states[0],)]
    return torch.cat(logits, dim=1), states


def test_selective_scan_equals_transformers_mamba_kernels(jamba: torch.nn.Module) -> None:
    ids = torch.randint(3, 384, (2, 9), generator=torch.Generator().manual_seed(1))
    prompt, decode = ids[:, :8], [ids[:, 8:9]]
    theirs, their_states = _run(jamba, [prompt, *decode])  # full-sequence kernel, then the one-token update
    with traceable_kernels(jamba) as replaced:
        assert replaced == ["transformers.models.jamba.modeling_jamba.mamba_scan_forward"]
        ours, our_states = _run(jamba, [prompt, *decode])
        chunked, chunked_states = _run(jamba, [ids[:, :3], ids[:, 3:8], *decode])
    assert len(their_states) == 2 and all(float(s.abs().max()) > 0 for s in their_states)
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    for mine, reference in zip([*our_states, *chunked_states], their_states * 2):
        torch.testing.assert_close(mine, reference, **TOLERANCE)
    # transformers' own full-sequence kernel starts every chunk from a zero state; the scan
    # continues from the cached one, so a chunked prefill is the one-shot prefill
    torch.testing.assert_close(chunked, theirs, **TOLERANCE)
