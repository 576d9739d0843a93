"""Edits of the bound non-block copies (Note: [an edit of a bound copy]): which of them user code changed in place.

Note: [an edit of a bound copy]
    For a whole training micro-batch (and between an accumulated step's micro-batches) the modules hold the
    non-block weights' device copies, not the host masters (param_binding.py). User code that edits one in place
    through the module there -- WGAN's ``p.data.clamp_`` after the critic's step, a ``mul_`` under ``no_grad``, a
    target network's ``lerp_``, a clamp in ``training_step`` after the forward -- edits the copy: the rest of the
    micro-batch computes with it, as under ``auto``, but the master the optimizer updates and the next step stages
    from never saw it (review 19: silently lost, 0.2 off in a critic's weights after 4 steps). Each copy's state is
    marked when it is bound, refreshed or written back: its own version counter (an in-place op under
    ``no_grad`` moves it; each copy has its own: Note: [one version counter per copy] in param_binding.py) and two
    reductions of its values, the integer sum of its bit patterns and its float32 2-norm (a ``.data`` edit moves no
    counter; the bit sum sees a change beside a NaN or an infinity). Where either moved,
    the copy is written back into its master (``ParamStore.sync_edits``): the elements whose value differs from the
    master's in the copy's dtype take the copy's (widened where the master is fp32: an element the user did not
    change keeps the master's low bits). That runs before the strategies' backward (whose updates, HybridAdamW's in
    the backward, change masters an edit merged after them would overwrite), before an optimizer steps inside the
    micro-batch (the edit, then the step, in the user's order) and again after its ``on_before_optimizer_step`` hooks
    (adapters/precision.py), when a micro-batch ends or is dropped, when evaluation's bind ends (an Embedding's
    ``max_norm`` renormalises rows in place), when the executor closes with one still bound, and before a state dict
    is read mid-bind.
    Cost: two reductions over the non-block weights on the device per check, a copy to the host of an edited one
    only. Not seen: an edit that keeps both the counter and both reductions (a permutation through ``.data``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EditWatch"]


class EditWatch:
    """The marks of a bind's floating copies ((entry, copy) pairs), and which moved since."""

    def __init__(self, pairs: list[tuple[Any, torch.Tensor]]) -> None:
        self.pairs = [(info, w) for info, w in pairs if w.is_floating_point() and w.numel()]
        self.reset()

    def _values(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per copy: the integer sum of its bit patterns (exact) and its float32 2-norm."""
        if not self.pairs:
            return None
        with torch.no_grad():
            return (torch.stack([_bits_sum(w) for _, w in self.pairs]),
                    torch.stack([torch.linalg.vector_norm(w, dtype=torch.float32) for _, w in self.pairs]))

    def reset(self) -> None:
        """Mark every copy as it is now."""
        self._versions = [w._version for _, w in self.pairs]
        self._marks = self._values()

    def changed(self) -> list[tuple[Any, torch.Tensor]]:
        """The (entry, copy) pairs edited since the marks (a device sync)."""
        if not self.pairs:
            return []
        now = self._values()
        assert now is not None and self._marks is not None
        (bits, norms), (bits0, norms0) = now, self._marks
        same = ((bits == bits0) & ((norms == norms0) | (norms.isnan() & norms0.isnan()))).tolist()
        return [pair for pair, kept, v in zip(self.pairs, same, self._versions) if not kept or pair[1]._version != v]


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_sum(w: torch.Tensor) -> torch.Tensor:
    """The sum of the copy's bit patterns as integers (int64; a wrap-around is as good a mark): exact, and moved by
    a change of any element whatever the values are (a NaN or an infinity in the copy leaves a float sum NaN or
    infinite whatever else changes: review 21)."""
    return w.detach().view(_BITS[w.element_size()]).sum(dtype=torch.int64)
