"""Global gradient norm and clip factor for fast (fused) clipping.

``torch.nn.utils.clip_grad_norm_`` makes two passes over every gradient: one to compute the norm
and one to multiply every gradient by the clip factor. Here the first pass disappears when the
executor hands over each parameter's gradient norm, computed on its host lane while the gradients
were arriving; the second is folded into the update: each layer's gradients are multiplied by the
factor right before that layer's AdamW math (in the pipelined step, on the worker, per layer).

Note: [exact clip]
    With handed-over per-parameter norms (:func:`grad_total_norm`), the norm, the factor and the
    clipped gradient round exactly as Lightning's ``clip_grad_norm_(optimizer's params)``: per-tensor
    norms from ``torch._foreach_norm`` in the gradients' dtype, stacked in the order torch's
    ``_group_tensors_by_device_and_dtype`` buckets them, ``vector_norm`` of the stack,
    ``clamp(max_norm / (norm + 1e-6), max=1)`` and ``grad * coef`` with ``_foreach_mul_``
    (:func:`scale_grads_`), then AdamW on the clipped gradient. Each piece matters at the last bit:
    a sum of per-group squared norms, a flat norm over a whole group, ``grad / (1 / coef)`` (the
    fused kernel's ``grad_scale``) or ``coef`` folded into the moment coefficients each differ from
    ``clip_grad_norm_`` by rounding (losses ~1e-6 apart after a few clipped steps).
    Without handed-over norms, :func:`global_grad_norm` is one ``_foreach_norm`` pass accumulated
    in float32 (equal to ``clip_grad_norm_``'s for float32 gradients, more accurate for 16-bit ones).
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


def grad_total_norm(grads: Sequence[torch.Tensor], norms: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm(grads)`` (2-norm), bit for bit, with ``norms[i]`` (when not
    None) standing for ``grads[i]``'s own norm as ``torch._foreach_norm`` gives it, so those
    gradients are not read. See Note: [exact clip]."""
    grads = list(grads)
    if not grads:
        return torch.tensor(0.0)
    known = list(norms) if norms is not None else [None] * len(grads)
    if len(known) != len(grads):
        raise ValueError(f"{len(known)} norms for {len(grads)} gradients")
    first_device = grads[0].device
    stacked: list[torch.Tensor] = []
    buckets = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    for (device, _), ([device_grads], indices) in buckets.items():
        have = [known[i] for i in indices]
        todo = [g for g, n in zip(device_grads, have) if n is None]
        if not todo:
            computed: list[torch.Tensor] = []
        elif _has_foreach_support(todo, device):
            computed = list(torch._foreach_norm(todo, 2.0))
        else:
            computed = [torch.linalg.vector_norm(g, 2.0) for g in todo]
        it = iter(computed)
        stacked.extend(n if n is not None else next(it) for n in have)
    return torch.linalg.vector_norm(torch.stack([n.to(first_device) for n in stacked]), 2.0)


def scale_grads_(grads: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """``grad *= coef`` in place, as ``clip_grad_norm_`` multiplies (``_foreach_mul_`` per device/dtype)."""
    if not grads:
        return
    buckets = _group_tensors_by_device_and_dtype([list(grads)])  # type: ignore[list-item]
    for (device, _), ([device_grads], _) in buckets.items():
        if _has_foreach_support(device_grads, device):
            torch._foreach_mul_(device_grads, coef.to(device))
        else:
            c = coef.to(device)
            for g in device_grads:
                g.mul_(c)


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
    """``min(1, max_norm / (total_norm + 1e-6))`` in ``total_norm``'s dtype, the expression clip_grad_norm_ uses."""
    return torch.clamp(float(max_norm) / (total_norm + CLIP_EPS), max=1.0)


@dataclass(kw_only=True, slots=True)
class ClipDecision:
    """What one optimizer step does with the gradient norm (decided with one host sync)."""

    grad_norm: float  # nan when no norm was computed
    scale: float  # factor the update applies to every gradient; exactly 1.0 = no clipping
    finite: bool
    scale_tensor: torch.Tensor | None  # 0-d ``scale`` as clip_grad_norm_ has it (the norm's dtype); None if 1

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
    value, scale = torch.stack([total_norm.float(), coef.float()]).tolist()
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
