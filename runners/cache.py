"""The layer-state cache: every layer's keys, values and fixed-size states, held where the session runs.

A `Cache` maps each past name of the contract (`DecoderIO.cache_names`) to its tensor for a batch
of rows. Where the session runs on the host (onnxruntime's CPU provider, the eager reference, a
TensorRT session that mirrors its cache), the tensors are numpy arrays; on a device they are
onnxruntime `OrtValue`s in the device's memory, and a step moves only the ids, positions and mask
up and the logits down. Which one is the session's `device`.

The cache is the one place that knows the layouts: keys and values shared between past and present
(the contract's `shared` mode: one preallocated buffer, written in place) or grown by every step
(`concat`), layers bounded by a sliding window (their past is the present's last `window - 1`
positions), and fixed-size states (replaced by every step's present).

The server's continuous batch (`BatchCache`) lives here too: its rows join, leave and are compacted
by copies where the cache lives. onnxruntime's Python API copies whole tensors only, so on a device
a region (a window-bounded layer's last positions, a row, a prefix-cache block) is copied by a
one-node graph run on the device's provider, bound at the two addresses (`OrtDevice.copy`): never
through host memory. This module is the only one that allocates KV memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import GenerationError, KvforgeError

if TYPE_CHECKING:
    import onnxruntime as ort


class Device(Protocol):
    """Where a session keeps its cache: how to make, read, write and copy a tensor there."""

    name: str

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any: ...

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        """A tensor whose every element the caller writes next."""
        ...

    def to_host(self, tensor: Any) -> np.ndarray: ...

    def from_host(self, array: np.ndarray) -> Any: ...

    def adopt(self, tensor: Any) -> Any: ...

    def copy(
        self, src: Any, src_start: Sequence[int], dst: Any, dst_start: Sequence[int], extent: Sequence[int]
    ) -> None:
        """``dst[dst_start : dst_start + extent] = src[src_start : src_start + extent]`` (per axis),
        where both live; overlapping regions of one buffer are copied as if through a temporary."""
        ...

    def rows(self, tensor: Any, start: int, count: int) -> Any:
        """Rows [start, start + count) of `tensor` (its first axis) where they are, without a copy."""
        ...


class HostDevice:
    """Host memory: tensors are numpy arrays, read and written in place."""

    name = "cpu"

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def to_host(self, tensor: Any) -> np.ndarray:
        return tensor if on_host(tensor) else OrtDevice.host_copy(tensor)

    def from_host(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def adopt(self, tensor: Any) -> np.ndarray:
        """`tensor` here: itself, or a device's tensor copied down."""
        return self.to_host(tensor)

    def copy(
        self, src: Any, src_start: Sequence[int], dst: Any, dst_start: Sequence[int], extent: Sequence[int]
    ) -> None:
        dst[_region(dst_start, extent)] = src[_region(src_start, extent)]

    def rows(self, tensor: Any, start: int, count: int) -> np.ndarray:
        return tensor[start : start + count]  # type: ignore[no-any-return]


HOST = HostDevice()


class DeviceView:
    """Rows of an `OrtValue` [slots, ...] where they are: an address and a shape, bound without a copy."""

    def __init__(self, base: Any, offset: int, dims: tuple[int, ...]) -> None:
        self.base, self.offset, self.dims = base, offset, dims
        self.dtype = _ORT_TYPES[base.element_type()]

    def shape(self) -> list[int]:
        return list(self.dims)

    def data_ptr(self) -> int:
        return int(self.base.data_ptr()) + self.offset


