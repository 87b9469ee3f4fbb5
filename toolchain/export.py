"""The eager model from a checkpoint, and its torch.export with a flat KV cache.

`DecoderWrapper` turns the HF model's `Cache` object into flat tensors in the order of
the contract (`past_key_values.{i}.key|value` in, `logits, present.{i}.key|value` out),
which is what both torch.export and the runner's sessions need.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.export import Dim, ExportedProgram

from kvforge.runners.contract import KV_KINDS, STATE_KINDS, DecoderIO, LayerState
from kvforge.runners.errors import CheckpointError, ExportError
from kvforge.toolchain.checkpoint import Checkpoint, check_against_spec, tokenizer_config
from kvforge.toolchain.recurrence import traceable_kernels
from kvforge.toolchain.spec import SDPA_IGNORED_FIELDS, DecoderSpec

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
    config, model_class = _model_class(checkpoint.config, spec)
    with _quiet_transformers():  # its load report goes to the log; we raise our own error below
        model, info = model_class.from_pretrained(
            None,
            config=config,
            state_dict=checkpoint.state_dict(dtype),
            dtype=dtype,
            attn_implementation=_attention_implementation(config, model_class),
            experts_implementation=EXPERTS_IMPLEMENTATION,
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


# Mixture-of-experts layers in transformers dispatch their experts through one of several
# implementations. `batched_mm` gathers each token's selected experts' weights and multiplies
# by them: no data-dependent shapes, so it traces with dynamic batch and sequence, and a
# token reads only the experts it was routed to. (The default, grouped_mm, sorts tokens by
# expert into data-dependent groups; the eager loop visits experts by data-dependent index.)
# Models without experts ignore it.
EXPERTS_IMPLEMENTATION = "batched_mm"


def _model_class(fields: dict[str, Any], spec: DecoderSpec) -> tuple[Any, Any]:
    """transformers' config object and causal-LM class for a parsed config.json."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        config = AutoConfig.for_model(spec.model_type, **{k: v for k, v in fields.items() if k not in _NOT_FIELDS})
    except Exception as e:  # config classes validate with ValueError, TypeError, KeyError, ...
        raise CheckpointError(
            f"config.json: transformers' {spec.model_type} config rejects it ({type(e).__name__}: {_first_line(e)}); "
            "fix config.json"
        ) from e
    return config, MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


# quantization_config: weights shipped quantized reach the model dequantized (`Checkpoint.state_dict`)
_NOT_FIELDS = ("model_type", "auto_map", "quantization_config")


def cache_layout(fields: dict[str, Any], spec: DecoderSpec) -> DecoderSpec:
    """`spec` with the KV cache's layout as the modeling code keeps it: one token through the
    model on the meta device (no weights, no memory), and the shapes its cache then holds.

    Families cache differently from what their config says: multi-query models one head,
    multi-head latent attention a compressed latent and a rotary part of different sizes, and
    a family's layout can change between transformers releases (falcon's new architecture
    cached every query head before 5.25, its KV heads since). Reading the cache is exact for
    all of them.
    """
    from transformers import DynamicCache

    config, model_class = _model_class(fields, spec)
    stateful = _has_state_layers(config)
    try:
        with _quiet_transformers(), torch.device("meta"):
            # eager attention: the SDPA path asks whether the mask is all ones (`.item()`),
            # which a meta tensor cannot answer; the cache is the same either way
            model = model_class._from_config(
                config, attn_implementation="eager", experts_implementation=EXPERTS_IMPLEMENTATION
            )
        # a config makes the cache give each layer kind its own cache object (a convolution's
        # state); attention-only models keep a plain cache, every layer its full history
        cache = DynamicCache(config=config) if stateful else DynamicCache()
        one = torch.ones(1, 1, dtype=torch.long, device="meta")  # a mask too: no padding check reads the ids
        with torch.no_grad():
            model.eval()(input_ids=one, attention_mask=one, cache=cache)
    except Exception as e:  # modeling code raises anything; what matters is which stage
        raise ExportError(
            f"{spec.model_type}: transformers' modeling code fails on one token ({type(e).__name__}: "
            f"{_first_line(e)}); this architecture/transformers version combination cannot be compiled"
        ) from e
    layers: list[Any] = list(cache.layers)
    states = _layer_states(layers, spec) if stateful else None
    shapes = {
        (tuple(layer.keys.shape), tuple(layer.values.shape))
        for layer in layers
        if getattr(layer, "keys", None) is not None and getattr(layer, "values", None) is not None
    }
    if len(layers) != spec.num_layers or len(shapes) != 1:
        raise ExportError(
            f"{spec.model_type}: the modeling code caches {len(layers)} layers of shapes {sorted(shapes)} "
            f"for a config of {spec.num_layers} layers; kvforge's contract needs one key/value shape for every layer"
        )
    (key, value) = shapes.pop()
    if key[:3] != value[:3] or len(key) != 4:
        raise ExportError(
            f"{spec.model_type}: the modeling code caches keys {list(key)} and values {list(value)}; kvforge's "
            "contract needs [batch, heads, positions, size] for both, with the same heads"
        )
    return spec.with_cache(num_kv_heads=key[1], head_dim=key[3], value_head_dim=value[3], layers=states)


