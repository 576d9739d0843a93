"""The training core's optimizer side: ``HybridAdamW``'s layer-pipelined step (the plan's
``pipelined`` optimizer), the gradient norms handed to its fused clip, and how the non-block weights
are split into parts along its layers.

Note: [pipelined step]
    With a ``HybridAdamW`` whose layers follow the blocks and a plan whose optimizer is
    ``pipelined``, the optimizer step runs the closure (forward, backward, the hooks before the step,
    clipping) as usual and then starts a layer-pipelined update in forward order and returns
    (``PipelinedSteps.start``); the next forward stages block j as soon as block j is updated (the
    executor calls ``wait_updated(j)`` before it casts or fetches a master). Evaluation, checkpoints
    and teardown wait for every update still running (``finish``).

Note: [updates in the backward pass]
    A ``HybridAdamW(updates_in_backward=True)`` (Note: [updates in backward] in optim/backward_updates.py)
    whose fit allows it (``FitSettings.updates_in_backward``: the Trainer's automatic optimization, no
    clip, no loss scaling, no hook that may edit gradients between the backward and the step) and one
    process (the final-grads hook is free), where the plan chose it (``Schedule.updates_in_backward``:
    the MILP prices both ways): in an armed micro-batch (the optimizer step's last, not a
    profiled one) the store's final-grads hook hands each block j >= 1 to the optimizer as its last
    accumulation is queued on the host lane (the update waits for it); block 0 and the non-block
    layers, complete at the backward's end, are queued by the step in the forward's order (the next
    forward needs them first). Before a plan switches the schedule, the updates queued so far finish
    (``drain``): a re-plan does not move masters an update is writing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from lightning_lazytrain.core.weight_reads import ReadGuard, guarded
from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.param_store import REST

log = logging.getLogger("lightning_lazytrain")

__all__ = ["PipelinedSteps", "hand_over_norms", "hybrid_adamws", "norms_wanted", "split_rest_parts"]


def hybrid_adamws(optimizers: list) -> list:
    """The ``HybridAdamW`` optimizers among ``optimizers`` (Lightning's wrappers unwrapped)."""
    from lightning_lazytrain.optim import HybridAdamW

    return [inner for opt in optimizers if isinstance(inner := getattr(opt, "optimizer", opt), HybridAdamW)]


class PipelinedSteps:
    """The pipelined updates of a run (Note: [pipelined step]): per optimizer its layer order, and
    the updates still running."""

    def __init__(self) -> None:
        # id(optimizer) -> (layer order, block -> layer, non-block part -> layers)
        self._plans: dict[int, tuple[list, dict, list]] = {}
        self._pending: list[tuple[Any, dict, list]] = []
        # Note: [updates in the backward pass]: (optimizer, block -> layer) of those that update there
        self._eager: list[tuple[Any, dict]] = []
        self.armed = False  # this micro-batch's final gradients are the step's: hand them over (arm)
        self._handed: set[int] = set()  # the blocks handed over in this micro-batch
        self._hooked: set[int] = set()  # optimizers whose serial steps for their hooks were logged
        self._known: list = []
        self._guard: ReadGuard | None = None  # training_step's, while it runs (Note: [weights read before the forward])
        self.reads_waited = 0  # training_steps that read weights before their forward and waited for the updates

    def configure(self, ex: Executor, optimizers: list, *, in_backward: str | None = None) -> bool:
        """For the executor's (new) schedule: which optimizers step pipelined, in which order; True
        when any does (the executor must then wait for the updates). ``in_backward``: None when the fit
        lets a ``HybridAdamW(updates_in_backward=True)`` update blocks during the backward, else why
        not (logged once per configuration when such an optimizer waits for its step instead)."""
        self._pending = []
        self._plans = {}
        self._signatures: dict[int, tuple] = {}  # id(optimizer) -> its groups' layers when planned
        self._eager = []
        self._ex, self._known, self._in_backward = ex, list(optimizers), in_backward  # (Note: [groups added mid-run])
        ex.on_part_final, ex.early_part_set = None, frozenset()  # Note: [early non-block parts]
        if ex.params is not None and ex.params.final_grads_hook == self._on_final_grads:
            ex.params.set_final_grads_hook(None)
        if ex.params is None or ex.schedule.optimizer != "pipelined":
            return False
        blocks_n = len(ex.stack)
        for inner in hybrid_adamws(optimizers):
            plan = _layer_plan(ex, inner)
            if plan is None:
                continue  # the optimizer's layers do not follow the blocks: keep the serial step
            first, block_layer, rest, part_layers = plan
            # T updates the non-block layers, layer 0, then the schedule's serial layers (the per-layer
            # mode: the executor waits for them before F0); the forward pipelines the others in order
            serial = [j for j in ex.schedule.serial_layers if j < blocks_n]
            blocks_order = [0, *serial] + [j for j in range(1, blocks_n) if j not in serial]
            self._plans[id(inner)] = (first + [block_layer[j] for j in blocks_order] + rest, block_layer, part_layers)
            self._signatures[id(inner)] = _signature(inner)
            if getattr(inner, "updates_in_backward", False) and not inner.has_step_hooks:  # Note: [step hooks]
                self._eager.append((inner, block_layer))
        if self._eager:
            why = in_backward
            if why is None and ex.params.final_grads_hook is not None:
                why = "several processes average each block's gradients first"
            if why is None and not ex.schedule.updates_in_backward:
                log.info("HybridAdamW(updates_in_backward=True): the plan updates at the step, pipelined under "
                         "the next forward (predicted faster for this run than in the backward)")
                self._eager = []
            elif why is None:
                ex.params.set_final_grads_hook(self._on_final_grads)
                ex.on_part_final, ex.early_part_set = self._on_part_final, self._early_parts(ex)
            else:
                log.warning("HybridAdamW(updates_in_backward=True): the updates wait for the optimizer step "
                            "(pipelined under the next forward) because %s", why)
                self._eager = []
        return bool(self._plans)

    def _on_final_grads(self, store: Any, layer: int, accumulated: Any, param_norms: Any, sq_norm: Any) -> None:
        """The store's final-grads hook (Note: [updates in the backward pass])."""
        if not self.armed or layer < 1:
            return
        self._handed.add(layer)
        for inner, block_layer in self._eager:
            inner.update_in_backward(block_layer[layer], after=accumulated.wait)

    def _early_parts(self, ex: Executor) -> frozenset[int]:
        """Note: [early non-block parts] (engine/early_parts.py): the parts p >= 1 of the non-block weights
        that every such optimizer's layers lie wholly inside (a layer handed over must be complete)."""
        return _early_parts(ex, [(inner, self._plans[id(inner)][2]) for inner, _ in self._eager])

    @staticmethod
    def planned_early_parts(ex: Executor, optimizers: list) -> tuple[int, ...]:
        """The early parts a configuration for ``ex``'s stack would arm if the updates run in the backward
        (what the plan prices: ``Workload.early_parts``)."""
        eager = [(inner, plan[3]) for inner in hybrid_adamws(optimizers)
                 if getattr(inner, "updates_in_backward", False) and (plan := _layer_plan(ex, inner)) is not None]
        return tuple(sorted(_early_parts(ex, eager))) if eager else ()

    def _on_part_final(self, part: int, accumulated: Any) -> None:
        """Part ``part`` of the non-block weights was written back during the backward (Note: [early
        non-block parts]): its layers go to the optimizer once their accumulation is done."""
        self._handed.add(REST)
        for inner, _ in self._eager:
            for layer in self._plans[id(inner)][2][part]:
                inner.update_in_backward(layer, after=accumulated.wait)

    def arm(self, on: bool) -> None:
        """This micro-batch's final gradients are (``on``) or are not the step's: hand them over."""
        self.armed = on
        self._handed = set()

    def check_late(self, late_groups: set[int]) -> None:
        """The micro-batch has ended: a block handed over as complete whose gradients changed after
        (``StepStats.late_groups``) was updated with part of them -- raise (the update cannot be undone)."""
        late = sorted(self._handed & late_groups)
        if late:
            for inner, _ in self._eager:
                inner.abandon_step()  # no update still running; the open step is given up (logged)
            what = ", ".join("the non-block weights" if j == REST else f"block {j}" for j in late)
            raise RuntimeError(
                f"HybridAdamW(updates_in_backward=True): {what} were updated during the backward, then their "
                "gradients changed (a block called again after its gradients were complete, or a post-accumulate-grad "
                "hook registered during the fit): this step cannot be exact. Use updates_in_backward=False for this "
                "model.")

    @property
    def updates_in_backward(self) -> bool:
        """Does an optimizer update blocks during the backward under this configuration?"""
        return bool(self._eager)

    def seal(self, ex: Executor) -> None:
        """The step's backward has ended: its gradients are all on the host (the host lane's last
        accumulations waited for); what changes them from here is checked at the step."""
        if self._eager and self.armed and ex.params is not None:
            ex.params.wait_host()
            for inner, _ in self._eager:
                inner.seal_backward()

    def drain(self) -> None:
        """Wait for the updates begun in the backward so far (before a plan switches the schedule)."""
        for inner, _ in self._eager:
            inner.wait_backward_updates()

    def order(self, optimizer: Any) -> list | None:
        """The layer order of ``optimizer``'s pipelined step, or None (a serial step). An optimizer whose
        param groups changed since the configuration (``add_param_group``: a finetuning callback thawing
        weights) is configured again first."""
        entry = self._plans.get(id(optimizer))
        if (entry is not None and self._signatures.get(id(optimizer)) != _signature(optimizer)
                and not any(inner.updating_in_backward for inner, _ in self._eager)):
            self._regroup(optimizer)
            entry = self._plans.get(id(optimizer))
        if entry is not None and getattr(optimizer, "has_step_hooks", False) and not optimizer.updating_in_backward:
            # Note: [step hooks] (optim/torch_contract.py): a post-hook may edit the weights the next forward reads
            if id(optimizer) not in self._hooked:
                self._hooked.add(id(optimizer))
                log.info("lazytrain: %s has step hooks (register_step_pre_hook / _post_hook): its steps run serially "
                         "while they exist, not pipelined under the next forward", type(optimizer).__name__)
            return None
        return None if entry is None else entry[0]

    def _regroup(self, optimizer: Any) -> None:
        """Note: [groups added mid-run]
            The pipelined order lists every layer of the optimizer once, worked out per schedule. A group
            added later (Lightning's ``BaseFinetuning.unfreeze_and_add_param_group``) brings a layer the
            order lacks, and may put a block's weights in two layers (no longer one layer per block): the
            configuration is made again from the optimizers as they are now (after every update still in
            flight: a new configuration drops the waits), or, where an optimizer's layers no longer follow
            the blocks, its step is serial from then on (logged)."""
        self.finish()
        self.configure(self._ex, self._known, in_backward=self._in_backward)
        if id(optimizer) not in self._plans:
            log.info("lazytrain: %s's param groups changed (add_param_group) and its layers no longer follow the "
                     "blocks: its step is serial from now on", type(optimizer).__name__)

    def start(self, optimizer: Any, *, clipped_grads: bool = False) -> None:
        """Start ``optimizer``'s pipelined update (its closure has run); ``clipped_grads``: its gradients
        hold their clipped values when this returns (Note: [gradients read after a clipped step] in
        optim/hybrid_adamw.py)."""
        order, block_layer, part_layers = self._plans[id(optimizer)]
        pipe = optimizer.step_pipelined(order, clipped_grads=clipped_grads)
        self._pending.append((pipe, block_layer, part_layers))

    def wait_updated(self, j: int) -> None:
        """The executor is about to stage block j (or, for j = -1 - p, part p of the non-block
        weights; one part: REST)."""
        for pipe, block_layer, part_layers in self._pending:
            for layer in (part_layers[-1 - j] if j < 0 else [block_layer[j]]):
                pipe.wait_updated(layer)
        if self._guard is not None:  # Note: [weights read before the forward]: block j's are updated
            self._guard.released(j)

    def reads_guard(self) -> contextlib.AbstractContextManager:
        """What ``training_step`` runs under: while updates are in flight, a guard that waits for them before
        it reads their weights (Note: [weights read before the forward] in core/weight_reads.py)."""
        watched: dict[Any, list[torch.Tensor]] = {}
        for inner in self._known:
            plan = self._plans.get(id(inner))
            entry = next((e for e in self._pending if plan is not None and e[1] is plan[1] and not e[0].done), None)
            if entry is None:
                continue
            pipe, block_layer, part_layers = entry
            # layer -> what its update reads or writes: the parameters, their gradients (read; scaled in place
            # by a clip on the worker) and their optimizer states
            written: dict[Any, list[torch.Tensor]] = {}
            for g in inner.param_groups:
                for p in g["params"]:
                    written.setdefault(g["layer"], []).append(p)
                    if p.grad is not None:
                        written[g["layer"]].append(p.grad)
                    written[g["layer"]].extend(v for k, v in inner.state.get(p, {}).items()
                                               if isinstance(v, torch.Tensor) and not str(k).startswith("qmap"))
            block_of = {layer: j for j, layer in block_layer.items()}
            for layer in plan[0]:
                if pipe.is_updated(layer):
                    continue
                key = block_of.get(layer, next((-1 - p for p, ls in enumerate(part_layers) if layer in ls), None))
                watched.setdefault(key, []).extend(written.get(layer, ()))
        return guarded(watched, self._wait_pending, self._set_guard)

    def _set_guard(self, guard: ReadGuard | None) -> None:
        self._guard = guard

    def _wait_pending(self) -> None:
        self.reads_waited += 1
        for pipe, _, _ in self._pending:
            pipe.wait_all()

    def prune(self) -> None:
        """Forget the updates that have finished (a step's first micro-batch)."""
        self._pending = [p for p in self._pending if not p[0].done]

    def finish(self, refuse: str | None = None) -> bool:
        """Wait for the updates still running (before evaluation, checkpoints, teardown). A step begun in
        the backward that has not reached its optimizer step: ``refuse`` (what wants the weights now: a
        checkpoint, evaluation) raises -- the blocks updated already cannot be taken back, and giving the
        step up would update them twice at the optimizer step; None (teardown, an error in the backward)
        gives it up. Returns whether a step was given up (the masters then hold a step half done)."""
        pending, self._pending = self._pending, []
        failed: BaseException | None = None
        for pipe, _, _ in pending:  # every one waited for, even after one failed (its error raised below)
            try:
                pipe.wait_all()
            except BaseException as err:  # noqa: BLE001 - re-raised once all are done
                failed = failed or err
        if failed is not None:
            raise failed
        gave_up = False
        for inner, _ in self._eager:
            if inner.updating_in_backward:
                if refuse is not None:
                    raise RuntimeError(
                        f"{refuse} between a backward and its optimizer step, while HybridAdamW(updates_in_backward="
                        f"True) is updating blocks in that backward ({list(inner.layers_updated_in_backward)} "
                        "began): their weights are neither the step's old ones nor its new ones. Write it after the "
                        "optimizer step (on_train_batch_end), or let the callback not declare reads_gradients_only "
                        "(the updates then wait for the step), or use updates_in_backward=False")
                inner.abandon_step()
                gave_up = True
        return gave_up

    def clear(self) -> None:
        try:
            self.finish()
        finally:  # a failed update is raised after the configuration is dropped
            self._plans = {}
            self._eager = []
            self.arm(False)


def _layer_plan(ex: Executor, inner: Any) -> tuple[list, dict, list, list] | None:
    """How ``inner``'s layers lie over ``ex``'s groups: (the layers of the non-block weights, block ->
    layer, the layers of neither, the layers holding each part of the non-block weights; one part: all
    of them), or None where its layers do not follow the blocks (one layer per block, each its own)."""
    assert ex.params is not None
    blocks_n = len(ex.stack)
    layer_of = {id(p): g["layer"] for g in inner.param_groups for p in g["params"]}
    groups: dict[int, set] = {}
    for j in [REST, *range(blocks_n)]:
        groups[j] = {layer_of.get(id(p)) for p in ex.params.group_parameters(j)} - {None}
    blocks = [groups[j] for j in range(blocks_n)]
    if any(len(g) != 1 for g in blocks) or len({next(iter(g)) for g in blocks}) != len(blocks):
        return None
    block_layer = {j: next(iter(groups[j])) for j in range(blocks_n)}
    if groups[REST] & set(block_layer.values()):  # a layer holding a block's and non-block weights (a module
        return None  # shared by blocks grouped with one of them): its update waits for both
    first = [layer for layer in inner.layers if layer in groups[REST]]
    rest = [layer for layer in inner.layers if layer not in first and layer not in block_layer.values()]
    parts = len(ex.params.rest_parts)
    part_layers = [first] if parts == 1 else [
        [layer for layer in first if layer in {layer_of.get(id(p)) for p in ex.params.rest_part_parameters(k)}]
        for k in range(parts)]
    return first, block_layer, rest, part_layers


def _early_parts(ex: Executor, eager: list[tuple[Any, list]]) -> frozenset[int]:
    """Note: [early non-block parts]: the parts p >= 1 that every optimizer of ``eager`` (with its layers
    per part) holds in whole layers lying wholly inside the part."""
    assert ex.params is not None
    parts = len(ex.params.rest_parts)
    rest = {id(q) for q in ex.params.group_parameters(REST)}
    ok = set(range(1, parts))
    for k in range(1, parts):  # a module shared by blocks gets gradients from every block's backward (Note:
        # [modules shared by blocks] in engine/param_store.py): its part is complete only at the end
        if any(id(q) in ex.params.shared_ids for q in ex.params.rest_part_parameters(k)):
            ok.discard(k)
    for inner, part_layers in eager:
        for k in range(1, parts):
            inside = {id(q) for q in ex.params.rest_part_parameters(k)}
            layer_rest = [{id(q) for g in inner.param_groups if g["layer"] == layer for q in g["params"]} & rest
                          for layer in part_layers[k]]
            if not part_layers[k] or any(not ids <= inside for ids in layer_rest):
                ok.discard(k)
    return frozenset(ok)


def norms_wanted(optimizers: list, *, hand_over: bool, clip: bool, several: bool) -> bool:
    """Note: [norms only when wanted] (engine/executor.py): does anything use the host lane's gradient
    norms? Several processes average with them; a ``HybridAdamW`` that is handed them (``hand_over``)
    uses them (``_uses_handed_norms``, ``hand_over_norms``' rule too). Anything else (torch's optimizers
    clip with their own pass) takes none."""
    if several:
        return True
    return hand_over and any(_uses_handed_norms(inner, clip) for inner in hybrid_adamws(optimizers))


def _uses_handed_norms(inner: Any, clip: bool) -> bool:
    """Does this ``HybridAdamW`` use handed-over norms: for a clip (the Trainer's, or its own
    ``max_grad_norm``), or for its non-finite skip -- without them one serial pass over every host
    gradient on the step's critical path (~0.5 s per step for 1B parameters on the H200's host, a
    third of the step). Only for fp32 gradients: that pass sums 16-bit ones in fp32, the handed-over
    norms are in their own dtype (an fp16 norm overflows at 65504 and would skip a finite step)."""
    skip_only = inner.skip_nonfinite and all(p.dtype == torch.float32 for g in inner.param_groups
                                             for p in g["params"])
    return clip or inner.max_grad_norm is not None or skip_only


def hand_over_norms(optimizers: list, stats: StepStats, *, clip: bool, trusted: bool,
                    recompute: Callable[[list], dict] | None) -> None:
    """Give HybridAdamW each parameter's gradient norm, taken by the executor's host lane as the
    gradients arrived, so its clip needs no pass over the gradients and equals ``clip_grad_norm_``
    bit for bit (Note: [exact clip] in optim/clip.py). The step runs after this. A norm whose
    gradient changed since (a hook or callback edited it) is taken again at the step (Note: [stale
    norms] in optim/grad_norms.py); untrusted norms (user code that could edit gradients unseen,
    loss-scaled gradients, an ad-hoc backward without norms) are all taken again. ``recompute``
    (sharded gradients): the norms over every rank's shards, at the step."""
    norms: dict[torch.nn.Parameter, torch.Tensor] | None = None
    for inner in hybrid_adamws(optimizers):
        if not (_uses_handed_norms(inner, clip) or recompute is not None):
            inner.set_grad_norms(None)  # never a stale step's norms
            continue
        if norms is None:
            ok = trusted and bool(stats.grad_norms)
            norms = {p: n for per_layer in stats.grad_norms.values() for p, n in per_layer.items()} if ok else {}
        inner.set_grad_norms(norms, recompute=recompute)


def split_rest_parts(ex: Executor, optimizers: list) -> None:
    """T moves, updates and stages the non-block weights in the parts of the first ``HybridAdamW``'s
    layers (e.g. ``embed``, ``head``; Note: [non-block parts] in planner/schedule_windows.py), in that
    optimizer's layer order, when they are runs of the packed buffer; otherwise in one part."""
    if ex.params is None:
        return
    rest = {id(p) for p in ex.params.group_parameters(REST)}
    for inner in hybrid_adamws(optimizers):
        by_layer: dict[Any, list] = {}
        for g in inner.param_groups:
            by_layer.setdefault(g["layer"], []).extend(p for p in g["params"] if id(p) in rest)
        ex.set_rest_parts([ps for ps in by_layer.values() if ps])
        return


def _signature(inner: Any) -> tuple:
    """An optimizer's groups as its pipelined order depends on them: each group's layer and parameters."""
    return tuple((g["layer"], tuple(map(id, g["params"]))) for g in inner.param_groups)
