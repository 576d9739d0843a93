"""HybridAdamW: AdamW with per-parameter 8-bit or 32-bit states, fused clipping, pipelined step.

* State bits per parameter come from :func:`assign_state_bits` (pure, logged, byte-accounted).
* 8-bit states: bitsandbytes' blockwise kernel (CPU or CUDA) on the gradient clipped in place.
* 32-bit states: torch's fused AdamW kernel (default) or foreach math, clip factor fused in.
* Global gradient norm: each parameter's norm handed over by the executor (:meth:`set_grad_norms`:
  then norm, factor and clipped update are bit for bit ``clip_grad_norm_`` + AdamW, see Note:
  [exact clip] in clip.py), per-layer squared norms (:meth:`add_layer_sq_norm`,
  :meth:`set_grad_sq_norms`: equal up to rounding), or one ``_foreach_norm`` pass. Non-finite
  norm -> the step is skipped, nothing changes (not even the step counters), ``skipped_steps`` is
  incremented.
* :meth:`step_pipelined` runs the same per-layer updates on a worker thread (see pipeline.py).
* ``updates_in_backward=True``: :meth:`update_in_backward` starts a layer's update as soon as its
  gradient is complete, during the backward (backward_updates.py, Note: [updates in backward]).

Layers: each param group has a ``"layer"`` key (default: the group's index). The serial step
updates layer by layer in group order; the pipelined step in the order the caller gives. All
state initialisation happens in the constructor (state_bits.py), so :meth:`state_bytes` reports
the real figure before the first step and the worker never allocates states.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from .adamw32 import Impl32, adamw32_update
from .assign import DEFAULT_MIN_8BIT_NUMEL, EightBitPolicy
from .bnb8bit import adamw_8bit_update, validate_block_size
from .checkpoint import load_param_state, saved_bits
from .clip import (
    ClipDecision,
    SqNormInbox,
    decide_clip,
    scale_grads_,
)
from .backward_updates import BackwardUpdates
from .grad_norms import GradNorms
from .pipeline import LayerPipeline
from .state_bits import StateBits
from .torch_contract import (
    has_step_hooks,
    names_differ,
    refuse_unsupported,
    run_load_post_hooks,
    run_load_pre_hooks,
    step_hooks,
)

logger = logging.getLogger("lightning_lazytrain.optim")


@dataclass(kw_only=True, slots=True, frozen=True)
class _GroupHyper:
    """A group's hyper-parameters, snapshot at step start (a scheduler may change the group
    while a pipelined step is still running)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


@dataclass(kw_only=True, slots=True)
class _StepPlan:
    clip: ClipDecision
    hyper: list[_GroupHyper]
    # Every parameter's .grad, read on the calling thread when the step starts: a pipelined step's
    # worker must not see a zero_grad(set_to_none=True) that runs meanwhile (Lightning's, before
    # validation), which would silently skip the layers it had not reached.
    grads: dict[int, torch.Tensor]


