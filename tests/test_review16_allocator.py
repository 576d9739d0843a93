"""Review 16 (core/allocator.py, Note: [the budget is what the allocator reserves]): the device-memory watch at the
user level. The contract: ``gpu_memory_budget_gb`` (or the hardware profile's cap) bounds what the CUDA caching
allocator RESERVES; the plan's allocated peak is held to ``budget / reserve ratio``; after every optimizer step the
strategy reads the allocator's reserved and allocated peaks (``MemoryWatch.observe``); a step that reserved more
than planned for (ratio +2%), reserved over the budget or allocated beyond the plan's peak re-plans at the next step
with what it measured and says so in the log ("memory: ..."), at most ``MemoryWatch.max_replans`` (3) per fit; the
first plan leaves room for the byte overhead of the profiled step (``MemoryWatch.prime``); a schedule switch gives
the allocator's cache back (``release_cache``). No GPU here: the allocator's figures are injected into each executor
step's ``StepStats`` (as tests/test_allocator.py does), on CPU, fp32 (training compared with ``strategy="auto"``
bit for bit where a probe says so).

DEFECTS FOUND, ALL FIXED THE SAME DAY (each test below failed before the fix):
- test_a_drift_and_a_memory_reason_in_the_same_step_both_reach_the_re_plan: a step whose drift watch fires and whose
  allocator over-reserved (1.3x) re-plans for drift only: ``watch_memory`` returns at ``replan_reason`` without
  reading the step, so the re-plan keeps ratio 1.05 and the memory re-plan comes two steps later (one more
  over-reserving step; on a GPU over the budget that step may run out of memory).
- test_a_kept_re_plan_for_untracked_bytes_is_not_repeated: a step allocating 200 MB beyond the plan's peak
  re-profiles; the profile counts the 200 MB (``device_overhead_bytes``), the current schedule still fits and is
  kept -- but the watch goes on comparing against the OLD plan's peak (~20 kB), so the same reason fires after every
  planned step: 3 re-profiles in 6 steps, none of them changing anything.
- test_an_infeasible_budget_names_a_budget_that_works / test_a_memory_re_plan_that_leaves_no_schedule_says_why: the
  InfeasibleBudget message's "smallest GPU budget for this batch" is the allocated CAP (budget / ratio), not a
  budget: with ratio 1.05 a user who sets exactly the suggested figure fails again ("the cap is 15.7 kB, short by
  785 B"); after a memory re-plan (ratio 20) the message suggests 15.6 kB while the user's budget is 30 kB, and
  says nothing of the reserve ratio that shrank the cap.
- test_only_one_ranks_allocator_growing_still_re_plans (two gloo processes): only rank 0 reads its allocator
  (``watch_memory`` observes ``if layout.is_global_zero``); rank 1 reserving 1.3x what it allocates, step after
  step, never re-plans (the ranks do agree: no deadlock).
- test_an_over_budget_step_after_the_last_re_plan_is_still_reported: after max_replans (3) memory re-plans,
  ``observe`` returns None before reading the step: a step reserving 25 GB of a 20 GB budget is neither re-planned
  nor warned about (the next sign is an out-of-memory error).
- test_a_memory_warning_without_re_plan_does_not_say_re_planning (wording): with a named policy or replan=False the
  warning reads "...: re-planning with a reserve ratio of 1.326 (not re-planned: ...)".
The fixes (core/planning.py ``watch_memory``/``solve``, core/allocator.py ``MemoryWatch.worst``/``observe``, planner/
errors.py ``InfeasibleBudget.under_reserve``): the step is read whatever else asks for a re-plan, and both reasons
go to it; a kept schedule is watched against its own peak on the new profile (``Planner.peak``); a GPU shortage
is given in budget terms (the cap's figure times the ratio) and names the reserve; every rank's peaks are gathered
and the worst decides (named "memory (rank N)"), the profiled step's too; a step over the budget after the last
re-plan is logged once; the reason says whether the run re-plans.

PASSING (regression tests): the watch's unit behaviour (missing/zero readings, a constant over-reserve converges
in one re-plan, a growing one stops at 3, the ratio never falls, over-the-budget at the planned ratio, the saturated
ratio 20, prime's refusals); with accumulation one reading per optimizer step and the re-profile at a step's first
micro-batch, training equal to auto; full micro-batches (on_after_backward) the same; validation between the
micro-batches of a step does not count, validation between steps leaves the watch on; a memory re-plan during the
plan's race abandons the race; readings of None (plain CPU)
and of 0 re-plan nothing; a named policy / replan=False warns and keeps training; the log line names reserved,
ratio, bytes over, budget and the new ratio and reaches Lightning's logger; the budget from the strategy, the profile
and the clamp to the device; a memory re-plan that forces a switch releases the cache there and trains as auto; a
re-plan that leaves no schedule raises InfeasibleBudget naming the GPU tier and its shortfall (not a crash deep in
the step); a resumed run (checkpoint) starts from the starting ratio and re-measures; with two ranks
the ratio rank 0 raises is every rank's and both re-plan at the same step.

NOT COVERED: real CUDA figures (fragmentation, expandable segments, release_cache's effect); an evaluation's cached
segments counted in the next training step's reserved peak (on CUDA the peak is reset at the step, the cache is not:
needs a GPU); Fabric; the sharded data-parallel mode.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------------------
# the two-process script (``python test_review16_allocator.py '<json list of runs>'``; Lightning's launcher
# starts rank 1 with the same command)
# ------------------------------------------------------------------------------------------------

def _dist_run(opts: dict) -> None:
    from datetime import timedelta

    import lightning as L
    from test_conformance import Net, data

    from lightning_lazytrain.core.allocator import MemoryWatch
    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.strategy import LazyTrainStrategy

    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    real_end = Executor.end_microbatch
    count = [0]

    def end_microbatch(self):
        stats = real_end(self)
        if stats is not None:
            count[0] += 1
            a = int(stats.peak_tracked_bytes)
            stats.max_memory_allocated = a
            stats.max_memory_reserved = int(a * (1.3 if rank == opts["grow_rank"] and count[0] >= 3 else 1.0))
        return stats

    Executor.end_microbatch = end_microbatch
    ratios: list[float] = []
    losses: list[float] = []

    class Watch(L.Callback):
        def on_fit_start(self, trainer, module):
            trainer.strategy.core.planner.memory = MemoryWatch(ratio=1.05)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            ratios.append(trainer.strategy.core.planner.memory.ratio)
            losses.append(float(outputs["loss"]))

    strategy = LazyTrainStrategy(policy="milp", hardware="cpu", gpu_memory_budget_gb=100.0,
                                 timeout=timedelta(seconds=60))
    torch.manual_seed(11)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=6, logger=False,
                        callbacks=[Watch()], enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, enable_checkpointing=False,
                        use_distributed_sampler=False)
    trainer.fit(Net(), train_dataloaders=torch.utils.data.DataLoader(data(), batch_size=None))
    Executor.end_microbatch = real_end
    out = Path(opts["out"])
    (out / f"{opts['name']}_rank{rank}.json").write_text(json.dumps({
        "replans": [[r["step"], r["reason"]] for r in strategy.replans], "ratios": ratios, "losses": losses}))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    for run_opts in json.loads(sys.argv[1]):
        _dist_run(run_opts)
    sys.exit(0)

# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------

import logging
import subprocess

import lightning as L
import pytest
from test_allocator import AsOnCuda
from test_conformance import HookNet, Losses, Net, data, fit

from lightning_lazytrain.core import schedule_control
from lightning_lazytrain.core.allocator import MemoryWatch
from lightning_lazytrain.core.replan import DriftMonitor
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.planner import InfeasibleBudget
from lightning_lazytrain.strategy import LazyTrainStrategy

GB = 1e9
KB = 1e-6  # gpu_memory_budget_gb of one kB


# ---- helpers ---------------------------------------------------------------------------------------
def inject(monkeypatch, reserved, allocated=None, untracked=None) -> list[dict]:
    """Each executor step reports CUDA-like allocator peaks on the CPU: allocated = its tracked peak (or
    ``allocated(k, tracked)``), reserved = ``reserved(k, allocated, stats)`` for the k-th executor step (from 1);
    ``untracked(k)``: bytes added to a PROFILED step's untracked bytes (what a real profile would measure).
    Returns the readings, one dict per executor step."""
    real_end = Executor.end_microbatch
    readings: list[dict] = []

    def end_microbatch(self):
        profiling = self.profiling
        stats = real_end(self)
        if stats is not None:
            k = len(readings) + 1
            a = int(stats.peak_tracked_bytes)
            if allocated is not None:
                a = int(allocated(k, a))
            if untracked is not None and profiling:
                stats.untracked_bytes = int(stats.untracked_bytes) + int(untracked(k))
            stats.max_memory_allocated = a
            stats.max_memory_reserved = None if reserved is None else int(reserved(k, a, stats))
            readings.append({"k": k, "allocated": a, "reserved": stats.max_memory_reserved,
                             "profiling": profiling, "mid_eval": stats.evaluated_mid_step})
        return stats

    monkeypatch.setattr(Executor, "end_microbatch", end_microbatch)
    return readings


def memory_replans(strategy) -> list[dict]:
    return [r for r in strategy.replans if r["reason"].startswith("memory:")]


def strategy(**kw) -> LazyTrainStrategy:
    kw.setdefault("gpu_memory_budget_gb", 100.0)
    return LazyTrainStrategy(policy=kw.pop("policy", "milp"), hardware="cpu", **kw)


class ValNet(Net):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.head(self(batch)).square().mean())

    def val_dataloader(self):
        return torch.utils.data.DataLoader(data(2, seed=7), batch_size=None)


def train(strategy_, module, *, steps=4, callbacks=(), ckpt_path=None, **trainer_kw):
    """As test_conformance.fit, with validation, checkpoints and resume at the caller's choice."""
    losses = Losses()
    torch.manual_seed(11)
    kw = {"enable_checkpointing": False, "num_sanity_val_steps": 0, "limit_val_batches": 0}
    kw.update(trainer_kw)
    trainer = L.Trainer(strategy=strategy_, accelerator="cpu", max_steps=steps, logger=False,
                        callbacks=[losses, *callbacks], enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(), batch_size=None), ckpt_path=ckpt_path)
    return module, losses.values