def _has_state_layers(config: Any) -> bool:
    return any(kind in _STATE_LAYER_TYPES for kind in getattr(config, "layer_types", None) or ())


# transformers' layer_types whose cache objects keep a fixed-size state the contract carries
# (falcon_h1's "hybrid" layers keep one next to their keys and values).
_STATE_LAYER_TYPES = ("conv", "linear_attention", "hybrid")


def _layer_states(layers: list[Any], spec: DecoderSpec) -> tuple[LayerState, ...]:
    """Each cached layer's kind and state shapes (after batch), from the cache objects the
    modeling code filled: attention layers hold keys and values, convolution layers a state,
    hybrid layers (attention and a Mamba mixer in one) keys and values and two states."""
    from transformers.cache_utils import (
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionCacheLayerMixin,
    )

    result = []
    for index, layer in enumerate(layers):
        hybrid = type(layer) is LinearAttentionAndFullAttentionLayer
        if isinstance(layer, LinearAttentionCacheLayerMixin) and (hybrid or not isinstance(layer, DynamicLayer)):
            conv = layer.conv_states.get(0) if layer.is_conv_states_initialized.get(0) else None
            recurrent = layer.recurrent_states.get(0) if layer.is_recurrent_states_initialized.get(0) else None
            shapes = tuple(tuple(state.shape[1:]) for state in (conv, recurrent) if state is not None)
            kind = {(False, 1): "conv", (False, 2): "linear_attention", (True, 2): "hybrid"}.get((hybrid, len(shapes)))
            if conv is not None and layer.number_of_states == 1 and kind is not None:
                result.append(LayerState(kind, shapes))
                continue
        elif type(layer) is DynamicLayer:
            result.append(LayerState("attention"))
            continue
        raise ExportError(
            f"{spec.model_type}: layer {index} keeps a {type(layer).__name__} cache; kvforge's contract carries "
            "attention layers' keys and values, convolution layers' states, linear-attention layers' "
            "convolution and recurrent states, and hybrid layers' keys, values and both states only"
        )
    return tuple(result)


