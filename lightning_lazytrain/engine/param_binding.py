"""Binding of ``ParamStore`` (a mixin of it, param_store.py: it reads the store's groups and slots): ``bind``
puts a staged group's compute copy into the modules that own its parameters for a while, as fresh leaf
``nn.Parameter`` views of the slot's device buffer whose ``.grad`` are views of the slot's device gradient
buffer; ``release`` marks a slot's last compute user (Note: [slot reuse] in param_store.py);
``masters_in_modules`` puts the host masters back for a while (Note: [a state dict mid-bind]).

Why swap ``_parameters`` entries rather than ``param.data`` or functional_call?
    * Swapping ``param.data`` would alias master and compute copy: autograd
      would write compute-dtype device grads into the master's ``.grad``
      (which must stay host fp32), and the master could not be updated while
      a block is bound.
    * ``torch.func.functional_call`` does the same swap internally, but only
      around one call; a context manager also works when the executor drives
      the whole model's forward or uses hooks.
    The wrappers' ``.grad`` are pre-set to views of a flat device grad buffer,
    so autograd accumulates in place into it (AccumulateGrad does ``grad +=``
    when a grad exists) and one D2H moves a block's grads. Tied parameters
    get one wrapper installed at every site, so their grads are summed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_lazytrain.engine.bound_edits import EditWatch
from lightning_lazytrain.engine.eval_grads import refuse_accumulation
from lightning_lazytrain.engine.grad_writeback import REST
from lightning_lazytrain.engine.user_grad_hooks import PostAccumulateHooks, forward_tensor_hooks, run_tensor_hooks

if TYPE_CHECKING:
    from lightning_lazytrain.engine.copy_engine import CopyEngine
    from lightning_lazytrain.engine.param_groups import Slot

__all__ = ["ParamBinding"]


class ParamBinding:
    """The binds of ``ParamStore`` (see the module doc); the attributes are the store's."""

    engine: CopyEngine
    _slots: list[Slot]
    post_hooks: PostAccumulateHooks
    arrival_watch: Callable[[nn.Parameter], None] | None
    shared_ids: set[int]
    arrivals: int = 0  # gradients autograd accumulated into bound copies (Note: [a backward that reaches nothing])

    # ---- binding (Note: [slot reuse]) -------------------------------------------------
    def release(self, layer: int, slot: int | None = None) -> None:
        """Mark the compute queued so far as the last user of the slot (Note: [slot reuse])."""
        self._slot(layer, slot).free = self.engine.record_compute()

    @contextlib.contextmanager
    def bind(self, layer: int, slot: int | None = None, *, grads: bool | None = None,
             follow_requires_grad: bool = False, watch_edits: bool = False) -> Iterator[None]:
        """Run the group's modules on the staged compute copy.

        ``grads`` (default: grad mode at entry) makes the compute copy require
        grad and zeroes the slot's device grads; grads accumulate there until
        ``write_back_grads``. ``follow_requires_grad``: for a long bind (the
        non-block weights, bound for a whole micro-batch), each module call
        re-reads its masters' ``requires_grad`` (``toggle_optimizer`` changes it
        after the bind). ``watch_edits``: user code's in-place edits of the copies reach the masters at
        ``sync_edits`` (Note: [an edit of a bound copy] in bound_edits.py).

        Note: [one version counter per copy]
            The non-block copies are views of one flat buffer, and views share their base's version counter:
            an in-place edit of one (under ``no_grad``) made autograd refuse the backward through every other
            copy a forward saved ("modified by an inplace operation" on the head's weight for an edit of an
            unused critic's: review 19), where ``auto`` refuses only a saved one that changed. Each non-block
            copy gets a counter of its own (a wrapper over ``.data``). Block copies keep the shared one.
        """
        g, s = self._group(layer), self._slot(layer, slot)
        if s.gid != layer or s.ready is None:
            where = "its buffer" if layer == REST else f"slot {slot}"
            raise RuntimeError(f"layer {layer} is not staged in {where}; call stage() first")
        if s.bound:
            raise RuntimeError(f"slot {slot} is already bound")
        want_grads = torch.is_grad_enabled() if grads is None else grads
        s.ready.sync_current_stream()
        if want_grads:
            if s.sending is not None:  # Note: [grad write-back ordering]: zeroing waits for the last D2H
                s.sending.sync_current_stream()
            self._ensure_grad_buffers(s)[: g.numel].zero_()
        s.wrappers = []
        s.touched = set()
        follow: dict[int, tuple[nn.Module, list]] = {}
        for info in g.params:
            requires = want_grads and info.param.requires_grad
            view = self._view(s.weights, info)
            # Note: [one version counter per copy]
            w = nn.Parameter(view.data if layer == REST else view, requires_grad=requires)
            if requires or (want_grads and follow_requires_grad and w.is_floating_point()):
                w.requires_grad_(True)
                w.grad = self._view(s.grads, info)  # autograd accumulates in place here
                # A parameter no gradient reaches keeps .grad None on the host, as under plain
                # autograd (optimizers skip such parameters; zeros would decay them).
                w.register_post_accumulate_grad_hook(functools.partial(self._arrived, s, id(info), info.param))
                # the master's register_hook hooks run on the wrapper autograd accumulates into
                # (Note: [gradient hooks on streamed parameters]); a long bind also sees later ones
                if layer != REST or id(info.param) not in self.shared_ids:  # (shared: run_shared_tensor_hooks)
                    forward_tensor_hooks(info.param, w, always=follow_requires_grad)
                w.requires_grad_(requires)
                if follow_requires_grad:
                    for m, _ in info.sites:
                        follow.setdefault(id(m), (m, []))[1].append((info.param, w))
            if layer == REST and not want_grads and info.param.requires_grad and w.is_floating_point():
                # Note: [weights in evaluation] (eval_grads.py): requires grad as its master; no backward lands here
                w.requires_grad_(True)
                w.register_post_accumulate_grad_hook(refuse_accumulation(info.name))
            s.wrappers.append((info, w))
            for m, name in info.sites:
                if m._parameters.get(name) is not info.param:
                    _refuse_changed_site(m, name, info.param)
                # Same mechanism as torch.func.functional_call; bypasses
                # registration hooks that would fire per layer per step.
                m._parameters[name] = w
        followers = [_Follower(pairs) for _, pairs in follow.values()]
        handles = [m.register_forward_pre_hook(f) for (m, _), f in zip(follow.values(), followers)]
        s.bound = True
        s.edits = EditWatch(s.wrappers) if watch_edits else None
        try:
            yield
        finally:
            s.edits = None
            for h in handles:
                h.remove()
            for f in followers:  # set through the module after its last call: the master follows too
                f()
            for info, _ in s.wrappers:
                for m, name in info.sites:
                    m._parameters[name] = info.param
            s.bound = False
            s.free = self.engine.record_compute()

    def is_bound(self, layer: int, slot: int | None = None) -> bool:
        """Is group ``layer``'s slot bound into the modules now (REST: between a step's micro-batches too)?"""
        return self._slot(layer, slot).bound and self._slot(layer, slot).gid == layer

    @contextlib.contextmanager
    def masters_in_modules(self) -> Iterator[None]:
        """For a while, the host masters in the modules where a bind put compute copies.

        Note: [a state dict mid-bind]
            The non-block group is bound into the modules for a whole training micro-batch, through
            evaluation, and between an accumulated step's micro-batches; a checkpoint written then
            (ModelCheckpoint at validation end, ``trainer.save_checkpoint`` in ``training_step``) reads the
            modules' ``state_dict()``, which must hold the masters -- fp32 with ``fp32_masters``, on the
            host -- not the bound 16-bit device copies. The strategies read it inside this."""
        self.sync_edits()  # Note: [an edit of a bound copy]
        swapped = []
        for s in self._slots:
            if s.bound:
                for info, w in s.wrappers:
                    for m, name in info.sites:
                        if m._parameters.get(name) is w:
                            m._parameters[name] = info.param
                            swapped.append((m, name, w))
        try:
            yield
        finally:
            for m, name, w in swapped:
                m._parameters[name] = w

    def run_shared_tensor_hooks(self) -> int:
        """The tensor pre-hooks of the weights several blocks use, once, on the gradient this backward summed
        over every use (Note: [gradient hooks on streamed parameters] in user_grad_hooks.py); how many ran."""
        if not self.shared_ids or not self._slots:
            return 0
        s = self._slot(REST, None)
        ran = 0
        with torch.no_grad():
            for info, w in s.wrappers:
                if (id(info.param) not in self.shared_ids or id(info) not in s.touched or w.grad is None
                        or not info.param._backward_hooks):
                    continue
                grad = w.grad.clone()
                out = run_tensor_hooks(info.param, grad)
                w.grad.copy_(grad if out is None else out)
                ran += 1
        return ran

    def refresh_bound(self, params: Iterable[nn.Parameter]) -> int:
        """Note: [a step inside a micro-batch] (core/microbatches.py): the bound non-block copies of these
        masters take the masters' values again (an optimizer stepped them after the copies were staged); how
        many. In place: each copy's own version counter moves (Note: [one version counter per copy]), so a
        backward through a forward that saved a stepped one is refused as under ``auto``, and one that saved
        another still runs. A collective in a sharded store (every rank steps the same optimizer)."""
        s = self._bound_rest()
        if s is None:
            return 0
        want = {id(p) for p in params}
        n = 0
        with torch.no_grad():
            for info, w in s.wrappers:
                if id(info.param) in want:
                    w.copy_(self._master_value(info))  # its own counter moves, as the stepped parameter's does
                    n += 1
        if n and s.edits is not None:
            s.edits.reset()
        return n

    def sync_edits(self) -> int:
        """Note: [an edit of a bound copy] (bound_edits.py): the bound non-block copies user code edited in place
        since they were bound, refreshed or last synced go into their masters; how many."""
        s = self._bound_rest()
        if s is None or s.edits is None:
            return 0
        edited = s.edits.changed()
        with torch.no_grad():
            for info, w in edited:
                self._take_edit(info, w.detach().to(info.param.device))
        if edited:
            s.edits.reset()
        return len(edited)

    def _bound_rest(self) -> Slot | None:
        """The non-block group's slot while it is bound into the modules (None: not bound, or no slots yet)."""
        if not self._slots:
            return None
        s = self._slot(REST, None)
        return s if s.bound and s.gid == REST else None

    def _master_value(self, info: Any) -> torch.Tensor:
        """A parameter's whole master value (a sharded store gathers it: engine/shard_store.py)."""
        return info.param.detach()

    def _take_edit(self, info: Any, value: torch.Tensor) -> None:
        """The master takes an edited copy's ``value`` where it differs from the master in the copy's dtype (a
        sharded store: this rank's rows)."""
        merge_edit(info.param.data, value)

    def _arrived(self, s: Slot, key: int, master: nn.Parameter, _wrapper: torch.Tensor) -> None:
        self.arrivals += 1
        s.touched.add(key)
        self.post_hooks.arrived(key, master)
        if self.arrival_watch is not None and s.gid == REST:
            self.arrival_watch(master)


