"""Staging of ``ParamStore`` (a mixin of it, param_store.py: it reads the store's groups, slots,
engine and host lane, and calls its layout helpers): ``stage`` starts a group's H2D into a device
slot, through one of three routes -- the masters cast on the host lane into the slot's cast buffer
(Note: [host lane] in param_store.py), the kept compute copy (below), or fp32 over the link cast by
the device (Note: [conversion on the device] in copy_engine.py). ``keep_copies`` picks between the
slots' cast buffers and the kept copies; ``set_placement`` puts groups' conversions on the device.

Note: [kept compute copy] With ``keep_copies(True)`` (16-bit compute copies of masters in another
    dtype), each group also has a host copy in the compute dtype (the ``copies`` arena, pinned on
    CUDA): a group's first ``stage`` after ``invalidate_copies`` casts its masters into it on the host
    lane, later stages of the same range H2D straight from it (one DMA, no cast). The executor
    invalidates every copy when a micro-batch begins and when evaluation begins: inside a micro-batch
    the masters cannot change (the optimizer runs between micro-batches; the pipelined one updates a
    layer before its first stage), so a backward's or a re-run's fetch reuses the forward's cast.
    A re-cast waits for the last H2D that read the copy (``copy_read``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import torch

from lightning_lazytrain.engine.host_arena import HostArena

if TYPE_CHECKING:
    from collections.abc import Iterable

    from lightning_lazytrain.engine.copy_engine import CopyEngine, CopyHandle
    from lightning_lazytrain.engine.host_ops import HostOps
    from lightning_lazytrain.engine.param_groups import ParamEntry, ParamGroup, Slot

__all__ = ["VIA_NUMEL", "ParamStaging"]

# The device buffer each copy lane converts through (Note: [conversion on the device] in copy_engine.py):
# 16M elements, 64 MiB in fp32; the copies of larger groups run through it in chunks.
VIA_NUMEL: Final[int] = 1 << 24


class ParamStaging:
    """The staging methods of ``ParamStore`` (see the module doc); the attributes are the store's."""

    device: torch.device
    compute_dtype: torch.dtype
    engine: CopyEngine
    _ops: HostOps
    _pin: bool
    _groups: dict[int, ParamGroup]
    _slots: list[Slot]
    _device_cast: frozenset[int]
    _device_widen: frozenset[int]
    _via: dict[str, torch.Tensor]
    _cast_arena: HostArena | None
    _copies: HostArena | None
    _copy_cast: dict[tuple[int, int, int], CopyHandle]

    # ---- staging ---------------------------------------------------------
    def _repair_master(self, g: ParamGroup, infos: Iterable[ParamEntry] | None = None) -> None:
        # An optimizer that *replaced* p.data (instead of updating in place) broke the packing.
        with torch.no_grad():
            for info in g.params if infos is None else infos:
                view = self._host_view(g.master, info)
                if info.param.data_ptr() != view.data_ptr() or info.param.dtype != g.master.dtype:
                    view.copy_(info.param.data)
                    info.param.data = view

    def stage(self, layer: int, slot: int | None = None, *, part: int | None = None) -> CopyHandle:
        """Start copying group ``layer``'s masters into ``slot`` (REST: its own buffer).

        ``part`` (REST only, ``set_rest_parts``): only that part's range; stage parts 0, 1, ... in
        order, and all of them before ``bind`` (which waits for the last H2D: the lane is FIFO)."""
        g, s = self._group(layer), self._slot(layer, slot)
        if s.bound:
            raise RuntimeError(f"slot {slot} is bound (layer {s.gid}); leave bind() before restaging it")
        lo, hi, infos, index = self._range(layer, part)
        self._repair_master(g, infos)
        if s.weights is None:
            self._allocate(s)
        if not part:  # the whole group, or the first part: what the previous staging's H2D read
            s.prior_ready = s.ready
        src = g.master[lo:hi]
        after = [s.free] if s.free is not None else []
        if layer in self._device_cast:  # fp32 over the link, cast by the device (Note: [conversion on the device])
            s.ready = self.engine.h2d(s.weights[lo:hi], src, after=after, tag=f"param:{index}", via=self._via["h2d"])
            s.gid = layer
            return s.ready
        if g.copy is not None:  # Note: [kept compute copy]
            src, cast = self._from_copy(g, layer, lo, hi, index)
            after.append(cast)
        elif s.cast is not None and g.master.dtype != s.cast.dtype:
            # Cast on the host so only compute-dtype bytes cross the link, on the host lane (Note:
            # [host lane]); the cast buffer may still feed this slot's previous H2D.
            src, master = s.cast[lo:hi], g.master[lo:hi]
            after.append(self.engine.host(lambda: self._ops.cast_into(src, master),
                                          after=[s.prior_ready] if s.prior_ready else [],
                                          tag=f"cast:{index}", nbytes=master.nbytes + src.nbytes))
        s.ready = self.engine.h2d(s.weights[lo:hi], src, after=after, tag=f"param:{index}")
        if g.copy is not None:
            g.copy_read = s.ready
        s.gid = layer
        return s.ready

    # ---- kept compute copies (Note: [kept compute copy]) ------------------------------------
    def _needs_cast(self, g: ParamGroup) -> bool:
        return self.compute_dtype != torch.float32 and g.master.dtype != self.compute_dtype

    def keep_copies(self, on: bool) -> bool:
        """Keep (``on``) each group's host compute-dtype copy, or cast per fetch through the slots'
        cast buffers; returns whether copies are kept (never when no master needs a cast). Either
        way only one of the two arenas exists (``host_pinned_bytes``)."""
        groups = [g for g in self._groups.values() if self._needs_cast(g) and g.gid not in self._device_cast]
        if getattr(self, "_slots", None) and any(s.bound for s in self._slots):
            raise RuntimeError("keep_copies() inside bind()")
        self.engine.synchronize()  # no H2D or cast still reads the buffers that go
        self._release_cast_buffers()
        if not groups:
            return False
        dt = self.compute_dtype
        e = torch.empty((), dtype=dt).element_size()
        if on:
            self._copies = HostArena.for_sizes([self._host_numel(g) * e for g in groups], pin=self._pin, name="copies")
            for g in groups:
                g.copy = self._copies.take(self._host_numel(g), dt)
            return True
        self._cast_arena = HostArena.for_sizes([s.host_numel * e for s in self._slots], pin=self._pin, name="cast")
        for s in self._slots:
            s.cast = self._cast_arena.take(s.host_numel, dt)
        return False

    def _release_cast_buffers(self) -> None:
        """Drop the kept copies and the slots' cast buffers (their memory goes with the last view)."""
        for g in self._groups.values():
            g.copy, g.copy_read = None, None
        for s in self._slots:
            s.cast = None
        self._copy_cast = {}
        for arena in (self._copies, self._cast_arena):
            if arena is not None:
                arena.release()
        self._copies = self._cast_arena = None

    @property
    def keeps_copies(self) -> bool:
        return self._copies is not None

    # ---- where the dtype conversions run (Note: [conversion on the device] in copy_engine.py) -----
    def set_placement(self, *, cast_on_device: Iterable[int] = (), widen_on_device: Iterable[int] = ()) -> dict:
        """Put groups' conversions on the device: ``cast_on_device`` groups' masters cross the link in
        their own dtype and the device casts them into the slot (no host cast, no kept copy);
        ``widen_on_device`` groups' 16-bit gradients are widened by the device and cross in the
        masters' dtype, so the host adds like to like or the copy lands in the host gradient
        directly (Note: [direct landing] in grad_writeback.py). Only groups with something to convert
        count (masters in another dtype than the compute copies; not a sharded group). Between
        micro-batches. Returns what was set (group ids)."""
        if any(s.bound for s in self._slots):
            raise RuntimeError("set_placement() inside bind()")
        cast = frozenset(j for j in cast_on_device if self.convertible(j))
        widen = frozenset(j for j in widen_on_device if self.convertible(j))
        if (cast, widen) == (self._device_cast, self._device_widen):
            return {"cast_on_device": sorted(cast), "widen_on_device": sorted(widen)}
        self.engine.synchronize()  # nothing in flight reads the buffers that change
        copies = self.keeps_copies
        self._device_cast, self._device_widen = cast, widen
        self._via = {}
        for lane, groups in (("h2d", cast), ("d2h", widen)):
            if groups:
                n = min(VIA_NUMEL, max(self._group(j).numel for j in groups))
                with torch.inference_mode(False):
                    self._via[lane] = torch.empty(n, dtype=torch.float32, device=self.device)
        self._make_staging()
        self.keep_copies(copies)  # the third arena serves the groups still cast on the host
        return {"cast_on_device": sorted(cast), "widen_on_device": sorted(widen)}

    def convertible(self, layer: int) -> bool:
        """Has group ``layer`` conversions the plan may place (fp32 masters, 16-bit compute copies)?"""
        g = self._group(layer)
        return self._needs_cast(g) and g.dtype == torch.float32 and not self.sharded(layer)

    @property
    def placement(self) -> dict[str, list[int]]:
        return {"cast_on_device": sorted(self._device_cast), "widen_on_device": sorted(self._device_widen)}

    @property
    def conversion_device_bytes(self) -> int:
        """Device bytes of the lanes' conversion buffers (``VIA_NUMEL`` fp32 at most, each)."""
        return sum(t.nbytes for t in self._via.values())

    def invalidate_copies(self) -> None:
        """The masters may have changed: the next stage of each group casts again."""
        self._copy_cast = {}

    def _from_copy(self, g: ParamGroup, layer: int, lo: int, hi: int, index: Any) -> tuple[torch.Tensor, CopyHandle]:
        """The H2D source of a stage from the kept copy, and the cast it waits for (queued now if the
        range was not cast since ``invalidate_copies``)."""
        assert g.copy is not None
        key = (layer, lo, hi)
        cast = self._copy_cast.get(key)
        if cast is None:
            dst, master = g.copy[lo:hi], g.master[lo:hi]
            cast = self.engine.host(lambda: self._ops.cast_into(dst, master), after=[g.copy_read] if g.copy_read else [],
                                    tag=f"cast:{index}", nbytes=master.nbytes + dst.nbytes)
            self._copy_cast[key] = cast
        return g.copy[lo:hi], cast