class Ratios(L.Callback):
    """The memory watch's ratio after every training batch."""

    def __init__(self):
        self.values: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(trainer.strategy.core.planner.memory.ratio)


# ---- MemoryWatch on its own ----------------------------------------------------------------------
CALM = {"budget_bytes": 20 * GB, "predicted_peak": 17 * GB}


@pytest.mark.parametrize("reserved, allocated", [(None, None), (None, 10 ** 9), (10 ** 9, None), (0, 0), (10 ** 9, 0)])
def test_missing_or_zero_readings_ask_for_nothing(reserved, allocated):
    w = MemoryWatch(ratio=1.05)
    assert w.observe(reserved=reserved, allocated=allocated, **CALM) is None
    assert w.ratio == 1.05 and w.replans == 0
    assert not w.prime(reserved=reserved, allocated=allocated, budget_bytes=20 * GB) and w.ratio == 1.05


def test_a_reserved_reading_of_zero_is_not_an_over_reserve():
    w = MemoryWatch(ratio=1.05)
    assert w.observe(reserved=0, allocated=int(10 * GB), **CALM) is None and w.ratio == 1.05


def test_a_constant_over_reserve_converges_in_one_re_plan():
    """The allocator keeps reserving 1.3x what it allocates, step after step (allocated follows the new cap)."""
    w = MemoryWatch(ratio=1.05)
    reasons = []
    for _ in range(10):
        allocated = min(17 * GB, w.cap(20 * GB))
        reasons.append(w.observe(reserved=int(allocated * 1.3), allocated=int(allocated), **CALM))
    assert sum(r is not None for r in reasons) == 1 and reasons[0] is not None
    # the larger of 1.3 x 1.02 and the byte overhead's ratio (22.1 GB reserved of 20 at the first step)
    assert w.ratio == pytest.approx(max(1.3 * 1.02, 20 / (20 - 0.3 * 17 * 1.02)))
    assert w.cap(20 * GB) * 1.3 <= 20 * GB


