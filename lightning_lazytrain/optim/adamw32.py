"""AdamW on full-precision states, after the clip factor is multiplied into the gradients.

Two implementations of exactly torch.optim.AdamW's math (decoupled weight decay, bias-corrected
moments, ``eps`` added after the bias-corrected square root):

* ``"fused"`` -- torch's fused AdamW kernel (``torch._fused_adamw_``, CPU and CUDA): one pass over
  param/grad/moments.
* ``"foreach"`` -- torch's multi-tensor AdamW op sequence (``torch._foreach_*``).

The clip factor ``c`` (``clip_coef``) is applied first as ``grad *= c`` (``_foreach_mul_``, exactly
``clip_grad_norm_``'s multiply), then the unclipped math runs on the clipped gradient: the update is
bit for bit torch AdamW after ``clip_grad_norm_`` (Note: [exact clip] in clip.py). The kernel's own
``grad_scale`` (``grad / (1/c)``) or folding ``c`` into the moment coefficients would round
differently. Afterwards ``.grad`` holds the clipped gradient, as after ``clip_grad_norm_``.
State ``step`` tensors are float32 0-d CPU tensors (torch's non-capturable layout) so bias
corrections need no device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from .clip import scale_grads_

Impl32: TypeAlias = Literal["fused", "foreach"]


def init_32bit_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """torch AdamW's state layout (and key names): step, exp_avg, exp_avg_sq in the param's dtype."""
    return {
        "step": torch.zeros((), dtype=torch.float32),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def adamw32_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    clip_coef: torch.Tensor | None,
    impl: Impl32,
) -> None:
    """One AdamW step for these tensors on ``grad * clip_coef`` (``None``: no clipping).

    ``clip_coef`` is the 0-d clip factor as ``clip_grad_norm_`` computes it; the gradients are
    multiplied by it in place first (see the module doc).
    """
    if not params:
        return
    if any(g.is_sparse for g in grads):
        raise RuntimeError("HybridAdamW does not support sparse gradients")
    if impl not in ("fused", "foreach"):
        raise ValueError(f"unknown 32-bit AdamW implementation {impl!r}: use 'fused' or 'foreach'")
    if clip_coef is not None:
        scale_grads_(grads, clip_coef)
    torch._foreach_add_(list(steps), 1.0)
    fused = [i for i in range(len(params)) if _flat_alike(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i])] \
        if impl == "fused" else []
    if fused:
        _fused(*_pick(fused, params, grads, exp_avgs, exp_avg_sqs, steps), lr=lr, beta1=beta1, beta2=beta2,
               eps=eps, weight_decay=weight_decay)
    if len(fused) < len(params):
        rest = sorted(set(range(len(params))) - set(fused))
        _foreach(*_pick(rest, params, grads, exp_avgs, exp_avg_sqs, steps), lr=lr, beta1=beta1, beta2=beta2,
                 eps=eps, weight_decay=weight_decay)


def _flat_alike(*tensors: torch.Tensor) -> bool:
    """Note: [the fused kernel reads flat memory] torch's fused AdamW kernel walks param, grad and moments
    as flat memory, element i of each together: only right when the four are laid out alike (same strides,
    no gaps). A gradient laid out unlike its parameter (a ``channels_last`` weight with a contiguous
    gradient, a transposed one) would update the wrong elements (torch's own ``fused=True`` does): such
    tensors take the foreach ops, elementwise by index."""
    p = tensors[0]
    if any(t.stride() != p.stride() for t in tensors[1:]):
        return False
    return p.is_contiguous() or (p.dim() == 4 and p.is_contiguous(memory_format=torch.channels_last))


def _pick(idx: list[int], *lists: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    return [[seq[i] for i in idx] for seq in lists]


def _fused(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    buckets = _group_tensors_by_device_and_dtype(
        [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps)]  # type: ignore[list-item]
    )
    for (device, _), ((d_params, d_grads, d_m, d_v, d_steps), _) in buckets.items():
        # The kernel reads each step on the params' device; the states keep theirs on the CPU.
        # Parameters of one step share a handful of step values: one small tensor per value.
        by_value: dict[float, torch.Tensor] = {}
        dev_steps = []
        for s in d_steps:
            value = float(s.item())
            if value not in by_value:
                by_value[value] = torch.full((), value, dtype=torch.float32, device=device)
            dev_steps.append(by_value[value])
        torch._fused_adamw_(
            d_params,
            d_grads,
            d_m,
            d_v,
            [],
            dev_steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=None,
            found_inf=None,
        )


def _foreach(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    buckets = _group_tensors_by_device_and_dtype(
        [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps)]  # type: ignore[list-item]
    )
    for _, ((d_params, d_grads, d_m, d_v, d_steps), _) in buckets.items():
        if weight_decay != 0:
            torch._foreach_mul_(d_params, 1 - lr * weight_decay)
        # The very op sequence of torch's multi-tensor AdamW.
        torch._foreach_lerp_(d_m, d_grads, 1 - beta1)
        torch._foreach_mul_(d_v, beta2)
        torch._foreach_addcmul_(d_v, d_grads, d_grads, 1 - beta2)
        step_values = [float(s.item()) for s in d_steps]
        step_size = [-lr / (1 - beta1**t) for t in step_values]
        bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in step_values]
        denom = torch._foreach_sqrt(d_v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(d_params, d_m, denom, step_size)
