"""Gradient write-back of ``ParamStore`` (a mixin of it, param_store.py): a slot's device gradients
go to the host (``send_grads``, one D2H) and join the masters' host ``.grad`` on the copy engine's
host lane (``finish_grads``: Note: [host lane] and Note: [grad write-back ordering] in
param_store.py), with each parameter's norm for exact clipping; ad-hoc passes' gradients
(``take_grads``) are summed in first, as autograd sums every use of a leaf.

Note: [direct landing] A gradient copy whose bytes are already in the host gradients' dtype (fp32
compute, or 16-bit gradients the plan widens on the device: Note: [conversion on the device] in
copy_engine.py) lands straight in the group's flat host gradient when that holds nothing yet this
step (every parameter of the range has ``.grad is None``, as ``zero_grad(set_to_none=True)`` leaves
it, and no accumulation into it is in flight): no landing buffer, no host addition. The host lane
then only gives the parameters the gradient reached their ``.grad`` views (the others' ranges are
zeroed, ``.grad`` stays None) and takes the norms. ``0 + x`` is ``x``: bit-identical to adding.
A step's later copies of the group add as before (like to like when widened). Ad-hoc passes'
gradients never land directly (``take_grads`` reads the landing buffer).

Note: [gradients sent once] A slot's ``touched`` (the parameters whose compute copy received a gradient
since the bind) is what a copy of its gradients carries to the host, and a send takes it: the slot's
device values stay until the next bind zeroes them, but nothing marks them as news. Block 0's slot
lives on between micro-batches; a micro-batch that does not bind it with gradients (a ``no_grad``
forward, then a loss on the non-block weights: manual optimization) still sends it at T -- before, the
previous backward's gradients came a second time (stepped again after ``zero_grad``). A parameter the
gradient reached keeps it whatever its ``requires_grad`` is when the copy lands: one frozen between
the micro-batches of a step keeps what reached it while it required one, as ``.grad`` does under plain
autograd (``tests/test_gradients_sent_once.py``).

Note: [only what trained crosses] A gradient copy moves the group's range from the first parameter a
gradient reached up to the end of the last, not the whole group: in a fine-tune whose blocks are mostly frozen (LoRA:
small adapters beside frozen base weights) the frozen weights' zeros do not cross the link. The store
lays each block's trainable parameters out first (param_store.py, ``_build_groups``), so that prefix is
the adapters; the non-block group keeps module order (its parts are runs of it), so a frozen embedding
before a trained head stays out from the front. What lies outside the copy is no gradient: the host adds only the parameters a gradient
reached, and where an ad-hoc pass's gradients join a landing buffer its uncopied tail is zeroed first.
The plan prices the same bytes (engine/profiler.py: ``ParamStore.grad_extent``).

The host gradient buffers themselves (grown for weights thawed later, renewed where kept ``.grad`` tensors hold
them: Note: [host gradients for what trains]) are ``HostGrads``' (host_grads.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from lightning_lazytrain.engine.copy_engine import CopyHandle
from lightning_lazytrain.engine.host_grads import HostGrads
from lightning_lazytrain.engine.param_groups import REST, ParamEntry, ParamGroup, Slot, aligned_span

__all__ = ["REST", "GradWriteBack", "PendingGrads", "sq_sum"]


@dataclass(eq=False)
class PendingGrads:
    """A gradient D2H in flight (``ParamStore.send_grads``); ``finish_grads`` completes it."""

    layer: int
    slot: Slot
    handle: CopyHandle
    touched: frozenset = frozenset()  # ids of the _Params that received a gradient
    part: int | None = None  # REST in parts: which (see ``ParamStore.set_rest_parts``)
    direct: bool = False  # landed in the host gradient itself (Note: [direct landing])
    end: int | None = None  # the copy's end in the group (Note: [only what trained crosses]); None: the range's
    start: int | None = None  # ... and its start (the first parameter a gradient reached); None: the range's
    # or, when that is known only once the copy is in (a sharded group: the union over the ranks,
    # shard_grads.py), a function giving it, called after ``handle`` is done
    resolve: Callable[[], frozenset] | None = None

    def touched_ids(self) -> frozenset:
        """``touched`` (after ``handle`` is done when ``resolve`` is set)."""
        return self.resolve() if self.resolve is not None else self.touched

    def clear_uncopied(self, buf: torch.Tensor, lo: int, hi: int) -> None:
        """Zero ``buf[lo:hi]`` outside the span the copy moved (Note: [only what trained crosses]): no gradient
        there, though a landing buffer may hold an old one."""
        if self.end is not None and self.end < hi:
            buf[self.end:hi].zero_()
        if self.start is not None and self.start > lo:
            buf[lo:self.start].zero_()


class GradWriteBack(HostGrads):
    """The gradient methods of ``ParamStore`` (which provides the groups, slots, views and engine); the host
    gradient buffers are ``HostGrads``' (host_grads.py), a master's uses outside its block ``OutsideUses``'
    (outside_uses.py)."""

    def write_back_grads(self, layer: int, slot: int | None = None, *, norm: bool = True,
                         param_norms: dict[nn.Parameter, torch.Tensor] | None = None,
                         final: bool | None = None, skip: Collection[int] = ()) -> torch.Tensor | None:
        """D2H the slot's grads, add them into the host fp32 ``.grad`` of the masters.

        Returns the group's squared grad norm (0-dim fp32, of the accumulated
        host grad) for global-norm clipping, or None with ``norm=False``;
        ``param_norms`` and ``final`` (default: ``norm``) as in ``finish_grads``. ``skip``: the parts of
        the non-block group written back already (Note: [early non-block parts] in early_parts.py;
        never all of them, nor part 0).
        """
        final = norm if final is None else final
        if layer == REST and len(self._rest_parts) > 1:  # Note: [non-block parts]: part p's
            # accumulation overlaps part p+1's D2H; the norms come with the last part (every part in)
            parts = [p for p in range(len(self._rest_parts)) if p not in skip]
            if not parts or parts[0] != 0:
                raise ValueError(f"write_back_grads(skip={sorted(skip)}): part 0 and at least one part are written "
                                 "back here")
            pending = [self.send_grads(layer, slot, part=p) for p in parts]
            for pend in pending[:-1]:
                self.finish_grads(pend, norm=False, final=False, wait=False)
            return self.finish_grads(pending[-1], norm=norm, final=final, param_norms=param_norms)
        return self.finish_grads(self.send_grads(layer, slot), norm=norm, final=final, param_norms=param_norms)

    def send_grads(self, layer: int, slot: int | None = None, *, part: int | None = None,
                   direct: bool = True) -> PendingGrads:
        """Start the D2H of the slot's grads (after the compute queued so far); see ``finish_grads``.
        ``part`` (REST only): that part's range (send parts 0, 1, ... in order). ``direct``: may land
        in the host gradient itself (Note: [direct landing]); ``take_grads`` needs the landing buffer."""
        s = self._slot(layer, slot)
        if s.gid != layer:
            raise RuntimeError(f"layer {layer} is not the one staged in slot {slot} (found {s.gid})")
        lo, hi, infos, index = self._range(layer, part)
        g = self._group(layer)
        if not self.sharded(layer):  # Note: [host gradients for what trains]: weights thawed since it was sized
            self._fit_host_grads(g, [i for i in g.params if id(i) in s.touched])
            if not part:
                self.renew_aliased_host_grads(layer)  # Note: [a kept gradient] (kept_grads.py)
        if s.grads is None and not any(w.requires_grad for _, w in s.wrappers):
            # a slot whose weights all ran frozen has no gradient buffer, and gets none for an empty copy: a
            # resident block no gradient reached (Note: [blocks no gradient reaches] in block_calls.py) would
            # otherwise hold a whole group's buffer the plan does not count until its slot goes
            grads = torch.empty(0, dtype=self.compute_dtype, device=self.device)
            if not part:
                s.prior_accumulated = s.accumulated
        elif not part:
            grads = self._collect_grads(s)
            s.prior_accumulated = s.accumulated
        else:  # part 0's collected every part's; a part written back before it collects its own (Note:
            # [early non-block parts] in early_parts.py)
            grads = self._collect_grads(s, infos)
        via = self._via.get("d2h") if layer in self._device_widen else None  # Note: [conversion on the device]
        landed = s.grad_host
        direct = direct and self._lands_directly(g, infos, via is not None)
        if direct:
            landed = g.grad
            self.direct_landings += 1
            for info in infos:  # the copy writes their ranges: kept views move out first (Note: [a kept gradient])
                self._handed.release(id(info), None)
        touched = frozenset(s.touched) if part is None else frozenset(s.touched) & {id(i) for i in infos}
        s.touched -= touched  # Note: [gradients sent once]
        # Note: [only what trained crosses]: from the first parameter a gradient reached (offsets are aligned) up
        # to the end of the last (its alignment padding included: a group's end is aligned)
        start, end = aligned_span((i for i in infos if id(i) in touched), lo, hi)
        # Note: [grad write-back ordering]; the landing buffer may still be read by the host work
        # of this slot's previous D2H.
        h = self.engine.d2h(landed[start:end], grads[start:end],
                            after=[s.prior_accumulated] if s.prior_accumulated else [], tag=f"grad:{index}", via=via)
        s.sending = h
        return PendingGrads(layer, s, h, touched, part, direct=direct, end=end, start=start)

    def _lands_directly(self, g: ParamGroup, infos: Iterable, widened: bool) -> bool:
        """Note: [direct landing]: the copy arrives in the gradients' dtype and their range is empty."""
        if self.sharded(g.gid) or not (widened or self.compute_dtype == g.grad.dtype):
            return False
        if g.accumulating is not None and not g.accumulating.done():
            return False
        return all(info.param.grad is None for info in infos)

    def _collect_grads(self, s: Slot, only: Iterable[ParamEntry] | None = None) -> torch.Tensor:
        """The slot's flat grad buffer with every wrapper's gradient in it (``only``: those of these
        parameters, a part's)."""
        grads = self._ensure_grad_buffers(s)
        keep = None if only is None else {id(i) for i in only}
        with torch.no_grad():
            for info, w in s.wrappers:
                if keep is not None and id(info) not in keep:
                    continue
                # Grads that did not land in place: create_graph=True makes
                # AccumulateGrad replace .grad by (old + new); user code may
                # have set it to None (= zero).
                view = self._view(grads, info)
                if not w.requires_grad or (w.grad is not None and w.grad.data_ptr() == view.data_ptr()):
                    continue
                if w.grad is None:
                    view.zero_()
                else:
                    view.copy_(w.grad)
                w.grad = view
        return grads

    def take_grads(self, pending: PendingGrads) -> tuple[torch.Tensor, frozenset]:
        """Wait for a ``send_grads(direct=False)`` copy and return it (host: the compute dtype, or
        widened) instead of accumulating it, with the parameters it touched; the device grads are
        zeroed. See ``finish_grads(extra=)``."""
        g, s = self._group(pending.layer), pending.slot
        if pending.direct:
            raise ValueError("take_grads() needs a copy in the landing buffer: send_grads(..., direct=False)")
        pending.handle.wait()
        with torch.no_grad():
            if s.grads is not None:  # (none: a slot whose weights all ran frozen, send_grads)
                s.grads[: g.numel].zero_()
            taken = s.grad_host[: self._host_numel(g)].clone()
            pending.clear_uncopied(taken, 0, taken.numel())
            return taken, pending.touched_ids()

    def finish_grads(self, pending: PendingGrads, *, norm: bool = True, final: bool | None = None,
                     extra: tuple[torch.Tensor, frozenset] | None = None, wait: bool = True,
                     param_norms: dict[nn.Parameter, torch.Tensor] | None = None) -> torch.Tensor | None:
        """Accumulate a ``send_grads`` copy into the host fp32 grads once it has landed.

        The accumulation (and the squared norm of the group's accumulated host grad, returned as a
        0-dim fp32 tensor, or None with ``norm=False``) runs on the host lane (Note: [host lane]);
        ``wait=False`` returns at once: the result is valid once the engine has synchronised
        (``wait_host``). ``bind`` with grads makes compute wait for the D2H before it zeroes the
        slot's device grads for their next use (Note: [grad write-back ordering]).

        With ``norm``, the host lane takes each parameter's norm (``grad_norms``: what
        ``clip_grad_norm_`` computes per tensor) and the squared group norm from those; a given
        ``param_norms`` dict is filled with them (replacing its contents) for exact clipping.

        ``final`` (default: ``norm``): the step's last accumulation of this group, handed to
        the final-grads hook (``ParamStore.set_final_grads_hook``).

        ``extra`` (from ``take_grads``): gradients of further uses of the same weights in this
        backward, summed with these *before* they join the host grad, as autograd sums every use of
        a leaf before accumulating into its ``.grad``."""
        g, s = self._group(pending.layer), pending.slot
        n, layer = self._host_numel(g), pending.layer
        lo, hi, _, index = self._range(layer, pending.part)
        if pending.part is None:
            lo, hi = 0, n  # host coordinates (a sharded group's host buffers hold its shard)
        if pending.part is not None and extra is not None:
            raise ValueError("extra gradients join a whole group's D2H, not a part's")
        out = torch.zeros((), dtype=torch.float32) if norm else None

        def accumulate() -> None:
            touched = pending.touched_ids() | (extra[1] if extra is not None else frozenset())
            landed = (g.grad if pending.direct else s.grad_host)[:n]
            if extra is not None:
                pending.clear_uncopied(landed, lo, hi)
                self._join_extra(landed, extra[0])
            if pending.direct:  # Note: [direct landing]: the range holds the gradient already
                self._adopt_landed(g, self._range(layer, pending.part)[2], touched)
            else:
                self.accumulate_host(layer, landed, touched)  # a part's touched holds only its parameters
            if out is not None:
                norms = self.grad_norms(layer)
                out.copy_(sq_sum(norms.values()))
                if param_norms is not None:
                    param_norms.clear()
                    param_norms.update(norms)

        top = hi if pending.end is None else min(hi, pending.end)  # the bytes the copy moved
        bottom = lo if pending.start is None else max(lo, pending.start)
        nbytes = (g.grad[bottom:top].nbytes if pending.direct
                  else 2 * s.grad_host[bottom:top].nbytes + 3 * g.grad[bottom:top].nbytes)
        s.accumulated = g.accumulating = self.engine.host(accumulate, after=[pending.handle], tag=f"accum:{index}",
                                                          nbytes=nbytes)
        # the hook sees the step's last accumulation with or without norms (None: not taken this step,
        # Executor.take_norms; several processes always take them)
        if (norm if final is None else final) and self._on_final_grads is not None:
            self._on_final_grads(self, layer, s.accumulated, param_norms, out)
        if wait:
            s.accumulated.wait()
        return out

    def _join_extra(self, landed: torch.Tensor, extra: torch.Tensor) -> None:
        """``landed += extra`` (an ad-hoc pass's gradients of the same weights) in the compute dtype,
        as autograd sums every use of a leaf; a widened ``landed`` holds compute-dtype values exactly."""
        extra = extra[: landed.numel()]  # a direct landing's host gradient ends with what trains: zeros beyond
        if landed.dtype == self.compute_dtype and extra.dtype == self.compute_dtype:
            landed.add_(extra)
            return
        total = landed.to(self.compute_dtype)
        total.add_(extra.to(self.compute_dtype))
        landed.copy_(total)

    def _adopt_landed(self, g: ParamGroup, infos: Iterable, touched: frozenset | set) -> None:
        """After a direct landing (Note: [direct landing]): the parameters the gradient reached get
        their views of the host gradient as ``.grad``; the others' ranges go back to zero."""
        with torch.no_grad():
            receiving = []
            for info in infos:
                if not self._has_host_grad(g, info):
                    continue  # frozen: beyond the host gradient (Note: [host gradients for what trains])
                view = self._host_view(g.grad, info)
                if id(info) in touched:
                    with self._outside_lock:  # Note: [a master used outside its block]
                        cur = self._take_outside(info, view) if g.gid != REST else None
                        if cur is not None:
                            view.add_(cur)
                        self._set_grad(g, info, view)
                    receiving.append(info)
                else:
                    view.zero_()
            self.post_hooks.landed((id(i), i.param) for i in receiving)

    def grad_norms(self, layer: int) -> dict[nn.Parameter, torch.Tensor]:
        """Each of the group's parameters that has a ``.grad``, with that gradient's L2 norm exactly
        as ``clip_grad_norm_`` computes it per tensor (``torch._foreach_norm``, the grad's dtype).
        Reads the host grads as they are now (call on the host lane or after ``wait_host``)."""
        g = self._group(layer)
        params = [info.param for info in g.params if info.param.grad is not None]
        if not params:
            return {}
        with torch.no_grad():  # torch._foreach_norm's, bit for bit, over the host threads (engine/host_ops.py)
            return dict(zip(params, self._ops.norms([p.grad for p in params])))

    def flat_host_grads(self, layer: int, *, wait: bool = True
                        ) -> tuple[torch.Tensor, list[tuple[nn.Parameter, torch.Tensor]]]:
        """The group's flat host grad holding every parameter's current ``.grad`` (one set elsewhere
        is copied in; zero where a parameter has none), and each parameter with its view in it.
        For whole-group operations such as a gradient all-reduce; after the host lane is done with
        the group (``wait``: with every group; without, the caller waited for the group's own work)."""
        g = self._group(layer)
        if wait:
            self.wait_host()
        self.renew_aliased_host_grads(layer)  # Note: [a kept gradient]
        with_grad = [i for i in g.params if i.param.grad is not None]
        self._fit_host_grads(g, with_grad)  # one set on a frozen weight too (Note: [host gradients for what trains])
        with torch.no_grad():
            self._ensure_host_grads(g, {id(i) for i in with_grad})
        infos = [i for i in g.params if self._has_host_grad(g, i)]
        views = [(i.param, self._host_view(g.grad, i)) for i in infos]
        for info, (_, view) in zip(infos, views):  # the caller may make them .grad (core/grad_sync.py)
            self._handed.record(id(info), view)  # Note: [a kept gradient]
        return g.grad, views

    def wait_host(self) -> None:
        """Wait for the host lane's work on every slot (casts, gradient accumulation)."""
        for s in self._slots:
            if s.accumulated is not None:
                s.accumulated.wait()

    def accumulate_host(self, layer: int, grads: torch.Tensor, touched: frozenset | set) -> None:
        """Add a group's flat gradients (host) into the host ``.grad`` of the parameters ``touched``."""
        g = self._group(layer)
        with torch.no_grad():
            self._ensure_host_grads(g, touched)
            receiving = [i for i in g.params if id(i) in touched]
            self.post_hooks.landed((id(i), i.param) for i in receiving)
            if len(receiving) == len(g.params):
                self._add(g.grad, grads[: g.grad.numel()])
            else:  # only parameters a gradient reached (and that still want one) accumulate
                for info in receiving:
                    self._add(self._host_view(g.grad, info), self._host_view(grads, info))

    def _add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst += src`` over the host threads (engine/host_ops.py): a 16-bit ``src`` into an fp32
        ``dst`` is widened piece by piece into a per-thread fp32 scratch first, the same sums bit for
        bit (widening is exact), without the slow mixed-dtype kernel."""
        self._ops.add_into(dst, src)

    def zero_grad(self) -> None:
        self.wait_host()
        for g in self._groups.values():
            g.grad.zero_()
            self._ensure_host_grads(g)


def sq_sum(norms: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of 0-d norms, in fp32 (0 for none)."""
    parts = [n.float() for n in norms]
    return torch.stack(parts).square().sum() if parts else torch.zeros((), dtype=torch.float32)