class OrtDevice:
    """Memory onnxruntime allocates on a device (`device_type` "cuda", or "cpu" for memory of its
    own on the host that no numpy array aliases); tensors are `OrtValue`s (or `DeviceView`s of their
    rows), copied to and from the host explicitly and within the device by a copy graph run on the
    device's own provider (an Identity over bytes, bound by address: no round trip through the host)."""

    def __init__(self, device_type: str, device_id: int = 0) -> None:
        self.device_type, self.device_id = device_type, device_id
        self.name = f"{device_type}:{device_id}"
        self._copier: Any = None

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> ort.OrtValue:
        return self.from_host(np.zeros(shape, dtype=dtype))

    def empty(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> ort.OrtValue:
        """A tensor whose every element the caller writes next (no host copy)."""
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_shape_and_type(
            list(shape), np.dtype(dtype).type, self.device_type, self.device_id
        )

    def to_host(self, tensor: Any) -> np.ndarray:
        return tensor if on_host(tensor) else self.host_copy(tensor)

    @staticmethod
    def host_copy(tensor: Any) -> np.ndarray:
        if isinstance(tensor, DeviceView):
            device = OrtDevice(tensor.base.device_name().lower())
            whole = device.empty(tuple(tensor.dims), tensor.dtype)
            device.copy(tensor, (0,) * len(tensor.dims), whole, (0,) * len(tensor.dims), tensor.dims)
            tensor = whole
        return np.asarray(tensor.numpy())

    def from_host(self, array: np.ndarray) -> ort.OrtValue:
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device_type, self.device_id)

    def adopt(self, tensor: Any) -> Any:
        """`tensor` here: itself (a session on this device returned it), or a host array copied up."""
        return self.from_host(tensor) if on_host(tensor) else tensor

    def rows(self, tensor: Any, start: int, count: int) -> DeviceView:
        dims = tuple(shape_of(tensor))
        base, offset = (tensor.base, tensor.offset) if isinstance(tensor, DeviceView) else (tensor, 0)
        row_bytes = math.prod(dims[1:]) * np.dtype(_ORT_TYPES[base.element_type()]).itemsize
        return DeviceView(base, offset + start * row_bytes, (count, *dims[1:]))

    def copy(
        self, src: Any, src_start: Sequence[int], dst: Any, dst_start: Sequence[int], extent: Sequence[int]
    ) -> None:
        if on_host(src):
            src = self.from_host(src)
        itemsize = np.dtype(_ORT_TYPES[_base(dst).element_type()]).itemsize
        spans = _spans(shape_of(src), src_start, shape_of(dst), dst_start, extent, itemsize)
        if not spans:
            return
        src_at, dst_at = int(src.data_ptr()), int(dst.data_ptr())
        low = min(s for s, _, _ in spans), max(s + n for s, _, n in spans)
        high = min(d for _, d, _ in spans), max(d + n for _, d, n in spans)
        if src_at + low[0] < dst_at + high[1] and dst_at + high[0] < src_at + low[1]:  # overlap: through a temporary
            temp = self.empty(tuple(extent), _ORT_TYPES[_base(dst).element_type()])
            self.copy(src, src_start, temp, (0,) * len(extent), extent)
            self.copy(temp, (0,) * len(extent), dst, dst_start, extent)
            return
        copier = self._copy_session()
        for src_offset, dst_offset, nbytes in spans:
            binding = copier.io_binding()
            binding.bind_input("x", self.device_type, self.device_id, np.uint8, [nbytes], src_at + src_offset)
            binding.bind_output("y", self.device_type, self.device_id, np.uint8, [nbytes], dst_at + dst_offset)
            copier.run_with_iobinding(binding)

    def _copy_session(self) -> Any:
        if self._copier is None:
            import onnxruntime as ort

            provider = (
                "CPUExecutionProvider" if self.device_type == "cpu" else f"{self.device_type.upper()}ExecutionProvider"
            )
            options = ort.SessionOptions()
            options.log_severity_level = 3
            self._copier = ort.InferenceSession(COPY_GRAPH, options, providers=[provider])
        return self._copier


# The copy graph `OrtDevice.copy` runs: y = Identity(x), x and y uint8 [n], opset 17, IR version 8.
# Serialized here, so that the runtime needs no onnx package; a test builds it with onnx's helpers
# and compares the bytes.
COPY_GRAPH = (
    b'\x08\x08:<\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x04copyZ\x10\n\x01x\x12\x0b\n\t\x08\x02\x12\x05\n\x03'
    b"\x12\x01nb\x10\n\x01y\x12\x0b\n\t\x08\x02\x12\x05\n\x03\x12\x01nB\x04\n\x00\x10\x11"
)