def layer_windows(fields: dict[str, Any], spec: DecoderSpec) -> tuple[int | None, ...] | None:
    """Per layer, the sliding window transformers' own cache bounds it by (its layer types, as
    `DynamicCache(config=...)` reads them), or None for a layer that keeps its whole history;
    None when no layer is bounded. Chunked attention is not a sliding window and stays whole; a
    window no shorter than the model's context bounds nothing and is left out, and layers of
    different windows (which would share one mask) are all left whole."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    config, _ = _model_class(fields, spec)
    kinds, settings = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows = tuple(
        int(kwargs["sliding_window"])
        if kind == "sliding_attention" and 1 < int(kwargs.get("sliding_window") or 0) < spec.max_positions
        else None
        for kind, kwargs in zip(kinds, settings)
    )
    sizes = {window for window in windows if window is not None}
    # transformers builds one sliding mask for every sliding layer, from the first one's cache
    if len(windows) != spec.num_layers or len(sizes) != 1:
        return None
    return windows


def _attention_implementation(config: Any, model_class: Any) -> str:
    """SDPA traces to one ONNX Attention op (opset 23), the form every fusion starts from.
    transformers' SDPA path ignores attention-logit softcapping, so softcapped models
    (gemma2) keep the eager path, whose plain MatMul/Softmax ops are exact; so do models
    whose class has no SDPA path (attention sinks, ALiBi in some families)."""
    ignored = any(getattr(config, field, None) for field in SDPA_IGNORED_FIELDS)
    if ignored or not getattr(model_class, "_supports_sdpa", False):
        return "eager"
    return "sdpa"


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


def _bounded_layer(history: Any) -> Any:
    """A cache layer bounded by a sliding window, as the contract keeps it (`DecoderIO.layer_windows`):
    its past holds the last min(history, window - 1) of the `history` positions seen, and its
    present is that past plus the new positions (the runner keeps the present's last window - 1).

    The masks transformers builds from it are its own masks over the whole history, cut to the
    columns this layer holds (`get_mask_sizes`: their number and the first one's position);
    query positions stay absolute. Every size is read from a tensor's shape, so torch.export
    keeps them symbolic.
    """
    from transformers.cache_utils import DynamicLayer

    class BoundedLayer(DynamicLayer):
        is_sliding = True

        def get_seq_length(self) -> Any:
            return history

        def get_mask_sizes(self, query_length: Any) -> tuple[Any, Any]:
            assert self.keys is not None  # the past was put in when the cache was made
            held = self.keys.shape[-2]
            return held + query_length, history - held

    return BoundedLayer()


class DecoderWrapper(torch.nn.Module):
    """HF causal LM with flat KV-cache tensors in and out, in contract order.

    `past` is `io.cache_names` in order. For a model whose layers keep fixed-size states,
    each state enters transformers' own cache object for its layer, so the modeling code
    reads and updates it as it does in `generate`, and leaves as the layer's present.
    `io.layer_windows` bounds the layers it gives a window: their past holds only the
    window's last positions (`_bounded_layer`).
    """

    def __init__(self, model: torch.nn.Module, num_layers: int, io: DecoderIO | None = None) -> None:
        super().__init__()
        self.model = model
        self.num_layers = num_layers
        self.io = io if io is not None and io.layers is not None else None
        windows = None if io is None else io.layer_windows
        self.layer_windows = tuple(windows) if windows is not None else (None,) * num_layers

    def _bound(self, cache: Any, history: Any, past: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace the cache layers the contract bounds by a window with `_bounded_layer`s
        holding their past (`past(i)`: layer i's keys and values)."""
        for i, window in enumerate(self.layer_windows):
            if window is not None:
                cache.layers[i] = layer = _bounded_layer(history)
                layer.update(*past(i))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        if self.io is not None:
            return self._forward_with_states(input_ids, attention_mask, position_ids, past)
        # No config: every layer keeps what its past holds. A sliding-window layer the contract
        # does not bound keeps its full history and gets its windowed mask from the model.
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.num_layers)])
        self._bound(cache, attention_mask.shape[1] - input_ids.shape[1], lambda i: (past[2 * i], past[2 * i + 1]))
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

    def _forward_with_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache
        from transformers.cache_utils import LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

        io = self.io
        assert io is not None and io.layers is not None
        tensors = dict(zip(io.cache_names, past))
        attention = set(io.attention_layers)
        cache = DynamicCache(
            ddp_cache_data=[
                (tensors[io.past_name(i, "key")], tensors[io.past_name(i, "value")]) if i in attention else (None, None)
                for i in range(self.num_layers)
            ]
        )
        history = attention_mask.shape[1] - input_ids.shape[1]
        self._bound(cache, history, lambda i: (tensors[io.past_name(i, "key")], tensors[io.past_name(i, "value")]))
        for i, layer in enumerate(io.layers):
            if layer.kind != "attention":  # a conv state, and a recurrent one where the kind keeps it
                state: LinearAttentionLayer
                if layer.kind == "hybrid":  # keys and values too, as the attention layers'
                    both = LinearAttentionAndFullAttentionLayer()
                    both.update(tensors[io.past_name(i, "key")], tensors[io.past_name(i, "value")])
                    state = both
                else:
                    state = LinearAttentionLayer()
                conv = tensors[io.state_past_name(i, "conv")]
                state.dtype, state.device = conv.dtype, conv.device  # type: ignore[assignment]
                # a copy: the cache object updates its state in place
                state.conv_states[0] = conv.clone()
                state.conv_kernel_size[0] = conv.shape[-1]
                state.is_conv_states_initialized[0] = True
                # a zero state is what a fresh sequence has: one graph for prefill and decode
                state.has_previous_state[0] = True
                if "recurrent" in STATE_KINDS[layer.kind]:
                    state.recurrent_states[0] = tensors[io.state_past_name(i, "recurrent")].clone()
                    state.is_recurrent_states_initialized[0] = True
                cache.layers[i] = state
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        present: list[torch.Tensor] = []
        for i, layer in enumerate(io.layers):
            held = cache.layers[i]
            if layer.kind in KV_KINDS:  # keys and values first, then any states
                present += [held.keys, held.values]  # type: ignore[union-attr, list-item]
            if layer.kind != "attention":  # in the contract's order of the kind's states
                held_states = {"conv": held.conv_states[0], "recurrent": held.recurrent_states[0]}  # type: ignore[union-attr]
                present += [held_states[name] for name in STATE_KINDS[layer.kind]]  # type: ignore[misc]
        return (out.logits.float(), *present)


