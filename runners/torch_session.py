"""The eager torch reference behind the same `Session` interface as onnxruntime.

Used by the verification gate and the tests, never by the runtime path: it imports torch,
which `runners` otherwise does not need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from runners.contract import DecoderIO


class TorchSession:
    """Runs `module(input_ids, attention_mask, position_ids, past)` -> (logits, *present)."""

    def __init__(self, module: Callable[..., Any], io: DecoderIO) -> None:
        self.module = module
        self.io = io

    @torch.no_grad()
    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        tensors = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in feeds.items()}
        past = [tensors[name] for name in self.io.past_names]
        outputs = self.module(tensors["input_ids"], tensors["attention_mask"], tensors["position_ids"], past)
        names = [t.name for t in self.io.outputs]
        return {name: out.detach().float().numpy() for name, out in zip(names, outputs)}
