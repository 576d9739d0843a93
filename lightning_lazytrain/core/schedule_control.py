"""Which schedule the training core runs, and when it switches: the plan from a profiled step, a larger
batch planned for ahead, the plan timed against its baselines, and the switch itself (a mixin of
``TrainingCore``, training_core.py: it reads the core's executor-facing state).

A switch happens between optimizer steps, after the updates in flight: ``_run_on`` sets the schedule and
placement, gives the allocator's cache back and configures the optimizer step for it; ``_switch`` does that
for a plan (its NVMe space checked first, its table logged, its files written). ``_plan`` makes the plan
from a profiled step (Note: [profiled first step] in training_core.py), ``_guard_size`` plans ahead for a
larger batch (Note: [batches larger than the plan] in batch_size.py), ``_race_step`` runs the plan's
measured check (Note: [the plan checked by measurement] in plan_race.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_lazytrain.core.allocator import release_cache
from lightning_lazytrain.core.optimizer_steps import hybrid_adamws
from lightning_lazytrain.core.planning import Profile
from lightning_lazytrain.core.processes import broadcast_object
from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.nvme import check_nvme_dir
from lightning_lazytrain.engine.param_store import REST
from lightning_lazytrain.planner import min_memory
from lightning_lazytrain.planner.placement import conversions_note

if TYPE_CHECKING:
    from lightning_lazytrain.core.batch_size import BatchSizeGuard
    from lightning_lazytrain.core.options import CoreOptions, FitSettings, ProcessLayout
    from lightning_lazytrain.core.optimizer_steps import PipelinedSteps
    from lightning_lazytrain.core.plan_race import PlanRace
    from lightning_lazytrain.core.planning import Planner

__all__ = ["ScheduleControl"]

log = logging.getLogger("lightning_lazytrain.core.training_core")  # the core's messages, under its name


class ScheduleControl:
    """The schedule-switching half of ``TrainingCore`` (see the module doc); the attributes are the core's."""

    options: CoreOptions
    planner: Planner
    steps: PipelinedSteps
    layout: ProcessLayout
    batch_size: BatchSizeGuard
    fit: FitSettings
    optimizers: list
    race: PlanRace | None
    _profiled_trainable: tuple[int, ...] | None
    artifact_dir: str | None
    grad_sync: Any
    _info: Callable[[str], None]

    def _guard_size(self, ex: Executor, elements: int, tokens: Callable[[], int]) -> None:
        """Note: [batches larger than the plan] (core/batch_size.py)."""
        guard = self.batch_size
        if ex.profiling or self.plan is None:
            return
        factor = guard.factor(elements, first=self._micro_index == 0)
        if guard.mid_step():
            log.warning("lazytrain: a micro-batch larger than the plan covers came after the first of its "
                        "optimizer step: it runs on the current schedule (a schedule switches between steps only); "
                        "the next step is planned for it")
        if factor is None:
            return
        if self.layout.is_distributed:
            if not self._size_logged:
                self._size_logged = True
                log.warning("lazytrain: a micro-batch %.2fx the size the plan was made for; with several processes "
                            "the plan is not re-made for it ahead (each rank's batches differ). Profile with the "
                            "longest batches (sort or pad them to one length)", factor)
            guard.cover(factor)
            return
        plan = self.planner.rescale(factor, ex.schedule, step=self._steps_ended)
        guard.cover(factor)
        if plan is self.planner.SHORT:
            return
        # the current schedule does not fit the scaled estimate: this step runs on the estimate's plan (or,
        # where the estimate fits no schedule, the smallest footprint there is) and is profiled; the plan
        # is then made from what it measured (the estimate is linear in the batch, the step is not)
        self.steps.finish()  # the schedule switches after the updates in flight
        self.race = None  # the plan for this batch is timed once it is made from its profile
        if plan is not None:
            self._switch(ex, plan)
        else:
            self._run_on(ex, min_memory(len(ex.stack)))
        self.planner.replan_reason = None
        ex.profiling = True
        self._tokens = tokens()
        self._size_reason = f"a micro-batch {factor:.2f}x the size the plan was made for"

    # Note: [blocks thawed or frozen] The plan is made for the weights that trained in its profiled step: which
    # blocks run a backward at all (Workload.no_backward: none, no re-run, no second fetch, no internals for
    # the others), what each gradient copy moves, the optimizer's states and seconds. A fine-tune that thaws
    # weights later (BaseFinetuning, requires_grad_) or freezes some runs another step: a thawed prefix now
    # keeps the internals its plan priced as none, and the plan's peak no longer holds. So before a step's
    # first micro-batch the elements that train per group (or that an optimizer holds: a toggled GAN stays
    # as it is) are compared with the profile's; on a change the step runs on the smallest footprint
    # (min_memory), is profiled, and its plan is taken whatever it gains (``Planner.replan_forced``; a named
    # policy: its schedule, priced again). ``Planner.watch_backward`` checks the engine's own set after
    # each planned step, for changes this count does not see.
    def _trainable(self, ex: Executor) -> tuple[int, ...]:
        """Per group (the non-block one, then each block): the elements that train or an optimizer holds."""
        assert ex.params is not None
        held = {id(q) for o in self.optimizers for g in getattr(o, "param_groups", ()) for q in g["params"]}
        return tuple(sum(p.numel() for p in ex.params.group_parameters(j) if p.requires_grad or id(p) in held)
                     for j in (REST, *range(len(ex.stack))))

    def _guard_trainable(self, ex: Executor, tokens: Callable[[], int]) -> None:
        """Note: [blocks thawed or frozen]: a step whose weights that train differ from the profile's is
        profiled, on min_memory."""
        if (ex.profiling or self.plan is None or self._micro_index != 0 or self._profiled_trainable is None
                or not self.options.replan.enabled):
            return
        now = self._trainable(ex)
        if now == self._profiled_trainable:
            return
        before, self._profiled_trainable = self._profiled_trainable, None
        changed = [("non-block" if k == 0 else f"block {k - 1}") for k, (a, b) in enumerate(zip(before, now)) if a != b]
        self.steps.finish()  # the schedule switches after the updates in flight
        self._run_on(ex, min_memory(len(ex.stack)))
        self.planner.replan_reason = f"the weights that train changed in {', '.join(changed)} (thawed or frozen)"
        self.planner.replan_forced = True
        ex.profiling = True
        self._tokens = tokens()
        self._info(f"lazytrain: {self.planner.replan_reason}; this step runs on the smallest footprint and is "
                   "profiled to re-plan")

    def _profile_warmup(self) -> int:
        """Steps run on the provisional schedule before the profiled one (core/replan.py, Note:
        [profile warm-up])."""
        n = self.options.replan.profile_warmup
        return (1 if self.device.type == "cuda" else 0) if n is None else n

    def _race_step(self, ex: Executor) -> bool:
        """Note: [the plan checked by measurement] (core/plan_race.py): a step of the race, if one runs
        (rank 0's clock decides for all); switches the schedule where the race says. True while it runs."""
        race = self.race
        if race is None:
            return False
        choice = None
        if self.layout.is_global_zero:
            entry = race.abandon() if self.planner.replan_reason is not None else race.step_ended(time.perf_counter())
            choice = None if entry is None else race.entries.index(entry)
        if self.layout.is_distributed:  # the other ranks follow rank 0's clock
            choice, race.current, won = broadcast_object((choice, race.current, race.winner_index))
            race.winner = None if won is None else race.entries[won]
        if choice is not None:
            self.steps.finish()  # the schedule switches after the updates in flight
            entry = race.entries[choice]
            self._run_on(ex, entry.schedule, entry.plan.result.placement)
            self.planner.predicted, self.planner.peak = entry.predicted_s, entry.plan.result.sim.peak_gpu_bytes
        if race.done:
            self.race = None
            self.planner.raced(race, self._steps_ended)
        return True

    def _incomplete_profile(self, ex: Executor, stats: StepStats) -> None:
        """The step meant as the profile left blocks without a backward (Note: [unreached blocks]):
        the next step profiles; after three such steps the run stays on the provisional schedule."""
        self._incomplete_profiles += 1
        blocks = ", ".join(map(str, sorted(stats.unreached)))
        if self._incomplete_profiles < 3:
            self._info(f"lazytrain: the profiled step's backward did not reach block(s) {blocks} of its "
                       "planned pass (a forward with grad whose output was detached or not backpropagated); "
                       "the next step is profiled instead")
            return
        ex.profiling = False
        self.planner.replan_reason = None
        log.warning("lazytrain: %d steps in a row left block(s) %s of the planned pass without a backward, so no "
                    "step could be profiled: training goes on exactly, on the current schedule (%s), without a "
                    "new plan. Run forwards whose output is not backpropagated under torch.no_grad() to let the "
                    "strategy plan.", self._incomplete_profiles, blocks, ex.schedule.policy)

    def _plan(self, ex: Executor, stats: StepStats, micro_batches: int, step: int) -> None:
        """Plan from the profiled step and switch the executor to the plan, before the step's optimizer
        update (an impossible budget raises here). Full micro-batches (each writes all of its
        gradients back: the executor's step is the micro-batch) are planned one by one."""
        if self.race is not None:  # a re-profile ends the race on the plan (Note: [the plan checked by measurement])
            back, self.race = self.race.abandon(), None
            if back is not None:
                self._run_on(ex, back.schedule, back.plan.result.placement)
        profile = Profile(ex, stats, tokens=self._tokens or 1, grad_accum=1 if self._full else self.fit.grad_accum,
                          micro_batches=micro_batches, t_step=self._t_step, hybrids=hybrid_adamws(self.optimizers),
                          grad_sync=self.grad_sync, shard_store=self.shard_store(),
                          shard_bytes_per_s=self._shard_bytes_per_s,
                          updates_in_backward=self._updates_in_backward(),
                          # the parts a configuration would arm whose gradients the profiled step saw complete early
                          early_parts=tuple(p for p in self.steps.planned_early_parts(ex, self.optimizers)
                                            if p in stats.early_complete_parts) if self._updates_in_backward() else (),
                          serial_step=self._step_waits() is not None)
        self._profiled_trainable = self._trainable(ex)  # Note: [blocks thawed or frozen]
        try:
            plan = self.planner.solve(profile, self.layout, step=step, device=self.device)
        except Exception:
            if self._size_reason is not None:  # Note: [batches larger than the plan]: say which batch
                log.error("lazytrain: planning for %s (the step just profiled) failed: a batch that large does not "
                          "fit this budget; cap the batch length (or its size) or raise gpu_memory_budget_gb",
                          self._size_reason)
            raise
        finally:
            self._size_reason = None
        # the plan covers the profiled step's largest micro-batch; a kept schedule, what it covered too
        covered = self.batch_size.covered
        self.batch_size.planned()
        if plan is None:  # a re-plan that keeps the current schedule
            self.batch_size.covered = max(covered, self.batch_size.covered)
            return
        self._switch(ex, plan)
        self.race = self.planner.race(plan, self.device)
        if self.race is not None:
            self.race.step_ended(time.perf_counter())  # the clock starts at the step that adopted the plan

    def _run_on(self, ex: Executor, schedule: Any, placement: Any = None) -> None:
        """The executor runs ``schedule`` (and ``placement``, a plan's) from now on (between optimizer steps)."""
        ex.set_schedule(schedule)
        if placement is not None:
            ex.set_placement(**placement.groups(len(ex.stack)))  # Note: [conversion placement]
        release_cache(ex.device)  # the old schedule's cached segments (Note: [the budget is what the allocator reserves])
        # the schedule decides: serial or pipelined optimizer (Note: [pipelined step])
        ex.set_wait_updated(self.steps.wait_updated if self.steps.configure(
            ex, self.optimizers, in_backward=self.fit.updates_in_backward) else None)

    def _switch(self, ex: Executor, plan: Any) -> None:
        """The executor runs ``plan`` from now on (between optimizer steps)."""
        nvme = int(plan.result.sim.nvme_bytes)
        if nvme:
            check_nvme_dir(self.options.nvme_dir, nvme)  # before the first real step
            ex.nvme_required_bytes = nvme
        t0 = time.perf_counter()
        self._run_on(ex, plan.schedule, plan.result.placement)
        plan.timings["executor"] = time.perf_counter() - t0
        self.planner.adopt(plan)
        from lightning_lazytrain.planner.report import format_table

        self._info(f"lazytrain plan ({plan.result.status}; profile {plan.timings['profile']:.2f} s, "
                   f"solve {plan.timings['solve']:.2f} s){conversions_note(plan.result.workload, plan.result.placement)}:\n"
                   f"{format_table(plan.result.rows())}")
        if self.artifact_dir and self.layout.is_global_zero:
            plan.write(self.artifact_dir)

    def _updates_in_backward(self) -> bool:
        """May the run's optimizer update blocks during the backward (Note: [updates in the backward pass]
        in optimizer_steps.py)? What ``PipelinedSteps.configure`` will find, for the plan's pricing."""
        return (self.fit.updates_in_backward is None and self.grad_sync is None and not self._late_grads_seen
                and any(getattr(o, "updates_in_backward", False) for o in hybrid_adamws(self.optimizers)))