def test_a_growing_over_reserve_stops_at_max_replans_and_the_ratio_never_falls():
    w = MemoryWatch(ratio=1.05)
    seen, ratios = [], []
    for k in range(10):
        seen.append(w.observe(reserved=int(10 * GB * (1.2 + 0.2 * k)), allocated=int(10 * GB), **CALM))
        ratios.append(w.ratio)
    assert sum(r is not None for r in seen) == w.max_replans == 3
    assert ratios == sorted(ratios)
    calm = w.ratio
    assert w.observe(reserved=int(10 * GB), allocated=int(10 * GB), **CALM) is None and w.ratio == calm


def test_over_the_budget_at_the_planned_ratio_leaves_the_overhead_room():
    """1.18x planned for, 1.18x measured, but 20.5 GB reserved of 20: the byte overhead (3.1 GB) fits the new cap."""
    w = MemoryWatch(ratio=1.18)
    why = w.observe(reserved=int(20.5 * GB), allocated=int(17.4 * GB), **CALM)
    assert why is not None and "against a budget of 20 GB" in why
    assert w.cap(20 * GB) + (20.5 - 17.4) * GB <= 20 * GB


def test_an_overhead_of_nearly_the_whole_budget_saturates_the_ratio():
    w = MemoryWatch(ratio=1.05)
    assert w.observe(reserved=int(19.5 * GB), allocated=int(0.5 * GB), **CALM) is not None
    assert w.ratio == pytest.approx(max(20.0, 39 * 1.02))
    # prime does not take such an overhead at all (the first plan keeps its ratio)
    p = MemoryWatch(ratio=1.05)
    assert not p.prime(reserved=int(19.5 * GB), allocated=int(0.5 * GB), budget_bytes=20 * GB) and p.ratio == 1.05