def shape_of(tensor: Any) -> tuple[int, ...]:
    """The shape of a host array, an `OrtValue` or a `DeviceView`."""
    shape = tensor.shape if on_host(tensor) else tensor.shape()
    return tuple(int(d) for d in shape)


def _base(tensor: Any) -> Any:
    return tensor.base if isinstance(tensor, DeviceView) else tensor


def _region(start: Sequence[int], extent: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(s, s + e) for s, e in zip(start, extent))


def _spans(
    src_shape: Sequence[int],
    src_start: Sequence[int],
    dst_shape: Sequence[int],
    dst_start: Sequence[int],
    extent: Sequence[int],
    itemsize: int,
) -> list[tuple[int, int, int]]:
    """The contiguous byte runs (source offset, destination offset, bytes) of a block copy between
    two C-contiguous tensors, adjacent runs merged."""
    if any(e <= 0 for e in extent):
        return []
    ndim = len(extent)
    # the trailing axes copied whole in both tensors (and the one before them, in part) form one run
    inner = ndim - 1
    while inner > 0 and extent[inner] == src_shape[inner] == dst_shape[inner]:
        inner -= 1
    run = math.prod(extent[inner:]) * itemsize
    src_strides = [math.prod(src_shape[a + 1 :]) * itemsize for a in range(ndim)]
    dst_strides = [math.prod(dst_shape[a + 1 :]) * itemsize for a in range(ndim)]
    spans: list[tuple[int, int, int]] = []
    for index in np.ndindex(*extent[:inner]):
        src = sum((s + i) * st for s, i, st in zip(src_start, (*index, 0, *[0] * ndim), src_strides))
        dst = sum((s + i) * st for s, i, st in zip(dst_start, (*index, 0, *[0] * ndim), dst_strides))
        if spans and spans[-1][0] + spans[-1][2] == src and spans[-1][1] + spans[-1][2] == dst:
            spans[-1] = (spans[-1][0], spans[-1][1], spans[-1][2] + run)
        else:
            spans.append((src, dst, run))
    return spans


def _ort_types() -> dict[int, Any]:
    # onnx TensorProto element types of the caches kvforge builds
    return {1: np.float32, 10: np.float16, 11: np.float64, 3: np.int8, 2: np.uint8, 7: np.int64, 6: np.int32}


_ORT_TYPES = _ort_types()


def full_names(io: DecoderIO) -> list[str]:
    """The past names of the key/value layers that keep their whole history (in `shared` mode, the
    buffers the graph writes in place)."""
    return [name for name in io.past_names if io.window_of(name) is None]


def bounded_names(io: DecoderIO) -> list[str]:
    """The past names of the key/value layers bounded by a sliding window (each step's past is the
    previous present's last positions: never a buffer written in place)."""
    return [name for name in io.past_names if io.window_of(name) is not None]


def in_place(io: DecoderIO) -> bool:
    """Whether the graph writes the new positions into the past buffers (`shared`), so a caller
    keeps one preallocated buffer per full layer; else every step returns the past grown."""
    return io.shared_kv


def device_of(session: Any) -> Device:
    """Where `session` keeps its cache: its `device`, or the host for a session that names none."""
    return getattr(session, "device", HOST)


def on_host(tensor: Any) -> bool:
    return isinstance(tensor, np.ndarray)


