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

What a device cannot do in place (slicing a window-bounded layer's present, cutting positions off a
grown cache) goes through host memory: correct, and paid only by those layouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvforge.runners.contract import DecoderIO
from kvforge.runners.errors import GenerationError

if TYPE_CHECKING:
    import onnxruntime as ort


class Device(Protocol):
    """Where a session keeps its cache: how to make, read and write a tensor there."""

    name: str

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any: ...

    def to_host(self, tensor: Any) -> np.ndarray: ...

    def from_host(self, array: np.ndarray) -> Any: ...

    def adopt(self, tensor: Any) -> Any: ...


class HostDevice:
    """Host memory: tensors are numpy arrays, read and written in place."""

    name = "cpu"

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def to_host(self, tensor: Any) -> np.ndarray:
        return tensor if on_host(tensor) else np.asarray(tensor.numpy())

    def from_host(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def adopt(self, tensor: Any) -> np.ndarray:
        """`tensor` here: itself, or a device's tensor copied down."""
        return self.to_host(tensor)


HOST = HostDevice()


class OrtDevice:
    """Memory onnxruntime allocates on a device (`device_type` "cuda", or "cpu" for memory of its
    own on the host that no numpy array aliases); tensors are `OrtValue`s, copied to and from the
    host explicitly."""

    def __init__(self, device_type: str, device_id: int = 0) -> None:
        self.device_type, self.device_id = device_type, device_id
        self.name = f"{device_type}:{device_id}"

    def zeros(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> ort.OrtValue:
        return self.from_host(np.zeros(shape, dtype=dtype))

    def to_host(self, tensor: Any) -> np.ndarray:
        return tensor if on_host(tensor) else np.asarray(tensor.numpy())

    def from_host(self, array: np.ndarray) -> ort.OrtValue:
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self.device_type, self.device_id)

    def adopt(self, tensor: Any) -> Any:
        """`tensor` here: itself (a session on this device returned it), or a host array copied up."""
        return self.from_host(tensor) if on_host(tensor) else tensor


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


def columns_fed(io: DecoderIO, buffer: np.ndarray, width: int) -> np.ndarray:
    """What a step over the first `width` columns of a host buffer [rows, heads, capacity, dim] is fed:
    the buffer itself where the graph writes in place, else a copy of the columns in use (the
    graph takes exactly the positions held, and returns them grown)."""
    return buffer if io.shared_kv else np.ascontiguousarray(buffer[:, :, :width])


def keep_columns(io: DecoderIO, buffer: np.ndarray, present: np.ndarray, rows: slice, width: int, seq: int) -> None:
    """After a step fed `columns_fed(io, buffer, width)` for `rows`: the `seq` new positions, which a
    graph writing in place has already put into `buffer`, copied there from `present` otherwise."""
    if not io.shared_kv:
        buffer[rows, :, width : width + seq] = present[:, :, width : width + seq]


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
            if window is not None and _positions(tensor) >= window + extra:
                tensor = self.device.from_host(io.bounded(past, self.device.to_host(tensor), extra))
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
            tensors[name] = self.device.from_host(self.device.to_host(tensor)[:, :, :kept])
        return Cache(io, tensors, self.device)

    def host(self) -> dict[str, np.ndarray]:
        """Every tensor as a numpy array (copies, from a device)."""
        return {name: self.device.to_host(tensor) for name, tensor in self.items()}


def _positions(tensor: Any) -> int:
    shape = tensor.shape if on_host(tensor) else tensor.shape()
    return int(shape[2])