def example_inputs(io: DecoderIO, dtype: torch.dtype = torch.float32) -> tuple[Any, ...]:
    b, s, p = _EXAMPLE_BATCH, _EXAMPLE_SEQ, _EXAMPLE_PAST
    input_ids = torch.randint(0, io.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(b, p + s, dtype=torch.int64)
    positions = torch.arange(p, p + s, dtype=torch.int64).expand(b, s).contiguous()
    # a bounded layer's past one shorter than the history: its own size, related to no other
    past = [
        torch.zeros(_cache_shape(io, name, b, p - 1 if io.window_of(name) else p), dtype=dtype)
        for name in io.cache_names
    ]
    return input_ids, mask, positions, past


def _cache_shape(io: DecoderIO, name: str, batch: int, length: int) -> tuple[int, ...]:
    return io.kv_shape(name, batch, length) if name in io.past_names else io.state_shape(name, batch)


def export_decoder(model: torch.nn.Module, spec: DecoderSpec, io: DecoderIO) -> ExportedProgram:
    """torch.export the wrapped decoder with dynamic batch, sequence, past and total length."""
    wrapper = DecoderWrapper(model, spec.num_layers, io).eval()
    dyn = Dim.DYNAMIC
    dynamic_shapes = {
        "input_ids": {0: dyn, 1: dyn},
        "attention_mask": {0: dyn, 1: dyn},
        "position_ids": {0: dyn, 1: dyn},
        "past": [{0: dyn, 2: dyn} if name in io.past_names else {0: dyn} for name in io.cache_names],
    }
    dtype = next(model.parameters()).dtype
    try:
        with torch.no_grad(), traceable_kernels(model):
            return torch.export.export(wrapper, example_inputs(io, dtype), dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:  # torch.export raises many unrelated types; all mean the same to the user
        raise ExportError(
            f"torch.export failed for {spec.model_type}: {type(e).__name__}: {_first_line(e)}; "
            "this architecture/transformers version combination is not traceable, please report it"
        ) from e


def read_spec(ckpt: Checkpoint, context: int | None = None) -> DecoderSpec:
    """The checkpoint's spec (of `context` positions where given), checked against its weights,
    with the KV cache's layout read off the modeling code."""
    spec = DecoderSpec.from_config(
        ckpt.config, ckpt.generation_config, context=context, tokenizer_config=tokenizer_config(ckpt)
    )
    check_against_spec(ckpt, spec)
    return cache_layout(ckpt.config, spec)
