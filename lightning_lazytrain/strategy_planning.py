"""Planning of ``LazyTrainStrategy`` (a mixin of it, strategy.py): the plan made from the profiled
first step (rank 0 solves for every process), the machine it is made for, one rank's workload with
several processes, and drift re-planning (``replan.py``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info

from lightning_lazytrain.autoplan import AutoPlan, given_hardware, measure_hardware, plan_from_workload
from lightning_lazytrain.engine.executor import StepStats
from lightning_lazytrain.engine.nvme import check_nvme_dir
from lightning_lazytrain.engine.param_store import REST as REST_GROUP
from lightning_lazytrain.engine.profiler import workload_from_stats
from lightning_lazytrain.planner import Hardware, InfeasibleBudget
from lightning_lazytrain.planner.milp import MilpOptions
from lightning_lazytrain.planner.placement import conversions_note

log = logging.getLogger(__name__)

__all__ = ["StrategyPlanning", "artifact_dir"]


class StrategyPlanning:
    """Planning methods of ``LazyTrainStrategy`` (it provides ``executor``, ``plan``, ``replan``,
    ``grad_sync``, the options and the rest of Lightning's strategy)."""

    def _predicted_seconds(self) -> float:
        if self._predicted is not None:
            return self._predicted
        return self.plan.result.sim.iteration_seconds if self.plan else float("nan")

    def _watch_drift(self) -> None:
        """After a planned step: has the run drifted from the plan? (decided on rank 0 for all)"""
        if self.plan is None or self.policy != "milp" or not self.replan.enabled or self._replan_reason:
            return
        reason = None
        if self.is_global_zero:
            reason = self._drift.observe(self._pending_metrics.get("lazytrain/step_seconds", float("nan")),
                                         self._predicted_seconds())
        if self.is_distributed:
            reason = self.broadcast(reason)
        if reason is not None:
            self._replan_reason = reason
            rank_zero_debug(f"lazytrain: {reason}; re-profiling the next step to re-plan")

    def _make_plan(self, stats: StepStats, micro_batches: int, replan: str | None = None) -> None:
        """Plan from the profiled step, and switch the executor to the plan (before the step's
        optimizer update; an impossible budget raises here). ``replan``: why this is a re-plan;
        the links are then measured from the step's copies, and the schedule switches only if the
        new plan beats the current schedule by ``replan.min_gain`` on the new profile."""
        ex, module = self.executor, self.lightning_module
        assert ex is not None and module is not None
        trainer = module.trainer
        plan: AutoPlan | None = None
        failure: str | None = None
        current_s: float | None = None  # the current schedule, re-simulated (re-plans only)
        if self.is_global_zero:  # with several processes rank 0 plans for all (one plan, not N)
            try:
                t0 = time.perf_counter()
                hardware = self._hardware()
                if replan is not None:
                    from lightning_lazytrain.replan import measured_link_rates

                    rates = measured_link_rates(stats.segments)
                    hardware = hardware.replace(h2d_bytes_per_s=rates.get("h2d", hardware.h2d_bytes_per_s),
                                                d2h_bytes_per_s=rates.get("d2h", hardware.d2h_bytes_per_s))
                t_hw = time.perf_counter() - t0
                # full micro-batches (every one writes all of its gradients back: the executor's step is the
                # micro-batch, strategy._begin_microbatch) are planned as such, one by one
                accum = 1 if self._full_microbatches else trainer.accumulate_grad_batches
                wl = workload_from_stats(ex, stats, tokens=self._tokens or 1,
                                         grad_accum=accum, micro_batches=micro_batches,
                                         opt_params_per_s=hardware.cpu_adam_params_per_s)
                wl, fraction = self._plan_optimizer_states(wl, hardware)
                wl = self._rank_workload(wl)
                plan = plan_from_workload(wl, hardware, policy=self.policy,
                                          options=MilpOptions(conversions=self.conversions),
                                          start=ex.schedule if replan is not None else None, profiled=ex.schedule)
                plan.state_fraction = fraction
                plan.timings["hardware"] = t_hw
                plan.timings["profile"] = time.perf_counter() - self._t_step - plan.timings["solve"] - t_hw
                if replan is not None:
                    from lightning_lazytrain.planner import simulate

                    try:
                        current_s = simulate(ex.schedule, wl, hardware).iteration_seconds
                    except Exception:  # the current schedule no longer fits: switch
                        current_s = float("inf")
            except BaseException as err:
                if isinstance(err, InfeasibleBudget):  # the first line a user reads, before the traceback
                    log.error("lazytrain cannot train this within its budget: %s", err)
                if not self.is_distributed:
                    raise
                failure = f"{type(err).__name__}: {err}"
                self.broadcast((None, failure, None))
                raise
        if self.is_distributed:
            plan, failure, current_s = self.broadcast((plan, failure, current_s))
            if plan is None:
                raise RuntimeError(f"rank 0 could not plan, so no rank trains: {failure}")
        assert plan is not None
        if plan.state_fraction is not None:  # the other processes' optimizers take rank 0's choice
            self._hybrid_optimizers(pending=True, fraction=plan.state_fraction)
        if replan is not None:
            assert current_s is not None
            new_s = plan.result.sim.iteration_seconds
            gain = 1.0 - new_s / current_s if current_s > 0 else 0.0
            switch = gain >= self.replan.min_gain
            self.replans.append({"step": trainer.global_step, "reason": replan, "current_predicted_s": current_s,
                                 "new_predicted_s": new_s, "gain": gain, "switched": switch,
                                 "warm_start": plan.result.solver.get("seed")})
            # a switch is news; a kept schedule (usually a noisy machine) is a debug line and a row of
            # ``replans`` (the training app sums them up in its summary)
            (rank_zero_info if switch else rank_zero_debug)(
                f"lazytrain re-plan at step {trainer.global_step}: {replan}; current schedule {current_s:.3f} s, "
                f"new plan {new_s:.3f} s ({gain:+.1%}): {'switching' if switch else 'keeping the current schedule'}")
            self._drift.replanned(switch)  # a kept schedule raises the bar for the next re-plan
            if not switch:
                self._predicted = current_s
                return
        self._predicted = None
        nvme = int(plan.result.sim.nvme_bytes)
        if nvme:
            check_nvme_dir(self.nvme_dir, nvme)  # before the first real step
            ex._nvme_required = nvme
        t0 = time.perf_counter()
        ex.set_schedule(plan.schedule)
        ex.set_placement(**plan.result.placement.groups(len(ex.stack)))  # Note: [conversion placement]
        plan.timings["executor"] = time.perf_counter() - t0
        self.plan = plan
        self._plan_pipelined_steps()  # the plan decides: serial or pipelined optimizer
        from lightning_lazytrain.report import format_table

        rank_zero_info(f"lazytrain plan ({plan.result.status}; profile {plan.timings['profile']:.2f} s, "
                       f"solve {plan.timings['solve']:.2f} s){conversions_note(plan.result.workload, plan.result.placement)}:\n"
                       f"{format_table(plan.result.rows())}")
        out = artifact_dir(trainer)
        if out and trainer.is_global_zero:
            plan.write(out)

    def _hybrid_optimizers(self, *, pending: bool = False, fraction: float | None = None) -> list:
        """The HybridAdamW optimizers (``pending``: those still without states; given a ``fraction``,
        each gets that 8-bit slice)."""
        from lightning_lazytrain.optim import HybridAdamW

        out = [inner for opt in self.optimizers if isinstance(inner := getattr(opt, "optimizer", opt), HybridAdamW)
               and (inner.bits_pending or not pending)]
        if fraction is not None:
            for o in out:
                if o.bits_pending:
                    o.set_state_bits("none" if fraction == 0 else fraction)
        return out

    def _plan_optimizer_states(self, wl: Any, hardware: Hardware) -> tuple[Any, float | None]:
        """Note: [planned 8-bit slice] (optim/plan_states.py): ``HybridAdamW(eight_bit="plan")`` gets the
        smallest 8-bit slice that fits host memory; every HybridAdamW is priced as its states are
        (the 8-bit update's rate measured when there is one)."""
        from lightning_lazytrain.optim.bnb8bit import measure_adamw_8bit_params_per_s
        from lightning_lazytrain.optim.plan_states import choose_state_bits, price_optimizers

        hybrids = self._hybrid_optimizers()
        if not hybrids:
            return wl, None
        fraction = choose_state_bits(hybrids, wl.host_static_bytes, hardware.cpu_memory_bytes)
        if fraction is not None:
            rank_zero_info(f"lazytrain: HybridAdamW(eight_bit='plan'): {fraction:.1%} of its parameters with 8-bit "
                           "states" + (" (the host holds 32-bit states for all)" if fraction == 0 else
                                       " (the smallest slice that fits host memory)"))
        rate8 = hardware.cpu_adam8_params_per_s
        if any(o.bits_of(p) == 8 for o in hybrids for g in o.param_groups for p in g["params"]):
            rate8 = measure_adamw_8bit_params_per_s() or rate8
        ex = self.executor
        assert ex is not None and ex.params is not None
        groups = {j: ex.params.group_parameters(j) for j in (REST_GROUP, *range(len(ex.stack)))}
        return price_optimizers(wl, hybrids, groups, hardware.cpu_adam_params_per_s, rate8), fraction

    def _rank_workload(self, wl: Any) -> Any:
        """With several processes: the plan is one rank's, with the host all-reduce of every group
        at the bandwidth the profiled step measured (``replicate_overlap`` with
        ``overlap_grad_sync``, else ``replicate``: the windows they run in)."""
        sync = self.grad_sync
        if not self.is_distributed or sync is None:
            return wl
        from lightning_lazytrain.planner.multi import measured_rank_workload, measured_shard_workload

        store = self._shard_store()
        if store is not None:  # every group sharded: fetches of shards, all-gathers, reduce-scatters
            bandwidth = getattr(self, "_shard_bytes_per_s", None)
            if bandwidth is None:
                return wl
            e = torch.empty((), dtype=store.compute_dtype).element_size()
            land = store.slot(0).grad_host.element_size()
            return measured_shard_workload(
                wl, store.world, max(1, self.world_size // self.num_nodes),
                [store.shard_numel(j) for j in range(store.num_layers)], store.shard_numel(REST_GROUP),
                bandwidth, gather_element_bytes=e, reduce_element_bytes=land, replicas=store.replicas)

        bandwidth = sync.bytes_per_s()
        if bandwidth is None:  # no gradient crossed (a frozen model): nothing to price
            return wl
        # With accumulation the MILP plans the overlapped mode's windows as replicate's (the all-reduces
        # serial after the backward: an upper bound; the overlap runs only in a step's last micro-batch)
        mode = "replicate_overlap" if sync.overlap and wl.grad_accum == 1 else "replicate"
        ex = self.executor
        assert ex is not None and ex.params is not None
        host_grad = ex.params.grad_flat(REST_GROUP).element_size()  # the host gradients' dtype (the masters')
        return measured_rank_workload(wl, self.world_size, max(1, self.world_size // self.num_nodes), bandwidth, mode,
                                      grad_element_bytes=host_grad)

    def _hardware(self) -> Hardware:
        """The machine to plan for. The budget applies on every path; without ``nvme_dir`` the plan
        gets no NVMe tier (there is nowhere to spill). With several processes on a node, each holds
        its own masters and optimizer states: a process plans with its share of host memory."""
        if self.hardware == "measure":
            if self._hardware_measured is None:
                self._hardware_measured = measure_hardware(
                    self.root_device, gpu_memory_budget_gb=self.gpu_memory_budget_gb, nvme_dir=self.nvme_dir,
                    link_gb_per_s=self.emulate_link_gb_per_s)
            hw = self._hardware_measured
        else:
            hw = given_hardware(self.hardware, self.gpu_memory_budget_gb, self.nvme_dir)
        if self.num_processes > 1:
            hw = hw.replace(cpu_memory_bytes=hw.cpu_memory_bytes / self.num_processes)
        # the budget bounds what the allocator reserves; the plan's allocated peak gets it less the
        # allocator's reserve (allocator.py, Note: [the budget is what the allocator reserves])
        self._budget_bytes = hw.gpu_memory_cap_bytes
        return hw.replace(gpu_memory_cap_bytes=self._memory.cap(hw.gpu_memory_cap_bytes))

    def _watch_memory(self, stats: StepStats) -> None:
        """After a planned step on CUDA: the allocator's own peaks against the budget and the plan;
        a re-plan when they say so (Note: [the budget is what the allocator reserves]). Rank 0
        decides for all."""
        if self.plan is None or self._budget_bytes is None or self._replan_reason:
            return
        reason = None
        if self.is_global_zero:
            reason = self._memory.observe(reserved=stats.max_memory_reserved, allocated=stats.max_memory_allocated,
                                          budget_bytes=self._budget_bytes,
                                          predicted_peak=self.plan.result.sim.peak_gpu_bytes)
        if self.is_distributed:
            reason, ratio = self.broadcast((reason, self._memory.ratio))
            self._memory.ratio = ratio
        if reason is None:
            return
        if self.policy != "milp" or not self.replan.enabled:
            log.warning("lazytrain: %s (not re-planned: policy=%r, replan=%s)", reason, self.policy,
                        self.replan.enabled)
            return
        self._replan_reason = reason
        rank_zero_info(f"lazytrain: {reason}")


def artifact_dir(trainer: Any) -> str | None:
    """The logger's directory; None without a real logger (no files in the working directory)."""
    from lightning.pytorch.loggers.logger import DummyLogger

    if not trainer.loggers or all(isinstance(lg, DummyLogger) for lg in trainer.loggers):
        return None
    return trainer.log_dir