class Cache(dict[str, Any]):
    """Every layer's state for a batch of rows, by past name, on `device`.

    A dict so that a step's feeds are ``small inputs | cache``; the methods below are the only
    code that reads the layouts.
    """

    def __init__(self, io: DecoderIO, tensors: Mapping[str, Any], device: Device = HOST) -> None:
        super().__init__(tensors)
        self.io = io
        self.device = device

    @classmethod
    def empty(cls, io: DecoderIO, batch: int, capacity: int, device: Device = HOST) -> Cache:
        """The cache before the first step: keys and values empty (`concat`) or `capacity` positions
        preallocated (`shared`); a window-bounded layer empty; fixed-size states zero. A graph with a
        fixed capacity (`io.capacity`) takes buffers of exactly that length, and a `capacity` beyond it
        is refused."""
        if io.capacity is not None and io.shared_kv:
            if capacity > io.capacity:
                raise GenerationError(
                    f"prompt plus max_new_tokens need {capacity} cache positions, but the artifact's KV cache holds "
                    f"{io.capacity} (io.capacity in its manifest); shorten the prompt, lower --max-new-tokens, or "
                    "rebuild with a larger --capacity"
                )
            capacity = io.capacity
        length = capacity if io.shared_kv else 0
        dtype = np.dtype(io.kv_dtype)
        tensors: dict[str, Any] = {
            name: device.zeros(io.kv_shape(name, batch, 0 if io.window_of(name) else length), dtype)
            for name in io.past_names
        }
        tensors.update({name: device.zeros(io.state_shape(name, batch), dtype) for name in io.state_names})
        return cls(io, tensors, device)

    def after(self, outputs: Mapping[str, Any], extra: int = 0) -> Cache:
        """The cache for the next step from a step's outputs: each present becomes its past (a layer
        bounded by its window keeps the present's last window - 1 positions, and `extra` older ones
        for a caller that may take back up to `extra` positions: `DecoderIO.bounded`)."""
        io = self.io
        tensors: dict[str, Any] = {}
        for past, present in zip(io.cache_names, io.cache_present_names):
            tensor = self.device.adopt(outputs[present])
            window = io.window_of(past)
            if window is not None and (positions := _positions(tensor)) >= window + extra:
                kept = window - 1 + extra
                tensor = columns(self.device, tensor, positions - kept, kept)
            tensors[past] = tensor
        return Cache(io, tensors, self.device)

    def drop_last(self, drop: int, length: int) -> Cache:
        """The cache without its last `drop` positions, `length` remaining (taking back rejected
        drafts). A shared buffer keeps its bytes: the next mask does not reach them and the next
        step overwrites them."""
        io = self.io
        tensors = dict(self)
        for name in io.past_names:
            tensor = tensors[name]
            if io.window_of(name) is not None:  # its own tensor: its last positions are the newest
                kept = _positions(tensor) - drop
            elif not io.shared_kv:
                kept = length
            else:
                continue
            tensors[name] = columns(self.device, tensor, 0, kept)
        return Cache(io, tensors, self.device)

    def host(self) -> dict[str, np.ndarray]:
        """Every tensor as a numpy array (copies, from a device)."""
        return {name: self.device.to_host(tensor) for name, tensor in self.items()}


def new_presents(io: DecoderIO, feeds: Mapping[str, np.ndarray], new: int) -> dict[str, np.ndarray]:
    """Host arrays for the outputs of a step over `feeds` (host arrays) that are not written in
    place, by present name: a window-bounded layer's present (its past and the `new` positions)
    and each fixed-size state (small: a new array each step)."""
    pairs = dict(zip(io.cache_names, io.cache_present_names))
    arrays = {}
    for past in bounded_names(io):
        batch, heads, held, dim = feeds[past].shape
        arrays[pairs[past]] = np.empty((batch, heads, held + new, dim), dtype=feeds[past].dtype)
    for past in io.state_names:
        arrays[pairs[past]] = np.empty_like(feeds[past])
    return arrays


def _positions(tensor: Any) -> int:
    return shape_of(tensor)[2]


def columns(device: Device, tensor: Any, start: int, count: int) -> Any:
    """Columns [start, start + count) of a key/value tensor [rows, heads, positions, dim], as a new
    contiguous tensor on `device`."""
    if on_host(tensor):
        return device.adopt(np.ascontiguousarray(tensor[:, :, start : start + count]))
    rows, heads, _, dim = shape_of(tensor)
    out = device.empty((rows, heads, count, dim), np.dtype(_dtype(tensor)))
    device.copy(tensor, (0, 0, start, 0), out, (0, 0, 0, 0), (rows, heads, count, dim))
    return out


def _dtype(tensor: Any) -> Any:
    return tensor.dtype if on_host(tensor) or isinstance(tensor, DeviceView) else _ORT_TYPES[tensor.element_type()]


