"""The training core's planner: the machine a plan is made for, the plan made from a profiled step
(rank 0 solves for every process), one rank's workload with several processes, the 8-bit slice of
``HybridAdamW(eight_bit="plan")``, and when to re-plan (drift: ``replan.py``; the allocator's peaks:
``allocator.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_lazytrain.core.allocator import MemoryWatch
from lightning_lazytrain.core.autoplan import (AutoPlan, given_hardware, host_job_seconds, measure_hardware,
                                               plan_from_workload)
from lightning_lazytrain.core.options import CoreOptions, ProcessLayout
from lightning_lazytrain.core.plan_race import PlanRace, RaceEntry
from lightning_lazytrain.core.processes import broadcast_object, gather_objects
from lightning_lazytrain.core.replan import DriftMonitor, measured_link_rates
from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.param_store import REST
from lightning_lazytrain.engine.profiler import workload_from_stats
from lightning_lazytrain.planner import Hardware, InfeasibleBudget, InfeasibleSchedule, Workload, simulate
from lightning_lazytrain.planner.plan import EIGHT_BIT_FIX
from lightning_lazytrain.planner.milp import MilpOptions
from lightning_lazytrain.planner.placement import candidates

__all__ = ["Planner", "Profile"]

#: the host-memory fix for a Trainer user: 8-bit states for every parameter
TRAINER_EIGHT_BIT_FIX = ("the optimizer lightning_lazytrain.optim.HybridAdamW(..., eight_bit='all') (on a resume, a "
                         "checkpoint's 32-bit states are converted as it loads)")

log = logging.getLogger(__name__)


class Profile:
    """A profiled step, as the planner needs it: the executor that ran it, its stats, and what the
    core knows of the run (tokens of a micro-batch, accumulation, the step's micro-batches, when
    the step began, the HybridAdamW optimizers, the gradient sync, a sharded store's measured
    collective bandwidth, whether blocks are updated during the backward, and whether the optimizer step
    must be serial)."""

    def __init__(self, executor: Executor, stats: StepStats, *, tokens: int, grad_accum: int, micro_batches: int,
                 t_step: float, hybrids: list, grad_sync: Any, shard_store: Any,
                 shard_bytes_per_s: float | None, updates_in_backward: bool = False,
                 early_parts: tuple[int, ...] = (), serial_step: bool = False) -> None:
        self.executor = executor
        self.stats = stats
        self.tokens = tokens
        self.grad_accum = grad_accum
        self.micro_batches = micro_batches
        self.t_step = t_step
        self.hybrids = hybrids
        self.grad_sync = grad_sync
        self.shard_store = shard_store
        self.shard_bytes_per_s = shard_bytes_per_s
        # Note: [updates in the backward pass] (core/optimizer_steps.py): the run's updates may start there
        self.updates_in_backward = updates_in_backward
        # Note: [early non-block parts] (engine/early_parts.py): the parts written back and updated there
        self.early_parts = early_parts
        # Note: [weights read after the step] (adapters/weight_readers.py): the step must be serial
        self.serial_step = serial_step


class Planner:
    """Plans for ``TrainingCore``; owns the plan, the re-plan records and the watches that ask for one.

    ``info``/``debug``: where its messages go (the strategies pass Lightning's rank-zero loggers)."""

    def __init__(self, options: CoreOptions, *, info: Callable[[str], None], debug: Callable[[str], None]) -> None:
        self.options = options
        self._info, self._debug = info, debug
        self.plan: AutoPlan | None = None
        self.replans: list[dict[str, Any]] = []  # what each re-plan found and did
        self.races: list[dict[str, Any]] = []  # what each race measured and kept (core/plan_race.py)
        self.drift = DriftMonitor(options.replan)
        # the allocator's reserve against the budget (allocator.py, Note: [the budget is what the allocator reserves])
        self.memory = MemoryWatch()
        self.budget_bytes: float | None = None
        self.replan_reason: str | None = None  # set: the next step is re-profiled
        self.replan_forced = False  # ... and its plan is taken whatever it gains (Note: [blocks thawed or frozen])
        self.no_backward: tuple[int, ...] | None = None  # the blocks without a backward in the last profile
        self.predicted: float | None = None  # the current schedule's prediction after a kept re-plan
        self.peak: float | None = None  # ... and its peak of device bytes (what the memory watch holds it to)
        self._milp: MilpOptions | None = None  # the options the last plan was solved with (rescale's too)
        self._measured: Hardware | None = None

    # ---- the machine -----------------------------------------------------------------------------
    def start(self, device: torch.device, memory: MemoryWatch, *, measure: bool) -> None:
        """Before the executor allocates: the allocator's watch, and with ``hardware="measure"`` (and
        ``measure``) the device's free memory and the links, read now."""
        self.memory = memory
        o = self.options
        if o.hardware == "measure" and measure:
            self._measured = measure_hardware(device, gpu_memory_budget_gb=o.gpu_memory_budget_gb,
                                              nvme_dir=o.nvme_dir, link_gb_per_s=o.emulate_link_gb_per_s,
                                              host_job=False)  # measured when a plan needs it (solve)

    def hardware(self, device: torch.device | None = None, per_node: int = 1) -> Hardware:
        """The machine to plan for. The budget applies on every path; without ``nvme_dir`` the plan
        gets no NVMe tier (there is nowhere to spill). With several processes on a node, each holds
        its own masters and optimizer states: a process plans with its share of host memory."""
        o = self.options
        if o.hardware == "measure":
            if self._measured is None:
                self._measured = measure_hardware(device or torch.device("cpu"),
                                                  gpu_memory_budget_gb=o.gpu_memory_budget_gb, nvme_dir=o.nvme_dir,
                                                  link_gb_per_s=o.emulate_link_gb_per_s, host_job=False)
            hw = self._measured
        else:
            hw = given_hardware(o.hardware, o.gpu_memory_budget_gb, o.nvme_dir)
        if per_node > 1:
            hw = hw.replace(cpu_memory_bytes=hw.cpu_memory_bytes / per_node)
        # the budget bounds what the allocator reserves; the plan's allocated peak gets it less the
        # allocator's reserve (allocator.py, Note: [the budget is what the allocator reserves])
        self.budget_bytes = hw.gpu_memory_cap_bytes
        return hw.replace(gpu_memory_cap_bytes=self.memory.cap(hw.gpu_memory_cap_bytes))

    def predicted_seconds(self) -> float:
        """The step time the current schedule is predicted at (nan before a plan)."""
        if self.predicted is not None:
            return self.predicted
        return self.plan.result.sim.iteration_seconds if self.plan else float("nan")

    def predicted_peak(self) -> float:
        """The device bytes the current schedule is predicted to allocate at its peak (after a kept re-plan: on
        the new profile, which counts what the step left untracked)."""
        assert self.plan is not None
        return self.peak if self.peak is not None else self.plan.result.sim.peak_gpu_bytes

    # ---- the plan ----------------------------------------------------------------------------------
    def solve(self, p: Profile, layout: ProcessLayout, *, step: int, device: torch.device) -> AutoPlan | None:
        """Plan from the profiled step; the plan to switch to, or None to keep the current schedule (a
        re-plan that does not gain ``replan.min_gain``). Rank 0 plans for all and broadcasts the plan or
        its failure (an impossible budget raises here, on every rank). A re-plan measures the links
        from the step's copies and compares against the current schedule on the new profile."""
        reason, self.replan_reason = self.replan_reason, None
        forced, self.replan_forced = self.replan_forced, False
        self.no_backward = tuple(sorted(p.stats.no_backward))
        ex = p.executor
        plan: AutoPlan | None = None
        failure: str | None = None
        current_s: float | None = None  # the current schedule, re-simulated (re-plans only)
        current_peak: float | None = None  # ... and its peak
        # every process's allocator peaks in the profiled step: the worst primes the first plan (allocator.py)
        peaks = gather_objects((p.stats.max_memory_reserved, p.stats.max_memory_allocated))
        if layout.is_global_zero:  # with several processes rank 0 plans for all (one plan, not N)
            try:
                t0 = time.perf_counter()
                hardware = self.hardware(device, layout.per_node)
                reserved, allocated = peaks[MemoryWatch.worst(peaks, self.budget_bytes or float("inf"),
                                                              self.memory.ratio)]
                if reason is None and self.plan is None and self.memory.prime(
                        reserved=reserved, allocated=allocated,
                        budget_bytes=self.budget_bytes):  # the allocator's overhead, seen in the profiled step
                    self._info(f"lazytrain: the allocator reserved {reserved / 1e9:.3g} GB for "
                               f"{allocated / 1e9:.3g} GB allocated in the profiled step: the plan "
                               f"leaves room for it (reserve ratio {self.memory.ratio:.3f})")
                    hardware = self.hardware(device, layout.per_node)
                if reason is not None:
                    rates = measured_link_rates(p.stats.segments)
                    hardware = hardware.replace(h2d_bytes_per_s=rates.get("h2d", hardware.h2d_bytes_per_s),
                                                d2h_bytes_per_s=rates.get("d2h", hardware.d2h_bytes_per_s))
                t_hw = time.perf_counter() - t0
                wl = workload_from_stats(ex, p.stats, tokens=p.tokens or 1, grad_accum=p.grad_accum,
                                         micro_batches=p.micro_batches, opt_params_per_s=hardware.cpu_adam_params_per_s)
                if self.options.hardware == "measure" and len(candidates(wl)) > 1:
                    # the host lane's fixed cost per job prices only conversions to place (planner/placement.py):
                    # measured for a workload that has them, once per process (autoplan.host_job_seconds)
                    t1 = time.perf_counter()
                    hardware = hardware.replace(host_job_seconds=host_job_seconds(
                        device, link_gb_per_s=self.options.emulate_link_gb_per_s))
                    t_hw += time.perf_counter() - t1
                wl, fraction = self._price_optimizer_states(wl, hardware, p)
                wl = rank_workload(wl, layout, p)
                if p.updates_in_backward:  # priced where the updates run (planner/schedule.py)
                    wl = dataclasses.replace(wl, updates_in_backward=True, early_parts=tuple(
                        k for k in p.early_parts if k < wl.nonblock_part_count))
                self._milp = MilpOptions(conversions=self.options.conversions,
                                         optimizer_mode="serial" if p.serial_step else "auto")
                plan = plan_from_workload(wl, hardware, policy=self.options.policy, options=self._milp,
                                          start=ex.schedule if reason is not None else None, profiled=ex.schedule)
                plan.state_fraction = fraction
                plan.timings["hardware"] = t_hw
                plan.timings["profile"] = time.perf_counter() - p.t_step - plan.timings["solve"] - t_hw
                if reason is not None:
                    try:
                        current = simulate(ex.schedule, wl, hardware)
                        current_s, current_peak = current.iteration_seconds, current.peak_gpu_bytes
                    except Exception:  # the current schedule no longer fits: switch
                        current_s = float("inf")
            except BaseException as err:
                if isinstance(err, InfeasibleBudget):  # the first line a user reads, before the traceback
                    err = err.reworded(EIGHT_BIT_FIX, TRAINER_EIGHT_BIT_FIX)  # the fix in a Trainer user's terms
                    if self.budget_bytes:  # a GPU budget that works, not the cap the allocator's reserve left
                        err = err.under_reserve(self.memory.ratio, self.budget_bytes)
                    log.error("lazytrain cannot train this within its budget: %s", err)
                if (isinstance(err, InfeasibleSchedule) and err.resource == "nvme_capacity"
                        and self.options.nvme_dir is not None and err.need_bytes is not None):
                    # a plan (a plan file's) needs more spill space than the drive has: say which directory
                    # and how to fix it (NvmeDirError), as the check before the first step does
                    from lightning_lazytrain.engine.nvme import check_nvme_dir

                    try:
                        check_nvme_dir(self.options.nvme_dir, int(err.need_bytes))
                    except Exception as named:
                        err = named
                if not layout.is_distributed:
                    raise err
                failure = f"{type(err).__name__}: {err}"
                broadcast_object((None, failure, None, None))
                raise err
        if layout.is_distributed:
            plan, failure, current_s, current_peak = broadcast_object((plan, failure, current_s, current_peak))
            if plan is None:
                raise RuntimeError(f"rank 0 could not plan, so no rank trains: {failure}")
        assert plan is not None
        if plan.state_fraction is not None:  # the other processes' optimizers take rank 0's choice
            for o in p.hybrids:
                if o.bits_pending:
                    o.set_state_bits("none" if plan.state_fraction == 0 else plan.state_fraction)
        if reason is None:
            self.predicted = self.peak = None
            return plan
        assert current_s is not None
        new_s = plan.result.sim.iteration_seconds
        gain = 1.0 - new_s / current_s if current_s > 0 else 0.0
        switch = forced or gain >= self.options.replan.min_gain
        self.replans.append({"step": step, "reason": reason, "current_predicted_s": current_s,
                             "new_predicted_s": new_s, "gain": gain, "switched": switch,
                             "warm_start": plan.result.solver.get("seed")})
        # a switch is news; a kept schedule (usually a noisy machine) is a debug line and a row of
        # ``replans`` (the training app sums them up in its summary)
        (self._info if switch else self._debug)(
            f"lazytrain re-plan at step {step}: {reason}; current schedule {current_s:.3f} s, "
            f"new plan {new_s:.3f} s ({gain:+.1%}): {'switching' if switch else 'keeping the current schedule'}")
        self.drift.replanned(switch)  # a kept schedule raises the bar for the next re-plan
        if not switch:
            self.predicted, self.peak = current_s, current_peak
            return None
        self.predicted = self.peak = None
        return plan

    def adopt(self, plan: AutoPlan) -> None:
        """The executor runs ``plan`` now."""
        self.plan = plan

    def race(self, plan: AutoPlan, device: torch.device) -> PlanRace | None:
        """Note: [the plan checked by measurement] (core/plan_race.py): the race for ``plan`` just adopted, or
        None (off, not the MILP's plan, or no baseline fits the budget within the margin). Every rank
        builds the same race from the same plan; rank 0's clock decides (``TrainingCore``)."""
        o = self.options.replan
        if self.options.policy != "milp" or not o.races(device.type):
            return None
        result = plan.result
        mine = result.sim.iteration_seconds
        challengers = []
        for name, schedule in result.baseline_schedules.items():
            if dataclasses.replace(schedule, policy="") == dataclasses.replace(result.schedule, policy=""):
                continue  # the plan is this baseline
            try:
                sim = simulate(schedule, result.workload, result.hardware)
            except InfeasibleSchedule:
                continue  # does not fit the budget
            if sim.iteration_seconds <= mine * (1.0 + o.race_margin):
                challengers.append(RaceEntry(name, schedule, sim.iteration_seconds, plan=dataclasses.replace(
                    plan, result=dataclasses.replace(result, schedule=schedule, sim=sim))))
        if not challengers:
            return None
        challengers = sorted(challengers, key=lambda e: e.predicted_s)[:o.race_candidates]
        self._debug(f"lazytrain: timing the plan against {', '.join(e.name for e in challengers)} "
                    f"({o.patience} steps each; Note: [the plan checked by measurement])")
        return PlanRace([RaceEntry("plan", result.schedule, mine, plan=plan), *challengers], steps=o.patience,
                        min_gain=o.min_gain)

    def raced(self, race: PlanRace, step: int) -> None:
        """A race is decided: its winner's plan is the plan (predictions, the drift baseline, the memory
        watch's peak); logged and kept in ``races``."""
        assert race.winner is not None
        self.plan = race.winner.plan
        self.predicted = self.peak = None
        self.drift.reset()
        self.races.append({"step": step, **race.record()})
        kept_plan = race.winner is race.entries[0]
        (self._debug if kept_plan else self._info)(
            f"lazytrain: the plan timed against the baselines it was compared with at step {step}: {race.summary()}")

    SHORT = object()  # rescale(): the current schedule stays

    def rescale(self, factor: float, current: Any, *, step: int) -> Any:
        """Micro-batches ``factor`` times what the plan covers are coming (Note: [batches larger than the
        plan] in core/batch_size.py), on the plan's workload scaled by ``factor``: ``SHORT`` when the
        current schedule fits the budget there (it now covers them; another policy than the MILP has no
        other schedule: the excess is logged), else the MILP's plan for it, or None where no schedule fits
        the estimate (the caller then runs the smallest footprint there is and profiles). One process."""
        assert self.plan is not None
        result = self.plan.result
        hardware = result.hardware
        if self.budget_bytes is not None:  # the allocator's reserve as the memory watch has it now
            hardware = hardware.replace(gpu_memory_cap_bytes=self.memory.cap(self.budget_bytes))
        wl = result.workload.scaled(factor)
        try:
            sim = simulate(current, wl, hardware)
        except InfeasibleSchedule as err:
            short = err
        else:
            self._debug(f"lazytrain: micro-batches {factor:.2f}x the planned size fit the current schedule "
                        f"({sim.iteration_seconds:.3f} s predicted)")
            self.plan = dataclasses.replace(self.plan, result=dataclasses.replace(result, workload=wl, sim=sim))
            self.predicted = self.peak = None
            return self.SHORT
        if self.options.policy != "milp":
            log.warning("lazytrain: a micro-batch %.2fx the size the plan was made for does not fit policy=%r's "
                        "schedule (%s); it runs on it anyway. Plan from a step with the longest batches, or use "
                        "policy='milp'", factor, self.options.policy, short)
            self.plan = dataclasses.replace(self.plan, result=dataclasses.replace(result, workload=wl))
            return self.SHORT
        t0 = time.perf_counter()
        plan: AutoPlan | None
        try:
            plan = plan_from_workload(wl, hardware, policy="milp", options=self._milp, start=current)
        except InfeasibleBudget as err:
            plan, then = None, (f", nor any on the linear estimate ({err}); this step runs on the smallest footprint "
                                "and is profiled to plan for it")
        else:
            plan.timings["profile"] = 0.0
            then = (f"; re-planned for it in {time.perf_counter() - t0:.2f} s, switching (this step is profiled: the "
                    "plan is then made from what it measured)")
        self.replans.append({"step": step, "reason": f"a micro-batch {factor:.2f}x the planned size",
                             "current_predicted_s": float("inf"),
                             "new_predicted_s": plan.result.sim.iteration_seconds if plan else float("nan"),
                             "gain": float("nan"), "switched": True,
                             "warm_start": plan.result.solver.get("seed") if plan else None})
        self._info(f"lazytrain: a micro-batch {factor:.2f}x the size the plan was made for: the current schedule "
                   f"does not fit ({short}){then}")
        if plan is not None:
            self.predicted = self.peak = None
        return plan

    def _price_optimizer_states(self, wl: Workload, hardware: Hardware, p: Profile) -> tuple[Workload, float | None]:
        """Note: [planned 8-bit slice] (optim/plan_states.py): ``HybridAdamW(eight_bit="plan")`` gets the
        smallest 8-bit slice that fits host memory; every HybridAdamW is priced as its states are
        (the 8-bit update's rate measured when there is one)."""
        from lightning_lazytrain.optim.bnb8bit import measure_adamw_8bit_params_per_s
        from lightning_lazytrain.optim.plan_states import choose_state_bits, price_optimizers

        if not p.hybrids:
            return wl, None
        fraction = choose_state_bits(p.hybrids, wl.host_static_bytes, hardware.cpu_memory_bytes)
        if fraction is not None:
            self._info(f"lazytrain: HybridAdamW(eight_bit='plan'): {fraction:.1%} of its parameters with 8-bit "
                       "states" + (" (the host holds 32-bit states for all)" if fraction == 0 else
                                   " (the smallest slice that fits host memory)"))
        rate8 = hardware.cpu_adam8_params_per_s
        if any(o.bits_of(q) == 8 for o in p.hybrids for g in o.param_groups for q in g["params"]):
            rate8 = measure_adamw_8bit_params_per_s() or rate8
        params = p.executor.params
        assert params is not None
        groups = {j: params.group_parameters(j) for j in (REST, *range(len(p.executor.stack)))}
        return price_optimizers(wl, p.hybrids, groups, hardware.cpu_adam_params_per_s, rate8), fraction

    # ---- when to re-plan ---------------------------------------------------------------------------
    def watch_drift(self, layout: ProcessLayout, step_seconds: float) -> None:
        """After a planned step: has the run drifted from the plan? (decided on rank 0 for all)"""
        if self.plan is None or self.options.policy != "milp" or not self.options.replan.enabled or self.replan_reason:
            return
        reason = None
        if layout.is_global_zero:
            reason = self.drift.observe(step_seconds, self.predicted_seconds())
        if layout.is_distributed:
            reason = broadcast_object(reason)
        if reason is not None:
            self.replan_reason = reason
            self._debug(f"lazytrain: {reason}; re-profiling the next step to re-plan")

    def watch_backward(self, layout: ProcessLayout, stats: StepStats, layers: int) -> None:
        """Note: [blocks thawed or frozen] The plan prices the blocks that ran no backward in its profile
        (``Workload.no_backward``, planner/workload.py: no re-runs, no second fetch, no internals for them).
        When a planned step's set differs (a fine-tune thawed a frozen prefix, or froze one), the plan
        prices another run: fewer re-runs and fetches than now run, and no internals where blocks now keep
        them, so its peak may no longer hold. The next step is re-profiled and its plan taken whatever it
        gains (``replan_forced``; for a named policy: the same schedule, priced again). Only a step whose
        planned pass ran whole counts (a pass left without a gradient has no set to compare). Rank 0
        decides for all, as for drift."""
        if (self.plan is None or self.no_backward is None or not self.options.replan.enabled or self.replan_reason
                or len(stats.boundary_bytes) != layers + 1 or stats.unreached):
            return
        reason = None
        now = tuple(sorted(stats.no_backward))
        if layout.is_global_zero and now != self.no_backward:
            reason = (f"the blocks that run no backward changed from {list(self.no_backward)} (the plan's) to "
                      f"{list(now)} (weights thawed or frozen)")
        if layout.is_distributed:
            reason = broadcast_object(reason)
        if reason is not None:
            self.replan_reason, self.replan_forced = reason, True
            self._info(f"lazytrain: {reason}; re-profiling the next step to re-plan")

    def watch_memory(self, layout: ProcessLayout, stats: StepStats) -> None:
        """After a planned step on CUDA: the allocator's own peaks against the budget and the plan;
        a re-plan when they say so (Note: [the budget is what the allocator reserves]). Every process's
        peaks are gathered and rank 0 decides for all on the worst (only rank 0 has made the plan's machine,
        so only rank 0 knows the budget). A re-plan already wanted for another reason (drift, blocks thawed)
        still reads the step: it re-plans with the raised ratio, for both reasons."""
        if self.plan is None:
            return
        readings = gather_objects((stats.max_memory_reserved, stats.max_memory_allocated))
        replanning = self.options.policy == "milp" and self.options.replan.enabled
        reason = None
        if layout.is_global_zero and self.budget_bytes is not None:
            rank = MemoryWatch.worst(readings, self.budget_bytes, self.memory.ratio)
            reserved, allocated = readings[rank]
            reason = self.memory.observe(reserved=reserved, allocated=allocated, budget_bytes=self.budget_bytes,
                                         predicted_peak=self.predicted_peak(), replanning=replanning)
            if reason is not None and layout.is_distributed:
                reason = reason.replace("memory:", f"memory (rank {rank}):", 1)
        if layout.is_distributed:
            reason, ratio = broadcast_object((reason, self.memory.ratio))
            self.memory.ratio = ratio
        if reason is None:
            return
        if not replanning:
            log.warning("lazytrain: %s (not re-planned: policy=%r, replan=%s)", reason, self.options.policy,
                        self.options.replan.enabled)
            return
        self.replan_reason = f"{self.replan_reason}; {reason}" if self.replan_reason else reason
        self._info(f"lazytrain: {reason}")

    def reset(self) -> None:
        """The run ended (teardown): no plan, no pending re-plan; the re-plan records stay."""
        self.plan = None
        self._measured = None
        self.replan_reason, self.predicted, self.peak = None, None, None
        self.replan_forced, self.no_backward = False, None
        self.drift.reset()


def rank_workload(wl: Workload, layout: ProcessLayout, p: Profile) -> Workload:
    """With several processes: the plan is one rank's, with the host all-reduce of every group
    at the bandwidth the profiled step measured (``replicate_overlap`` with ``overlap_grad_sync``,
    else ``replicate``: the windows they run in); sharded groups: fetches of shards, all-gathers and
    reduce-scatters at the bandwidth of the store's in-line collectives."""
    sync = p.grad_sync
    if not layout.is_distributed or sync is None:
        return wl
    from lightning_lazytrain.planner.multi import measured_rank_workload, measured_shard_workload

    per_node = layout.per_node
    store = p.shard_store
    if store is not None:
        if p.shard_bytes_per_s is None:
            return wl
        e = torch.empty((), dtype=store.compute_dtype).element_size()
        land = store.slot(0).grad_host.element_size()
        return measured_shard_workload(
            wl, store.world, per_node, [store.shard_numel(j) for j in range(store.num_layers)],
            store.shard_numel(REST), p.shard_bytes_per_s, gather_element_bytes=e, reduce_element_bytes=land,
            replicas=store.replicas)
    bandwidth = sync.bytes_per_s()
    if bandwidth is None:  # no gradient crossed (a frozen model): nothing to price
        return wl
    # With accumulation the MILP plans the overlapped mode's windows as replicate's (the all-reduces
    # serial after the backward: an upper bound; the overlap runs only in a step's last micro-batch)
    mode = "replicate_overlap" if sync.overlap and wl.grad_accum == 1 else "replicate"
    params = p.executor.params
    assert params is not None
    host_grad = params.grad_flat(REST).element_size()  # the host gradients' dtype (the masters')
    # the flat host gradients as all-reduced: up to each group's last trainable parameter (Note: [host
    # gradients for what trains] in engine/grad_writeback.py)
    return measured_rank_workload(wl, layout.world_size, per_node, bandwidth, mode, grad_element_bytes=host_grad,
                                  grad_elements=[params.grad_flat(j).numel() for j in range(params.num_layers)],
                                  nonblock_grad_elements=params.grad_flat(REST).numel())
