"""AdamW on full-precision states with the clip factor fused into the update.

Two implementations of exactly torch.optim.AdamW's math (decoupled weight decay, bias-corrected
moments, ``eps`` added after the bias-corrected square root):

* ``"fused"`` -- torch's fused AdamW kernel (``torch._fused_adamw_``, CPU and CUDA): one pass over
  param/grad/moments. The clip factor ``c`` goes in as the kernel's ``grad_scale = 1/c`` (the
  kernel divides each gradient by it on the fly; it also writes the scaled gradient back into
  ``.grad``, so afterwards ``.grad`` holds the clipped gradient, like after ``clip_grad_norm_``,
  without a separate pass).
* ``"foreach"`` -- ``torch._foreach_*`` ops; ``c`` is folded into the moment coefficients:
  ``m = b1*m + (1-b1)*c*g`` and ``v = b2*v + (1-b2)*c^2*g^2``. ``.grad`` is left untouched.

Neither rescales the gradients in a pass of its own. State ``step`` tensors are float32 0-d CPU
tensors (torch's non-capturable layout) so bias corrections need no device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

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
    scale: float,
    scale_tensor: torch.Tensor | None,
    impl: Impl32,
) -> None:
    """One AdamW step for these tensors, every gradient multiplied by ``scale`` inside the math.

    ``scale_tensor`` is ``scale`` as a float32 0-d tensor (``None`` when ``scale == 1``); the fused
    kernel takes it without a host round trip.
    """
    if not params:
        return
    if any(g.is_sparse for g in grads):
        raise RuntimeError("HybridAdamW does not support sparse gradients")
    torch._foreach_add_(list(steps), 1.0)
    if impl == "fused":
        _fused(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
               weight_decay=weight_decay, scale_tensor=scale_tensor)
    elif impl == "foreach":
        _foreach(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay, scale=scale)
    else:
        raise ValueError(f"unknown 32-bit AdamW implementation {impl!r}: use 'fused' or 'foreach'")


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
    scale_tensor: torch.Tensor | None,
) -> None:
    buckets = _group_tensors_by_device_and_dtype(
        [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps)]  # type: ignore[list-item]
    )
    inv_scale: dict[torch.device, torch.Tensor] = {}
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
        grad_scale = None
        if scale_tensor is not None:
            if device not in inv_scale:
                inv_scale[device] = torch.reciprocal(scale_tensor.to(device=device, dtype=torch.float32))
            grad_scale = inv_scale[device]
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
            grad_scale=grad_scale,
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
    scale: float,
) -> None:
    buckets = _group_tensors_by_device_and_dtype(
        [list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps)]  # type: ignore[list-item]
    )
    for _, ((d_params, d_grads, d_m, d_v, d_steps), _) in buckets.items():
        if weight_decay != 0:
            torch._foreach_mul_(d_params, 1 - lr * weight_decay)
        if scale == 1.0:
            # Unclipped: the very op sequence of torch's multi-tensor AdamW.
            torch._foreach_lerp_(d_m, d_grads, 1 - beta1)
            torch._foreach_mul_(d_v, beta2)
            torch._foreach_addcmul_(d_v, d_grads, d_grads, 1 - beta2)
        else:
            torch._foreach_mul_(d_m, beta1)
            torch._foreach_add_(d_m, d_grads, alpha=(1 - beta1) * scale)
            torch._foreach_mul_(d_v, beta2)
            torch._foreach_addcmul_(d_v, d_grads, d_grads, (1 - beta2) * scale * scale)
        step_values = [float(s.item()) for s in d_steps]
        step_size = [-lr / (1 - beta1**t) for t in step_values]
        bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in step_values]
        denom = torch._foreach_sqrt(d_v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(d_params, d_m, denom, step_size)
