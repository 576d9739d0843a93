"""Note: [a kept gradient] (engine/kept_grads.py): a ``.grad`` tensor kept by reference from an earlier step keeps
that step's values, as under ``strategy="auto"`` (``zero_grad()`` drops ``.grad``; the next backward makes a new
tensor), though the store reuses its host gradient buffers; and an ordinary loop keeps none, so no buffer is
renewed (a renewal costs an allocation of page-locked memory on CUDA). fp32 on CPU: bit for bit."""

from __future__ import annotations

import dataclasses
import gc
import time

import lightning as L
import pytest
import torch

from lightning_lazytrain.engine.kept_grads import HandedGrads
from lightning_lazytrain.lit_module import CausalLMModule
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.planner import keep_all
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_updates_in_backward import plan_file

STEPS = 4
LAYERS = 4  # CausalLMModule "tiny"
GROUPS = LAYERS + 1  # the blocks and the non-block rest


def plan(kind: str):
    if kind == "pipelined":
        return plan_file(dataclasses.replace(keep_all(LAYERS), optimizer="pipelined", policy="t-pipelined"))
    if kind == "in_backward":
        return plan_file(dataclasses.replace(keep_all(LAYERS), optimizer="pipelined", updates_in_backward=True,
                                             policy="t-in-backward"))
    return kind


class SlowHybridAdamW(HybridAdamW):
    """Each layer's host update takes 20 ms: a pipelined step is still running at ``zero_grad`` (deferred) and
    when the next batch begins, so its plan lives on past the step."""

    def _update_layer(self, layer, plan):
        time.sleep(0.02)
        super()._update_layer(layer, plan)


class Module(CausalLMModule):
    def __init__(self, *, keep: bool, hybrid: bool, in_backward: bool = False, zero_to_none: bool = True):
        super().__init__(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
        self.keep, self.hybrid, self.in_backward, self.zero_to_none = keep, hybrid, in_backward, zero_to_none
        self.kept: list[dict[str, torch.Tensor]] = []
        self.renewals: int | None = None

    def configure_optimizers(self):
        if self.hybrid:
            return SlowHybridAdamW(self.param_groups(), lr=self.lr, eight_bit="none", skip_nonfinite=False,
                               updates_in_backward=self.in_backward)
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def on_before_optimizer_step(self, optimizer):
        if self.keep:  # by reference: a gradient-similarity log
            self.kept.append({n: p.grad for n, p in self.named_parameters() if p.grad is not None})

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=self.zero_to_none)

    def on_train_end(self):
        executor = getattr(self.trainer.strategy, "executor", None)
        if executor is not None:
            self.renewals = executor.params.kept_grad_renewals


def fit(strategy, module: Module, **trainer_kw) -> Module:
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **trainer_kw)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(STEPS * trainer.accumulate_grad_batches)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return module


def module(**kw) -> Module:
    torch.manual_seed(0)
    return Module(**kw)


def assert_kept_same(got: Module, want: Module) -> None:
    assert len(got.kept) == len(want.kept) == STEPS
    for step, (a, b) in enumerate(zip(got.kept, want.kept)):
        assert a.keys() == b.keys()
        bad = [n for n in a if not torch.equal(a[n], b[n])]
        assert not bad, f"step {step}: kept gradients differ from auto's: {bad[:4]}"
    for a, b in zip(got.model.parameters(), want.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["keep_all", "recompute_all", "pipelined"])
def test_gradients_kept_by_reference_keep_their_step_values(kind):
    """Before: every kept tensor showed the last backward's gradient (the buffer was reused); now each step's
    host gradients are renewed while the earlier ones are kept: one renewal per group per later step."""
    hybrid = kind == "pipelined"
    want = fit("auto", module(keep=True, hybrid=hybrid))
    got = fit(LazyTrainStrategy(policy=plan(kind)), module(keep=True, hybrid=hybrid))
    assert_kept_same(got, want)
    assert got.renewals == (STEPS - 1) * GROUPS


def test_gradients_kept_over_accumulated_micro_batches():
    want = fit("auto", module(keep=True, hybrid=False), accumulate_grad_batches=2)
    got = fit(LazyTrainStrategy(policy="recompute_all"), module(keep=True, hybrid=False), accumulate_grad_batches=2)
    assert_kept_same(got, want)


def test_gradients_kept_without_set_to_none_change_as_under_auto():
    """``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place, under auto too: every kept tensor is the same
    one and ends with the last step's gradient. Nothing is renewed."""
    want = fit("auto", module(keep=True, hybrid=False, zero_to_none=False))
    got = fit(LazyTrainStrategy(policy="recompute_all"), module(keep=True, hybrid=False, zero_to_none=False))
    assert_kept_same(got, want)
    assert got.renewals == 0


@pytest.mark.parametrize("kind,hybrid,clip,accum", [
    ("keep_all", False, None, 1),
    ("recompute_all", False, 0.5, 2),
    ("pipelined", True, None, 1),
    ("pipelined", True, 0.5, 2),
    ("in_backward", True, None, 1),
])
def test_an_ordinary_loop_renews_no_host_gradient(kind, hybrid, clip, accum):
    """Nothing of the engine or the optimizer (a pipelined step's plan, a step begun in the backward, handed
    norms) keeps a gradient past its step: the host gradient buffers are reused. Found holding them: the
    pipelined step's plan and the early updates' edit check (released now)."""
    m = fit(LazyTrainStrategy(policy=plan(kind)), module(keep=False, hybrid=hybrid, in_backward=kind == "in_backward"),
            gradient_clip_val=clip, accumulate_grad_batches=accum)
    assert m.renewals == 0


def test_handed_grads_records_weakly():
    handed = HandedGrads()
    assert not handed.any_alive(0)
    kept = torch.zeros(4)
    handed.record(0, kept)
    for _ in range(200):  # views that die at once are forgotten as the list grows
        handed.record(0, torch.zeros(2))
    gc.collect()
    assert handed.any_alive(0) and not handed.any_alive(1)
    assert len(handed._refs[0]) == 1
    del kept
    assert not handed.any_alive(0)
    handed.record(1, torch.zeros(1))
    handed.forget(1)
    assert not handed.any_alive(1)