def merge_edit(master: torch.Tensor, value: torch.Tensor) -> None:
    """``master`` takes ``value`` (an edited copy, maybe of a narrower dtype) where the two differ in ``value``'s
    dtype; elsewhere it keeps its own bits (Note: [an edit of a bound copy])."""
    cast = master.to(value.dtype)
    same = (cast == value) | (cast.isnan() & value.isnan())
    master.copy_(torch.where(same, master, value.to(master.dtype)))


def _refuse_changed_site(m: nn.Module, name: str, master: nn.Parameter) -> None:
    """Note: [parameters changed after the layout] The store laid the model's parameters out when the fit began;
    a parameter since removed or renamed on its module (``torch.nn.utils.prune`` / Lightning's ``ModelPruning``
    re-register ``weight`` as ``weight_orig`` and compute ``weight`` in a forward pre-hook) would be bound
    under its old name, and the module's own code then fails (or trains something else)."""
    now = next((n for n, p in m._parameters.items() if p is master), None)
    where = f"{type(m).__name__}.{name}"
    moved = f" (it is {type(m).__name__}.{now} now)" if now else " (it is gone)"
    raise RuntimeError(
        f"strategy='lazytrain': the parameter {where} changed after the strategy laid the model's parameters out"
        f"{moved}; pruning re-parametrizes weights this way (torch.nn.utils.prune, ModelPruning). The streamed "
        "layout cannot follow a parameter renamed mid-run: prune before fit (and make it permanent with "
        "prune.remove), or train with strategy='auto'")


class _Follower:
    """A long bind's ``requires_grad``, both ways (``bind(follow_requires_grad=True)``), as a forward pre-hook
    of each module holding the pairs' compute copies and once more when the bind ends: set on a master
    (Lightning's ``toggle_optimizer``), the compute copy follows; set on the compute copy (user code that
    reaches the weight through the module during the step, where the module holds the copy), the master
    follows, as under plain autograd, where the module's parameter is the master."""

    def __init__(self, pairs: list) -> None:
        self.pairs = pairs
        self._last = {id(w): w.requires_grad for _, w in pairs}

    def __call__(self, module: nn.Module | None = None, args: Any = None) -> None:
        for master, w in self.pairs:
            if w.requires_grad != self._last[id(w)]:  # set through the module: the master follows
                master.requires_grad_(w.requires_grad)
            elif w.requires_grad != master.requires_grad:  # set on the master: the compute copy follows
                w.requires_grad_(master.requires_grad)
            self._last[id(w)] = w.requires_grad
