"""Which host-gradient views a ``ParamStore`` handed out as ``.grad`` are still alive (grad_writeback.py).

Note: [a kept gradient] A master's ``.grad`` is a view of its group's flat host gradient, and the buffer is
reused from step to step. Under plain autograd, ``zero_grad()`` (``set_to_none=True``) drops ``.grad`` and the
next backward makes a new tensor: a gradient kept by reference from an earlier step (a gradient-similarity log,
``[p.grad for p in model.parameters()]``) keeps its step's values. Here the next backward would write into the
same buffer the kept view shows. So every view the store hands out as ``.grad`` is recorded here (a weak
reference); when a group's gradients begin afresh (no master of it has a ``.grad``, on the training thread,
before the step's first copy lands in it: ``GradWriteBack.renew_kept_host_grads``) and a view handed out
earlier is still alive, the group gets a new host gradient and the old one stays with whoever kept it. An
ordinary loop keeps none (its ``.grad`` tensors go at ``zero_grad``; the engine keeps no gradient across a
step): no buffer is renewed, which ``renewed`` counts. ``zero_grad(set_to_none=False)`` zeroes ``.grad`` in
place under plain autograd too (a kept tensor then changes with it): nothing to do.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["HandedGrads"]


class HandedGrads:
    """Weak references to the ``.grad`` views handed out, per group id."""

    def __init__(self) -> None:
        self._refs: dict[int, list[weakref.ref]] = {}
        self.renewed = 0  # host gradients replaced because a view of the old one was kept

    def record(self, gid: int, view: torch.Tensor) -> None:
        refs = self._refs.setdefault(gid, [])
        refs.append(weakref.ref(view))
        if len(refs) > 64 and len(refs) & (len(refs) - 1) == 0:  # every doubling: drop the dead
            refs[:] = [r for r in refs if r() is not None]

    def any_alive(self, gid: int) -> bool:
        """Is a view handed out for group ``gid`` still referenced? Forgets the dead ones."""
        refs = self._refs.get(gid)
        if not refs:
            return False
        refs[:] = [r for r in refs if r() is not None]
        return bool(refs)

    def forget(self, gid: int) -> None:
        """The group's views are of a buffer the store no longer writes."""
        self._refs.pop(gid, None)
