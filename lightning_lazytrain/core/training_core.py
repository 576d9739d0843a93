"""``TrainingCore``: layer-streaming training without Lightning.

It owns the executor (``engine.Executor``), the plan (profile the first step, solve, switch; re-plan
on drift or when the allocator outgrows the plan: ``planning.py``), the gradient synchronisation of
several processes (``grad_sync.GradSync``), the pipelined optimizer steps (``optimizer_steps.py``)
and the checkpoint state transforms (``checkpoint_state.py``). The Lightning strategies
(``adapters/``) translate their framework's hooks into this API::

    core = TrainingCore(CoreOptions(policy="milp"))
    core.connect_processes(layout, device)            # several processes: GradSync
    core.build(module, device, compute_dtype=..., precision="32-true", automatic=True, measure=True)
    core.start_fit(optimizers, FitSettings(grad_accum=2))
    core.begin_microbatch(lambda: count_tokens(batch), last=...)   # then the user's forward + backward
    stats = core.end_microbatch(step=...)             # StepStats when the executor's step ended
    with core.inference(): ...                       # evaluation
    core.teardown()

Note: [profiled first step]
    The first real step is the profile (on CUDA the second: core/replan.py, Note: [profile
    warm-up]): it runs under a provisional schedule (``min_memory`` on CUDA, ``recompute_all`` on the
    CPU) with timing on, and the plan is made from it before its optimizer step, so no user code runs
    an extra time. A step whose backward left blocks of its planned pass
    without a gradient (Note: [unreached blocks] in engine/backward_windows.py) is no profile: the next step
    is, three times at most, after which the run goes on, exactly, on the provisional schedule.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch

from lightning_lazytrain.core.allocator import MemoryWatch, configure_allocator, release_cache
from lightning_lazytrain.core.autoplan import AutoPlan
from lightning_lazytrain.core.batch_size import BatchSizeGuard
from lightning_lazytrain.engine.blocks import find_blocks
from lightning_lazytrain.core.checkpoint_state import CheckpointState
from lightning_lazytrain.core.optimizer_steps import (PipelinedSteps, hand_over_norms, hybrid_adamws, norms_wanted,
                                                      split_rest_parts)
from lightning_lazytrain.core.options import CoreOptions, FitSettings, ProcessLayout
from lightning_lazytrain.core.plan_race import PlanRace
from lightning_lazytrain.core.planning import Planner
from lightning_lazytrain.core.schedule_control import ScheduleControl
from lightning_lazytrain.core.shard_norms import clip_sharded, whole_grad_norms
from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.nvme import check_nvme_dir, remove_stale_spill_dirs
from lightning_lazytrain.engine.param_store import upcast_parameters
from lightning_lazytrain.engine.shard_store import ShardedParamStore
from lightning_lazytrain.engine.user_grad_hooks import has_post_accumulate_hooks
from lightning_lazytrain.planner import Hardware, min_memory, recompute_all

__all__ = ["TrainingCore"]

log = logging.getLogger(__name__)


class TrainingCore(ScheduleControl):
    """Streams a module's blocks through one device, plans and re-plans, syncs gradients across
    processes, pipelines HybridAdamW's steps and shapes checkpoints (see the module doc).

    ``info``/``debug``/``warn``: where its messages go (the strategies pass Lightning's rank-zero
    functions; by default this module's logger and ``warnings.warn``)."""

    def __init__(self, options: CoreOptions, *, info: Callable[[str], None] = log.info,
                 debug: Callable[[str], None] = log.debug, warn: Callable[[str], None] = warnings.warn) -> None:
        self.options = options
        self._info, self._warn = info, warn
        self.planner = Planner(options, info=info, debug=debug)
        self.steps = PipelinedSteps()
        self.layout = ProcessLayout()
        self.device = torch.device("cpu")
        self.grad_sync: Any = None  # grad_sync.GradSync with several processes
        self.executor: Executor | None = None
        self.module: torch.nn.Module | None = None
        self.automatic = True  # automatic optimization: a micro-batch begins with its training step
        self.optimizers: list = []
        self.fit = FitSettings()
        self.artifact_dir: str | None = None  # plan.json, the timelines (rank 0)
        self.last_stats: StepStats | None = None
        self.metrics: dict[str, float] = {}  # the last step's lazytrain/* figures
        self._metrics_taken = True
        self._steps_ended = 0
        self._micro_index = 0
        self._last_of_step = True
        self._at_call = False  # the micro-batch begins at the model's call (begin_microbatch)
        self._t_step = 0.0
        self._outside_logged = False
        self.batch_size = BatchSizeGuard()  # Note: [batches larger than the plan] (core/batch_size.py)
        self._size_logged = False
        self._size_reason: str | None = None  # the step being profiled is a larger batch's
        self._tokens: int | None = None  # of the first batch, which is profiled
        self._profiled_trainable: tuple[int, ...] | None = None  # Note: [blocks thawed or frozen]
        self._full = False  # this step's micro-batches each write all gradients back
        # a step's gradients changed after their final accumulation (ad-hoc passes, post-accumulate
        # hooks): no update in the backward for the rest of the run (Note: [updates in the backward pass])
        self._late_grads_seen = False
        self._post_hooks = False  # the module has post-accumulate-grad hooks (this step)
        self._incomplete_profiles = 0  # steps meant as the profile whose backward skipped blocks
        self._shard_bytes_per_s: float | None = None  # a sharded store's in-line collectives
        self._loss_hooks: list = []
        self._inference = contextlib.ExitStack()
        self.race: PlanRace | None = None  # Note: [the plan checked by measurement] (core/plan_race.py)

    # ---- state -----------------------------------------------------------------------------------
    @property
    def plan(self) -> AutoPlan | None:
        """The plan the executor runs (None before the profiled step)."""
        return self.planner.plan

    @property
    def replans(self) -> list[dict[str, Any]]:
        """What each re-plan found and did."""
        return self.planner.replans

    @property
    def races(self) -> list[dict[str, Any]]:
        """What each timing of a plan against its baselines measured and kept (core/plan_race.py)."""
        return self.planner.races

    def hardware(self) -> Hardware:
        """The machine a plan is made for, as the options shape it (see ``Planner.hardware``)."""
        return self.planner.hardware(self.device, self.layout.per_node)

    def predicted_seconds(self) -> float:
        return self.planner.predicted_seconds()

    def shard_store(self) -> ShardedParamStore | None:
        """The executor's sharded store (``data_parallel="shard"`` with several processes), or None."""
        params = self.executor.params if self.executor is not None else None
        return params if isinstance(params, ShardedParamStore) else None

    @property
    def checkpoints(self) -> CheckpointState:
        """The checkpoint transforms of this run (``checkpoint_state.py``)."""
        return CheckpointState(self.options, self.layout, self.grad_sync, self.shard_store(), self._warn)

    def take_metrics(self) -> dict[str, float]:
        """The last step's figures, once (a logger logs each step once); {} when taken already."""
        if self._metrics_taken:
            return {}
        self._metrics_taken = True
        return self.metrics

    # ---- setup -----------------------------------------------------------------------------------
    def connect_processes(self, layout: ProcessLayout, device: torch.device, *, timeout: timedelta | None = None) -> None:
        """This process's place in the run; with several, the host-side collectives (a gloo group of
        their own, ``grad_sync.py``) once the default process group exists."""
        self.layout, self.device = layout, device
        if not layout.is_distributed:
            return
        from lightning_lazytrain.core.grad_sync import GradSync

        self.grad_sync = GradSync(timeout)
        if self.options.data_parallel == "shard":  # Note: [hybrid sharding]: within a node by default
            self.grad_sync.make_shard_groups(self.options.shard_size or layout.per_node,
                                             gloo_reduce=device.type != "cuda")

    def build(self, module: torch.nn.Module, device: torch.device, *, compute_dtype: torch.dtype, precision: str,
              automatic: bool = True, measure: bool = True) -> Executor:
        """The executor on a provisional schedule (the plan replaces it after the profiled step): the
        module's blocks stream from its host parameters, its buffers and non-block weights live on
        ``device``. ``measure``: read the device's free memory now (``hardware="measure"``), before
        the executor's buffers exist."""
        o = self.options
        self.device, self.module, self.automatic = device, module, automatic
        if o.nvme_dir is not None:
            check_nvme_dir(o.nvme_dir)
            remove_stale_spill_dirs(o.nvme_dir)  # crashed runs' leftovers, whatever this plan uses
        links = None
        if o.emulate_link_gb_per_s is not None and device.type == "cpu":
            bw = o.emulate_link_gb_per_s * 1e9
            links = {"h2d": LinkSpec(bw, 0.0), "d2h": LinkSpec(bw, 0.0)}
        # expandable segments before the executor's buffers exist (Note: [the budget is what the allocator reserves])
        self.planner.start(device, MemoryWatch.for_device(device, configure_allocator(device)), measure=measure)
        if o.fp32_masters:
            if compute_dtype == torch.float32:
                raise ValueError(f"LazyTrainStrategy(fp32_masters=True) streams 16-bit copies of fp32 masters: use "
                                 f"precision='bf16-true' (or '16-true'), not {precision!r} (under '32-true' and "
                                 "the mixed precisions the weights are fp32 already)")
            upcast_parameters(module)
        t0 = time.perf_counter()
        stack = find_blocks(module, o.blocks)
        n = len(stack)
        self._install_chunked_loss(module)
        if o.fixed_schedule is not None and o.fixed_schedule.num_layers != n:
            raise ValueError(f"plan file {o.policy} is for {o.fixed_schedule.num_layers} layers, but the "
                             f"block stack {stack.path!r} has {n}: plan for this model")
        provisional = min_memory(n) if device.type == "cuda" else recompute_all(n)
        sync = self.grad_sync
        shard = sync is not None and o.data_parallel == "shard"
        if shard:  # rank 0's start (as DDP), before each rank keeps its shard of it
            sync.broadcast_module(module)
        self.executor = Executor(module, provisional, blocks=stack, device=device, compute_dtype=compute_dtype,
                                 nvme_dir=o.nvme_dir, links=links,
                                 shard_group=sync.shard_device_group if shard else None,
                                 replica_group=sync.replica_device_group if shard else None,
                                 grad_group=sync.shard_grad_group if shard else None)
        if sync is not None:
            ex = self.executor
            assert ex.params is not None
            sync.broadcast_state(ex.params, module)  # rank 0's start, as DDP
            if o.overlap_grad_sync and automatic:
                sync.attach(ex.params)
                sync.set_late_grads_probe(lambda: ex.late_grads)
        self._info(f"lazytrain: {n} blocks at {stack.path!r}, executor on {device} ({precision}) built in "
                   f"{time.perf_counter() - t0:.2f} s")
        return self.executor

    def _install_chunked_loss(self, module: torch.nn.Module) -> None:
        """``chunked_loss``: hooks on the module's Hugging Face causal LMs (models/hf_loss.py)."""
        for hooks in self._loss_hooks:
            hooks.remove()
        self._loss_hooks = []
        if not self.options.chunked_loss:
            return
        from lightning_lazytrain.models.hf_loss import ChunkedLoss, chunked_loss_modules

        found = chunked_loss_modules(module)
        if not found:
            raise ValueError("LazyTrainStrategy(chunked_loss=...) found no Hugging Face causal LM (a ...ForCausalLM) "
                             f"in {type(module).__name__}: compute a chunked loss yourself "
                             "(lightning_lazytrain.models.loss.chunked_lm_loss) or drop the option")
        try:  # one at a time: a model refused later must not leave the earlier ones hooked
            for m in found:
                self._loss_hooks.append(ChunkedLoss(m, self.options.chunked_loss))
        except BaseException:
            for hooks in self._loss_hooks:
                hooks.remove()
            self._loss_hooks = []
            raise

    def start_fit(self, optimizers: list, fit: FitSettings, *, artifact_dir: str | None = None) -> None:
        """Training begins with these optimizers: the non-block weights split along HybridAdamW's
        layers (one process), the 16-bit copies kept or not (``fp32_masters``)."""
        self.optimizers, self.fit, self.artifact_dir = list(optimizers), fit, artifact_dir
        ex = self.executor
        if ex is None:
            return
        if not self.layout.is_distributed and self.options.nonblock_parts:  # several processes: one part
            split_rest_parts(ex, self.optimizers)
        self._choose_compute_copy()
        if fit.step_waits is not None and hybrid_adamws(self.optimizers):
            self._info(f"lazytrain: the optimizer step updates every weight before it returns (no pipelined step): "
                       f"{fit.step_waits}")

    def add_optimizer(self, optimizer: Any) -> None:
        """One more optimizer of the module's parameters (Fabric sets them up one by one)."""
        self.optimizers.append(optimizer)

    def _choose_compute_copy(self) -> None:
        """``fp32_masters``: keep the 16-bit copies on the host (engine/param_store.py, Note: [kept
        compute copy]) when asked, or with ``"auto"`` when the host holds them beside the masters,
        their gradients and AdamW-sized optimizer states (8 bytes per parameter)."""
        ex = self.executor
        if not self.options.fp32_masters or ex is None or ex.params is None or self.module is None:
            return
        want = self.options.keep_compute_copy
        store = ex.params
        numel = sum(p.numel() for p in self.module.parameters())
        if want == "auto":
            need = store.host_pinned_bytes + store.host_grad_bytes + 8 * numel + 2 * numel
            want = need <= self.hardware().cpu_memory_bytes
            self._info(f"lazytrain: 16-bit weight copies {'kept on the host' if want else 'cast per fetch'} "
                       f"(keep_compute_copy='auto': the host needs ~{need / 1e9:.3g} GB with them)")
        ex.set_keep_compute_copy(bool(want))

    # ---- micro-batches ---------------------------------------------------------------------------
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
        self.abort_microbatch()  # the previous step returned None, or ran a forward without backward
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

    # ---- the optimizer step ----------------------------------------------------------------------
    def pipelined_order(self, optimizer: Any) -> list | None:
        """The layer order of ``optimizer``'s pipelined step, or None (a serial step)."""
        return self.steps.order(optimizer)

    def start_pipelined_step(self, optimizer: Any) -> bool:
        """``optimizer``'s closure has run: start its layer-pipelined update (Note: [pipelined step]).
        False when the closure re-planned to a schedule whose optimizer step is serial (a re-plan runs
        at the end of a step's backward): the caller then steps ``optimizer`` itself."""
        if self.steps.order(optimizer) is None:
            return False
        self.steps.start(optimizer, clipped_grads=self.fit.grads_read_after_step is not None)
        if self._step_waits() is not None:  # Note: [weights read after the step] (adapters/weight_readers.py)
            self.steps.finish()
        return True

    def _step_waits(self) -> str | None:
        """Why the optimizer step must have updated every weight when it returns: a hook of the fit
        (``FitSettings.step_waits``), or a block's master used outside its block (Note: [a master used
        outside its block] in engine/grad_writeback.py: the code that does so reads the master itself,
        before the forward would wait for its update)."""
        if self.fit.step_waits is not None:
            return self.fit.step_waits
        ex = self.executor
        if ex is not None and ex.params is not None and ex.params.outside_uses_seen:
            if not self._outside_logged:
                self._outside_logged = True
                log.warning("lazytrain: a block's weights were used outside the block (e.g. a weight penalty on "
                            "the parameter itself): the optimizer step updates every weight before it returns "
                            "from now on (no pipelined step)")
            return "a block's weights are used outside the block"
        return None

    def finish_optimizer_steps(self, what: str | None = None) -> bool:
        """Wait for pipelined updates still running (before evaluation, checkpoints, teardown); ``what``
        (a checkpoint, evaluation) raises where a step begun in the backward is still open; without it
        such a step is given up (returns True: the masters hold a step half done)."""
        return self.steps.finish(refuse=what)

    def masters_in_modules(self) -> contextlib.AbstractContextManager:
        """Note: [a state dict mid-bind] (engine/param_binding.py): the host masters in the modules while a
        checkpoint reads their ``state_dict()``."""
        ex = self.executor
        return ex.params.masters_in_modules() if ex is not None and ex.params is not None else contextlib.nullcontext()

    def clip_sharded(self, optimizer: Any, max_norm: float) -> bool:
        """``clip_grad_norm_`` over ``optimizer``'s parameters when blocks are sharded, with the norm of
        the whole gradients (``shard_norms.clip_sharded``); False, nothing done, otherwise."""
        store = self.shard_store()
        if store is None or self.grad_sync is None:
            return False
        clip_sharded(store, self.grad_sync, optimizer, max_norm)
        return True

    def _whole_grad_norms(self, stale: list) -> dict:
        store = self.shard_store()
        assert store is not None and self.grad_sync is not None
        return whole_grad_norms(store, self.grad_sync, stale)

    # ---- evaluation ------------------------------------------------------------------------------
    def begin_inference(self) -> None:
        """Evaluation begins: pipelined updates finished, an open micro-batch dropped, non-block
        weights staged on the device while blocks stream."""
        self.steps.finish(refuse="evaluation")
        ex = self.executor
        if ex is not None:
            ex.disarm()
            self.abort_microbatch()  # a forward without backward (manual optimization)
            self._inference.enter_context(ex.inference())
            if self.race is not None:  # an evaluation's step is not timed (Note: [the plan checked by measurement])
                self.race.taint()
            if ex.evaluating_mid_step:  # its time is not the step's (step_seconds, the drift watch)
                t0 = time.perf_counter()
                self._inference.callback(lambda: setattr(self, "_t_step", self._t_step + time.perf_counter() - t0))

    def end_inference(self) -> None:
        self._inference.close()

    @contextlib.contextmanager
    def inference(self) -> Iterator[None]:
        self.begin_inference()
        try:
            yield
        finally:
            self.end_inference()

    # ---- end -------------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Restore the blocks' forward, free device buffers and threads; the module keeps its trained
        host parameters. The re-plan records stay; the next fit profiles and plans again. A failed
        pipelined update (raised again by ``steps.clear``) is raised after everything is closed."""
        try:
            self.steps.clear()
        finally:
            try:
                self.end_inference()
            finally:
                self._close()

    def _close(self) -> None:
        if self.executor is not None:
            if self.last_stats is not None and self.artifact_dir and self.layout.is_global_zero:
                _write_measured_timeline(self.last_stats, self.artifact_dir)
            self.executor.close()
            self.executor = None
        for hooks in self._loss_hooks:
            hooks.remove()
        self._loss_hooks = []
        self.planner.reset()
        self.race = None
        self._tokens = None
        self._profiled_trainable = None
        self._micro_index = 0
        self._steps_ended = self._incomplete_profiles = 0  # a next fit warms up and profiles again
        self.metrics, self._metrics_taken = {}, True
        if self.grad_sync is not None:
            self.grad_sync.close()
        self.grad_sync = None
        self.module = None
        self.optimizers = []


def _write_measured_timeline(stats: StepStats, directory: str) -> None:
    if not stats.segments:
        return
    try:
        from lightning_lazytrain.planner.report import plot_timeline

        os.makedirs(directory, exist_ok=True)
        plot_timeline(stats.segments, os.path.join(directory, "timeline_measured.png"), title="measured: last step")
    except Exception as err:  # a plot must never fail a run
        log.warning("could not draw the measured timeline: %s", err)
