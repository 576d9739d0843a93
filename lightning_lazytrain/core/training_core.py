"""``TrainingCore``: layer-streaming training without Lightning.

It owns the executor (``engine.Executor``), the plan (profile the first step, solve, switch; re-plan
on drift or when the allocator outgrows the plan: ``planning.py``), the gradient synchronisation of
several processes (``grad_sync.GradSync``), the pipelined optimizer steps (``optimizer_steps.py``)
and the checkpoint state transforms (``checkpoint_state.py``); a micro-batch's begin and end are its
mixin ``MicroBatches`` (``microbatches.py``), the schedule switches ``ScheduleControl``
(``schedule_control.py``). The Lightning strategies (``adapters/``) translate their framework's hooks
into this API::

    core = TrainingCore(CoreOptions(policy="milp"))
    core.connect_processes(layout, device)            # several processes: GradSync
    core.build(module, device, compute_dtype=..., precision="32-true", automatic=True, measure=True)
    core.start_fit(optimizers, FitSettings(grad_accum=2))
    core.begin_microbatch(lambda: count_tokens(batch), last=...)   # then the user's forward,
    core.before_backward(loss)                                      # and the backward
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

from lightning_lazytrain.core.allocator import MemoryWatch, configure_allocator
from lightning_lazytrain.core.autoplan import AutoPlan
from lightning_lazytrain.core.batch_size import BatchSizeGuard
from lightning_lazytrain.engine.blocks import find_blocks
from lightning_lazytrain.core.checkpoint_state import CheckpointState
from lightning_lazytrain.core.microbatches import MicroBatches
from lightning_lazytrain.core.optimizer_steps import PipelinedSteps, hybrid_adamws, split_rest_parts
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
from lightning_lazytrain.planner import Hardware, min_memory, recompute_all

__all__ = ["TrainingCore"]

log = logging.getLogger(__name__)


class TrainingCore(MicroBatches, ScheduleControl):
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
        self._outside_backward_warned = False  # Note: [a backward outside the strategy] (microbatches.py)
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
        elif compute_dtype == torch.float32:
            _refuse_narrow_parameters(module, precision)
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
            raise ValueError("LazyTrainStrategy(chunked_loss=...) found no Hugging Face causal LM (a ...ForCausalLM, or "
                             "another class AutoModelForCausalLM builds) "
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

    # ---- micro-batches: MicroBatches (microbatches.py) ---------------------------------------------

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
        outside its block] in engine/outside_uses.py: the code that does so reads the master itself,
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


def _refuse_narrow_parameters(module: torch.nn.Module, precision: str) -> None:
    """Under a float32 compute dtype ('32-true' and the mixed precisions) every weight is staged as float32: a
    16-bit parameter would compute in float32 where ``strategy="auto"`` computes in its own dtype (review 20: a
    bf16 model under Fabric's '32-true' failed in torch, "mat1 and mat2 must have the same dtype")."""
    narrow = [(n, p.dtype) for n, p in module.named_parameters() if p.is_floating_point() and p.dtype != torch.float32]
    if narrow:
        names = ", ".join(f"{n} ({str(d).replace('torch.', '')})" for n, d in narrow[:3])
        more = f" and {len(narrow) - 3} more" if len(narrow) > 3 else ""
        raise ValueError(
            f"strategy='lazytrain' with precision={precision!r} computes in float32, but the model has parameters "
            f"in another dtype: {names}{more}. Fix: convert the model to float32 (model.float()), or train 16-bit "
            "weights with the Trainer's precision='bf16-true' (fp32 masters: LazyTrainStrategy(fp32_masters=True))")
