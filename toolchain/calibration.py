"""Calibrated 4-bit weights: GPTQ-style error feedback against the model's own activations.

`kvforge build --weights int4` (symmetric) rounds each projection's weight column by column
along its input features, and spreads each column's rounding error over the columns not yet
rounded through the inverse of the layer's input statistic H = Σ x xᵀ, collected by running
the eager model over windows of a calibration text (GPTQ: Frantar et al., 2022). Each block of
`block_size` columns takes its scale when its turn comes, searched as round-to-nearest searches
it (`kvforge.passes.quantize`), over the weights as the earlier columns' errors have moved them.

The result stays in the eager model: each calibrated weight is replaced by its dequantized
values (codes times scales, exact in the weight's dtype to well under half a step), and its
scales are returned, keyed by the weight's name. `kvforge.passes.quantize.QuantizeWeights` rounds
those weights against those scales, which gives back the very codes chosen here; no codes are
held twice, and the pass stays free of torch.

Memory: H is K × K float32 per distinct input (projections reading the same activations, such
as q/k/v or gate/up, share one). The projections are calibrated in groups, in the order the
model calls them, each group's statistics within `budget_bytes` (at least one input's); each
group costs one forward pass over the calibration windows, stopped at the group's last
projection, so the peak is the weights plus one group's H plus one batch's activations.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from kvforge.passes.quantize import (
    LM_HEAD,
    WeightQuantization,
    quantize_free_min,
    symmetric_scales,
)
from kvforge.passes.storage import layer_count, mixed_head, mixed_to_8_bits
from kvforge.runners.errors import ArtifactError
from kvforge.runners.tokenizer import TokenizerBundle

log = logging.getLogger(__name__)

BUILTIN = "builtin"  # `--calibration builtin`: the text shipped with kvforge
NONE = "none"
METHOD = "gptq"
WINDOWS = 256  # calibration windows of WINDOW tokens, spread evenly over the text (65,536 tokens)
WINDOW = 256
BATCH = 8  # windows per forward pass
DAMPING = 0.1  # added to H's diagonal, as a fraction of its mean: held-out error fell with it (docs/performance.md)
ACT_ORDER = True  # round the columns in decreasing order of activity, against scales chosen up front
LAZY_COLUMNS = 128  # columns rounded before the rest of the weight is updated at once


def builtin_text() -> Path:
    """The calibration text that ships with kvforge (`toolchain/data/calibration.txt`)."""
    return Path(str(resources.files("kvforge.toolchain") / "data" / "calibration.txt"))


@dataclass(frozen=True)
class CalibrationText:
    """What a build calibrates on: the text's file, its sha256, and how it is cut."""

    path: Path
    sha256: str
    builtin: bool
    windows: int = WINDOWS
    window: int = WINDOW
    damping: float = DAMPING
    act_order: bool = ACT_ORDER

    @classmethod
    def resolve(cls, choice: str | Path) -> CalibrationText | None:
        """`builtin`, `none` (None) or a UTF-8 text file's path."""
        if str(choice) == NONE:
            return None
        builtin = str(choice) == BUILTIN
        path = builtin_text() if builtin else Path(choice)
        try:
            data = path.read_bytes()
            data.decode("utf-8")
        except OSError as e:
            raise ArtifactError(
                f"--calibration {choice}: cannot read it ({e.strerror or e}); give a UTF-8 text file, "
                f"{BUILTIN} or {NONE}"
            ) from e
        except UnicodeDecodeError as e:
            raise ArtifactError(f"--calibration {path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
        return cls(path, hashlib.sha256(data).hexdigest(), builtin)

    def to_dict(self) -> dict[str, Any]:
        """The manifest's record (under the build's flags)."""
        return {
            "method": METHOD,
            "text": BUILTIN if self.builtin else self.path.name,
            "text_sha256": self.sha256,
            "windows": self.windows,
            "window": self.window,
            "damping": self.damping,
            "act_order": self.act_order,
        }

    def token_windows(self, tokenizer_dir: Path) -> torch.Tensor:
        """[windows, window] token ids: `windows` windows spread evenly over the encoded text
        (fewer when the text is shorter)."""
        text = self.path.read_text(encoding="utf-8")
        ids = TokenizerBundle.load(tokenizer_dir).encode(text, add_special_tokens=False)
        count = len(ids) // self.window
        if count == 0:
            raise ArtifactError(
                f"--calibration {self.path}: {len(ids)} tokens, fewer than one window of {self.window}; "
                "give a longer text"
            )
        starts = np.linspace(0, (count - 1) * self.window, min(self.windows, count)).astype(np.int64)
        return torch.tensor(np.stack([ids[s : s + self.window] for s in starts]), dtype=torch.long)


def calibratable(weights: WeightQuantization | None) -> bool:
    """Whether a recipe's weights are calibrated: 4-bit blocks without zero points (symmetric,
    or with a free minimum; a recipe that leaves its zero points to the target is calibrated
    without them)."""
    return weights is not None and weights.bits == 4 and weights.symmetric is not False


@dataclass
class _Input:
    """One distinct input of projections: its modules and, while its group runs, H."""

    modules: list[tuple[str, torch.nn.Linear]]
    hessian: torch.Tensor | None = None
    tokens: int = 0

    @property
    def features(self) -> int:
        return self.modules[0][1].in_features


class _Stop(Exception):
    """Raised from a hook: the group's last projection has its input, the rest of the model is not needed."""


def calibrate(
    model: torch.nn.Module,
    text: CalibrationText,
    tokenizer_dir: Path,
    weights: WeightQuantization,
    budget_bytes: int | None = None,
) -> dict[str, np.ndarray]:
    """Quantize every 4-bit projection of `model` in place (its weight becomes its dequantized
    codes) and return each one's scales `[out, ⌈in / block⌉]` float32, keyed by its weight's name."""
    windows = text.token_windows(tokenizer_dir)
    inputs = _inputs(model, windows[:1, :8], weights)
    if budget_bytes is None:
        budget_bytes = max(64 << 20, sum(p.numel() * p.element_size() for p in model.parameters()) // 4)
    scales: dict[str, np.ndarray] = {}
    groups = _groups(inputs, budget_bytes)
    collecting = 0.0
    start = time.perf_counter()
    for group in groups:
        started = time.perf_counter()
        _collect(model, windows, group)
        collecting += time.perf_counter() - started
        for found in group:
            assert found.hessian is not None
            factor = inverse_factor(found.hessian, weights.block_size, text.damping, text.act_order)
            found.hessian = None  # H is freed as soon as its factor is made
            for name, module in found.modules:
                scales[f"{name}.weight"] = _quantize_module(module, factor, weights.block_size, weights.free_min)
            del factor
    log.info(
        "calibrated %d weights on %d windows of %d tokens: %d forward passes and their statistics %.1f s, "
        "rounding %.1f s",
        len(scales),
        len(windows),
        windows.shape[1],
        len(groups),
        collecting,
        time.perf_counter() - start - collecting,
    )
    return scales


def _candidates(model: torch.nn.Module, weights: WeightQuantization) -> dict[int, str]:
    """id(module) -> name of each nn.Linear the recipe quantizes to 4 bits."""
    head_of, table_of = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    head = head_of() if callable(head_of) else None
    table = table_of() if callable(table_of) else None
    table_weight = getattr(table, "weight", None)
    layers = layer_count(name for name, _ in model.named_modules())
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module.weight.dtype not in (
            torch.float32,
            torch.float16,
            torch.bfloat16,
        ):
            continue
        weight_name = f"{name}.weight"
        if module.weight is table_weight:  # a tied head: its codes would move the table too
            continue
        named = [*weights.keep, *weights.int8, *((LM_HEAD,) if mixed_head(weights.mixed) else ())]
        if any(fnmatch.fnmatchcase(weight_name, p) for p in named) or (module is head and LM_HEAD in named):
            continue
        if mixed_to_8_bits(weights.mixed, weight_name, layers):  # the mix keeps it at 8 bits
            continue
        found[id(module)] = name
    return found


def _inputs(model: torch.nn.Module, probe: torch.Tensor, weights: WeightQuantization) -> list[_Input]:
    """The distinct inputs of the 4-bit projections, in the order one forward pass reaches them;
    projections handed the same tensor in turn (q/k/v, gate/up) share one."""
    candidates = _candidates(model, weights)
    modules = dict(model.named_modules())
    order: list[_Input] = []
    last: list[Any] = [None]

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        name = candidates[id(module)]
        if any(name == seen for found in order for seen, _ in found.modules):
            return
        if order and args[0] is last[0]:
            order[-1].modules.append((name, modules[name]))  # type: ignore[arg-type]
        else:
            order.append(_Input([(name, modules[name])]))  # type: ignore[list-item]
        last[0] = args[0]

    with _hooks(model, candidates, hook), torch.inference_mode():
        model(input_ids=probe, use_cache=False)
    return order


def _groups(inputs: list[_Input], budget_bytes: int) -> list[list[_Input]]:
    """Consecutive inputs whose H together fit in `budget_bytes` (at least one each)."""
    groups: list[list[_Input]] = []
    used = 0
    for found in inputs:
        size = found.features**2 * 4
        if not groups or used + size > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(found)
        used += size
    return groups


def _collect(model: torch.nn.Module, windows: torch.Tensor, group: list[_Input]) -> None:
    """Accumulate H of each input of `group` over the windows, stopping each forward pass at its
    last projection (so nothing after it runs: no logits when it is the LM head)."""
    first = {id(found.modules[0][1]): found for found in group}
    stop = group[-1].modules[-1][1]
    watched = {id(module): name for found in group for name, module in found.modules}
    for found in group:
        found.hessian = torch.zeros(found.features, found.features, dtype=torch.float32)

    def hook(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        found = first.get(id(module))
        if found is not None:
            x = args[0].detach().reshape(-1, found.features).to(torch.float32)
            found.hessian.addmm_(x.T, x)  # type: ignore[union-attr]
            found.tokens += x.shape[0]
        if module is stop:
            raise _Stop

    with _hooks(model, watched, hook), torch.inference_mode():
        for start in range(0, len(windows), BATCH):
            try:
                model(input_ids=windows[start : start + BATCH], use_cache=False)
            except _Stop:
                pass


@dataclass
class _hooks:
    model: torch.nn.Module
    modules: dict[int, str]
    hook: Any

    def __enter__(self) -> None:
        self.handles = [m.register_forward_pre_hook(self.hook) for m in self.model.modules() if id(m) in self.modules]

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


ROWS = 2048  # output rows rounded at a time: each row's rounding is its own, so the temporaries stay small


def _quantize_module(module: torch.nn.Linear, factor: Factor, block_size: int, free_min: bool) -> np.ndarray:
    """GPTQ of `module.weight` [N, K], `ROWS` rows at a time: its weight becomes the dequantized
    codes; returns the scales [N, ⌈K / block⌉] float32. `free_min` (where K is whole blocks, as
    the pass gives a free minimum): codes with a step and minimum per block."""
    weight = module.weight
    n, k = weight.shape
    free_min = free_min and k % block_size == 0
    scales = np.empty((n, factor.blocks(block_size)), np.float32)
    with torch.no_grad():
        for start in range(0, n, ROWS):
            rows = slice(start, min(start + ROWS, n))
            rounded = gptq_rows(weight[rows].to(torch.float32), factor, block_size, weight.dtype, free_min)
            dequantized, scales[rows] = rounded
            weight[rows] = dequantized.to(weight.dtype)
    return scales


@dataclass(frozen=True)
class Factor:
    """What GPTQ needs of H [K, K], computed once for every weight that reads the same input:
    the upper Cholesky factor U of (H + damping)⁻¹ (H⁻¹ = Uᵀ U), over K padded to whole blocks
    and in the order the columns are rounded (`order`, None: their own); `dead`: inputs never
    active (and the padding), in their own order."""

    u: torch.Tensor
    dead: torch.Tensor
    order: torch.Tensor | None
    k: int

    def blocks(self, block_size: int) -> int:
        return -(-self.k // block_size)


def inverse_factor(hessian: torch.Tensor, block_size: int, damping: float, act_order: bool) -> Factor:
    """`Factor` of H: `damping` times the mean of its diagonal added to it; `act_order`: the
    columns rounded in decreasing order of H's diagonal (the most active inputs first, while the
    most columns are left to take their error)."""
    k = hessian.shape[0]
    pad = -k % block_size
    h = torch.zeros(k + pad, k + pad, dtype=torch.float64)
    h[:k, :k] = hessian.to(torch.float64)
    diagonal = torch.diagonal(h)
    dead = diagonal == 0
    diagonal[dead] = 1.0
    diagonal += damping * float(diagonal[~dead].mean()) if bool((~dead).any()) else 0.0
    order = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else None
    if order is not None:
        h = h[order][:, order]
    inverse = torch.cholesky_solve(torch.eye(k + pad, dtype=torch.float64), torch.linalg.cholesky(h))
    return Factor(torch.linalg.cholesky(inverse, upper=True).to(torch.float32), dead, order, k)


def gptq(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    block_size: int,
    damping: float,
    dtype: torch.dtype,
    act_order: bool = False,
) -> tuple[torch.Tensor, np.ndarray]:
    """(dequantized weight [N, K] float32, scales [N, ⌈K / block⌉] float32) of a [N, K] float32
    weight against H [K, K] (`inverse_factor`, `gptq_rows`)."""
    return gptq_rows(weight, inverse_factor(hessian, block_size, damping, act_order), block_size, dtype)


def gptq_rows(
    weight: torch.Tensor, factor: Factor, block_size: int, dtype: torch.dtype, free_min: bool = False
) -> tuple[torch.Tensor, np.ndarray]:
    """(dequantized [N, K] float32, scales [N, ⌈K / block⌉] float32) of [N, K] float32 rows
    rounded to 4-bit codes column by column, each column's error fed to the columns after it
    through `factor.u`; scales stored in `dtype` (the weight's), as the pass stores them.
    Symmetric codes -8..7 times the scale, or with `free_min` (K whole blocks) codes 0..15 times
    the step plus the block's minimum (`kvforge.passes.quantize.quantize_free_min`'s grid). In act order
    every block's grid is chosen first, from the weight as it is; otherwise each block's when its
    first column comes, from the weight as the earlier errors have moved it."""
    n, k = weight.shape
    pad = -k % block_size
    if free_min and pad:
        raise ValueError(f"a free minimum needs whole blocks: K={k} is not a multiple of {block_size}")
    w = torch.nn.functional.pad(weight, (0, pad)) if pad else weight.clone()  # never the caller's tensor
    w[:, factor.dead] = 0.0
    stored = _scale_dtype(dtype)
    scales = np.empty((n, (k + pad) // block_size), np.float32)
    lows = np.zeros_like(scales)  # each block's code 0: its minimum (free_min), else 0
    order, u = factor.order, factor.u
    if order is not None:
        scales[:], lows[:] = _grid(w.numpy().reshape(n, -1, block_size), stored, free_min)
        fixed, fixed_low = torch.from_numpy(scales), torch.from_numpy(lows)
        w = w[:, order]
    lowest, highest = (0, 15) if free_min else (-8, 7)
    out = torch.empty_like(w)
    for lazy in range(0, k + pad, LAZY_COLUMNS):
        end = min(lazy + LAZY_COLUMNS, k + pad)
        errors = torch.empty(n, end - lazy, dtype=torch.float32)
        for j in range(lazy, end):
            if order is not None:
                block = int(order[j]) // block_size
                step, low = fixed[:, block], fixed_low[:, block]
            elif j % block_size == 0:
                block_scales, block_lows = _grid(w[:, j : j + block_size].numpy()[:, None, :], stored, free_min)
                scales[:, j // block_size], lows[:, j // block_size] = block_scales[:, 0], block_lows[:, 0]
                step = torch.from_numpy(block_scales[:, 0].astype(np.float32))
                low = torch.from_numpy(block_lows[:, 0].astype(np.float32))
            column = w[:, j]
            rounded = torch.clamp(torch.round((column - low) / step), lowest, highest) * step + low
            out[:, j] = rounded
            error = (column - rounded) / u[j, j]
            w[:, j:end] -= error[:, None] * u[j, j:end][None, :]
            errors[:, j - lazy] = error
        w[:, end:] -= errors @ u[lazy:end, end:]
    if order is not None:
        out = out[:, torch.argsort(order)]
    return out[:, :k], scales


def _grid(blocks: np.ndarray, stored: np.dtype, free_min: bool) -> tuple[np.ndarray, np.ndarray]:
    """(scale or step, minimum) per block of `blocks` [N, B, block]: round to nearest's symmetric
    scale and 0, or the free minimum's step and minimum; steps as stored in `stored`."""
    if not free_min:
        scale = symmetric_scales(blocks, 4, stored).astype(np.float32)
        return scale, np.zeros_like(scale)
    n, count, block_size = blocks.shape
    q = quantize_free_min(blocks.reshape(n, -1).astype(np.float32), block_size, dtype=stored)
    step = q.scales.astype(np.float32)
    assert q.mins is not None
    return step, q.mins - 8 * step


def _scale_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype scales are stored in for a weight of `dtype` (bfloat16 through ml_dtypes)."""
    if dtype == torch.bfloat16:
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({torch.float16: np.float16}.get(dtype, np.float32))
