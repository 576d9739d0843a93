"""HybridAdamW's updates during the backward (``updates_in_backward=True``): a mixin of the optimizer.

Note: [updates in backward]
    The backward completes the blocks' gradients last block first. With ``updates_in_backward``, the
    training core hands each block's layer to ``update_in_backward`` once its gradient is complete on
    the host (the step's last accumulation), and a worker updates it while the backward goes on (the
    same per-layer arithmetic as the serial ``step``: bit for bit its result). The optimizer step then
    queues the layers not updated yet (``step_pipelined``'s order, or ``step``), each with the gradient
    it has at that moment (as the serial step reads them when it starts: a ``zero_grad`` that runs
    while they wait, Lightning's before validation, changes nothing), and checks that nothing changed
    after the backward (``seal_backward``, or else each update's own reading) what an early update
    used: a gradient edited or replaced, or a hyperparameter (lr, betas, eps, weight decay) set
    between the backward and the step. A change raises (an early update cannot be taken back).
    After ``seal_backward`` the step does not wait for the updates handed over: it reads the gradients
    of those not started yet itself (the worker and the step read each layer's once, under one lock),
    and the layers still waiting take their places in the step's order (Note: [most urgent first] in
    pipeline.py): the next forward's first layers are not queued behind the whole backward's.
    Nothing global may decide the step, so no clip and no non-finite skip (the constructor refuses
    both).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .pipeline import LayerPipeline

logger = logging.getLogger("lightning_lazytrain.optim")

__all__ = ["BackwardUpdates"]


@dataclass(kw_only=True, slots=True)
class _EagerStep:
    """A step started in the backward: its open-ended pipeline, its plan, per parameter updated so far
    the gradient it used and that tensor's version then, ``seal_backward``'s record, and the layers
    whose gradients were read into the plan (by the worker, or by the optimizer step), under ``lock``."""

    pipe: LayerPipeline
    plan: Any  # hybrid_adamw._StepPlan
    used: list[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    sealed: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None
    read: set = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)


class BackwardUpdates:
    """``HybridAdamW``'s methods for a step begun in the backward (Note: [updates in backward]). The
    optimizer provides ``updates_in_backward``, ``max_grad_norm``, ``last_grad_norm``, its layer groups,
    ``_hyper()``, ``_backward_plan()``, ``_update_layer``, ``_clear_layer_grads``, ``_resolve_pending`` and
    ``_wait_inflight`` (which calls ``_abandon_eager``)."""

    _eager: _EagerStep | None = None
    # Note: [most urgent first] (pipeline.py); False: the layers handed over first (the bench's comparison)
    _most_urgent_first: bool = True
    # over the run: layers handed over in a backward whose update had not started when its step came
    backward_updates_left_at_step: int = 0

    def update_in_backward(self, layer: Hashable, after: Callable[[], None] | None = None) -> None:
        """Update ``layer`` now, during the backward: its gradients are complete once ``after()``
        returns (the worker calls it first). The step's first call starts the step (hyperparameters
        as they are now); the optimizer step queues the other layers."""
        if not self.updates_in_backward:
            raise RuntimeError("update_in_backward() needs HybridAdamW(updates_in_backward=True)")
        if self._eager is None:
            self._begin_eager()
        assert self._eager is not None
        self._eager.pipe.submit(layer, after)

    def seal_backward(self) -> None:
        """The backward has ended: every gradient is in place. From now on a change to the gradients of
        the layers handed over so far is an edit (checked at the step) -- for gradients that share a
        version counter with buffers written later in the backward (views of one flat buffer), where
        the versions seen by the updates themselves would not tell."""
        if self._eager is not None:
            self._eager.sealed = [(p, p.grad, p.grad._version) for p in self._layer_params(self._eager.pipe.submitted)
                                  if p.grad is not None]

    def wait_backward_updates(self) -> None:
        """Wait for the layers handed to :meth:`update_in_backward` so far (the step stays open)."""
        if self._eager is not None:
            self._eager.pipe.wait_submitted()

    @property
    def updating_in_backward(self) -> bool:
        """Has a step begun in the backward that its optimizer step has not finished yet?"""
        return self._eager is not None

    @property
    def layers_updated_in_backward(self) -> tuple[Hashable, ...]:
        """The layers handed over in the open step so far (empty: none open)."""
        return self._eager.pipe.submitted if self._eager is not None else ()

    def abandon_step(self) -> None:
        """Give up a step begun in the backward that will not reach its optimizer step (an error in the
        backward, teardown): the layers updated so far stay updated, the others are not (logged); then
        wait for any pipelined step in flight. Nothing to give up: as ``wait_step``."""
        self._wait_inflight()

    def _refuse_open(self, what: str) -> None:
        """``what`` (``zero_grad``, ``state_dict``, ``load_state_dict``, ``wait_step``) between a backward
        whose updates began and its optimizer step raises: it would give the open step up, and the
        optimizer step after it would update the layers already updated in the backward a second time."""
        if self._eager is not None:
            raise RuntimeError(f"{what} between a backward whose updates began (HybridAdamW(updates_in_backward="
                               "True)) and its optimizer step: step first (or abandon_step() to give the step up)")

    def _layer_params(self, layers) -> list[torch.Tensor]:
        return [p for layer in layers for gi in self._layer_groups[layer] for p in self.param_groups[gi]["params"]]

    def _begin_eager(self) -> None:
        self._wait_inflight()
        self._resolve_pending()
        if self._clip_now() is not None:
            raise RuntimeError(
                f"HybridAdamW(updates_in_backward=True) cannot clip (max_grad_norm={self._clip_now()}, e.g. "
                "from the Trainer's gradient_clip_val): a clip needs every gradient before any update")
        self.last_grad_norm = math.nan
        cuda_devices = sorted({p.device for p in self._bits if p.device.type == "cuda"}, key=str)

        def update(layer: Hashable) -> None:
            with e.lock:
                if layer not in e.read:  # a layer handed over in the backward: its gradients as they are now
                    e.read.add(layer)
                    for p in self._layer_params([layer]):
                        if p.grad is not None:
                            e.plan.grads[id(p)] = p.grad
                            e.used.append((p, p.grad, p.grad._version))
            self._update_layer(layer, e.plan)

        pipe = LayerPipeline(list(self._layer_groups), update, self._clear_layer_grads, cuda_devices=cuda_devices,
                             open_ended=True)
        e = _EagerStep(pipe=pipe, plan=self._backward_plan())
        self._eager = e
        pipe.start()

    def _finish_eager(self, order: Sequence[Hashable]) -> LayerPipeline:
        """Queue the layers not updated in the backward, in ``order``, with their gradients as they are
        now, after checking that nothing the early updates used changed since."""
        e, self._eager = self._eager, None
        assert e is not None
        if e.sealed is None:  # unsealed: the check below reads what the early updates used
            e.pipe.wait_submitted()
        changed = [self._names.get(p, "?") for p, grad, version in (e.used if e.sealed is None else e.sealed)
                   if p.grad is not grad or grad._version != version]
        hyper = self._hyper() != e.plan.hyper
        if changed or hyper or self._clip_now() is not None:
            e.pipe.abort()
            e.pipe.wait_all()
            what = (f"the gradients of {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} were edited or "
                    "replaced" if changed else "a hyperparameter (lr, betas, eps, weight_decay) was changed"
                    if hyper else f"a clip was set (max_grad_norm={self._clip_now()})")
            raise RuntimeError(
                f"HybridAdamW(updates_in_backward=True): layers {list(e.pipe.submitted)} were updated during the "
                f"backward, but between the backward and the optimizer step {what}; the step cannot equal a serial "
                "one. Change gradients and hyperparameters before the backward (or in tensor hooks), or use "
                "updates_in_backward=False.")
        with e.lock:  # read here, on the caller's thread, as the serial step does: what no update read yet
            unread = [layer for layer in order if layer not in e.read]
            for p in self._layer_params(unread):
                if p.grad is not None:
                    e.plan.grads[id(p)] = p.grad
            e.read.update(unread)
            e.used, e.sealed = [], None  # checked: no gradient is kept past its use (engine/kept_grads.py)
        e.pipe.close(order, reorder=self._most_urgent_first)
        self.backward_updates_left_at_step += e.pipe.waiting_at_close
        return e.pipe

    def _abandon_eager(self) -> None:
        """A step begun in the backward that never reached its optimizer step (an error in the backward,
        teardown): no further layer is updated; said in the log."""
        e, self._eager = self._eager, None
        if e is not None:
            left = e.pipe.abort()
            e.pipe.wait_all()
            logger.warning("HybridAdamW: a step begun in the backward was abandoned before its optimizer step; "
                           "layers %s were updated, %s were not", [x for x in e.pipe.submitted if x not in left], left)
