"""HybridAdamW's states: which parameters get 8-bit and which 32-bit AdamW states, their allocation and
their measured bytes. A mixin of ``HybridAdamW`` (its ``param_groups``, ``state``, ``eight_bit``,
``min_8bit_numel``, ``_names``, ``_bits`` and ``_qmaps``).

The bits come from :func:`assign_state_bits` (assign.py: pure, logged, byte-accounted), for the constructor's
parameters and for each group added later; with ``eight_bit="plan"`` only once the plan has chosen its slice
(:meth:`set_state_bits`; Note: [planned 8-bit slice] in plan_states.py), or at the first step without one. The
states are allocated here, all at once (8-bit: bitsandbytes' blockwise states and qmaps, one pair of qmaps per
device; 32-bit: torch's), so :meth:`state_bytes` reports the real figure before the first step and the pipelined
step's worker never allocates states.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from .adamw32 import init_32bit_state
from .assign import EightBitPolicy, StateBytes, assign_state_bits, log_assignment
from .bnb8bit import init_8bit_state, make_qmaps

logger = logging.getLogger("lightning_lazytrain.optim")

__all__ = ["StateBits"]


class StateBits:
    """The 8/32-bit assignment, allocation and byte accounting of ``HybridAdamW``'s states."""

    @property
    def bits_pending(self) -> bool:
        """``eight_bit="plan"`` and no state allocated yet (:meth:`set_state_bits` decides)."""
        return self.eight_bit == "plan"

    def set_state_bits(self, policy: EightBitPolicy) -> StateBytes:
        """Note: [planned 8-bit slice] Choose the states of an ``eight_bit="plan"`` optimizer (any
        policy ``eight_bit`` takes, e.g. the fraction the plan found) and allocate them; before the
        first step only. Returns the state bytes."""
        if not self.bits_pending:
            raise RuntimeError(f"set_state_bits() is for HybridAdamW(eight_bit='plan'); this one has "
                               f"eight_bit={self.eight_bit!r} and its states already")
        if policy == "plan":
            raise ValueError("set_state_bits() needs a policy: 'none', 'all', a fraction or a predicate")
        self.eight_bit = policy
        self._assign_and_init([p for g in self.param_groups for p in g["params"]])
        return self.state_bytes()

    def _resolve_pending(self) -> None:
        if self.bits_pending:  # no plan chose (not under strategy="lazytrain"): plain AdamW states
            logger.info("HybridAdamW(eight_bit='plan'): no plan chose an 8-bit slice before the first step; "
                        "32-bit states for every parameter")
            self.set_state_bits("none")

    def _assign_and_init(self, params: Sequence[torch.Tensor]) -> None:
        if self.bits_pending:  # Note: [planned 8-bit slice]: set_state_bits allocates them
            return
        named = [(self._names[p], p) for p in params]
        bits = assign_state_bits(named, self.eight_bit, min_8bit_numel=self.min_8bit_numel)
        for name, p in named:
            self._bits[p] = bits[name]
            self.state[p] = self._fresh_state(p)
        log_assignment(bits, self.state_bytes(), policy=self.eight_bit)

    def _fresh_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        if self._bits[p] == 8:
            if p.device not in self._qmaps:
                self._qmaps[p.device] = make_qmaps(p.device)
            return init_8bit_state(p, *self._qmaps[p.device])
        return init_32bit_state(p)

    def bits_of(self, p: torch.Tensor) -> int | None:
        """8 or 32: the bits of ``p``'s states (None: not one of this optimizer's, or still pending)."""
        return self._bits.get(p)

    @property
    def assignment(self) -> dict[str, int]:
        """``{parameter name: 8 or 32}`` as decided by :func:`assign_state_bits`."""
        return {self._names[p]: b for p, b in self._bits.items()}

    def state_bytes(self) -> StateBytes:
        """Measured bytes of all optimizer-state tensors (shared qmaps counted once)."""
        out = StateBytes(total=0)
        seen_qmaps: set[tuple[torch.device, int]] = set()
        for p, bits in self._bits.items():
            nbytes = 0
            for key, value in self.state[p].items():
                if not isinstance(value, torch.Tensor):
                    continue
                size = value.numel() * value.element_size()
                if key.startswith("qmap"):
                    ident = (value.device, value.untyped_storage().data_ptr())
                    if ident not in seen_qmaps:
                        seen_qmaps.add(ident)
                        out.qmap_bytes += size
                else:
                    nbytes += size
            out.per_param[self._names[p]] = nbytes
            out.numel += p.numel()
            if bits == 8:
                out.eight_bit_bytes += nbytes
                out.eight_bit_numel += p.numel()
            else:
                out.full_bytes += nbytes
        out.total = out.eight_bit_bytes + out.full_bytes + out.qmap_bytes
        return out
