"""The device slots of ``ParamStore`` (a mixin of it, param_store.py: it reads the store's groups,
engine and host layout hooks): ``num_slots`` block slots and, last, the non-block group's own slot. Each
is a flat device weight buffer in the compute dtype, a flat device gradient buffer (allocated at the
first bind with grads, ``ensure_grad_buffers``) and a host landing buffer for its gradient D2H (every
slot's in one ``staging`` arena, ``_make_staging``). ``slot`` / ``_slot`` look a slot up;
``slot_weights``, ``staged``, ``allocated``, ``device_bytes`` and ``slot_bytes`` say what it holds.
What goes into a slot is param_staging.py's (``stage``), how modules use it param_binding.py's
(``bind``), and when its memory may be overwritten Note: [slot reuse] in param_store.py.

Lazy slots
    Slots named in ``lazy_slots`` (the executor's recompute slot and resident-weight slots) hold no
    device memory until ``stage`` allocates them and give it back at ``evict``, so the device holds
    them only in the windows the plan counts them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_lazytrain.engine.grad_writeback import REST
from lightning_lazytrain.engine.host_arena import HostArena
from lightning_lazytrain.engine.param_groups import Slot

if TYPE_CHECKING:
    from lightning_lazytrain.engine.blocks import BlockStack
    from lightning_lazytrain.engine.copy_engine import CopyEngine
    from lightning_lazytrain.engine.param_groups import ParamGroup

__all__ = ["ParamSlots"]


class ParamSlots:
    """The device slots of ``ParamStore`` (see the module doc); the attributes are the store's."""

    device: torch.device
    compute_dtype: torch.dtype
    engine: CopyEngine
    blocks: BlockStack
    num_slots: int
    _pin: bool
    _groups: dict[int, ParamGroup]
    _slots: list[Slot]
    _staging_arena: HostArena | None

    # ---- construction (ParamStore.__init__; _make_staging again at set_placement) ----------
    def _new_slot(self, numel: int, *, lazy: bool = False) -> Slot:
        # Device gradient buffers are allocated at the first bind with grads: a slot used only for
        # no-grad recompute (the executor's third slot) then costs weights only, as planned. Its host
        # staging comes from the staging arena (_make_staging; its cast buffer from the cast arena:
        # keep_copies), so no pinned allocation happens mid-step.
        s = Slot(numel=numel, weights=None, grads=None, cast=None, grad_host=torch.empty(0), lazy=lazy)
        if not lazy:
            self._allocate(s)
        return s

    def _make_staging(self) -> None:
        """(Re)make every slot's gradient landing buffer, in one arena: the compute dtype, except a
        sharded store's block slots (its reduce-scatter averages in the masters' dtype) and slots
        whose gradients the plan widens on the device (``_landing_dtype``)."""
        if self._staging_arena is not None:
            self.engine.synchronize()  # no D2H still lands in the buffers that go
            self._staging_arena.release()
        n = self.num_slots
        host_block = max(self._host_numel(self._groups[i]) for i in range(len(self.blocks)))
        host_sizes = [host_block] * n + [self._host_numel(self._groups[REST])]
        land = [self._landing_dtype(k < n) for k in range(len(host_sizes))]
        le = [torch.empty((), dtype=dt).element_size() for dt in land]
        self._staging_arena = HostArena.for_sizes([h * x for h, x in zip(host_sizes, le)], pin=self._pin,
                                                  name="staging")
        for s, h, dt in zip(self._slots, host_sizes, land):
            s.grad_host, s.host_numel = self._staging_arena.take(h, dt), h

    def _allocate(self, s: Slot) -> None:
        # never an inference tensor (a lazy slot first staged under the user's inference_mode in a
        # training step): the copy lanes write it from their own threads, outside that mode
        with torch.inference_mode(False):
            s.weights = torch.empty(s.numel, dtype=self.compute_dtype, device=self.device)
        # A fresh device buffer may reuse memory that queued compute still reads (caching
        # allocator, compute stream): the first H2D into it must wait (Note: [slot reuse] in
        # param_store.py).
        s.free = self.engine.record_compute()

    # ---- lazy slots: device buffers on demand ----------------------------
    def evict(self, slot: int, *, keep_grads: bool = False) -> None:
        """Give a lazy slot's device buffers back (after its copies): it holds nothing until the
        next ``stage``. ``keep_grads``: only the weights go (the block's backward is done, its
        gradients still wait for ``send_grads``). Compute still queued on the buffers is ordered
        before any reuse (the allocator's stream order)."""
        s = self._slot(0, slot)
        if not s.lazy:
            raise ValueError(f"slot {slot} is not lazy")
        if s.bound:
            raise RuntimeError(f"evict() of slot {slot} inside bind()")
        for h in (s.ready,) if keep_grads else (s.ready, s.sending):
            if h is not None:
                h.wait()
        if keep_grads and s.grads is not None:
            self._collect_grads(s)  # the wrappers are views of the weights: they go too
        s.wrappers = []
        s.weights, s.ready = None, None
        if not keep_grads:
            s.grads = None
            s.gid, s.free, s.sending = None, None, None

    def allocated(self, slot: int) -> bool:
        """Does block slot ``slot`` hold device memory now (always, unless it is a lazy one)?"""
        return self._slot(0, slot).weights is not None

    def ensure_grad_buffers(self, *slots: int) -> None:
        """Allocate the device gradient buffers of block slots ``slots`` and of the non-block
        weights now (else the first bind with grads does): the executor's memory measurement
        counts them as static device bytes, not a window's work."""
        for s in (*(self.slot(k) for k in slots), self._slot(REST, None)):
            self._ensure_grad_buffers(s)

    def _ensure_grad_buffers(self, s: Slot) -> torch.Tensor:
        if s.grads is None:
            with torch.inference_mode(False):
                s.grads = torch.zeros(s.numel, dtype=self.compute_dtype, device=self.device)
        return s.grads

    # ---- lookups -----------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Device bytes the slots hold now."""
        return sum(self._held(s) for s in self._slots)

    def slot_bytes(self, layer: int, slot: int | None = None) -> int:
        """Device bytes a slot holds now (weights once allocated, plus grads once allocated)."""
        return self._held(self._slot(layer, slot))

    @staticmethod
    def _held(s: Slot) -> int:
        return sum(t.nbytes for t in (s.weights, s.grads) if t is not None)

    def slot(self, index: int) -> Slot:
        """Block slot ``index`` (identity is what ``PendingGrads.slot`` refers to)."""
        return self._slot(0, index)

    def slot_weights(self, layer: int, slot: int | None = None) -> torch.Tensor:
        """The flat device weight buffer of a slot (for re-viewing saved weights, see the executor)."""
        w = self._slot(layer, slot).weights
        if w is None:
            raise RuntimeError(f"slot {slot} holds no weights (a lazy slot before stage())")
        return w

    def staged(self, layer: int, slot: int | None = None) -> bool:
        """Is ``layer`` the group staged in ``slot``?"""
        return self._slot(layer, slot).gid == layer

    def _slot(self, layer: int, slot: int | None) -> Slot:
        if not self._slots:
            raise RuntimeError("param store is closed")
        if layer == REST:
            return self._slots[-1]
        if slot is None or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot must be in 0..{self.num_slots - 1} for block {layer}, got {slot}")
        return self._slots[slot]
