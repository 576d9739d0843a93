"""The optimizer as the plan sees it: the 8-bit slice it picks, the seconds and bytes it prices.

Note: [planned 8-bit slice] 8-bit AdamW states take 2 + 8/256 bytes per parameter instead of 8, at
the price of a much slower host update (bitsandbytes' CPU kernel: ~25 s per billion parameters per
thread, against ~1 s for torch's fused 32-bit AdamW). So 8-bit states are worth it only where host
memory is short. ``HybridAdamW(eight_bit="plan")`` leaves the choice to the plan: the smallest
fraction of parameters (largest tensors first, ``assign_state_bits``) whose 8-bit states bring the
host's static bytes (masters, gradients, pinned buffers, states) within its memory; none when it
fits with 32-bit states. A fixed policy the user chose (``"all"``, a fraction) is kept and priced.

Pricing (``price_optimizers``): a measured workload counts every parameter with 32-bit states at
the 32-bit rate; here each group's optimizer seconds become ``n32 / rate32 + n8 / rate8`` with the
optimizer's real assignment, and the host bytes its real state bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace

from torch import nn

from lightning_lazytrain.planner.workload import STATE_BYTES_8, STATE_BYTES_32, Workload

from .hybrid_adamw import HybridAdamW

__all__ = ["choose_state_bits", "planned_fraction", "price_optimizers"]

log = logging.getLogger(__name__)


def planned_fraction(host_static_bytes: float, cpu_memory_bytes: float, numel: int, largest: int) -> float:
    """The smallest 8-bit fraction of ``numel`` optimizer parameters that brings ``host_static_bytes``
    (counted with 32-bit states) within ``cpu_memory_bytes``: 0 when it fits already; one largest
    tensor of margin (the greedy assignment stays below its target); at most 1 (then it is short
    anyway, and the plan's diagnosis says by how much)."""
    short = host_static_bytes - cpu_memory_bytes
    if short <= 0 or numel <= 0:
        return 0.0
    need = short / ((STATE_BYTES_32 - STATE_BYTES_8) * numel) + largest / numel
    return min(1.0, need)


def choose_state_bits(optimizers: Iterable[HybridAdamW], host_static_bytes: float, cpu_memory_bytes: float) -> float | None:
    """Give every ``eight_bit="plan"`` optimizer its slice (``planned_fraction`` over all of their
    parameters together); returns the fraction, or None when none was pending."""
    pending = [o for o in optimizers if o.bits_pending]
    if not pending:
        return None
    params = [p for o in pending for g in o.param_groups for p in g["params"]]
    numel = sum(p.numel() for p in params)
    frac = planned_fraction(host_static_bytes, cpu_memory_bytes, numel, max((p.numel() for p in params), default=0))
    for o in pending:
        o.set_state_bits("none" if frac == 0 else frac)
    return frac


def price_optimizers(wl: Workload, optimizers: Iterable[HybridAdamW], groups: Mapping[int, list[nn.Parameter]],
                     rate32: float, rate8: float) -> Workload:
    """``wl`` with the optimizer seconds of each group (``groups``: layer -> its parameters; -1 the
    non-block group) and the host's static bytes of ``optimizers``' real state assignment (parameters
    of other optimizers keep the workload's 32-bit figures)."""
    bits: dict[int, int] = {}
    state_bytes = 0.0
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                b = o.bits_of(p)
                if b is not None:
                    bits[id(p)] = b
        state_bytes += o.state_bytes().total
    if not bits:
        return wl

    def seconds(params: list[nn.Parameter], default: float) -> float:
        if not any(id(p) in bits for p in params):
            return default
        # a frozen weight gets no gradient and so no update (Note: [frozen weights in the plan] in
        # engine/profiler.py)
        known = [p for p in params if id(p) in bits and p.requires_grad]
        other = sum(p.numel() for p in params if id(p) not in bits and p.requires_grad)
        return (sum(p.numel() / (rate8 if bits[id(p)] == 8 else rate32) for p in known)
                + other / rate32)

    layers = tuple(replace(layer, opt_seconds=seconds(groups.get(j, []), layer.opt_seconds))
                   for j, layer in enumerate(wl.layers))
    # the profile counted 32-bit states for the weights that train (engine/profiler.py); these optimizers'
    # real states replace them
    counted = sum(p.numel() for ps in groups.values() for p in ps if id(p) in bits and p.requires_grad) * STATE_BYTES_32
    return replace(wl, layers=layers, nonblock_opt_seconds=seconds(groups.get(-1, []), wl.nonblock_opt_seconds),
                   host_static_bytes=wl.host_static_bytes - counted + state_bytes).validate()
