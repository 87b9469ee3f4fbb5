"""The eager model from a checkpoint, and its torch.export with a flat KV cache.

`DecoderWrapper` turns the HF model's `Cache` object into flat tensors in the order of
the contract (`past_key_values.{i}.key|value` in, `logits, present.{i}.key|value` out),
which is what both torch.export and the runner's sessions need.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.export import Dim, ExportedProgram

from runners.contract import DecoderIO
from runners.errors import CheckpointError, ExportError
from toolchain.checkpoint import Checkpoint
from toolchain.spec import DecoderSpec

log = logging.getLogger(__name__)

# Example sizes for tracing: distinct and >= 2, so no dimension is specialized to 0/1
# or confused with another. The gate then runs the graph at past = 0 and seq = 1.
_EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST = 2, 3, 5


def eager_model(checkpoint: Checkpoint, spec: DecoderSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The HF model with the checkpoint's weights, in eval mode, computing in `dtype`.

    The architecture comes from transformers' own classes (never remote code). Weights come
    from our checkpoint loader, so only safetensors or weights-only pickle are ever read;
    transformers maps them onto the model (renamed keys, tied embeddings, bare base models).
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    fields = {k: v for k, v in checkpoint.config.items() if k not in ("model_type", "auto_map")}
    config = AutoConfig.for_model(spec.model_type, **fields)
    model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with _quiet_transformers():  # its load report goes to the log; we raise our own error below
        model, info = model_class.from_pretrained(
            None,
            config=config,
            state_dict=checkpoint.state_dict(dtype),
            dtype=dtype,
            attn_implementation=_attention_implementation(config),
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        what = "; ".join(f"{k.replace('_', ' ')}: {sorted(map(str, v))[:5]}" for k, v in problems.items())
        raise CheckpointError(
            f"{checkpoint.path}: weights do not match the {spec.model_type} architecture in config.json ({what}); "
            "check that config.json belongs to these weights"
        )
    return model.eval()


def _attention_implementation(config: Any) -> str:
    """SDPA traces to one ONNX Attention op (opset 23), the form every fusion starts from.
    transformers' SDPA path ignores attention-logit softcapping, so softcapped models
    (gemma2) keep the eager path, whose plain MatMul/Softmax ops are exact."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def _first_line(error: Exception) -> str:
    lines = str(error).splitlines()
    return lines[0] if lines else ""


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


class DecoderWrapper(torch.nn.Module):
    """HF causal LM with flat KV-cache tensors in and out, in contract order."""

    def __init__(self, model: torch.nn.Module, num_layers: int) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        # No config: every layer keeps its full history. Sliding-window layers still get
        # their windowed mask from the model, so results match, and the contract stays uniform.
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)])
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        present = [t for layer in cache.layers for t in (layer.keys, layer.values)]  # type: ignore[union-attr]
        # Logits leave in fp32 whatever the compute dtype: sampling needs the precision, and
        # the cast of one [batch, seq, vocab] tensor costs nothing next to the LM head.
        return (out.logits.float(), *present)


def example_inputs(io: DecoderIO, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    b, s, p = _EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST
    input_ids = torch.randint(0, io.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(b, p + s, dtype=torch.int64)
    positions = torch.arange(p, p + s, dtype=torch.int64).expand(b, s).contiguous()
    past = [torch.zeros(b, io.num_kv_heads, p, io.head_dim, dtype=dtype) for _ in io.past_names]
    return input_ids, mask, positions, past


def export_decoder(model: torch.nn.Module, spec: DecoderSpec, io: DecoderIO) -> ExportedProgram:
    """torch.export the wrapped decoder with dynamic batch, sequence, past and total length."""
    wrapper = DecoderWrapper(model, spec.num_layers).eval()
    dyn = Dim.DYNAMIC
    dynamic_shapes = {
        "input_ids": {0: dyn, 1: dyn},
        "attention_mask": {0: dyn, 1: dyn},
        "position_ids": {0: dyn, 1: dyn},
        "past": [{0: dyn, 2: dyn} for _ in io.past_names],
    }
    dtype = next(model.parameters()).dtype
    try:
        with torch.no_grad():
            return torch.export.export(wrapper, example_inputs(io, dtype), dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many unrelated types; all mean the same to the user
        raise ExportError(
            f"torch.export failed for {spec.model_type}: {type(e).__name__}: {_first_line(e)}; "
            "this architecture/transformers version combination is not traceable, please report it"
        ) from e