def test_prime_then_the_same_overhead_asks_for_nothing():
    w = MemoryWatch(ratio=1.05)
    assert w.prime(reserved=int(3 * GB), allocated=int(1 * GB), budget_bytes=20 * GB)
    cap = w.cap(20 * GB)
    assert w.observe(reserved=int(cap + 2 * GB), allocated=int(cap), budget_bytes=20 * GB, predicted_peak=cap) is None


def test_a_small_model_far_under_the_budget_re_plans_once_and_keeps_the_plan_feasible():
    """Documented behaviour: 0.3 GB reserved for 0.1 GB allocated under an 80 GB budget is 'more than planned
    for' (3x): one re-plan, the cap falls to 26 GB -- still far above what the plan allocates."""
    w = MemoryWatch(ratio=1.05)
    assert w.observe(reserved=int(0.3 * GB), allocated=int(0.1 * GB), budget_bytes=80 * GB,
                     predicted_peak=0.1 * GB) is not None
    assert 0.1 * GB < w.cap(80 * GB) == pytest.approx(80 * GB / 3.06)


def test_an_over_budget_step_after_the_last_re_plan_is_still_reported(caplog):
    w = MemoryWatch(ratio=1.05)
    for k in range(3):
        assert w.observe(reserved=int(10 * GB * (1.3 + 0.3 * k)), allocated=int(10 * GB), **CALM) is not None
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain"):
        why = w.observe(reserved=int(25 * GB), allocated=int(10 * GB), **CALM)
    assert why is not None or any("25" in r.getMessage() for r in caplog.records)


