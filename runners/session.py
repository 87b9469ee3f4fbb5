"""One `Session` interface over the backends that run a compiled decoder step.

A session takes the contract's feeds as numpy arrays and returns every output by name.
The generation loop only sees this interface, so it is tested the same way against
onnxruntime and the eager torch reference (`runners.torch_session`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from pathlib import Path
from typing import Protocol

import numpy as np

from runners.contract import DecoderIO
from runners.errors import ArtifactError
from runners.external_data import check_external_data


class Session(Protocol):
    io: DecoderIO

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
    ) -> None:
        import onnxruntime as ort

        check_external_data(Path(model_path), data_files)

        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            self._session = ort.InferenceSession(str(model_path), options, providers=list(providers))
        except Exception as e:  # onnxruntime raises its own untyped errors
            raise ArtifactError(
                f"{model_path}: onnxruntime could not load the model ({e}); rebuild the artifact"
            ) from e
        self.io = io
        names = [i.name for i in self._session.get_inputs()], [o.name for o in self._session.get_outputs()]
        expected = [t.name for t in io.inputs], [t.name for t in io.outputs]
        if names != expected:
            raise ArtifactError(
                f"{model_path}: graph I/O {names} does not match the manifest's contract {expected}; "
                "rebuild the artifact"
            )
        self._output_names = expected[1]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self._session.run(self._output_names, feeds)
        return dict(zip(self._output_names, outputs))
