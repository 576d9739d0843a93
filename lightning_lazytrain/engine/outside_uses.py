"""A block master used outside its block (a mixin of ``ParamStore``, through ``GradWriteBack``: grad_writeback.py):
autograd's own gradient of such a use and the host lane's adoption of the slot's gradients meet here, under one
lock, so ``.grad`` is the sum of both uses (Note: [a master used outside its block], on ``_watch_outside_uses``)."""

from __future__ import annotations

import functools
import threading

import torch
from torch import nn

from lightning_lazytrain.engine.param_groups import REST, ParamEntry

__all__ = ["OutsideUses"]


class OutsideUses:
    """The outside-use methods of ``ParamStore`` (which provides the groups, views and ``_set_grad``)."""

    def _watch_outside_uses(self) -> None:
        """Note: [a master used outside its block]
            A block's weights reach its forward as bound copies, so the gradients of that use arrive
            through the slot and are landed or added into the master's host ``.grad`` on the host lane.
            User code may also use the master itself outside the block (a weight penalty on
            ``model.layers[1].lin.weight``): autograd then accumulates into the master's ``.grad`` on
            the training thread, possibly while the host lane sets that ``.grad`` to its view of the
            host gradient -- one of the two would be lost. Each block master carries a post-accumulate
            hook recording such a gradient; the host lane merges one it finds (under a lock), and at
            the end of the micro-batch (after the host lane) ``reconcile_outside_grads`` adds any the
            race left out into the view, so ``.grad`` is the sum of both uses, as under plain autograd
            (the two terms bit for bit; over accumulated micro-batches the sums group differently)."""
        self._outside_lock = threading.Lock()
        # a master was used outside its block: the code that did so reads it directly, so a pipelined step
        # must have updated it when the step returns (TrainingCore: the step then waits, the plan is serial)
        self.outside_uses_seen = False
        self._outside: dict[int, tuple[ParamEntry, torch.Tensor]] = {}
        self._adopted: set[int] = set()  # entries whose .grad the host lane set to their view this micro-batch
        self._outside_handles = []
        for gid, g in self._groups.items():
            if gid == REST:  # bound for the whole step: a use of it goes through its copy
                continue
            for info in g.params:
                if not info.param.requires_grad:  # (torch refuses a hook there; one thawed later goes without)
                    continue
                hook = functools.partial(self._outside_use, info)
                hook._lazytrain_internal = True  # not the user's (user_grad_hooks.user_post_accumulate_hooks)
                self._outside_handles.append(info.param.register_post_accumulate_grad_hook(hook))

    def _outside_use(self, info: ParamEntry, param: nn.Parameter) -> None:
        # The check and the record under one lock: were the host lane to adopt .grad between them (adding it into
        # the view and setting .grad to the view), the record would name a gradient already counted, and
        # reconcile_outside_grads would add it a second time (seen once in CI under load: review 7's cross-layer
        # weight use ended one update off).
        with self._outside_lock:
            grad = param.grad
            view = self._host_view(self._group(self._owner[id(info)]).grad, info)
            if grad is None or grad.data_ptr() == view.data_ptr():
                return  # added into the view in place: counted
            self._outside[id(info)] = (info, grad)
            self.outside_uses_seen = True

    def _take_outside(self, info: ParamEntry, view: torch.Tensor) -> torch.Tensor | None:
        """The host lane is about to set ``info``'s ``.grad`` to ``view``: the gradient autograd put there
        from a use outside the block, if any (no longer pending); call under ``_outside_lock``."""
        self._adopted.add(id(info))
        cur = info.param.grad
        if cur is None or cur.data_ptr() == view.data_ptr():
            return None
        entry = self._outside.get(id(info))
        if entry is not None and entry[1] is cur:
            del self._outside[id(info)]
        return cur

    def reconcile_outside_grads(self) -> None:
        """End of a micro-batch, after the host lane: the outside uses' gradients the race left out join
        the host gradients (Note: [a master used outside its block])."""
        with self._outside_lock:
            pending, self._outside = list(self._outside.values()), {}
            adopted, self._adopted = self._adopted, set()
        with torch.no_grad():
            for info, grad in pending:
                if id(info) not in adopted:
                    continue  # no gradient of the block's use came: autograd's .grad stands alone
                g = self._group(self._owner[id(info)])
                view = self._host_view(g.grad, info)
                view.add_(grad)
                self._set_grad(g, info, view)

    def _remove_outside_watch(self) -> None:
        for h in getattr(self, "_outside_handles", []):
            h.remove()
        self._outside_handles = []