# ---- a run ---------------------------------------------------------------------------------------
def test_accumulation_reads_one_peak_per_optimizer_step_and_re_plans_at_a_step_boundary(monkeypatch):
    readings = inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    starts = []  # the micro-batches of profiled steps: first of their step or not
    real_begin = Executor.begin_microbatch

    def begin(self, *a, **kw):
        if self.profiling:
            starts.append(kw.get("first", True))
        return real_begin(self, *a, **kw)

    monkeypatch.setattr(Executor, "begin_microbatch", begin)
    _, want = fit("auto", Net(), accumulate_grad_batches=2)
    s = strategy()
    _, got = fit(s, Net(), accumulate_grad_batches=2, callbacks_extra=[AsOnCuda()])
    assert [r["k"] for r in readings] == [1, 2, 3, 4]  # 4 optimizer steps of 2 micro-batches: 4 readings
    assert [r["profiling"] for r in readings] == [True, False, False, True]
    memory = memory_replans(s)
    assert len(memory) == 1 and memory[0]["step"] == 3  # the step after the over-reserving one
    assert starts == [True, False, True, False]  # the re-profile is one whole step, from its first micro-batch
    assert got == want


def test_full_micro_batches_re_plan_from_their_own_peaks_and_train_as_auto(monkeypatch):
    """on_after_backward: every micro-batch is an executor step (its own peak); a memory re-plan then lands
    between micro-batches, which full micro-batches allow; hooks see auto's gradients."""
    readings = inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    ref, want = fit("auto", HookNet(), accumulate_grad_batches=2)
    s = strategy()
    got_model, got = fit(s, HookNet(), accumulate_grad_batches=2, callbacks_extra=[AsOnCuda()])
    assert len(readings) == 8  # one per micro-batch
    assert len(memory_replans(s)) == 1 and s.core.planner.memory.ratio == pytest.approx(1.3 * 1.02, rel=1e-3)
    assert got == want
    for g, r in zip(got_model.hook_grads, ref.hook_grads):
        assert all(torch.equal(g[n], r[n]) for n in r)


def test_validation_between_micro_batches_is_not_read_but_the_next_step_is(monkeypatch):
    """Validation after batch 3 (mid-step 2 of accumulate 2): that step's peak would be the evaluation's too and
    is not read; an over-reserve there alone re-plans nothing; the same over-reserve in a later step does."""
    readings = inject(monkeypatch, lambda k, a, s: a * (1.5 if s.evaluated_mid_step else 1.0))
    s = strategy()
    train(s, ValNet(), accumulate_grad_batches=2, limit_val_batches=1, val_check_interval=3,
          callbacks=[AsOnCuda()])
    assert [r["mid_eval"] for r in readings] == [False, True, False, False]
    assert not memory_replans(s)
    monkeypatch.undo()
    readings = inject(monkeypatch, lambda k, a, s: a * (1.5 if k >= 2 else 1.0))
    s = strategy()
    train(s, ValNet(), accumulate_grad_batches=2, limit_val_batches=1, val_check_interval=3,
          callbacks=[AsOnCuda()])
    assert [r["mid_eval"] for r in readings] == [False, True, False, False]
    assert [r["step"] for r in memory_replans(s)] == [3]  # read at step 3 (k=3), re-planned at the next


def test_validation_between_steps_leaves_the_watch_on(monkeypatch):
    inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    s = strategy()
    train(s, ValNet(), steps=6, limit_val_batches=1, val_check_interval=1, callbacks=[AsOnCuda()])
    assert len(memory_replans(s)) == 1


