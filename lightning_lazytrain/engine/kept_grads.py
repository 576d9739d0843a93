"""The host-gradient views a ``ParamStore`` handed out as ``.grad``, per parameter, and what to do with one still
alive when its range is written again (grad_writeback.py).

Note: [a kept gradient] A master's ``.grad`` is a view of its group's flat host gradient, and the buffer is
reused from step to step. Under plain autograd, ``zero_grad()`` (``set_to_none=True``) drops ``.grad`` and the
next backward makes a new tensor: a gradient kept by reference from an earlier step (a gradient-similarity log,
``[p.grad for p in model.parameters()]``) keeps its step's values. Here the next backward would write into the
range the kept view shows. So every view the store hands out as ``.grad`` is recorded here (a weak reference,
per parameter), and before the store writes a parameter's range while its ``.grad`` is not that range's view
(None after ``zero_grad``, a tensor the user assigned, autograd's from a use outside the block), each earlier
view still alive is moved out: ``set_`` onto a copy of its values (``release``). The user's tensor object stays
the same, with the same values, and the store keeps its buffer (page-locked on CUDA). An ordinary loop keeps
none (its ``.grad`` tensors go at ``zero_grad``; the engine and optimizer keep no gradient past its step): nothing
moves, which ``moved`` counts. ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place under plain autograd
too (a kept tensor then changes with it): nothing to do.

The same ``set_`` keeps a ``.grad`` object where the store used to rebind it: a tensor the user assigned as
``.grad`` before the backward becomes the view of its range (under plain autograd the gradient is added into
it in place), and a group whose host gradient grows (weights thawed) moves its live ``.grad`` tensors into the
new buffer. Not seen: other tensors over the same memory made from a handed view (``p.grad.detach()``,
``p.grad.view(-1)``) are not recorded; kept across ``zero_grad`` they are overwritten (README's limitations).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["HandedGrads"]


class HandedGrads:
    """Weak references to the ``.grad`` views handed out, per parameter entry (its ``id``)."""

    def __init__(self) -> None:
        self._refs: dict[int, list[weakref.ref]] = {}
        self.moved = 0  # kept tensors moved out of the host gradient before their range was written

    def record(self, key: int, view: torch.Tensor) -> None:
        refs = self._refs.setdefault(key, [])
        if any(r() is view for r in refs):
            return
        refs.append(weakref.ref(view))
        if len(refs) > 8:  # drop the dead
            refs[:] = [r for r in refs if r() is not None]

    def release(self, key: int, current: torch.Tensor | None) -> None:
        """The parameter's range is about to be written while its ``.grad`` is ``current``: every other view
        handed out for it that is still alive gets its own copy of its values (``set_``), and is forgotten."""
        refs = self._refs.get(key)
        if not refs:
            return
        keep = []
        for r in refs:
            t = r()
            if t is None:
                continue
            if t is current:
                keep.append(r)
                continue
            with torch.no_grad():
                t.set_(t.clone())
            self.moved += 1
        refs[:] = keep