def empty_states(io: DecoderIO, batch: int, device: Device = HOST) -> dict[str, Any]:
    """The fixed-size states (convolution, recurrent) of `batch` fresh sequences: zeros, on `device`."""
    return {name: device.zeros(io.state_shape(name, batch), np.dtype(io.kv_dtype)) for name in io.state_names}


def write_columns(cache: Cache, name: str, block: Any, start: int) -> None:
    """Write `block` [1, heads, count, dim] into columns [start, start + count) of `cache[name]`'s
    first row, where the cache lives (a prefix-cache block restored)."""
    cache.device.copy(block, (0, 0, 0, 0), cache[name], (0, 0, start, 0), shape_of(block))


def nbytes(tensor: Any) -> int:
    """Bytes `tensor` holds."""
    return math.prod(shape_of(tensor)) * np.dtype(_dtype(tensor)).itemsize


# Shared padding below this many columns is not worth a copy of the batch's cache.
MIN_COMPACTION = 16


class BatchCache:
    """The continuous batch's cache: one right-aligned, left-padded layout of every running row,
    where the session runs (numpy arrays on the host, `OrtValue`s on a device).

    The batch lives in one KV buffer per full-history layer, ``[max_rows, kv_heads, capacity,
    head_dim]``, and one attention mask ``[max_rows, capacity]`` (on the host: it is fed every step),
    all allocated once at the batch's capacity, so that a step at a given row count binds the same
    addresses every time (each buffer's first rows, bound where they are). Every row is
    right-aligned at a shared width ``W``: row ``i`` holds its ``length_i`` cached positions in
    columns ``[W - length_i, W)``, the columns before it are left padding (mask 0), and a decode step
    writes every row's new position at column ``W``. This is exactly a left-padded batch, so each
    row attends to what it would alone, and position ids count real tokens only.

    - A row joins from a batch-1 cache (its prefill), copied in right-aligned at ``W`` (a prompt
      longer than ``W`` first shifts the batch right to make room); a row that leaves has the
      last row moved into its slot.
    - A layer bounded by a sliding window (`DecoderIO.layer_windows`) keeps no column of the
      buffer: its cache is one tensor ``[rows, kv_heads, min(W, window - 1), head_dim]`` holding
      the last columns before ``W``, in the same layout, renewed by every step.
    - Fixed-size layer states have one buffer ``[max_rows, ...]`` with no column axis; a row's
      state joins with it and moves with it; padding columns never reach a state.
    - ``W`` grows with every step while rows come and go, so padding accumulates: when the padding
      every row shares (``W`` minus the longest row) reaches the longest row, or ``W`` reaches the
      capacity, the batch is shifted left by that amount (compaction). A row never holds more than
      the model's context, so the capacity stays bounded.
    - Rows may grow by different amounts in one step (speculative decoding): the width grows by the
      largest growth, and a row that kept fewer positions leaves the rest of those columns masked
      out (holes). The mask alone says what a row attends to, so holes change nothing; compaction
      gathers each row's real columns when holes are in the way of a plain shift.

    Every row operation is a copy where the cache lives (`Device.copy`): numpy slicing on the host,
    a copy run on the device's provider there; none goes through the host. A step moves the ids,
    positions and mask up and the logits down.
    """

    def __init__(self, io: DecoderIO, *, max_rows: int, max_positions: int, device: Device = HOST) -> None:
        self.io = io
        self.device = device
        self.max_rows = max_rows
        self.max_positions = max_positions
        # A graph with a fixed cache length takes buffers of exactly that length; otherwise
        # leave room past the context for the padding that builds up between compactions.
        self.fixed_capacity: int | None = io.capacity
        self.capacity_limit = self.fixed_capacity or max_positions + max(MIN_COMPACTION, max_positions // 4)
        self.full_names = full_names(io)
        self.lengths: list[int] = []  # positions cached, per row
        self.spans: list[int] = []  # columns from a row's first cached position to the width (length plus holes)
        self.width = 0
        self.compactions = 0  # times the batch was shifted left over shared padding
        dtype = np.dtype(io.kv_dtype)
        self.mask = np.zeros((max_rows, self.capacity_limit), dtype=np.int64)
        self._kv: dict[str, Any] = {
            name: device.zeros(io.kv_shape(name, max_rows, self.capacity_limit), dtype) for name in self.full_names
        }
        self._states: dict[str, Any] = empty_states(io, max_rows, device)
        self._bounded = self.empty_bounded()  # the window-bounded layers' last columns of every row
        self._views: tuple[int, dict[str, Any]] | None = None
        self._sequence: dict[str, Any] = {}  # a prefill's full-history buffers, reused

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def room(self) -> int:
        """Columns a step may write after the one at the width."""
        return self.capacity_limit - self.width - 1

    def empty_bounded(self, rows: int = 0) -> dict[str, Any]:
        """The window-bounded layers' caches of `rows` rows holding no position."""
        dtype = np.dtype(self.io.kv_dtype)
        return {name: self.device.zeros(self.io.kv_shape(name, rows, 0), dtype) for name in bounded_names(self.io)}

    def sequence(self, restore: Callable[[Cache], int] | None = None) -> tuple[Cache, int]:
        """A fresh batch-1 cache for a prefill, and the positions it already holds: `restore` (a
        prefix cache's) writes them into the full-history buffers and says how many. Those buffers
        are reused from one prefill to the next (in `shared` mode the graph writes into them);
        fixed-size states start from zero, so no state of another request leaks in."""
        if not self._sequence:
            length = self.io.capacity or self.max_positions
            dtype = np.dtype(self.io.kv_dtype)
            self._sequence = {
                name: self.device.zeros(self.io.kv_shape(name, 1, length), dtype) for name in self.full_names
            }
        start = 0 if restore is None else restore(Cache(self.io, self._sequence, self.device))
        full = {name: self._fed(buffer, start) for name, buffer in self._sequence.items()}
        tensors = full | self.empty_bounded(1) | empty_states(self.io, 1, self.device)
        return Cache(self.io, tensors, self.device), start

    # -- a step -------------------------------------------------------------------------

    def open(self, row: int | None, start: int, end: int) -> np.ndarray:
        """Unmask columns [start, end) of `row` (every row when None) for a step that feeds them;
        returns the step's mask, columns [0, end) of those rows."""
        rows = slice(0, self.rows) if row is None else slice(row, row + 1)
        self.mask[rows, start:end] = 1
        return np.ascontiguousarray(self.mask[rows, :end])

    def close(self, row: int, start: int, end: int) -> None:
        """Mask columns [start, end) of `row` out again (drafts a verify step rejected)."""
        self.mask[row, start:end] = 0

    def feeds(self, row: int | None, width: int) -> Cache:
        """The past of `row` (every row when None) over the first `width` columns, to feed a step
        that writes at column `width`. In the contract's `shared` mode the buffers' rows themselves
        (the graph writes the new positions in place; the same addresses while the row count stays);
        otherwise copies of the columns in use."""
        if row is None:
            views = self._whole(self.rows)
            full = {name: self._fed(views[name], width) for name in self._kv}
            states = {name: views[name] for name in self._states}
            bounded = self._bounded
        else:  # one row's verify step: no states, no bounded layers (speculation refuses them)
            full = {name: self._fed(self.device.rows(buffer, row, 1), width) for name, buffer in self._kv.items()}
            states, bounded = {}, {}
        return Cache(self.io, full | bounded | states, self.device)

    def store(self, present: Mapping[str, Any], row: int | None, width: int, seq: int) -> None:
        """Keep what a step over `feeds(row, width)` returned (the cache after it, by past name) for
        its `seq` new positions: their keys and values (already in place in `shared` mode), the
        rows' next states and, for a whole-batch step, the window-bounded layers' next caches."""
        first, count = (0, self.rows) if row is None else (row, 1)
        if not self.io.shared_kv:
            for name, buffer in self._kv.items():
                _, heads, _, dim = shape_of(buffer)
                self.device.copy(
                    present[name], (0, 0, width, 0), buffer, (first, 0, width, 0), (count, heads, seq, dim)
                )
        if row is None:
            for name, state in self._states.items():
                shape = shape_of(present[name])
                self.device.copy(present[name], (0,) * len(shape), state, (0,) * len(shape), shape)
            self._bounded = {name: present[name] for name in self._bounded}

    def take_back(self, drop: int) -> None:
        """Take the last `drop` positions out of the window-bounded layers after a whole-batch step
        (the drafts a batch of one rejected; the full layers' columns are cut by `close`). The step
        kept them `drop` positions beyond the window (`Cache.after`'s `extra`)."""
        if drop > 0:
            self._bounded = {
                name: columns(self.device, tensor, 0, _positions(tensor) - drop)
                for name, tensor in self._bounded.items()
            }

    def advance(self, growth: list[int], grown: int) -> None:
        """After a step: row i keeps `growth[i]` more positions; the width moves `grown` columns."""
        for index, kept in enumerate(growth):
            self.lengths[index] += kept
            self.spans[index] += grown
        self.width += grown

    # -- rows coming and going ----------------------------------------------------------

    def join(self, cache: Mapping[str, Any], length: int) -> None:
        """Append a row from a batch-1 cache holding `length` positions (its first `length`
        columns, a window-bounded layer's last ones), right-aligned at the width."""
        n = self.rows
        self._compact(force=max(self.width, length) + 1 > self.capacity_limit)
        width = max(self.width, length)
        if n + 1 > self.max_rows or width + 1 > self.capacity_limit:  # unreachable while requests fit the context
            raise KvforgeError(f"batch cache of {n + 1} x {width + 1} exceeds {self.max_rows} x {self.capacity_limit}")
        copy = self.device.copy
        shift = width - self.width
        if shift and n:  # a prompt longer than the batch's width: shift every row right
            for buffer in self._kv.values():
                _, heads, _, dim = shape_of(buffer)
                copy(buffer, (0, 0, 0, 0), buffer, (0, 0, shift, 0), (n, heads, self.width, dim))
            self.mask[:n, shift:width] = self.mask[:n, : self.width]
            self.mask[:n, :shift] = 0
        for name, buffer in self._kv.items():
            _, heads, _, dim = shape_of(buffer)
            copy(cache[name], (0, 0, 0, 0), buffer, (n, 0, width - length, 0), (1, heads, length, dim))
        for name, state in self._states.items():
            shape = shape_of(cache[name])
            copy(cache[name], (0,) * len(shape), state, (n, *[0] * (len(shape) - 1)), shape)
        self._bounded = {
            name: self._last_columns([rows, cache[name]], self.io.kept_positions(name, width))
            for name, rows in self._bounded.items()
        }
        self.mask[n] = 0
        self.mask[n, width - length : width] = 1
        self.width = width
        self.lengths.append(length)
        self.spans.append(length)
        self._views = None

    def remove(self, index: int) -> None:
        """Row `index` leaves; the last row moves into its slot (the caller moves its own record
        of the rows the same way)."""
        last = self.rows - 1
        copy = self.device.copy
        if index != last:
            for buffer in self._kv.values():
                _, heads, _, dim = shape_of(buffer)
                copy(buffer, (last, 0, 0, 0), buffer, (index, 0, 0, 0), (1, heads, self.width, dim))
            for tensor in [*self._states.values(), *self._bounded.values()]:
                shape = shape_of(tensor)
                rest = [0] * (len(shape) - 1)
                copy(tensor, (last, *rest), tensor, (index, *rest), (1, *shape[1:]))
            self.mask[index] = self.mask[last]  # whole: a verify step may have written past the width
            self.lengths[index], self.spans[index] = self.lengths[last], self.spans[last]
        self.lengths.pop()
        self.spans.pop()
        self.mask[last] = 0
        self._bounded = {name: self.device.rows(rows, 0, last) for name, rows in self._bounded.items()}
        self._views = None
        if not self.lengths:
            self.width = 0
            self._bounded = self.empty_bounded()

    def clear(self) -> None:
        """Every row leaves at once."""
        while self.rows:
            self.remove(self.rows - 1)

    # -- room ---------------------------------------------------------------------------

    def make_room(self, columns: int = 1) -> None:
        """Before a step: compact wasted padding, and make sure of room for one column at least
        (`columns` where the capacity allows)."""
        self._compact(force=self.width + columns > self.capacity_limit)
        if self.width + 1 > self.capacity_limit:  # unreachable while requests fit the context
            raise KvforgeError(f"batch cache width {self.width + 1} exceeds its capacity {self.capacity_limit}")

    def _compact(self, force: bool) -> None:
        """Shift the batch left over the padding every row shares, when it is wasteful or `force`."""
        if not self.lengths:
            return
        n = self.rows
        longest = max(self.lengths)
        waste = self.width - longest
        if waste > 0 and (force or waste >= max(longest, MIN_COMPACTION)):
            if max(self.spans) > longest:  # holes in the way of a shift: gather
                self._gather(longest)
                return
            for buffer in self._kv.values():
                _, heads, _, dim = shape_of(buffer)
                self.device.copy(buffer, (0, 0, waste, 0), buffer, (0, 0, 0, 0), (n, heads, longest, dim))
            self.mask[:n, :longest] = self.mask[:n, waste : self.width]
            self.mask[:n, longest:] = 0
            self._bounded = {
                name: self._last_columns([rows], self.io.kept_positions(name, longest))
                for name, rows in self._bounded.items()
            }
            self.width = longest
            self.compactions += 1

    def _gather(self, longest: int) -> None:
        """Compaction with holes (speculation only: no bounded layers, no states): each row's cached
        columns, in order, right-aligned at the new width `longest`."""
        for index, length in enumerate(self.lengths):
            columns = np.flatnonzero(self.mask[index, : self.width])
            start = longest - length
            for buffer in self._kv.values():
                if on_host(buffer):
                    buffer[index, :, start:longest] = buffer[index][:, columns]
                    continue
                _, heads, _, dim = shape_of(buffer)
                gathered = self.device.empty((1, heads, length, dim), np.dtype(_dtype(buffer)))
                at = 0
                for run in np.split(columns, np.flatnonzero(np.diff(columns) != 1) + 1):
                    if run.size:
                        extent = (1, heads, int(run.size), dim)
                        self.device.copy(buffer, (index, 0, int(run[0]), 0), gathered, (0, 0, at, 0), extent)
                        at += int(run.size)
                self.device.copy(gathered, (0, 0, 0, 0), buffer, (index, 0, start, 0), (1, heads, length, dim))
            self.mask[index] = 0
            self.mask[index, start:longest] = 1
            self.spans[index] = length
        self.width = longest
        self.compactions += 1

    def _fed(self, buffer: Any, width: int) -> Any:
        """What a step over the first `width` columns of `buffer` is fed: the buffer itself where the
        graph writes in place, else a copy of the columns in use (the graph takes exactly the
        positions held, and returns them grown)."""
        return buffer if self.io.shared_kv else columns(self.device, buffer, 0, width)

    def _last_columns(self, parts: list[Any], held: int) -> Any:
        """The rows of `parts` ([rows, heads, positions, dim] each) stacked, each as its last `held`
        columns: cut on the left, or padded there with zeros (columns every row's mask leaves out)."""
        shapes = [shape_of(part) for part in parts]
        _, heads, _, dim = shapes[0]
        out = self.device.zeros((sum(s[0] for s in shapes), heads, held, dim), np.dtype(self.io.kv_dtype))
        row = 0
        for part, (rows, _, positions, _) in zip(parts, shapes):
            take = min(positions, held)
            self.device.copy(part, (0, 0, positions - take, 0), out, (row, 0, held - take, 0), (rows, heads, take, dim))
            row += rows
        return out

    def _whole(self, rows: int) -> dict[str, Any]:
        """The first `rows` rows of every buffer, kept while the row count stays: the session keeps
        its binding while it is given the same arrays."""
        if self._views is None or self._views[0] != rows:
            buffers = self._kv | self._states
            self._views = (rows, {name: self.device.rows(buffer, 0, rows) for name, buffer in buffers.items()})
        return self._views[1]