def test_plain_cpu_reads_no_allocator_and_never_re_plans_for_memory():
    seen = []

    class Peek(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            stats = trainer.strategy.core.last_stats
            seen.append((stats.max_memory_reserved, stats.max_memory_allocated))

    s = strategy()
    _, want = fit("auto", Net(), steps=6)
    _, got = fit(s, Net(), steps=6, callbacks_extra=[Peek()])
    assert seen == [(None, None)] * 6
    assert s.core.planner.memory.ratio == 1.0 and not memory_replans(s) and got == want


def test_readings_of_zero_re_plan_nothing(monkeypatch):
    inject(monkeypatch, lambda k, a, s: 0, allocated=lambda k, a: 0)
    s = strategy()
    _, want = fit("auto", Net(), steps=5)
    _, got = fit(s, Net(), steps=5, callbacks_extra=[AsOnCuda()])
    assert not memory_replans(s) and s.core.planner.memory.ratio == 1.05 and got == want


@pytest.mark.parametrize("policy, replan", [("recompute_all", True), ("milp", False)])
def test_a_named_policy_or_no_replan_warns_and_trains_on(monkeypatch, caplog, policy, replan):
    inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    s = strategy(policy=policy, replan=replan)
    _, want = fit("auto", Net(), steps=6)
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain"):
        _, got = fit(s, Net(), steps=6, callbacks_extra=[AsOnCuda()])
    warned = [r.getMessage() for r in caplog.records if "not re-planned" in r.getMessage()]
    assert len(warned) == 1 and "1.300x what it allocated" in warned[0]
    assert not s.replans and got == want


def test_a_memory_warning_without_re_plan_does_not_say_re_planning(monkeypatch, caplog):
    inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain"):
        fit(strategy(replan=False), Net(), steps=5, callbacks_extra=[AsOnCuda()])
    warned = [r.getMessage() for r in caplog.records if "not re-planned" in r.getMessage()]
    assert warned and "re-planning" not in warned[0]


def test_the_log_line_names_the_figures_and_reaches_lightnings_logger(monkeypatch):
    inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, lg = Keep(level=logging.INFO), logging.getLogger("lightning.pytorch")
    lg.addHandler(handler)
    level = lg.level
    lg.setLevel(logging.INFO)
    try:
        s = strategy()
        fit(s, Net(), steps=5, callbacks_extra=[AsOnCuda()])
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
    memory = [x for x in lines if x.startswith("lazytrain: memory:")]
    assert len(memory) == 1
    line = memory[0]
    reading = next(r for r in s.replans if r["reason"].startswith("memory:"))
    assert line == "lazytrain: " + reading["reason"]
    for part in ("the allocator reserved 2.13e-05 GB", "1.300x what it allocated", "GB over",
                 "against a budget of 4 GB", "re-planning with a reserve ratio of 1.326"):
        assert part in line, part


def test_the_budget_comes_from_the_strategy_or_the_profile_and_is_clamped_to_the_device():
    assert LazyTrainStrategy(hardware="cpu").core.hardware().gpu_memory_cap_bytes == pytest.approx(3.5 * GB)
    s = LazyTrainStrategy(hardware="cpu", gpu_memory_budget_gb=2.5)
    s.core.planner.memory = MemoryWatch(ratio=1.05)
    assert s.core.hardware().gpu_memory_cap_bytes == pytest.approx(2.5 * GB / 1.05)
    assert s.core.planner.budget_bytes == pytest.approx(2.5 * GB)
    big = LazyTrainStrategy(hardware="cpu", gpu_memory_budget_gb=100.0)
    big.core.hardware()
    assert big.core.planner.budget_bytes == pytest.approx(4 * GB)  # the profile's device holds 4 GB
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="gpu_memory_budget_gb"):
            LazyTrainStrategy(hardware="cpu", gpu_memory_budget_gb=bad)


