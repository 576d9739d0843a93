"""Loading one parameter's saved HybridAdamW state exactly (8-bit states, qmaps, block scales).

torch's ``Optimizer.load_state_dict`` casts every state tensor of a floating-point parameter to
the parameter's dtype -- uint8 8-bit states would come back as floats.
HybridAdamW therefore loads states itself, with these functions: tensors move to the parameter's
device (CPU <-> CUDA) and keep their dtype; step counters stay float32 CPU scalars.
"""

from __future__ import annotations

from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch

from .bnb8bit import check_8bit_state, dequantized_moments, make_qmaps, require_bnb
from .assign import BNB_BLOCK_SIZE


def saved_bits(saved: Mapping[str, Any]) -> int:
    """8 for bitsandbytes-layout states (``state1``/``state2``), 32 for torch AdamW's layout."""
    return 8 if "state1" in saved else 32


def load_param_state(
    p: torch.Tensor,
    saved: Mapping[str, Any],
    *,
    bits: int,
    name: str,
    qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, Any]:
    """The state of parameter ``p`` rebuilt from ``saved``, validated against ``bits`` and ``p``.

    As with torch, a tensor already on the right device and dtype is adopted, not copied.
    ``qmaps`` (per device) is used to share one pair of maps among all 8-bit states again.
    """
    kind = saved_bits(saved)
    if kind != bits:  # Note: [states converted as they load]
        saved = convert_state(p, saved, bits, qmaps)
        kind = bits
    out: dict[str, Any] = {}
    for key, value in saved.items():
        if key == "step":
            # Always a float32 CPU scalar (see adamw32.py), whatever device it was saved from.
            out[key] = torch.as_tensor(value, dtype=torch.float32).detach().to("cpu").clone().reshape(())
        elif isinstance(value, torch.Tensor):
            if kind == 32 and value.is_floating_point():
                out[key] = value.detach().to(device=p.device, dtype=p.dtype)  # torch AdamW's rule
            else:
                out[key] = value.detach().to(device=p.device)  # uint8 states, float32 maps/scales
        else:
            out[key] = deepcopy(value)
    if kind == 8:
        check_8bit_state(p, out)
        out["qmap1"], out["qmap2"] = shared_qmaps(qmaps, p.device, out["qmap1"], out["qmap2"])
    elif out["exp_avg"].shape != p.shape or out["exp_avg_sq"].shape != p.shape:
        raise ValueError(f"saved moments of {name!r} do not match its shape {tuple(p.shape)}")
    return out


def shared_qmaps(
    qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    qmap1: torch.Tensor,
    qmap2: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One copy per device when the loaded maps equal the device's; the loaded ones if not (the
    states were quantised with them, so they must stay)."""
    if device not in qmaps:
        qmaps[device] = (qmap1, qmap2)
    ours1, ours2 = qmaps[device]
    return (ours1 if torch.equal(ours1, qmap1) else qmap1, ours2 if torch.equal(ours2, qmap2) else qmap2)


# Note: [states converted as they load]
#     A checkpoint's states have the bits the saving optimizer gave them; the loading one may assign others (its
#     eight_bit policy differs: a resume on a host with less memory that needs eight_bit='all', review 24, where
#     the load had been refused and no fix worked). The moments are converted: 32 -> 8 bits quantised blockwise
#     with the maps 8-bit states use (what the 8-bit update itself does after each step), 8 -> 32 bits
#     dequantised. The resume then differs from an uninterrupted run by that one rounding (the 8-bit states'
#     own error); ``HybridAdamW.load_state_dict`` logs how many tensors were converted.
def convert_state(p: torch.Tensor, saved: Mapping[str, Any], bits: int,
                  qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """``saved`` (one parameter's state, either layout) in the layout of ``bits``."""
    out: dict[str, Any] = {"step": saved["step"]}
    if bits == 8:
        bnb_f = require_bnb()
        if p.device not in qmaps:
            qmaps[p.device] = make_qmaps(p.device)
        q1, q2 = qmaps[p.device]
        for key, state, absmax, code in (("exp_avg", "state1", "absmax1", q1), ("exp_avg_sq", "state2", "absmax2", q2)):
            moment = saved[key].detach().to(device=p.device, dtype=torch.float32).reshape(p.shape).contiguous()
            out[state], qs = bnb_f.quantize_blockwise(moment, code=code, blocksize=BNB_BLOCK_SIZE)
            out[absmax] = qs.absmax.to(torch.float32)
        out["qmap1"], out["qmap2"] = q1, q2
        return out
    m, v = dequantized_moments({k: saved[k].detach().to(p.device) for k in ("state1", "state2", "absmax1", "absmax2",
                                                                         "qmap1", "qmap2")})
    out["exp_avg"], out["exp_avg_sq"] = m.reshape(p.shape), v.reshape(p.shape)
    return out
