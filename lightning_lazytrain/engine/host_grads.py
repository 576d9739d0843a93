"""The host gradients of ``ParamStore``'s groups (a mixin of it, through ``GradWriteBack``: grad_writeback.py):
how far each flat host gradient reaches, grown when weights thaw, renewed when kept ``.grad`` tensors still hold
it, and the masters' ``.grad`` views in it set, adopted or rebound (Note: [a kept gradient] in kept_grads.py).

Note: [host gradients for what trains] A group's flat host gradient (fp32 with fp32 masters, page-locked
on CUDA) reaches as far as its trainable prefix (``_grad_capacity``): the aligned end of the last
parameter that requires grad when the store is built, not the whole group. A frozen parameter has no
``.grad`` under plain autograd and no view here (``_has_host_grad``). A LoRA fine-tune's blocks then hold
host gradients for their adapters only (at 27B, ~108 GB of page-locked memory that was never written).
Weights thawed later (``BaseFinetuning``, a ``requires_grad_`` between steps) grow their group's buffer
when a gradient copy of it starts (``_fit_host_grads``, on the training thread): the group's host work and
copies in flight are waited for, the buffer is reallocated at the new extent, and the ``.grad`` views in it
move to the new one (values kept). A sharded group keeps its whole shard (engine/shard_store.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from lightning_lazytrain.engine.kept_grads import storage_refs
from lightning_lazytrain.engine.outside_uses import OutsideUses
from lightning_lazytrain.engine.param_groups import REST, ParamEntry, ParamGroup, aligned_end

__all__ = ["HostGrads"]

log = logging.getLogger(__name__)


class HostGrads(OutsideUses):
    """The host-gradient methods of ``ParamStore`` (which provides the groups, slots, views and arenas); a
    master's uses outside its block are ``OutsideUses``' (outside_uses.py)."""

    def _grad_capacity(self, g: ParamGroup, also: Iterable[ParamEntry] = ()) -> int:
        """Elements of group ``g``'s host gradient: up to the aligned end of its parameters that require
        grad and of ``also`` (Note: [host gradients for what trains]); a sharded group's whole shard."""
        if self.sharded(g.gid):
            return self._host_numel(g)
        wanted = [i for i in g.params if i.param.requires_grad]
        return min(g.numel, aligned_end([*wanted, *also]))

    def _has_host_grad(self, g: ParamGroup, info: ParamEntry) -> bool:
        """Does ``info`` have a view in its group's host gradient (Note: [host gradients for what trains])?"""
        return self.sharded(g.gid) or info.offset + info.numel <= g.grad.numel()

    def _fit_host_grads(self, g: ParamGroup, also: Iterable[ParamEntry] = ()) -> None:
        """Grow group ``g``'s host gradient to its parameters that require grad now and ``also`` (Note: [host
        gradients for what trains]). On the training thread: waits for the group's host work and copies."""
        need = self._grad_capacity(g, also)
        if need > g.grad.numel():
            self._replace_host_grad(g, need)

    @property
    def kept_grads_moved(self) -> int:
        """Kept ``.grad`` tensors moved out of the host gradient before their range was written (Note: [a kept
        gradient] in kept_grads.py); 0 in a loop that keeps none."""
        return self._handed.moved

    @property
    def kept_grad_renewals(self) -> int:
        """Host gradients replaced because other tensors over their memory were kept (Note: [a kept gradient])."""
        return self._handed.renewed

    def renew_aliased_host_grads(self, layer: int) -> None:
        """Note: [a kept gradient] (kept_grads.py): before a step's first gradient of group ``layer`` lands (none
        of its masters has a ``.grad``), a new host gradient if tensors the store does not know of still hold the
        old one's memory. On the training thread."""
        g = self._group(layer)
        infos = [i for i in g.params if self._has_host_grad(g, i)]

        def unknown() -> int:
            if any(i.param.grad is not None for i in infos):
                return 0
            return storage_refs(g.grad) - 1 - self._handed.alive_in((id(i) for i in infos), g.grad)

        if self.sharded(g.gid) or unknown() <= 0:
            return
        self._quiesce(g)  # finished copies and host work let their references go
        if unknown() <= 0:
            return
        old = g.grad
        with self._outside_lock:
            g.grad = torch.zeros(old.numel(), dtype=old.dtype, pin_memory=self._pin)
            self._handed.forget(id(i) for i in infos)  # their views stay with the old memory
        self._handed.renewed += 1
        self._supersede(g, old)
        log.info("lazytrain: tensors over layer %s's host gradient were kept across zero_grad() (e.g. "
                 "p.grad.detach()); it got a new one (%d so far)", layer, self._handed.renewed)

    def _replace_host_grad(self, g: ParamGroup, numel: int) -> None:
        """A new host gradient of ``numel`` elements for group ``g`` (grown), after the group's host work and
        copies; its values move along, and so do the live ``.grad`` tensors in it (the same objects, ``set_``
        onto the new buffer: Note: [a kept gradient])."""
        self._quiesce(g)
        old = g.grad
        new = torch.zeros(numel, dtype=old.dtype, pin_memory=self._pin)
        lo, hi = old.data_ptr(), old.data_ptr() + old.nbytes
        with torch.no_grad(), self._outside_lock:
            new[: old.numel()].copy_(old)
            for info in g.params:
                cur = info.param.grad
                if cur is not None and lo <= cur.data_ptr() < hi:
                    self._adopt_tensor(g, info, cur, self._view(new, info))
            g.grad = new
        self._supersede(g, old)

    def _quiesce(self, g: ParamGroup) -> None:
        """Wait for group ``g``'s host work and its slots' gradient copies (on the training thread)."""
        if g.accumulating is not None:
            g.accumulating.wait()
        for s in self._slots:
            if s.gid == g.gid and s.sending is not None:
                s.sending.wait()

    def _supersede(self, g: ParamGroup, old: torch.Tensor) -> None:
        """Count the host bytes of ``g``'s replaced host gradient: its arena slice stays reserved; a later buffer
        is freed with its views."""
        if g.gid not in self._grown_grads:
            self._superseded_grad_bytes += old.nbytes
            self._grown_grads.add(g.gid)

    def _set_grad(self, g: ParamGroup, info: ParamEntry, view: torch.Tensor) -> None:
        """``.grad`` = a view of the group's host gradient, recorded (Note: [a kept gradient])."""
        info.param.grad = view
        self._handed.record(id(info), view)

    def _adopt_tensor(self, g: ParamGroup, info: ParamEntry, cur: torch.Tensor, view: torch.Tensor) -> None:
        """``info``'s ``.grad`` is ``cur``, not its view, and ``view`` holds its values now: ``cur`` becomes the
        view (``set_``: the same tensor object, as plain autograd adds into a ``.grad`` in place), or, where it
        cannot (a gradient with a graph, another shape or dtype, a shard), ``.grad`` is rebound to ``view``."""
        if (self.sharded(g.gid) or cur.requires_grad or cur.dtype != view.dtype or cur.shape != view.shape
                or cur.device != view.device):
            self._set_grad(g, info, view)
            return
        cur.set_(view)
        self._handed.record(id(info), cur)

    def _ensure_host_grads(self, g: ParamGroup, touched: frozenset | set = frozenset()) -> None:
        # optimizer.zero_grad(set_to_none=True) or user code may have replaced .grad. A parameter
        # without a host grad gets one (a zeroed view) only when a gradient reached it; the flat
        # buffer stays zero where no parameter has a grad, so norms of the flat buffer are right.
        # A parameter beyond the host gradient (frozen: Note: [host gradients for what trains]) keeps its own.
        for info in g.params:
            if not self._has_host_grad(g, info):
                continue
            view = self._host_view(g.grad, info)
            with self._outside_lock:  # Note: [a master used outside its block]
                cur = info.param.grad
                if g.gid != REST:
                    self._take_outside(info, view)  # an outside use's gradient is copied in below
                if cur is None:
                    self._handed.release(id(info), None)  # Note: [a kept gradient] (kept_grads.py)
                    view.zero_()
                    if id(info) in touched:
                        self._set_grad(g, info, view)
                elif cur.data_ptr() != view.data_ptr():
                    self._handed.release(id(info), cur)
                    view.copy_(cur)
                    self._adopt_tensor(g, info, cur, view)