def test_a_memory_re_plan_that_no_longer_fits_switches_releases_the_cache_and_trains_as_auto(monkeypatch):
    """A 30 kB budget: the first plan peaks at 20.4 kB; the allocator then reserves 1.75x: the cap falls to 16.8 kB,
    the schedule no longer fits and switches (to 16.5 kB); the cache is given back at that switch."""
    readings = inject(monkeypatch, lambda k, a, s: a * (1.75 if k >= 3 else 1.0))
    released = []
    real = schedule_control.release_cache
    monkeypatch.setattr(schedule_control, "release_cache", lambda device: released.append(len(readings)) or
                        real(device))
    _, want = fit("auto", Net(), steps=7)
    s = strategy(gpu_memory_budget_gb=30 * KB)
    peaks = []

    class Peak(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            peaks.append(trainer.strategy.core.planner.plan.result.sim.peak_gpu_bytes)

    _, got = fit(s, Net(), steps=7, callbacks_extra=[AsOnCuda(), Peak()])
    memory = memory_replans(s)
    assert len(memory) == 1 and memory[0]["switched"] and memory[0]["current_predicted_s"] == float("inf")
    assert released == [1, 4]  # the first plan's switch, and the memory re-plan's (after the 4th step)
    assert peaks[-1] <= 30e3 / s.core.planner.memory.ratio < peaks[0]
    assert got == want


def test_a_memory_re_plan_during_the_plans_race_ends_it_and_trains_as_auto(monkeypatch):
    """replan race on (the CPU's default is off): the plan is being timed against a baseline when the allocator
    over-reserves; the re-plan abandons the race and re-profiles, training unchanged."""
    inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    from lightning_lazytrain.core.plan_race import PlanRace

    abandoned, real = [], PlanRace.abandon
    monkeypatch.setattr(PlanRace, "abandon", lambda self: abandoned.append(1) or real(self))
    s = strategy(replan={"race": True, "race_margin": 10.0, "patience": 3})
    _, want = fit("auto", Net(), steps=8)
    _, got = fit(s, Net(), steps=8, callbacks_extra=[AsOnCuda()])
    assert abandoned == [1] and not s.races  # the race was running, and the re-plan ended it
    assert len(memory_replans(s)) == 1 and s.core.planner.memory.ratio == pytest.approx(1.3 * 1.02, rel=1e-3)
    assert got == want


def test_a_drift_and_a_memory_reason_in_the_same_step_both_reach_the_re_plan(monkeypatch):
    readings = inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    calls = []

    def observe(self, measured_s, predicted_s):  # drift seen after the 2nd planned step (k=3)
        calls.append(1)
        return "drift: injected" if len(calls) == 2 else None

    monkeypatch.setattr(DriftMonitor, "observe", observe)
    s = strategy()
    ratios = Ratios()
    fit(s, Net(), steps=7, callbacks_extra=[AsOnCuda(), ratios])
    assert readings[2]["reserved"] > 1.29 * readings[2]["allocated"]  # k=3 over-reserved
    first = s.replans[0]
    assert first["step"] == 3
    # (measured: the re-plan at step 3 is 'drift: injected' alone, the ratio stays 1.05 until step 5's re-plan)
    assert "memory" in first["reason"] or ratios.values[3] > 1.3


def test_a_kept_re_plan_for_untracked_bytes_is_not_repeated(monkeypatch):
    extra = 200 << 20
    inject(monkeypatch, lambda k, a, s: a, allocated=lambda k, a: a + (extra if k >= 2 else 0),
           untracked=lambda k: extra if k >= 2 else 0)
    from lightning_lazytrain.core import planning

    overheads, real = [], planning.workload_from_stats
    monkeypatch.setattr(planning, "workload_from_stats",
                        lambda *a, **kw: overheads.append(real(*a, **kw)) or overheads[-1])
    s = strategy()
    _, want = fit("auto", Net(), steps=8)
    _, got = fit(s, Net(), steps=8, callbacks_extra=[AsOnCuda()])
    assert got == want
    assert overheads[1].device_overhead_bytes >= extra  # the re-profile counted the 200 MB
    memory = memory_replans(s)
    assert memory and "above the plan's peak" in memory[0]["reason"] and not memory[0]["switched"]
    # (measured: 3 re-plans, at steps 2, 4 and 6, each kept; every other step re-profiled)
    assert len(memory) == 1, [(r["step"], r["switched"]) for r in memory]


def test_a_memory_re_plan_that_leaves_no_schedule_raises_a_budget_error_naming_the_gpu_tier(monkeypatch):
    """A 30 kB budget, then a step reserving 12x what it allocates (0.197 MB): ratio 20, cap 1.5 kB, nothing fits.
    The run stops at the re-profiled step with InfeasibleBudget (tier, shortfall), after 3 good steps."""
    readings = inject(monkeypatch, lambda k, a, s: a * (12 if k >= 3 else 1.0))
    s = strategy(gpu_memory_budget_gb=30 * KB)
    with pytest.raises(InfeasibleBudget) as info:
        fit(s, Net(), steps=6, callbacks_extra=[AsOnCuda()])
    err = info.value
    assert err.tier == "gpu" and err.shortfall_bytes > 0 and "gpu memory short by" in str(err)
    assert len(readings) == 4 and readings[-1]["profiling"]


def test_a_memory_re_plan_that_leaves_no_schedule_says_why(monkeypatch):
    inject(monkeypatch, lambda k, a, s: a * (12 if k >= 3 else 1.0))
    with pytest.raises(InfeasibleBudget) as info:
        fit(strategy(gpu_memory_budget_gb=30 * KB), Net(), steps=6, callbacks_extra=[AsOnCuda()])
    text = str(info.value)
    assert "reserve" in text or "allocator" in text
    assert info.value.fits_bytes is None or info.value.fits_bytes > 30e3


def test_an_infeasible_budget_names_a_budget_that_works():
    with pytest.raises(InfeasibleBudget) as info:
        fit(strategy(gpu_memory_budget_gb=10 * KB), Net(), steps=2, callbacks_extra=[AsOnCuda()])
    suggested = info.value.fits_bytes
    assert suggested is not None
    fit(strategy(gpu_memory_budget_gb=suggested * 1.001 / 1e9), Net(), steps=2, callbacks_extra=[AsOnCuda()])


def test_a_resumed_run_starts_from_the_starting_ratio_and_re_measures(monkeypatch, tmp_path):
    """The reserve ratio is not in the checkpoint: a resumed run plans with the starting ratio (1.05) and, where the
    allocator still over-reserves, re-plans again at its first planned step."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    inject(monkeypatch, lambda k, a, s: a * (1.3 if k >= 3 else 1.0))
    first = strategy()
    ck = ModelCheckpoint(dirpath=tmp_path, filename="last", every_n_train_steps=5, save_top_k=-1)
    train(first, Net(), steps=5, callbacks=[AsOnCuda(), ck], enable_checkpointing=True)
    assert len(memory_replans(first)) == 1
    path = tmp_path / "last.ckpt"
    assert path.exists()
    monkeypatch.undo()
    readings = inject(monkeypatch, lambda k, a, s: a * 1.3)
    resumed, ratios = strategy(), Ratios()
    train(resumed, Net(), steps=8, callbacks=[AsOnCuda(), ratios], ckpt_path=str(path))
    assert ratios.values[0] == 1.05  # the profiled step planned with the starting ratio
    # re-measured: resumed at step 5 (profiled), step 6 over-reserves, step 7 re-plans
    assert [r["step"] for r in memory_replans(resumed)] == [7]
    assert resumed.core.planner.memory.ratio == pytest.approx(1.3 * 1.02, rel=1e-3)
    assert len(readings) == 3


# ---- two processes (gloo) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("review16_dist")
    runs = [{"out": str(out), "name": name, "grow_rank": rank} for name, rank in (("rank0", 0), ("rank1", 1))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), json.dumps(runs)], cwd=out, env=env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]
            for name in ("rank0", "rank1")}


def test_rank_zeros_over_reserve_re_plans_every_rank_alike(two_ranks):
    r0, r1 = two_ranks["rank0"]
    assert [s for s, _ in r0["replans"]] == [s for s, _ in r1["replans"]] == [3]
    assert r0["replans"][0][1].startswith("memory (rank 0):") and r0["replans"] == r1["replans"]
    assert r0["ratios"] == r1["ratios"] and r0["ratios"][-1] == pytest.approx(1.3 * 1.02, rel=1e-3)
    assert r0["losses"] == r1["losses"] or len(r0["losses"]) == len(r1["losses"]) == 6


def test_only_one_ranks_allocator_growing_leaves_the_ranks_in_agreement(two_ranks):
    r0, r1 = two_ranks["rank1"]
    assert r0["replans"] == r1["replans"] and r0["ratios"] == r1["ratios"]
    assert len(r0["losses"]) == len(r1["losses"]) == 6


def test_only_one_ranks_allocator_growing_still_re_plans(two_ranks):
    _, r1 = two_ranks["rank1"]
    assert [s for s, _ in r1["replans"]] == [3]
    assert r1["replans"][0][1].startswith("memory (rank 1): the allocator reserved")
