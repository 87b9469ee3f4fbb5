"""One `Session` interface over the backends that run a compiled decoder step.

A session takes the contract's feeds as numpy arrays and returns every output by name.
The generation loop only sees this interface, so it is tested the same way against
onnxruntime and the eager torch reference (`kvforge.runners.torch_session`).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Sequence, Set
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvforge.runners.cache import (
    HOST,
    Device,
    DeviceView,
    OrtDevice,
    bounded_names,
    full_names,
    in_place,
    new_presents,
    on_host,
)
from kvforge.runners.contract import KEEP_INPUT, DecoderIO
from kvforge.runners.cpus import usable_cpus
from kvforge.runners.errors import ArtifactError
from kvforge.runners.external_data import check_external_data
from kvforge.runners.hugepages import huge_pages_for_new_memory
from kvforge.runners.manifest import check_io_against_graph, release

if TYPE_CHECKING:
    import onnxruntime as ort

    from kvforge.runners.manifest import FileHashes


# Cache bindings an `OrtSession` keeps: a server's batch and the prompt it is prefilling,
# with room for the four configurations `kvforge bench` steps in turn.
_KEPT_BINDINGS = 4
# `logits_to_keep` when the caller does not say: the last position, what generation reads
# (the graph's own default, for other runtimes, is every position)
_LAST_POSITION = np.ones(1, dtype=np.int64)


class _CacheBinding:
    """An IO binding of one set of cache buffers, held by weak reference with their shapes."""

    def __init__(self, binding: ort.IOBinding, buffers: Sequence[np.ndarray]) -> None:
        self.binding = binding
        self._buffers = [(weakref.ref(a), a.shape) for a in buffers]

    def holds(self, buffers: Sequence[np.ndarray]) -> bool:
        return len(buffers) == len(self._buffers) and all(
            ref() is a and shape == a.shape for (ref, shape), a in zip(self._buffers, buffers)
        )

    def alive(self) -> bool:
        return all(ref() is not None for ref, _ in self._buffers)


class Session(Protocol):
    io: DecoderIO
    device: Device  # where the session keeps its cache (`kvforge.runners.cache`)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class OrtSession:
    """An onnxruntime session over `model.onnx`, checked against the contract on open.

    Before onnxruntime reads the model, its external data locations are checked to be
    plain files beside it (and among ``data_files`` when given: the manifest's files).
    """

    def __init__(
        self,
        model_path: Path,
        io: DecoderIO,
        providers: Sequence[str] = ("CPUExecutionProvider",),
        data_files: Set[str] | None = None,
        *,
        weights_cast_per_run: bool = False,
        prepack: bool = True,
        huge_pages: bool = False,
        hashes: FileHashes | None = None,
        stop_spinning: bool = False,
        built_with: str | None = None,
    ) -> None:
        """`weights_cast_per_run` is for a graph whose weights are read through Casts
        (`kvforge.passes.widen`): onnxruntime then leaves the graph as it is (constant folding would
        make float32 copies of the weights), runs nodes in priority order (each Cast just
        before its reader) and allocates without an arena, so one weight at a time is held
        converted.

        `prepack=False` leaves float MatMul weights as stored instead of copying each into its
        kernel's layout at load: MLAS packs them per product then, the same products to float32
        rounding (docs/performance.md), slower, and loading never holds a
        weight and its packed copy at once (the verification gate of an unquantized build;
        quantized kernels compute differently without theirs prepacked).

        `huge_pages` backs the memory onnxruntime allocates while loading (the prepacked
        weights) with 2 MiB pages on Linux (`kvforge.runners.hugepages`): decode streams it faster,
        for a little more time at load.

        `hashes`, where given, are the artifact's sha256 checks running in threads: every file
        but the external data must have matched before onnxruntime opens the model, so that
        what it parses is checked; the weights' bytes are hashed while it loads them, and the
        caller drops the session if they do not match.

        `stop_spinning` stops the CPU threads spinning when a run ends (onnxruntime's
        `session.force_spinning_stop`), for a session that takes turns with another in the
        process (`Engine.load`).

        `built_with`: the onnxruntime release the artifact was built and verified on (its
        manifest's `tools`); a graph this one cannot load, where it is older, says to install
        that release (a build uses the ops its own onnxruntime has, newer ones included)."""
        import onnxruntime as ort

        if io.kv_dtype == "bfloat16":
            raise ArtifactError(
                f"{model_path}: this artifact computes in bfloat16, which onnxruntime's CPU provider cannot run "
                "(it has no bfloat16 MatMul); run it on TensorRT (`kvforge build-engine`), or build it with "
                "--dtype fp16 or fp32 for onnxruntime"
            )
        locations = check_external_data(Path(model_path), data_files)
        if hashes is not None:
            hashes.wait(exclude=locations)

        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = usable_cpus()
        if not prepack:
            options.add_session_config_entry("session.disable_prepacking", "1")
        if stop_spinning:
            options.add_session_config_entry("session.force_spinning_stop", "1")
        if weights_cast_per_run:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            options.execution_order = ort.ExecutionOrder.PRIORITY_BASED
            options.enable_cpu_mem_arena = False
        try:
            with huge_pages_for_new_memory() if huge_pages else contextlib.nullcontext():
                self._session = ort.InferenceSession(str(model_path), options, providers=list(providers))
        except Exception as e:  # onnxruntime raises its own untyped errors
            advice = "rebuild the artifact"
            if built_with is not None and release(ort.__version__) < release(built_with):
                advice = (
                    f"it was built on onnxruntime {built_with} and this is {ort.__version__}: install "
                    f"'onnxruntime>={built_with}', or rebuild the artifact with this one"
                )
            raise ArtifactError(f"{model_path}: onnxruntime could not load the model ({e}); {advice}") from e
        self.io = io
        # an input with a default in the graph (`logits_to_keep`) is an overridable initializer to
        # onnxruntime, listed after the inputs the graph requires
        inputs = [*self._session.get_inputs(), *self._session.get_overridable_initializers()]
        outputs = self._session.get_outputs()
        check_io_against_graph(
            Path(model_path),
            io,
            [(t.name, t.type, t.shape) for t in inputs],
            [(t.name, t.type, t.shape) for t in outputs],
        )
        expected = [t.name for t in io.inputs], [t.name for t in io.outputs]
        self._output_names = expected[1]
        self._step_inputs = [name for name in expected[0] if name not in set(io.past_names)]
        self._small_inputs = [name for name in expected[0] if name not in set(io.cache_names)]
        # The cache lives where the session runs: host memory for the CPU provider, which reads it
        # in place; the device's own memory for any other (a device copies host memory it is given).
        self.device: Device = HOST if providers[0] == "CPUExecutionProvider" else OrtDevice("cuda", 0)
        # Layers bounded by a window take a new past every step and return a longer present
        # (`DecoderIO.layer_windows`); only the others' buffers are bound in place.
        pairs = dict(zip(io.past_names, io.present_names))
        self._in_place = [(p, pairs[p]) for p in full_names(io)]
        self._bounded = [(p, pairs[p]) for p in bounded_names(io)]
        # The most recently used cache bindings, each kept while its buffers live (see _run_in_place).
        self._bindings: collections.OrderedDict[tuple[int, ...], _CacheBinding] = collections.OrderedDict()

    def run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        if self.io.keeps_logits and KEEP_INPUT not in feeds:
            feeds = {**feeds, KEEP_INPUT: _LAST_POSITION}
        if self.device is not HOST:
            return self._run_on_device(feeds)
        if in_place(self.io):
            return self._run_in_place(feeds)
        outputs = self._session.run(self._output_names, feeds)
        return dict(zip(self._output_names, outputs))

    def _run_in_place(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Bind each past buffer as its present output too: the model writes the new
        positions into the caller's arrays, and nothing of the cache is copied.

        The cache buffers are the same arrays at every step of a generation, so a binding
        is made once per set of buffers and reused while later calls pass the same array
        objects with the same shapes; each step rebinds only the small inputs and the logits.
        The last few sets keep their bindings, so generations stepped in turn (a server's
        batch and the prompt it is prefilling, `kvforge bench`) do not rebind every cache
        tensor at every step. A layer bounded by a sliding window (`DecoderIO.layer_windows`)
        has no buffer to share: its past is bound as an input and its present (past plus the
        new positions) to a new array at every step.
        """
        buffers = [feeds[past] for past, _ in self._in_place]
        if buffers:
            binding = self._cached_binding(feeds, buffers)
        else:  # every layer bounded by a window: nothing to keep bound, and no binding shared between callers
            binding = self._session.io_binding()
        held_inputs: list[Any] = []  # alive until the run: the binding reads their memory
        for name in self._step_inputs:
            _bind_host_input(binding, name, feeds[name], held_inputs)
        ids = feeds["input_ids"]
        logits = np.empty((ids.shape[0], self.io.logits_rows(feeds), self.io.vocab_size), dtype=self.io.logits_dtype)
        binding.bind_output("logits", "cpu", 0, logits.dtype, list(logits.shape), logits.ctypes.data)
        outputs = {present: feeds[past] for past, present in self._in_place}
        for past, _ in self._bounded:
            held_inputs.append(np.ascontiguousarray(feeds[past]))
            binding.bind_cpu_input(past, held_inputs[-1])
        # a window-bounded layer's present (past + new positions) and the fixed-size states: new arrays
        for present, array in new_presents(self.io, feeds, ids.shape[1]).items():
            binding.bind_output(present, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
            outputs[present] = array
        self._session.run_with_iobinding(binding)
        del held_inputs
        outputs["logits"] = logits  # a new array per step: the caller may keep it
        return outputs

    def _cached_binding(self, feeds: dict[str, np.ndarray], buffers: list[np.ndarray]) -> ort.IOBinding:
        key = tuple(id(a) for a in buffers)
        entry = self._bindings.get(key)
        if entry is None or not entry.holds(buffers):
            entry = _CacheBinding(self._bind_cache(feeds), buffers)
            self._bindings[key] = entry
            # weak references: a finished generation's cache is freed as soon as its caller drops it
            for stale in [k for k, e in self._bindings.items() if not e.alive()]:
                del self._bindings[stale]
            while len(self._bindings) > _KEPT_BINDINGS:
                self._bindings.popitem(last=False)
        self._bindings.move_to_end(key)
        return entry.binding

    def _bind_cache(self, feeds: dict[str, np.ndarray]) -> ort.IOBinding:
        binding = self._session.io_binding()
        for past, present in self._in_place:
            buffer = feeds[past]
            if not (buffer.flags.c_contiguous and buffer.flags.writeable):
                raise ValueError(f"{past}: a shared KV buffer must be a writeable C-contiguous array")
            binding.bind_cpu_input(past, buffer)
            binding.bind_output(present, "cpu", 0, buffer.dtype, list(buffer.shape), buffer.ctypes.data)
        return binding

    def _run_on_device(self, feeds: dict[str, Any]) -> dict[str, Any]:
        """One step with the cache in the device's memory (`OrtValue`s from `kvforge.runners.cache`).

        Everything is bound anew at every step, since a device copies host memory when it is bound:
        a binding kept across steps would hold the values it had then. Cache tensors already on the
        device are bound where they are, at no copy; a shared buffer is bound as its present too, so
        the graph writes the new positions into it. Other presents and states are allocated on the
        device and returned as `OrtValue`s; only the logits come back to the host. Host arrays among
        the feeds (a caller holding its cache on the host) are copied up, and a shared one is written
        back, which is correct and slow.
        """
        device = self.device
        assert isinstance(device, OrtDevice)
        binding = self._session.io_binding()
        held: list[Any] = []  # host inputs alive until the run
        for name in self._small_inputs:
            _bind_host_input(binding, name, np.ascontiguousarray(feeds[name]), held)
        ids = feeds["input_ids"]
        logits = np.empty((ids.shape[0], self.io.logits_rows(feeds), self.io.vocab_size), dtype=self.io.logits_dtype)
        binding.bind_output("logits", "cpu", 0, logits.dtype, list(logits.shape), logits.ctypes.data)
        outputs: dict[str, Any] = {"logits": logits}
        allocated: list[str] = []  # presents the device allocates, in the order bound
        written_in_place = set(self._in_place) if in_place(self.io) else set()
        for past, present in zip(self.io.cache_names, self.io.cache_present_names):
            tensor = feeds[past]
            if on_host(tensor):
                held.append(np.ascontiguousarray(tensor))
                binding.bind_cpu_input(past, held[-1])
            elif isinstance(tensor, DeviceView):  # rows of a buffer, bound where they are
                where = (device.device_type, device.device_id, tensor.dtype, tensor.shape(), tensor.data_ptr())
                binding.bind_input(past, *where)
            else:
                binding.bind_ortvalue_input(past, tensor)
            if (past, present) in written_in_place:
                if on_host(tensor):  # written back into the array bound as its past
                    array = held[-1]
                    binding.bind_output(present, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)
                    outputs[present] = array
                elif isinstance(tensor, DeviceView):
                    binding.bind_output(present, *where)
                    outputs[present] = tensor
                else:
                    binding.bind_ortvalue_output(present, tensor)
                    outputs[present] = tensor
            else:
                binding.bind_output(present, device.device_type, device.device_id)
                allocated.append(present)
        self._session.run_with_iobinding(binding)
        del held
        if allocated:
            values = binding.get_outputs()
            # get_outputs lists every bound output in binding order: the logits, then the presents
            bound = ["logits", *(q for _, q in zip(self.io.cache_names, self.io.cache_present_names))]
            by_name = dict(zip(bound, values))
            outputs.update({name: by_name[name] for name in allocated})
        return outputs


def _bind_host_input(binding: ort.IOBinding, name: str, array: np.ndarray, held: list[Any]) -> None:
    """Bind a host array as input `name`. `logits_to_keep` has a default in the graph, which makes it
    an overridable initializer to onnxruntime: `bind_cpu_input` looks among the required inputs
    only, an `OrtValue` is bound by name (it is kept in `held` until the run)."""
    if name != KEEP_INPUT:
        binding.bind_cpu_input(name, array)
        return
    import onnxruntime as ort

    held.append(array)
    held.append(value := ort.OrtValue.ortvalue_from_numpy(array))
    binding.bind_ortvalue_input(name, value)
