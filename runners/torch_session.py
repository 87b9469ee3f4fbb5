"""The eager torch reference behind the same `Session` interface as onnxruntime.

Used by the verification gate and the tests, never by the runtime path: it imports torch,
which `runners` otherwise does not need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvforge.runners.cache import HOST, Device
from kvforge.runners.contract import DecoderIO


class TorchSession:
    """Runs `module(input_ids, attention_mask, position_ids, past)` -> (logits, *present).

    The cache computes in `dtype` (the model's) and crosses the numpy boundary in the
    contract's `kv_dtype`: a bfloat16 model, which numpy cannot hold, takes a float32
    contract, losslessly, since every cached value is a bfloat16 one widened.
    """

    def __init__(self, module: Callable[..., Any], io: DecoderIO, dtype: torch.dtype = torch.float32) -> None:
        self.module = module
        self.io = io
        self.device: Device = HOST  # feeds and returns numpy arrays
        self.dtype = dtype

    @torch.no_grad()
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in feeds.items()}
        past = [tensors[name].to(self.dtype) for name in self.io.cache_names]
        outputs = self.module(tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], past)
        return {
            spec.name: out.detach().to(getattr(torch, spec.dtype)).numpy()
            for spec, out in zip(self.io.outputs, outputs)
        }
