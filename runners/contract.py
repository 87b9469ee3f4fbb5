"""The KV-cache I/O contract: the one place that names every graph input and output.

Names follow the convention Optimum and onnxruntime-genai use, so artifacts are
understood by those tools too. torch.export dynamic shapes, the ONNX graph I/O, the
runner's feeds and the manifest's `io` section all derive from `DecoderIO`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvforge.runners.errors import ArtifactError

# `concat`: past and present are separate tensors; present = concat(past, new) along
# the sequence axis. The runner feeds each step's present back as the next past.
# `shared`: past and present are one preallocated buffer per tensor, `capacity` positions
# long; the model writes the new positions in place after the first `total - seq` (the
# attention mask's length says how many are valid), so no step copies the cache.
KV_MODES = ("concat", "shared")
# `all`: logits for every input position. `last`: only for the last one, the only one
# generation samples from (prompts are left-padded, so it is every row's last token);
# a prefill then skips the LM head for all other positions. `keep`: for the last
# `logits_to_keep` positions, an int64 [1] input (KEEP_INPUT): kvforge's runner asks for 1 at a
# prefill or decode step, for every position it feeds at a speculative verify step. Its
# default in the graph, for a runtime that does not feed it, is 0: every position.
LOGITS_POSITIONS = ("all", "last", "keep")
KEEP_INPUT = "logits_to_keep"
KEPT_DIM = "kept"  # the logits' positions dim under `keep`
# What graphs exchange with the runner. bfloat16 KV caches are a TensorRT (GPU) artifact's:
# numpy has no bfloat16, and onnxruntime's CPU provider cannot compute one (OrtSession says so).
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "int8")  # int8: a cache's codes (logits are float)
FLOAT_DTYPES = TENSOR_DTYPES[:3]
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
# The positions dimension of a bounded layer's past and present (`DecoderIO.layer_windows`),
# by the name a full layer's would have under `concat`.
WINDOW_DIMS = {"past": "window_past", "total": "window_total"}
# Far beyond any real model; a manifest past them is corrupt or hostile.
IO_LIMITS = {"num_layers": 10_000, "num_kv_heads": 1 << 16, "head_dim": 1 << 16, "vocab_size": 1 << 31}
# What a layer keeps between steps. `attention`: a key/value pair that grows by one position
# per token (`past_key_values.{i}.key|value`). `conv`: a short convolution's last inputs,
# `[batch, channels, kernel]` (`past_conv.{i}`), of fixed size: no sequence axis, each step
# reads the state and returns the next one. `linear_attention` (transformers' layer type for
# gated delta nets, qwen3_5 and qwen3_next, and for Mamba-2 layers): a short convolution's
# state as above (`past_conv.{i}`) and the recurrent state, `[batch, heads, key size, value
# size]` (`past_recurrent.{i}`), both of fixed size. `hybrid` (falcon_h1, whose every layer
# runs attention and a Mamba-2 mixer side by side): a key/value pair as `attention`, then the
# two states of `linear_attention`.
LAYER_KINDS = ("attention", "conv", "linear_attention", "hybrid")
STATE_KINDS: dict[str, tuple[str, ...]] = {
    "attention": (),
    "conv": ("conv",),
    "linear_attention": ("conv", "recurrent"),
    "hybrid": ("conv", "recurrent"),
}
# The kinds that keep a key/value pair (before their states, if any).
KV_KINDS = ("attention", "hybrid")
# A state's dimensions after batch: a few, each far beyond any real layer's.
MAX_STATE_RANK, MAX_STATE_DIM = 4, 1 << 20


class _SpecLike(Protocol):
    @property
    def num_layers(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name: "int64", "float32", ...
    dims: tuple[str | int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


@dataclass(frozen=True)
class LayerState:
    """One layer's kind and the shapes (after batch) of the fixed-size states it keeps, in
    the order of STATE_KINDS[kind]; an attention layer keeps its key/value pair instead."""

    kind: str
    states: tuple[tuple[int, ...], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        names = STATE_KINDS[self.kind]
        return {"kind": self.kind} | ({"states": {n: list(d) for n, d in zip(names, self.states)}} if names else {})

    @classmethod
    def from_dict(cls, index: int, data: object) -> LayerState:
        where = f"manifest.json: io.layers[{index}]"
        if not isinstance(data, Mapping) or data.get("kind") not in LAYER_KINDS:
            kind = data.get("kind") if isinstance(data, Mapping) else data
            raise ArtifactError(
                f"{where}: kind {str(kind)[:40]!r} is not one this runner knows ({', '.join(LAYER_KINDS)}); "
                "upgrade kvforge or rebuild the artifact"
            )
        kind = str(data["kind"])
        names = STATE_KINDS[kind]
        states = data.get("states", {})
        if not isinstance(states, Mapping) or sorted(states) != sorted(names):
            raise ArtifactError(f"{where}: a {kind} layer keeps the states {list(names)}; rebuild the artifact")
        shapes = []
        for name in names:
            dims = states[name]
            if (
                not isinstance(dims, list)
                or not 1 <= len(dims) <= MAX_STATE_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_STATE_DIM for d in dims)
            ):
                raise ArtifactError(
                    f"{where}: states.{name} must be 1 to {MAX_STATE_RANK} integers in [1, {MAX_STATE_DIM}], "
                    f"got {str(dims)[:80]}; rebuild the artifact"
                )
            shapes.append(tuple(dims))
        return cls(kind, tuple(shapes))


@dataclass(frozen=True)
class DecoderIO:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    kv_dtype: str = "float32"
    logits_dtype: str = "float32"
    kv_mode: str = "concat"
    logits_positions: str = "all"
    # `shared` mode only: a capacity fixed in the graph (the tensorrt target's S_max), or None
    # when the runner chooses it per request. Written to the manifest only when fixed.
    capacity: int | None = None
    # The value tensors' last dimension where it differs from the keys' `head_dim` (multi-head
    # latent attention caches a latent and a rotary part); None: the same. In the manifest
    # only when set.
    value_head_dim: int | None = None
    # Each layer's kind and fixed-size states, for a model whose layers are not all attention
    # (a convolution or linear-attention hybrid); None: every layer keeps a key/value pair.
    # In the manifest only when set.
    layers: tuple[LayerState, ...] | None = None
    # Per layer, the sliding window of a layer whose cache is bounded by it, or None for a layer
    # that keeps its whole history; None: every layer keeps it. A bounded layer's past holds its
    # last min(history, window - 1) positions and is always a separate tensor (never a shared
    # buffer): the graph returns past + new positions as its present, and the runner keeps that
    # present's last window - 1 positions as the next past (`bounded`). In the manifest only
    # when set.
    layer_windows: tuple[int | None, ...] | None = None

    @classmethod
    def for_spec(cls, spec: _SpecLike, kv_dtype: str = "float32") -> DecoderIO:
        value = getattr(spec, "value_head_dim", spec.head_dim)
        return cls(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            spec.vocab_size,
            kv_dtype,
            value_head_dim=None if value == spec.head_dim else value,
            layers=getattr(spec, "layers", None),
        )

    @functools.cached_property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that keep a key/value pair."""
        if self.layers is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, layer in enumerate(self.layers) if layer.kind in KV_KINDS)

    @functools.cached_property
    def _states(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """(past name, present name, dims after batch) of every fixed-size state, in layer order."""
        return tuple(
            (self.state_past_name(i, name), self.state_present_name(i, name), dims)
            for i, layer in enumerate(self.layers or ())
            for name, dims in zip(STATE_KINDS[layer.kind], layer.states)
        )

    @functools.cached_property
    def state_names(self) -> tuple[str, ...]:
        """The fixed-size states' past names (none for an attention-only model)."""
        return tuple(past for past, _, _ in self._states)

    @functools.cached_property
    def state_present_names(self) -> tuple[str, ...]:
        return tuple(present for _, present, _ in self._states)

    def state_shape(self, name: str, batch: int) -> tuple[int, ...]:
        """The shape of fixed-size state `name` (a past or present name) for `batch` rows."""
        dims = next(d for past, present, d in self._states if name in (past, present))
        return (batch, *dims)

    def state_bytes_per_sequence(self) -> int:
        """Bytes of fixed-size state one row holds, whatever its length."""
        return sum(math.prod(dims) for _, _, dims in self._states) * _ITEMSIZE[self.kv_dtype]

    @functools.cached_property
    def cache_names(self) -> tuple[str, ...]:
        """Every past input (key/value pairs and states), in the graph's input order."""
        return self._layer_names(past=True)

    @functools.cached_property
    def cache_present_names(self) -> tuple[str, ...]:
        return self._layer_names(past=False)

    def _layer_names(self, past: bool) -> tuple[str, ...]:
        states: dict[int, list[str]] = {i: [] for i in range(self.num_layers)}
        for p, q, _ in self._states:
            states[int(p.rsplit(".", 1)[1])].append(p if past else q)
        kv = set(self.attention_layers)
        name = self.past_name if past else self.present_name
        return tuple(
            n
            for i in range(self.num_layers)
            for n in ([name(i, "key"), name(i, "value")] if i in kv else []) + states[i]
        )

    def kv_shape(self, name: str, batch: int, length: int) -> tuple[int, int, int, int]:
        """The shape of cache tensor `name` (a past or present name) holding `length` positions."""
        last = self.head_dim if name.endswith(".key") else self.value_dim
        return (batch, self.num_kv_heads, length, last)

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.value_head_dim is None else self.value_head_dim

    def _layer_bytes_per_position(self) -> int:
        return self.num_kv_heads * (self.head_dim + self.value_dim) * _ITEMSIZE[self.kv_dtype]

    def state_past_name(self, layer: int, state: str) -> str:
        """A fixed-size state's input name: `past_conv.{layer}`, as lfm2's ONNX exports name it."""
        return f"past_{state}.{layer}"

    def state_present_name(self, layer: int, state: str) -> str:
        return f"present_{state}.{layer}"

    def window(self, layer: int) -> int | None:
        """The window bounding `layer`'s cache, or None when it keeps its whole history."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def window_of(self, name: str) -> int | None:
        """The window bounding the cache tensor `name` (a past or present name), or None (also
        for a fixed-size state's name)."""
        if self.layer_windows is None or not name.startswith(("past_key_values.", "present.")):
            return None
        return self.window(int(name.split(".")[-2]))

    def kept_positions(self, name: str, history: int) -> int:
        """How many positions the past tensor `name` holds after `history` positions were seen."""
        window = self.window_of(name)
        return history if window is None else min(history, window - 1)

    def bounded(self, name: str, present: Any, extra: int = 0) -> Any:
        """The next past of cache tensor `name` from its present [batch, heads, positions, dim]:
        the present itself, or for a bounded layer its last window - 1 positions (contiguous),
        plus `extra` older ones (which the mask leaves out) for a caller that may take back up
        to `extra` positions afterwards (speculative decoding)."""
        window = self.window_of(name)
        if window is None or present.shape[2] < window + extra:
            return present
        return present[:, :, present.shape[2] - (window - 1 + extra) :].copy()

    def kv_bytes_by_kind(self, positions: int, batch: int = 1) -> dict[str, int]:
        """Bytes of keys plus values the cache holds between steps once `positions` positions of
        `batch` rows are cached, by layer kind: "full" (whole history) and "sliding" (bounded by
        a window, min(positions, window - 1) each), over the layers that keep a key/value pair
        (a layer with a fixed-size state has none: `state_bytes_per_sequence`). A kind without
        layers is left out."""
        per_position = self._layer_bytes_per_position() * batch
        kinds: dict[str, int] = {}
        for layer in self.attention_layers:
            window = self.window(layer)
            kind, held = ("full", positions) if window is None else ("sliding", min(positions, window - 1))
            kinds[kind] = kinds.get(kind, 0) + held * per_position
        return kinds

    def past_name(self, layer: int, kind: str) -> str:
        return f"past_key_values.{layer}.{kind}"

    def present_name(self, layer: int, kind: str) -> str:
        return f"present.{layer}.{kind}"

    # Cached: the runner reads them at every decode step.
    # The key/value pairs only; `cache_names` adds the fixed-size states.
    @functools.cached_property
    def past_names(self) -> tuple[str, ...]:
        return tuple(self.past_name(i, k) for i in self.attention_layers for k in ("key", "value"))

    @functools.cached_property
    def present_names(self) -> tuple[str, ...]:
        return tuple(self.present_name(i, k) for i in self.attention_layers for k in ("key", "value"))

    @property
    def shared_kv(self) -> bool:
        return self.kv_mode == "shared"

    @property
    def _capacity_dim(self) -> str | int:
        return "capacity" if self.capacity is None else self.capacity

    def _kv_spec(self, name: str, length: str) -> TensorSpec:
        last = self.head_dim if name.endswith(".key") else self.value_dim
        if self.window_of(name) is not None:  # its own length, past and present alike
            positions: str | int = WINDOW_DIMS[length]
        else:
            positions = self._capacity_dim if self.shared_kv else length
        return TensorSpec(name, self.kv_dtype, ("batch", self.num_kv_heads, positions, last))

    def _cache_spec(self, name: str, length: str) -> TensorSpec:
        if name.startswith(("past_key_values.", "present.")):
            return self._kv_spec(name, length)
        return TensorSpec(name, self.kv_dtype, ("batch", *self.state_shape(name, 1)[1:]))

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return (
            TensorSpec("input_ids", "int64", ("batch", "seq")),
            TensorSpec("attention_mask", "int64", ("batch", "total")),
            TensorSpec("position_ids", "int64", ("batch", "seq")),
            *(self._cache_spec(n, "past") for n in self.cache_names),
            *((TensorSpec(KEEP_INPUT, "int64", (1,)),) if self.keeps_logits else ()),
        )

    @property
    def keeps_logits(self) -> bool:
        """The graph takes `logits_to_keep` (logits_positions `keep`)."""
        return self.logits_positions == "keep"

    def logits_rows(self, feeds: Mapping[str, Any]) -> int:
        """How many positions a step over `feeds` returns logits for: every one fed (`all`), the
        last (`last`), or the last `logits_to_keep` of them (`keep`; the graph slices, so 0 or
        more than were fed gives every one; not fed: 1, what `OrtSession` feeds then)."""
        seq = int(feeds["input_ids"].shape[1])
        if self.logits_positions == "all":
            return seq
        if self.logits_positions == "last":
            return 1
        keep = int(feeds[KEEP_INPUT][0]) if KEEP_INPUT in feeds else 1
        return seq if keep <= 0 or keep > seq else keep

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        positions: str | int = {"all": "seq", "keep": KEPT_DIM}.get(self.logits_positions, 1)
        return (
            TensorSpec("logits", self.logits_dtype, ("batch", positions, self.vocab_size)),
            *(self._cache_spec(n, "total") for n in self.cache_present_names),
        )

    def to_dict(self) -> dict[str, Any]:
        fixed: dict[str, Any] = {} if self.capacity is None else {"capacity": self.capacity}
        if self.value_head_dim is not None:
            fixed["value_head_dim"] = self.value_head_dim
        if self.layers is not None:
            fixed["layers"] = [layer.to_dict() for layer in self.layers]
        if self.layer_windows is not None:
            fixed["layer_windows"] = list(self.layer_windows)
        return fixed | {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "kv_dtype": self.kv_dtype,
            "logits_dtype": self.logits_dtype,
            "kv_mode": self.kv_mode,
            "logits_positions": self.logits_positions,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DecoderIO:
        """Read the manifest's `io` section; sizes are range-checked before any name list is built."""
        for field, limit in IO_LIMITS.items():
            value = data.get(field)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise ArtifactError(
                    f"manifest.json: io.{field} must be an integer in [1, {limit}], got {str(value)[:80]}; "
                    "rebuild the artifact"
                )
        try:
            io = cls(
                data["num_layers"],
                data["num_kv_heads"],
                data["head_dim"],
                data["vocab_size"],
                str(data["kv_dtype"]),
                str(data["logits_dtype"]),
                str(data["kv_mode"]),
                str(data["logits_positions"]),
                _capacity(data.get("capacity")),
                _value_head_dim(data.get("value_head_dim")),
                _layers(data.get("layers"), data["num_layers"]),
                _layer_windows(data.get("layer_windows"), data["num_layers"]),
            )
        except KeyError as e:
            raise ArtifactError(f"manifest.json: field io.{e.args[0]} is missing; rebuild the artifact") from e
        for field, allowed in (("kv_dtype", TENSOR_DTYPES), ("logits_dtype", FLOAT_DTYPES)):
            if getattr(io, field) not in allowed:
                raise ArtifactError(
                    f"manifest.json: io.{field} {str(getattr(io, field))[:40]!r} is not one of "
                    f"{', '.join(allowed)}; rebuild the artifact"
                )
        if io.kv_mode not in KV_MODES:
            raise ArtifactError(
                f"manifest.json: io.kv_mode {io.kv_mode!r} is not one this runner knows ({', '.join(KV_MODES)}); "
                "upgrade kvforge or rebuild the artifact"
            )
        if io.logits_positions not in LOGITS_POSITIONS:
            raise ArtifactError(
                f"manifest.json: io.logits_positions {io.logits_positions[:40]!r} is not one of "
                f"{', '.join(LOGITS_POSITIONS)}; upgrade kvforge or rebuild the artifact"
            )
        if io.capacity is not None and not io.shared_kv:
            raise ArtifactError(
                f"manifest.json: io.capacity is set for kv_mode {io.kv_mode!r}; only a shared cache has a fixed "
                "capacity, rebuild the artifact"
            )
        if io.to_dict() != dict(data):
            raise ArtifactError(
                "manifest.json: io section does not match the contract it declares; rebuild the artifact"
            )
        return io


def _layers(value: object, num_layers: int) -> tuple[LayerState, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != num_layers:
        raise ArtifactError(
            f"manifest.json: io.layers must list each of the {num_layers} layers, got {str(value)[:80]}; "
            "rebuild the artifact"
        )
    return tuple(LayerState.from_dict(i, layer) for i, layer in enumerate(value))


def _layer_windows(value: object, num_layers: int) -> tuple[int | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != num_layers:
        raise ArtifactError(
            f"manifest.json: io.layer_windows must be a list of {num_layers} entries (one per layer), got "
            f"{str(value)[:80]}; rebuild the artifact"
        )
    for window in value:
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or not 2 <= window <= MAX_CAPACITY
        ):
            raise ArtifactError(
                f"manifest.json: io.layer_windows entries must be null or an integer in [2, {MAX_CAPACITY}], got "
                f"{str(window)[:80]}; rebuild the artifact"
            )
    if all(window is None for window in value):
        raise ArtifactError("manifest.json: io.layer_windows bounds no layer (all null); rebuild the artifact")
    return tuple(value)


def _value_head_dim(value: object) -> int | None:
    if value is None:
        return None
    limit = IO_LIMITS["head_dim"]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ArtifactError(
            f"manifest.json: io.value_head_dim must be an integer in [1, {limit}], got {str(value)[:80]}; "
            "rebuild the artifact"
        )
    return value


# A fixed cache capacity beyond this is no real graph's (2**24 positions).
MAX_CAPACITY = 1 << 24


def _capacity(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CAPACITY:
        raise ArtifactError(
            f"manifest.json: io.capacity must be an integer in [1, {MAX_CAPACITY}], got {str(value)[:80]}; "
            "rebuild the artifact"
        )
    return value
