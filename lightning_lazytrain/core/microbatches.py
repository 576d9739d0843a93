"""A training micro-batch's life in the training core: it begins (armed at the model's call, or begun
now), its forward and backward run, it ends -- and when that ends the executor's step, the step's
gradients are averaged over the processes, a profiled step is planned from, the norms are handed to
HybridAdamW, the step's figures recorded and drift watched (a mixin of ``TrainingCore``,
training_core.py: it reads and writes the core's per-step state).

``begin_microbatch`` opens one (Note: [the micro-batch begins at the model's call]; the profiled
step chosen: Note: [profiled first step] in training_core.py), ``end_microbatch`` closes it,
``end_skipped_microbatch`` ends a step's last one whose ``training_step`` returned None (Note: [a step's
last micro-batch skipped]), ``abort_microbatch`` drops one whose backward never ran, and ``before_backward``
marks the blocks whose input the loss also reads (Note: [one gradient per boundary use] in engine/boundary_uses.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_lazytrain.core.allocator import release_cache
from lightning_lazytrain.core.optimizer_steps import hand_over_norms, norms_wanted
from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.user_grad_hooks import has_post_accumulate_hooks

if TYPE_CHECKING:
    from lightning_lazytrain.core.batch_size import BatchSizeGuard
    from lightning_lazytrain.core.options import CoreOptions, FitSettings, ProcessLayout
    from lightning_lazytrain.core.optimizer_steps import PipelinedSteps
    from lightning_lazytrain.core.planning import Planner

__all__ = ["MicroBatches"]

log = logging.getLogger("lightning_lazytrain.core.training_core")  # the core's messages, under its name


class MicroBatches:
    """The micro-batch half of ``TrainingCore`` (see the module doc); the attributes, ``plan``,
    ``shard_store`` and the norms are the core's, the schedule switches it calls ``ScheduleControl``'s."""

    options: CoreOptions
    planner: Planner
    steps: PipelinedSteps
    layout: ProcessLayout
    batch_size: BatchSizeGuard
    fit: FitSettings
    optimizers: list
    grad_sync: Any
    executor: Executor | None
    module: torch.nn.Module | None
    automatic: bool
    last_stats: StepStats | None
    metrics: dict[str, float]
    _metrics_taken: bool
    _steps_ended: int
    _micro_index: int
    _last_of_step: bool
    _at_call: bool
    _t_step: float
    _tokens: int | None
    _full: bool
    _late_grads_seen: bool
    _post_hooks: bool
    _incomplete_profiles: int
    _shard_bytes_per_s: float | None

    def _ex(self) -> Executor:
        if self.executor is None:
            raise RuntimeError("lazytrain: the training core has no executor (build it first)")
        return self.executor

    @property
    def in_microbatch(self) -> bool:
        """A micro-batch is open (its forward ran, its backward has not)."""
        return self.executor is not None and self.executor.in_microbatch

    def weight_reads_guard(self) -> contextlib.AbstractContextManager:
        """What ``training_step`` runs under (Note: [weights read before the forward] in core/weight_reads.py)."""
        return self.steps.reads_guard()

    def end_skipped_microbatch(self) -> None:
        """Note: [a step's last micro-batch skipped] The optimizer step's closure has run and the step's last
        micro-batch is still open: its ``training_step`` returned None, so no backward ran. Under ``auto`` the
        step still updates with the earlier micro-batches' gradients; here some of them are still on the
        device (the non-block weights' accumulate there for the whole step; layer 0's leave in the next F0),
        so the micro-batch ends as one no gradient reached -- its backward windows pass with their transfers
        and T's send the held gradients to the host. A step's only micro-batch skipped has nothing held: it
        stays open and is dropped when the next begins, as before (a profiled step without a backward would
        price none)."""
        ex = self.executor
        if self.automatic and ex is not None and self._micro_index > 0:
            if ex.armed:  # the model was never called (Note: [the micro-batch begins at the model's call])
                ex.begin_armed()
            if self.in_microbatch:
                self.end_microbatch()

    # Note: [the micro-batch begins at the model's call]
    # The Trainer's training_step arms the micro-batch (``Executor.arm``) instead of beginning it: the
    # non-block weights and block 0 are staged, and the non-block weights bound to their device copies, when
    # the model (a non-block module or a block) is first called. Code in training_step before that call sees
    # the host masters with their host gradients, as under ``auto``: a weight edit there (WGAN's clipping)
    # reaches what the forward uses, and ``p.grad`` is the step's gradient, not a bound copy's zeros (review 7;
    # before, both differed from ``auto`` from the first step). A step's last training_step that never calls
    # the model is begun and ended by ``end_skipped_microbatch``. Manual optimization always began so. Where the
    # LightningModule holds parameters of its own (read in training_step without a module call, so no pre-hook
    # would stage them: on a GPU they would be the host masters), it begins when training_step does, as before.

    def before_backward(self, loss: Any) -> None:
        """The adapters' backward is about to run on ``loss``: a block input also used elsewhere gets each use's
        gradient added in autograd's order (Note: [one gradient per boundary use] in engine/boundary_uses.py)."""
        if self.executor is not None:  # (the executor checks the micro-batch and the loss)
            # Note: [an edit of a bound copy]: before the backward, whose updates (HybridAdamW in the backward) may
            # change the masters an edit would otherwise be merged into after them
            self.executor.sync_edits()
            self.executor.mark_boundary_uses(loss)

    # Note: [a backward outside the strategy]
    # The adapters end a micro-batch right after the backward they run (``manual_backward``, ``fabric.backward``,
    # the automatic loop's): its gradients reach the host then. A ``loss.backward()`` called directly in manual
    # optimization (Fabric refuses one itself) runs the blocks' backward windows but nothing ends the micro-batch;
    # it used to be dropped at the next micro-batch's begin, as a forward without backward is: block
    # 0's and the non-block gradients never reached the host and the step trained silently wrong (review 17:
    # layers.0 .grad None, others up to 0.043 off). Now a micro-batch whose backward ran is ended late, where it
    # shows (``close_open_microbatch``): the optimizer step, a clip, the next micro-batch's begin; a warning says
    # so once, as ``.grad`` read between that backward and those points is not the step's yet.

    def close_open_microbatch(self, *, drop: bool = True) -> None:
        """An open micro-batch: ended if a backward ran in it (Note: [a backward outside the strategy]), else
        dropped with ``drop`` (a forward with grad whose backward never ran; without ``drop`` it stays open: an
        optimizer stepped between a forward and its ``manual_backward``)."""
        ex = self.executor
        if ex is None or not ex.in_microbatch:
            return
        if not ex.backward_ran:
            if drop:
                self.abort_microbatch()
            return
        if not self._outside_backward_warned:
            self._outside_backward_warned = True
            log.warning("lazytrain: a backward ran outside the strategy (loss.backward() instead of "
                        "self.manual_backward(loss)); its micro-batch ends now, at the optimizer step, clip or "
                        "next forward: .grad read before that is not complete. Call self.manual_backward(loss)")
        self.end_microbatch()

    # Note: [a backward that reaches nothing]
    # A Fabric loop may backpropagate a loss that reaches nothing of the streamed model between its forward and the
    # backward that does: Lightning's DCGAN loop runs the discriminator's ``fabric.backward`` on ``fake.detach()``
    # (the discriminator set up beside the streamed generator) before the generator's loss on the same ``fake``.
    # Ending the generator's micro-batch at the first made the second a backward "of an earlier micro-batch",
    # refused (review 20), where ``auto`` trains. ``end_microbatch_if_reached`` keeps the micro-batch open when the
    # backward reached no block and no bound copy (``Executor.reach_mark``): it had nothing to deliver, and the
    # next backward, the next forward (which drops a micro-batch no backward reached) or a step decides.

    def reach_mark(self) -> tuple[int, int] | None:
        """Before a backward: ``Executor.reach_mark`` of the open micro-batch (None: none open)."""
        ex = self.executor
        return ex.reach_mark() if ex is not None and ex.in_microbatch else None

    def end_microbatch_if_reached(self, mark: tuple[int, int] | None) -> StepStats | None:
        """After a backward: end the micro-batch unless the backward reached nothing of the model (Note: [a backward
        that reaches nothing]); ``mark``: ``reach_mark`` before it."""
        ex = self.executor
        if mark is not None and ex is not None and ex.in_microbatch and ex.reach_mark() == mark:
            return None
        return self.end_microbatch()

    # Note: [a step inside a micro-batch]
    # With manual optimization (and in a Fabric loop) an optimizer may step between a forward and its backward: a
    # GAN's critic stepped after the generator's forward, before the critic's use in the same loss. The open
    # micro-batch is not dropped there (its backward is still to come), and the non-block weights were staged and
    # bound to device copies when it began: without more, a later use in it computed with the weights before the
    # step, where ``auto`` uses them after (silently: losses off from the second step). ``stepping`` runs the
    # step with the queued copies finished (and the user's edits of the bound copies taken into the masters first:
    # Note: [an edit of a bound copy] in engine/bound_edits.py), and after it the bound copies of what the optimizer
    # holds take the new values. Blocks stream their weights per window, from the masters: a block staged after the
    # step sees it. A forward that saved a weight the step then changed is refused by ``auto`` ("modified by an
    # inplace operation"), and here too: a refreshed non-block copy's own version counter moves (Note: [one version
    # counter per copy] in engine/param_binding.py), and a block whose weights the step changed after its forward
    # refuses its backward (``BlockContext.stepped``).

    def sync_edits(self) -> int:
        """Note: [an edit of a bound copy] (engine/bound_edits.py): user edits of the bound non-block copies into
        their masters now (an open micro-batch; 0 otherwise)."""
        return self.executor.sync_edits() if self.executor is not None else 0

    @contextlib.contextmanager
    def stepping(self, optimizer: Any) -> Any:
        """An optimizer step by the adapters (Note: [a step inside a micro-batch])."""
        ex = self.executor
        if ex is None or not ex.in_microbatch:
            yield
            return
        inner = getattr(optimizer, "optimizer", optimizer)
        with ex.step_inside([p for group in inner.param_groups for p in group["params"]]):
            yield

    def abort_microbatch(self) -> None:
        """Drop an open micro-batch (a forward with grad whose backward never ran)."""
        ex = self.executor
        if ex is not None and ex.in_microbatch:
            ex.abort_microbatch()
            self._micro_index = 0

    def begin_microbatch(self, tokens: Callable[[], int], *, last: bool,
                         elements: Callable[[], int] | None = None, at_call: bool = False) -> None:
        """A training micro-batch begins: when the model is called with manual optimization, or with
        ``at_call`` (the Trainer's training_step: Note: [the micro-batch begins at the model's call]), so optimizer
        steps, parameter reads and edits before that see the host masters, as under ``auto``; else now (Fabric,
        whose forward begins it). ``tokens``: counts the batch's tokens (called for the profiled step); ``last``: the
        optimizer steps after this micro-batch; ``elements``: the batch's size (``batch_elements``: a
        batch larger than the plan covers is planned for first, Note: [batches larger than the plan]).
        A micro-batch left open (a forward without backward) is dropped first."""
        ex = self._ex()
        ex.disarm()
        # the previous step returned None, or ran a forward without backward (dropped), or a backward outside the
        # strategy (ended: Note: [a backward outside the strategy])
        self.close_open_microbatch()
        size = elements() if elements is not None else 0
        if size:
            self._guard_size(ex, size, tokens)
        self._guard_trainable(ex, tokens)  # Note: [blocks thawed or frozen] (schedule_control.py)
        if self.plan is None and self._tokens is None:  # Note: [profiled first step]
            if self._micro_index == 0 and self._steps_ended >= self._profile_warmup():
                self._tokens = tokens()
                ex.profiling = True
                release_cache(ex.device)  # the profile's reserved bytes are its own, not an earlier cache's
        elif self.planner.replan_reason is not None and self._micro_index == 0 and not ex.profiling:
            ex.profiling = True  # this step is the new profile (see replan.py)
        elif ex.profiling and self._micro_index > 0 and self._tokens is not None:
            self._tokens = max(self._tokens, tokens())  # the plan is for the step's largest micro-batch
        if ex.profiling and size:
            self.batch_size.profiling(size)
        self._last_of_step = last
        self._at_call = at_call
        self._open()

    def _open(self) -> None:
        ex = self._ex()
        if self._micro_index == 0:  # post-accumulate-grad hooks see every micro-batch's host grads
            # (engine/user_grad_hooks.py, Note: [gradient hooks on streamed parameters])
            self._post_hooks = self.module is not None and has_post_accumulate_hooks(self.module.parameters())
            # a weight shared by blocks: each micro-batch's uses summed on their own (Note: [modules shared by
            # blocks] in engine/param_store.py)
            self._full = self.fit.full_microbatches or self._post_hooks or bool(
                ex.params is not None and ex.params.shared_across_blocks)
        first = self._micro_index == 0 or self._full
        last = self._full or self._last_of_step
        # Note: [updates in the backward pass]: this micro-batch's final gradients are the step's (not a
        # profiled step's: its plan switches the schedule after the backward)
        # (nor one whose post-accumulate-grad hooks may change the gradients after they were handed over)
        self.steps.arm(self.automatic and self._last_of_step and not ex.profiling and not self._late_grads_seen
                       and not self._post_hooks)
        ex.early_parts_armed = self.steps.armed and self.steps.updates_in_backward  # Note: [early non-block parts]
        if first:
            self._micro_index = 0
            self._t_step = time.perf_counter()
            self.steps.prune()
            # Note: [norms only when wanted] (engine/executor.py)
            ex.take_norms = norms_wanted(self.optimizers, hand_over=self.fit.hand_over_norms, clip=self.fit.clip,
                                         several=self.grad_sync is not None or self.shard_store() is not None)
            # the weights an optimizer holds: frozen ones among them may be toggled back (toggle_optimizer),
            # so their blocks keep their backward (engine/block_calls.py, Note: [blocks no gradient reaches])
            ex.optimized_ids = frozenset(id(q) for o in self.optimizers for g in getattr(o, "param_groups", ())
                                         for q in g["params"])
            store = self.shard_store()
            if store is not None:  # a profiled step's collectives run in line: their times price the plan
                store.overlap = self.options.overlap_grad_sync and not ex.profiling  # Note: [overlapped all-gather]
            if self.grad_sync is not None:  # grad_sync.py, Note: [one sync per step]
                self.grad_sync.hold = (self._full and self.options.data_parallel != "shard"
                                       and not self._last_of_step)
        if self.automatic and not self._at_call:
            ex.begin_microbatch(first=first, last=last)
        else:  # Note: [the micro-batch begins at the model's call]
            ex.arm(first=first, last=last)

    def end_microbatch(self, step: int | None = None) -> StepStats | None:
        """The micro-batch's backward has run: finish it (its gradients reach the host). When that ends
        the executor's step: average the gradients over the processes, plan from a profiled step, hand
        the norms to HybridAdamW, record the step's figures and watch for drift; returns its stats.
        ``step``: the optimizer step's number, for the re-plan records (default: steps ended so far)."""
        ex = self.executor
        if ex is None or not ex.in_microbatch:
            return None
        stats = ex.end_microbatch()
        self._micro_index += 1
        if stats is None:
            return None
        micro_batches, self._micro_index = self._micro_index, 0
        self.last_stats = stats
        self._sync_gradients(ex, stats)
        self.steps.check_late(stats.late_groups)  # Note: [updates in the backward pass]
        self.steps.seal(ex)
        if ex.late_grads and not self._late_grads_seen:
            self._late_grads_seen = True
            if self.steps.updates_in_backward:
                log.warning("HybridAdamW(updates_in_backward=True): a block's gradients changed after their last "
                            "accumulation in this step (a block called twice, or a post-accumulate-grad hook): from "
                            "the next step the updates wait for the optimizer step")
        # (a backward whose forward ran no block with grad, e.g. a critic step, profiles nothing; nor
        # does one that left blocks of its planned pass without a gradient: Note: [unreached blocks])
        profiled = ex.profiling and len(stats.boundary_bytes) == len(ex.stack) + 1 and not stats.unreached
        if ex.profiling and stats.unreached:
            self._incomplete_profile(ex, stats)
        if profiled:
            self.steps.drain()  # no update begun in the backward writes masters the plan may move
            ex.profiling = False
            self._incomplete_profiles = 0
            self._plan(ex, stats, micro_batches, self._steps_ended if step is None else step)
        if self.fit.hand_over_norms:
            shard = self.shard_store() is not None
            hand_over_norms(self.optimizers, stats, clip=self.fit.clip,
                            trusted=self.fit.norms_trusted and not self.fit.loss_scaled,
                            recompute=self._whole_grad_norms if shard else None)
        self.metrics = stats.metrics(time.perf_counter() - self._t_step, self.predicted_seconds())
        self._metrics_taken = False
        self._steps_ended += 1
        if not profiled:  # a profiled step ran another schedule, with timing on
            self.planner.watch_backward(self.layout, stats, len(ex.stack))  # Note: [blocks thawed or frozen]
            if not self._race_step(ex):  # no drift is watched while the plan is timed
                self.planner.watch_drift(self.layout, self.metrics.get("lazytrain/step_seconds", float("nan")))
            if not stats.evaluated_mid_step:  # the allocator's peak would be the evaluation's too
                self.planner.watch_memory(self.layout, stats)
        if not self.automatic:
            self._open()  # later forwards of this training step are passes with grad
        return stats

    def _sync_gradients(self, ex: Executor, stats: StepStats) -> None:
        sync = self.grad_sync
        if sync is None:
            return
        assert ex.params is not None
        if sync.hold:  # averaged after the step's last micro-batch (grad_sync.py, Note: [one sync per step])
            if ex.profiling:  # the plan prices the all-reduces this micro-batch does not run
                sync.time_all_reduce(ex.params)
            return
        # before the plan, clipping and the optimizer see them; the collective lane's bytes, in the
        # planner's unit (grad_sync.py, Note: [collective bytes])
        stats.lane_bytes["collective"] = sync.average_grads(ex.params, stats.grad_norms, stats.layer_sq_norms)
        # sharded groups (their average came with the reduce-scatter): per-parameter norms of the whole
        # gradients from every rank's shard norms; their all-gathers and reduce-scatters are the step's
        # collective lane
        sync.combine_shard_norms(ex.params, stats.grad_norms, stats.layer_sq_norms)
        store = self.shard_store()
        if store is not None:
            nbytes, seconds = store.take_collective()
            stats.lane_bytes["collective"] = stats.lane_bytes.get("collective", 0.0) + nbytes
            if nbytes and seconds > 0 and not store.overlap:  # in line: the collectives' own time
                self._shard_bytes_per_s = nbytes / seconds