class HybridAdamW(StateBits, BackwardUpdates, GradNorms, Optimizer):
    """AdamW (decoupled weight decay, torch semantics) with hybrid 8/32-bit states.

    Args:
        params: tensors, ``(name, tensor)`` pairs (``model.named_parameters()``), or param group
            dicts (``"params"`` of either kind, optional ``"layer"``, per-group lr etc.). Names feed
            the 8-bit policy; unnamed parameters are called ``"g<group>.p<index>"``.
        eight_bit: "none" | "all" | fraction in (0, 1] | predicate ``(name, shape) -> bool``, or
            "plan": the states are allocated once the plan has chosen the smallest 8-bit slice that
            fits host memory (``LazyTrainStrategy`` calls :meth:`set_state_bits` before the first
            step); without a plan, 32-bit states at the first step (logged). Note: [planned 8-bit slice].
        block_size: must be 256 (bitsandbytes' fixed block; anything else raises).
        max_grad_norm: clip the global L2 gradient norm to this (None: no clipping).
        min_8bit_numel: tensors smaller than this keep 32-bit states.
        impl: 32-bit path, "fused" (torch's fused AdamW kernel) or "foreach".
        skip_nonfinite: compute the norm even without clipping, to skip non-finite steps.
        updates_in_backward: a layer may be updated as soon as its gradient is complete, during the
            backward (:meth:`update_in_backward`; Note: [updates in backward]). Nothing global may then
            decide the step: requires ``max_grad_norm=None`` and ``skip_nonfinite=False`` (torch's
            AdamW neither clips nor skips either).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        eight_bit: EightBitPolicy = "none",
        block_size: int = 256,
        max_grad_norm: float | None = None,
        min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
        impl: Impl32 = "fused",
        skip_nonfinite: bool = True,
        updates_in_backward: bool = False,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid lr/eps/weight_decay: {lr}, {eps}, {weight_decay}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas: {betas}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if impl not in ("fused", "foreach"):
            raise ValueError(f"impl must be 'fused' or 'foreach', got {impl!r}")
        if updates_in_backward and (max_grad_norm is not None or skip_nonfinite):
            raise ValueError(
                "HybridAdamW(updates_in_backward=True) updates a layer before the other layers' gradients "
                "exist, so no global norm can clip or skip the step: pass max_grad_norm=None and "
                "skip_nonfinite=False with it, or leave updates_in_backward=False"
                f" (got max_grad_norm={max_grad_norm}, skip_nonfinite={skip_nonfinite})")
        validate_block_size(block_size)
        # Set before Optimizer.__init__, which calls our add_param_group for each group.
        self.eight_bit = eight_bit
        self.block_size = block_size
        self.max_grad_norm = max_grad_norm
        self._step_clip: float | None = None  # clip_next_step's: the next step's only
        self.last_clip: float | None = None
        self.min_8bit_numel = min_8bit_numel
        self.impl: Impl32 = impl
        self.skip_nonfinite = skip_nonfinite
        self.updates_in_backward = updates_in_backward
        self.skipped_steps = 0
        self.last_grad_norm = math.nan
        self._ready = False
        self._names: dict[torch.Tensor, str] = {}
        self._name_set: set[str] = set()
        self._bits: dict[torch.Tensor, int] = {}
        self._qmaps: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layer_groups: dict[Hashable, list[int]] = {}
        self._inbox = SqNormInbox()
        # handed-over norms, each with the gradient it was taken from and that tensor's version then
        self._grad_norms: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor, int]] | None = None
        self._recompute_norms: Callable[[list[torch.Tensor]], Mapping[torch.Tensor, torch.Tensor]] | None = None
        # at the last step: handed-over norms used, and parameters whose norm was taken at the step
        # because none was handed over or its gradient had changed since (Note: [stale norms])
        self.handed_norms_used = 0
        self.stale_norms = 0
        self._inflight: LayerPipeline | None = None
        self._eager = None  # a step whose updates started in the backward (backward_updates.py)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self._ready = True
        self._assign_and_init([p for g in self.param_groups for p in g["params"]])

    # ------------------------------------------- groups (their states' bits and bytes: state_bits.py)
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        refuse_unsupported(param_group, f"param group {len(self.param_groups)}")  # torch_contract.py
        if self._ready:  # a step in flight reads the groups as they were when it began
            self._refuse_open("add_param_group()")
            self._wait_inflight()
        param_group.setdefault("layer", len(self.param_groups))
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        gi = len(self.param_groups) - 1
        names = group.get("param_names") or [f"g{gi}.p{i}" for i in range(len(group["params"]))]
        for name, p in zip(names, group["params"]):
            if name in self._name_set:
                raise ValueError(f"duplicate parameter name {name!r}")
            self._name_set.add(name)
            self._names[p] = name
        self._layer_groups.setdefault(group["layer"], []).append(gi)
        if self._ready:  # groups added after construction get assigned on their own
            self._assign_and_init(group["params"])

    @property
    def layers(self) -> list[Hashable]:
        """Layer ids in param-group order (the serial step's order)."""
        return list(self._layer_groups)

    # ------------------------------------------------------------------------------ stepping
    def _prepare(self) -> _StepPlan:
        self._resolve_pending()
        clip, asked, self._step_clip = self._clip_now(), self._step_clip is not None, None
        self.last_clip = clip  # the clip the step applied (its own max_grad_norm, or the one asked for it)
        total = self._global_norm(clip)
        decision = decide_clip(total, clip)
        if not decision.finite and total is not None and (asked or not self.skip_nonfinite):
            # a clip asked for this step, or no skip wanted: the step runs as clip_grad_norm_ then AdamW would
            decision = (self._clipped_nonfinite(total, clip) if clip is not None else
                        ClipDecision(grad_norm=decision.grad_norm, scale=1.0, finite=True, scale_tensor=None))
        self.last_grad_norm = decision.grad_norm
        if decision.skip:
            self.skipped_steps += 1
            logger.warning(
                "HybridAdamW: non-finite gradient norm (%s), step skipped; skipped_steps=%d",
                decision.grad_norm,
                self.skipped_steps,
            )
        grads = {id(p): p.grad for g in self.param_groups for p in g["params"] if p.grad is not None}
        return _StepPlan(clip=decision, hyper=self._hyper(), grads=grads)

    def _hyper(self) -> list[_GroupHyper]:
        return [
            _GroupHyper(
                lr=float(g["lr"]),
                beta1=float(g["betas"][0]),
                beta2=float(g["betas"][1]),
                eps=float(g["eps"]),
                weight_decay=float(g["weight_decay"]),
            )
            for g in self.param_groups
        ]

    def _update_layer(self, layer: Hashable, plan: _StepPlan) -> None:
        coef = plan.clip.scale_tensor
        # A finite global norm proves every gradient element finite: the 8-bit update can skip
        # its non-finite handling (bnb8bit.py). No norm computed (nan): it must check.
        grads_finite = math.isfinite(plan.clip.grad_norm)
        for gi in self._layer_groups[layer]:
            hp = plan.hyper[gi]
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for p in self.param_groups[gi]["params"]:
                grad = plan.grads.get(id(p))
                if grad is None:
                    continue
                state = self.state[p]
                if self._bits[p] == 8:
                    # clipped in place, as clip_grad_norm_ leaves it (bitsandbytes' ``gnorm_scale`` would
                    # scale a copy: the same update, but ``.grad`` read after the step would be unclipped;
                    # one pass beside the 8-bit kernel's many)
                    if coef is not None:
                        scale_grads_([grad], coef)
                    adamw_8bit_update(
                        p, grad, state, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps,
                        weight_decay=hp.weight_decay, gnorm_scale=1.0, grads_finite=grads_finite,
                    )
                else:
                    params.append(p)
                    grads.append(grad)
                    exp_avgs.append(state["exp_avg"])
                    exp_avg_sqs.append(state["exp_avg_sq"])
                    steps.append(state["step"])
            adamw32_update(
                params, grads, exp_avgs, exp_avg_sqs, steps, lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2,
                eps=hp.eps, weight_decay=hp.weight_decay, clip_coef=coef, impl=self.impl,
            )
        # the layer's gradients are the user's again: a pipelined step's plan lives until the next step, and a
        # reference kept here would make the store move those .grad tensors onto copies every step
        # (HandedGrads.release, counted by kept_grads_moved: Note: [a kept gradient] in engine/kept_grads.py)
        for gi in self._layer_groups[layer]:
            for p in self.param_groups[gi]["params"]:
                plan.grads.pop(id(p), None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Serial step: every layer updated, in param-group order, before returning."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._eager is not None:  # Note: [updates in backward]: the rest of a step begun in the backward
            self._inflight = self._finish_eager(list(self._layer_groups))
            self._wait_inflight()
            return loss
        self._wait_inflight()
        plan = self._prepare()
        if not plan.clip.skip:
            for layer in self._layer_groups:
                self._update_layer(layer, plan)
        return loss

    @torch.no_grad()
    def step_pipelined(self, order: Sequence[Hashable] | None = None, *, clipped_grads: bool = False) -> LayerPipeline:
        """Start a step whose per-layer updates run on a worker thread in ``order``.

        The norm / clip / skip decision is made here, before returning. ``order`` must list every
        layer exactly once (default: param-group order). Use ``handle.wait_updated(layer)`` before
        reading a layer's weights. The next ``step``/``state_dict``/... waits for completion;
        ``zero_grad`` is deferred per layer (see pipeline.py). ``clipped_grads``: the gradients hold
        their clipped values when this returns (code reads ``.grad`` after the step: Note: [gradients
        read after a clipped step]); else each layer's are scaled on the worker, before its update.
        """
        order = list(self._layer_groups) if order is None else list(order)
        missing = set(self._layer_groups) - set(order)
        unknown = [layer for layer in order if layer not in self._layer_groups]
        if missing or unknown:
            raise ValueError(f"order must list every layer exactly once: missing {missing}, unknown {unknown}")
        if self._eager is not None:  # Note: [updates in backward]: the rest of a step begun in the backward
            self._inflight = self._finish_eager(order)
            self._opt_called = True  # type: ignore[attr-defined]
            return self._inflight
        self._wait_inflight()
        post_hooks = step_hooks(self)  # the step hooks, as step() runs them (torch_contract.py)
        plan = self._prepare()
        skip = plan.clip.skip
        if clipped_grads and not skip and plan.clip.scale_tensor is not None:
            plan = self._scaled_first(plan)
        cuda_devices = sorted({p.device for p in self._bits if p.device.type == "cuda"}, key=str)
        pipe = LayerPipeline(
            order,
            (lambda layer: None) if skip else (lambda layer: self._update_layer(layer, plan)),
            self._clear_layer_grads,
            cuda_devices=cuda_devices,
            on_waited=post_hooks,
        )
        self._inflight = pipe.start()
        # What LRScheduler's wrapper of step() would record; it cannot see this entry point.
        self._opt_called = True  # type: ignore[attr-defined]
        return pipe

    @staticmethod
    def _scaled_first(plan: _StepPlan) -> _StepPlan:
        """Note: [gradients read after a clipped step]
            Under ``strategy="auto"``, ``clip_grad_norm_`` scales every ``.grad`` in place before the
            step, so code that reads gradients after it (a callback's ``on_train_batch_end`` that
            declares ``reads_gradients_only``: trusted to read no weights, so the pipelined step keeps
            running behind it) sees the clipped ones. A pipelined step scales each layer's gradients on
            its worker just before that layer's update, so such a read could see some layers scaled
            and others not. With ``clipped_grads`` the calling thread scales them all first (the same
            ``grad *= coef``, one pass at memory speed) and the updates run unclipped on the scaled
            gradients -- ``clip_grad_norm_`` then AdamW, as under auto; the updates still overlap the
            next forward."""
        scale_grads_(list(plan.grads.values()), plan.clip.scale_tensor)
        done = ClipDecision(grad_norm=plan.clip.grad_norm, scale=1.0, finite=plan.clip.finite, scale_tensor=None)
        return _StepPlan(clip=done, hyper=plan.hyper, grads=plan.grads)

    # ------------------------------------------------------------- updates in the backward
    def _backward_plan(self) -> _StepPlan:
        """The plan of a step begun in the backward (Note: [updates in backward] in backward_updates.py):
        no norm, no clip, the hyperparameters as they are now; gradients filled in layer by layer."""
        return _StepPlan(clip=decide_clip(None, None), hyper=self._hyper(), grads={})

    def _wait_inflight(self) -> None:
        self._abandon_eager()  # a step begun in the backward that never reached its optimizer step
        pipe, self._inflight = self._inflight, None
        if pipe is not None:
            pipe.wait_all()

    def wait_step(self) -> None:
        """Block until an in-flight pipelined step is complete (re-raising its error, if any). Between a
        backward whose updates began (``updates_in_backward``) and its optimizer step there is no complete
        step to wait for: that raises (``abandon_step`` gives such a step up)."""
        self._refuse_open("wait_step()")
        self._wait_inflight()

    def _clear_layer_grads(self, layer: Hashable, set_to_none: bool) -> None:
        for gi in self._layer_groups[layer]:
            for p in self.param_groups[gi]["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    p.grad.zero_()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._refuse_open("zero_grad()")
        pipe = self._inflight
        if pipe is not None and not pipe.done:
            pipe.request_zero_grad(set_to_none)
            return
        self._wait_inflight()
        super().zero_grad(set_to_none=set_to_none)

    # -------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        self._refuse_open("state_dict()")
        self._wait_inflight()
        return super().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`: 8-bit states, qmaps and block scales exactly as saved.

        Tensors move to their parameter's device (CPU <-> CUDA) keeping their dtype (see
        checkpoint.py). A state saved with other bits than this optimizer assigns is converted (Note: [states
        converted as they load] in checkpoint.py).
        """
        self._refuse_open("load_state_dict()")
        self._wait_inflight()
        state_dict = run_load_pre_hooks(self, state_dict)  # torch_contract.py
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        id_map: dict[Any, torch.Tensor] = {}
        for gi, (group, saved) in enumerate(zip(self.param_groups, saved_groups)):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError("loaded state dict has a parameter group of a different size")
            refuse_unsupported(saved, f"the loaded state dict's param group {gi}")
            differ = names_differ(group.get("param_names"), saved.get("param_names"))
            if differ is not None:  # torch: names do not decide the loading; positions do
                logger.warning("HybridAdamW.load_state_dict: param group %d was saved with other parameter names "
                               "(first: %r here, %r saved); loaded by position, as torch does", gi, *differ)
            id_map.update(zip(saved["params"], group["params"]))
        if self.bits_pending:  # a resume: the states' bits are the checkpoint's
            saved = {id_map[pid]: saved_bits(st) for pid, st in state_dict["state"].items() if pid in id_map}
            self.set_state_bits(lambda name, shape, bits={self._names[p]: b for p, b in saved.items()}:
                                bits.get(name, 32) == 8)
        new_state: dict[torch.Tensor, dict[str, Any]] = {}
        converted: list[str] = []
        for pid, saved_state in state_dict["state"].items():
            if pid not in id_map:
                raise ValueError(f"loaded state refers to unknown parameter id {pid}")
            p = id_map[pid]
            if saved_bits(saved_state) != self._bits[p]:
                converted.append(f"{self._names[p]} ({saved_bits(saved_state)} -> {self._bits[p]} bits)")
            new_state[p] = load_param_state(p, saved_state, bits=self._bits[p], name=self._names[p], qmaps=self._qmaps)
        if converted:  # Note: [states converted as they load] (checkpoint.py)
            logger.warning("HybridAdamW.load_state_dict: %d parameter(s) saved with other state bits than this "
                           "optimizer's eight_bit policy gives them; their moments were converted (one rounding: "
                           "the run is not bit-equal to one that kept its bits): %s", len(converted),
                           ", ".join(converted[:4]) + (" ..." if len(converted) > 4 else ""))
        for p in self._bits:  # parameters without saved state start fresh (torch: no state)
            if p not in new_state:
                new_state[p] = self._fresh_state(p)
        self.state = defaultdict(dict, new_state)
        for group, saved in zip(self.param_groups, saved_groups):
            for key, value in saved.items():
                if key not in ("params", "param_names", "layer"):
                    group[key] = deepcopy(value)
        run_load_post_hooks(self)

    @property
    def has_step_hooks(self) -> bool:
        """Does a step run hooks (``register_step_pre_hook`` / ``_post_hook``, or torch's global ones)? The
        training core then steps serially (torch_contract.py)."""
        return has_step_hooks(self)
