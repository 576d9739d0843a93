"""Batches larger than the plan (Note: [batches larger than the plan] in core/batch_size.py): the size
measure, the guard's bookkeeping, the scaled workload, and the strategy planning for a larger batch before
it runs -- keeping the schedule where it fits, re-planning where it does not -- exactly as under auto."""

from __future__ import annotations

import logging

import pytest
import torch
from test_review2_shapes import BUDGET_GB, LONG, SHORT, Net, Record, batches_of
from test_review_clip_manual import assert_same

from lightning_lazytrain.core.batch_size import BatchSizeGuard, batch_elements
from lightning_lazytrain.planner import keep_all, simulate
from lightning_lazytrain.planner.model import ModelSpec, TrainSpec
from lightning_lazytrain.planner.workload import Workload
from planner_helpers import hardware
from lightning_lazytrain.strategy import LazyTrainStrategy


def test_batch_elements_counts_every_tensor_once():
    ids = torch.zeros(2, 8, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "mask": torch.ones(2, 8), "extra": [torch.ones(3), ("text", 4)]}
    assert batch_elements(batch) == 16 + 16 + 3
    assert batch_elements((torch.ones(2, 5), torch.ones(2, 5))) == 20
    assert batch_elements(["no tensors"]) == 0


def test_the_guard_covers_the_profiled_steps_largest_micro_batch():
    g = BatchSizeGuard()
    assert g.factor(100, first=True) is None  # no plan yet
    g.profiling(60)
    g.profiling(100)  # accumulation: the step's largest micro-batch
    g.planned()
    assert g.covered == 100
    assert g.factor(100, first=True) is None and g.factor(50, first=True) is None
    assert g.factor(150, first=True) == 1.5
    g.cover(1.5)
    assert g.covered == 150 and g.factor(150, first=True) is None
    assert g.factor(300, first=False) is None  # mid-step: remembered, not planned for now
    assert g.mid_step() and not g.mid_step()  # said once
    assert g.factor(10, first=True) == 2.0  # the next step plans for the one seen


def workload(L=4) -> Workload:
    spec = ModelSpec(name="m", num_layers=L, hidden=256, intermediate=512, heads=4, kv_heads=4, head_dim=64,
                     vocab=1000)
    return Workload.analytic(spec, TrainSpec(micro_batch_size=2, seq_len=64), hardware(80e9))


def test_a_scaled_workload_scales_activations_and_compute_only():
    wl = workload()
    s = wl.scaled(2.0)
    for a, b in zip(wl.layers, s.layers):
        assert b.fwd_seconds == 2 * a.fwd_seconds and b.bwd_seconds == 2 * a.bwd_seconds
        assert b.internal_bytes == 2 * a.internal_bytes and b.fwd_work_bytes == 2 * a.fwd_work_bytes
        assert (b.param_bytes, b.grad_bytes, b.opt_seconds, b.cast_seconds) == (
            a.param_bytes, a.grad_bytes, a.opt_seconds, a.cast_seconds)
    assert s.boundary_bytes == tuple(2 * x for x in wl.boundary_bytes)
    assert s.tokens == 2 * wl.tokens and s.host_static_bytes == wl.host_static_bytes
    assert s.static_gpu_bytes == wl.static_gpu_bytes
    hw = hardware(80e9)
    assert simulate(keep_all(4), s, hw).peak_gpu_bytes > simulate(keep_all(4), wl, hw).peak_gpu_bytes


def fit(strategy, shapes, accum=1, **kw):
    import lightning as L

    rec = Record()
    torch.manual_seed(11)
    module = Net()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=len(shapes) // accum, logger=False,
                        enable_checkpointing=False, callbacks=[rec], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        accumulate_grad_batches=accum, **kw)
    trainer.fit(module, train_dataloaders=batches_of(shapes))
    return rec.losses, {k: v.clone() for k, v in module.state_dict().items()}, trainer, rec


def test_a_slightly_longer_batch_that_fits_keeps_the_schedule():
    """A 1.25x batch under a roomy budget: the current schedule fits the scaled estimate, nothing switches."""
    shapes = [(2, 16)] * 2 + [(2, 20)] * 2
    got = fit(LazyTrainStrategy(), shapes)
    want = fit("auto", shapes)
    assert_same(got[:3], want[:3])
    core = got[2].strategy.core
    assert core.replans == []


@pytest.mark.parametrize("accum", [1, 2])
def test_a_longer_batch_is_planned_for_before_it_runs(accum, caplog):
    """Profiled on short batches, then long ones under a budget the profiled plan does not hold for them:
    every long step holds the budget, the weights are auto's bit for bit. With accumulation the step's first
    micro-batch is the long one here (a later one is planned for at the next step, logged)."""
    shapes = [SHORT] * 2 * accum + [LONG, SHORT] * accum + [SHORT] * 2 * accum
    with caplog.at_level(logging.INFO):
        got = fit(LazyTrainStrategy(gpu_memory_budget_gb=BUDGET_GB), shapes, accum=accum)
    want = fit("auto", shapes, accum=accum)
    assert_same(got[:3], want[:3])
    rec, core = got[3], got[2].strategy.core
    assert core.replans and core.replans[0]["reason"].startswith("a micro-batch 16.00x")
    assert all(p <= rec.budget for p in rec.peaks if p is not None), (rec.peaks, rec.budget)
    assert "the size the plan was made for" in caplog.text


def test_a_later_micro_batch_larger_than_the_plan_is_said_and_planned_for_next(caplog):
    shapes = [SHORT, SHORT] * 2 + [SHORT, LONG] + [SHORT, SHORT] * 2
    with caplog.at_level(logging.WARNING):
        got = fit(LazyTrainStrategy(gpu_memory_budget_gb=BUDGET_GB), shapes, accum=2)
    assert_same(got[:3], fit("auto", shapes, accum=2)[:3])
    assert "came after the first of its optimizer step" in caplog.text
    assert got[2].strategy.core.replans  # the next step planned for it
