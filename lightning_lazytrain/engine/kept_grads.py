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
new buffer.

Other tensors over the same memory made from a handed view (``p.grad.detach()``, ``p.grad.view(-1)``, or
``p.grad.detach().cpu()``, which copies nothing: the gradients live on the host) are not recorded. They are
counted: each group's host gradient has a storage of its own (``own_storage``: the arena's bytes, DLPack keeping
the arena alive), whose use count is the references to it. When a group's gradients begin afresh (none of its
masters has a ``.grad``; on the training thread, before the step's first copy lands in it) and the count is
more than the store's own reference and the recorded views alive (``unknown()`` in ``GradWriteBack.renew_aliased_host_grads``), the group's copies in
flight and host work are waited for (their references go) and, if the count still says so, the group gets a
new host gradient (``renewed``); the old one stays with whoever kept it. A loop that keeps nothing renews
nothing (tests/test_kept_grads.py).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["HandedGrads", "own_storage", "storage_refs"]


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a tensor with a storage of its own (the DLPack capsule keeps ``t``, and so an arena slice's
    memory, alive): its use count then counts the references to this memory only."""
    if t.numel() == 0:
        return t
    return torch.utils.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # (torch's own; absent: nothing is counted)


def storage_refs(t: torch.Tensor) -> int:
    """Tensors referencing ``t``'s storage (``t`` included); 1 where this torch cannot count them."""
    if _USE_COUNT is None:
        return 1
    st = t.untyped_storage()
    return _USE_COUNT(st._cdata) - 1  # (less the ``st`` object itself)


class HandedGrads:
    """Weak references to the ``.grad`` views handed out, per parameter entry (its ``id``)."""

    def __init__(self) -> None:
        self._refs: dict[int, list[weakref.ref]] = {}
        self.moved = 0  # kept tensors moved out of the host gradient before their range was written
        self.renewed = 0  # host gradients replaced: other tensors over their memory were kept

    def alive_in(self, keys, buf: torch.Tensor) -> int:
        """The recorded views of these parameters still alive and over ``buf``'s storage."""
        ptr = buf.untyped_storage().data_ptr()
        n = 0
        for key in keys:
            for r in self._refs.get(key, ()):
                t = r()
                if t is not None and t.untyped_storage().data_ptr() == ptr:
                    n += 1
        return n

    def forget(self, keys) -> None:
        for key in keys:
            self._refs.pop(key, None)

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
