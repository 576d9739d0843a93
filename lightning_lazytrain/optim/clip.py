"""Global gradient norm and clip factor for fast (fused) clipping.

``torch.nn.utils.clip_grad_norm_`` makes two passes over every gradient: one to compute the norm
and one to multiply every gradient by the clip factor. Here the second pass disappears: the
factor is returned as a scalar and the optimizer folds it into its update (``gnorm_scale`` for
bitsandbytes' 8-bit kernel, ``grad_scale`` of torch's fused AdamW kernel, or the moment-update
coefficients in the foreach path). The first pass disappears too when the executor hands over
per-layer squared norms that it computed while the gradients were arriving.

The norm and the factor are computed exactly as ``clip_grad_norm_`` does (``_foreach_norm`` per
device/dtype, ``vector_norm`` of the stacked norms, ``max_norm / (norm + 1e-6)`` clamped at 1),
in float32, so the fused update matches AdamW + ``clip_grad_norm_``.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

#: Same epsilon as ``torch.nn.utils.clip_grad_norm_``.
CLIP_EPS = 1e-6


def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm over all ``grads`` as a float32 0-d tensor on the first gradient's device.

    One ``_foreach_norm`` pass per (device, dtype) bucket; norms are accumulated in float32 even
    for half/bfloat16 gradients. Does not synchronise with the device.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    first_device = grads[0].device
    norms: list[torch.Tensor] = []
    buckets = _group_tensors_by_device_and_dtype([list(grads)])  # type: ignore[list-item]
    for (device, _), ([device_grads], _) in buckets.items():
        if _has_foreach_support(device_grads, device):
            norms.extend(torch._foreach_norm(device_grads, 2.0, dtype=torch.float32))
        else:
            norms.extend(torch.linalg.vector_norm(g, 2.0, dtype=torch.float32) for g in device_grads)
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in norms]), 2.0)


def norm_from_sq_norms(sq_norms: Iterable[torch.Tensor | float], device: torch.device | None = None) -> torch.Tensor:
    """sqrt(sum of squared norms) in float32 as a 0-d tensor (on ``device``, default CPU)."""
    device = device or torch.device("cpu")
    parts = [
        v.detach().to(device=device, dtype=torch.float32).reshape(())
        if isinstance(v, torch.Tensor)
        else torch.tensor(float(v), dtype=torch.float32, device=device)
        for v in sq_norms
    ]
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(parts).sum().sqrt()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` as a float32 tensor, as clip_grad_norm_ computes it."""
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)


@dataclass(kw_only=True, slots=True)
class ClipDecision:
    """What one optimizer step does with the gradient norm (decided with one host sync)."""

    grad_norm: float  # nan when no norm was computed
    scale: float  # factor the update applies to every gradient; exactly 1.0 = no clipping
    finite: bool
    scale_tensor: torch.Tensor | None  # float32 0-d ``scale`` (for device-side kernels); None if 1

    @property
    def skip(self) -> bool:
        return not self.finite


def decide_clip(total_norm: torch.Tensor | None, max_grad_norm: float | None) -> ClipDecision:
    """Turn the global norm into the step's clip factor; the one device->host sync of a step."""
    if total_norm is None:
        return ClipDecision(grad_norm=math.nan, scale=1.0, finite=True, scale_tensor=None)
    if max_grad_norm is None:
        value = float(total_norm.item())
        return ClipDecision(grad_norm=value, scale=1.0, finite=math.isfinite(value), scale_tensor=None)
    coef = clip_coefficient(total_norm, max_grad_norm)
    value, scale = torch.stack([total_norm.float(), coef]).tolist()
    finite = math.isfinite(value)
    if not finite or scale == 1.0:
        return ClipDecision(grad_norm=value, scale=1.0, finite=finite, scale_tensor=None)
    return ClipDecision(grad_norm=value, scale=scale, finite=True, scale_tensor=coef)


class SqNormInbox:
    """Per-layer squared gradient norms handed over by the executor as gradients arrive.

    Thread-safe: autograd runs CUDA backward hooks on its own device threads. Values may be
    tensors (kept on their device, no sync) or floats; several calls for one layer add up, so
    an executor can hand over one value per parameter or per layer.
    """

    __slots__ = ("_lock", "_values")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[Hashable, list[torch.Tensor | float]] = {}

    def add(self, layer: Hashable, sq_norm: torch.Tensor | float) -> None:
        if isinstance(sq_norm, torch.Tensor) and sq_norm.numel() != 1:
            raise ValueError(f"squared norm for layer {layer!r} must be a scalar, got shape {tuple(sq_norm.shape)}")
        with self._lock:
            self._values.setdefault(layer, []).append(sq_norm)

    def replace(self, sq_norms: Mapping[Hashable, torch.Tensor | float] | Sequence[torch.Tensor | float]) -> None:
        items = sq_norms.items() if isinstance(sq_norms, Mapping) else enumerate(sq_norms)
        with self._lock:
            self._values = {layer: [v] for layer, v in items}

    def take(self) -> dict[Hashable, list[torch.Tensor | float]]:
        """Return and clear what was handed over (each step consumes its own norms)."""
        with self._lock:
            values, self._values = self._values, {}
        return values

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._values)
