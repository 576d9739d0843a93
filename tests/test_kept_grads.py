"""Note: [a kept gradient] (engine/kept_grads.py): a ``.grad`` tensor kept by reference from an earlier step keeps
that step's values, as under ``strategy="auto"`` (``zero_grad()`` drops ``.grad``; the next backward makes a new
tensor), though the store reuses its host gradient buffers; and an ordinary loop keeps none, so nothing is moved
(a move copies the kept values). fp32 on CPU: bit for bit."""

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
        self.moved: int | None = None
        self.renewed: int | None = None

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
            self.moved = executor.params.kept_grads_moved
            self.renewed = executor.params.kept_grad_renewals


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
    """Before: every kept tensor showed the last backward's gradient (the buffer was reused); now each kept
    tensor is moved out (onto a copy of its values) before the next backward writes its range."""
    hybrid = kind == "pipelined"
    want = fit("auto", module(keep=True, hybrid=hybrid))
    got = fit(LazyTrainStrategy(policy=plan(kind)), module(keep=True, hybrid=hybrid))
    assert_kept_same(got, want)
    assert got.moved == (STEPS - 1) * len(got.kept[0])
    assert got.renewed == 0  # only the handed tensors themselves were kept: moved, no buffer renewed


def test_gradients_kept_over_accumulated_micro_batches():
    want = fit("auto", module(keep=True, hybrid=False), accumulate_grad_batches=2)
    got = fit(LazyTrainStrategy(policy="recompute_all"), module(keep=True, hybrid=False), accumulate_grad_batches=2)
    assert_kept_same(got, want)


def test_gradients_kept_without_set_to_none_change_as_under_auto():
    """``zero_grad(set_to_none=False)`` zeroes ``.grad`` in place, under auto too: every kept tensor is the same
    one and ends with the last step's gradient. Nothing is moved."""
    want = fit("auto", module(keep=True, hybrid=False, zero_to_none=False))
    got = fit(LazyTrainStrategy(policy="recompute_all"), module(keep=True, hybrid=False, zero_to_none=False))
    assert_kept_same(got, want)
    assert got.moved == 0 and got.renewed == 0


@pytest.mark.parametrize("kind,hybrid,clip,accum", [
    ("keep_all", False, None, 1),
    ("recompute_all", False, 0.5, 2),
    ("pipelined", True, None, 1),
    ("pipelined", True, 0.5, 2),
    ("in_backward", True, None, 1),
])
def test_an_ordinary_loop_moves_no_gradient(kind, hybrid, clip, accum):
    """Nothing of the engine or the optimizer (a pipelined step's plan, a step begun in the backward, handed
    norms) keeps a gradient past its step: nothing is moved (each move copies the kept values). Found holding
    them: the pipelined step's plan and the early updates' edit check (released now)."""
    m = fit(LazyTrainStrategy(policy=plan(kind)), module(keep=False, hybrid=hybrid, in_backward=kind == "in_backward"),
            gradient_clip_val=clip, accumulate_grad_batches=accum)
    assert m.moved == 0 and m.renewed == 0


def test_handed_grads_moves_what_is_kept():
    """``release`` gives every other live view of the parameter its own copy (the same tensor object, the same
    values), keeps the current ``.grad``'s, and forgets the dead."""
    buf = torch.arange(8.0)
    handed = HandedGrads()
    kept, current = buf[:4], buf[4:]
    handed.record(1, kept)
    handed.record(1, current)
    handed.record(1, buf[:2])  # dies at once
    gc.collect()
    handed.release(1, current)
    assert handed.moved == 1
    assert kept.data_ptr() != buf.data_ptr() and torch.equal(kept, torch.arange(4.0))
    buf.zero_()
    assert torch.equal(kept, torch.arange(4.0)) and current.abs().sum() == 0  # the current one stays a view
    handed.release(1, None)
    assert handed.moved == 2 and current.data_ptr() != buf.data_ptr()
    handed.release(1, None)
    assert handed.moved == 2  # forgotten once moved


def _cuda_fabric_kept(strategy, steps=3):
    """A Fabric loop on the GPU keeping every ``p.grad`` by reference: the kept tensors, on the host."""
    from models import tiny_llama

    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    model = tiny_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fabric = L.Fabric(accelerator="cuda", devices=1, precision="32-true",
                      strategy=LazyTrainFabricStrategy(policy=strategy) if strategy != "auto" else "auto")
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    kept = []
    for _ in range(steps):
        b = torch.randint(0, 256, (4, 32), generator=g).to(fabric.device)
        fabric.backward(model(input_ids=b, labels=b).loss)
        kept.append([p.grad for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    out = [[t.detach().float().cpu() for t in step] for step in kept]
    if strategy != "auto":
        fabric.strategy.teardown()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["keep_all", "recompute_all"])
def test_gradients_kept_on_a_gpu_keep_their_step_values(policy):
    """On CUDA the host gradients are page-locked and a step's first copy lands in them directly (Note: [direct
    landing]): a kept ``.grad`` is moved out before that copy. Against auto on the same GPU (TF32 off): each kept
    tensor within 1e-5 relative (a reused buffer would show the last step's gradient: errors of order 1)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    want = _cuda_fabric_kept("auto")
    got = _cuda_fabric_kept(policy)
    for step, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a, b):
            err = float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
            assert err <= 1e-5, (step, err)


class KeepsDetached(Module):
    def on_before_optimizer_step(self, optimizer):  # a logging idiom: on the host, .cpu() copies nothing here
        self.kept.append({n: p.grad.detach().cpu() for n, p in self.named_parameters() if p.grad is not None})


@pytest.mark.parametrize("kind", ["keep_all", "pipelined"])
def test_detached_gradients_kept_keep_their_step_values(kind):
    """``p.grad.detach().cpu()`` kept: another tensor over the host gradient's memory, not the one handed out.
    The group's references are counted; once its gradients begin afresh with such a tensor alive, the group
    gets a new host gradient (one renewal per group per later step)."""
    hybrid = kind == "pipelined"
    torch.manual_seed(0)
    want = fit("auto", KeepsDetached(keep=True, hybrid=hybrid))
    torch.manual_seed(0)
    got = fit(LazyTrainStrategy(policy=plan(kind)), KeepsDetached(keep=True, hybrid=hybrid))
    assert_kept_same(got, want)
    assert got.renewed == (STEPS - 1) * (LAYERS + 1) and got.moved == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_gradients_stay_page_locked_and_unrenewed_on_a_gpu():
    """Each group's host gradient is the arena's bytes through DLPack (a storage of its own, whose references are
    counted): still page-locked (``is_pinned``: the copies land in it directly), and an ordinary loop on the GPU
    moves and renews nothing."""
    from models import tiny_llama

    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    model = tiny_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fabric = L.Fabric(accelerator="cuda", devices=1, precision="32-true",
                      strategy=LazyTrainFabricStrategy(policy="recompute_all"))
    model, opt = fabric.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        b = torch.randint(0, 256, (4, 32), generator=g).to(fabric.device)
        fabric.backward(model(input_ids=b, labels=b).loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
    store = fabric.strategy.core.executor.params
    assert store.kept_grads_moved == 0 and store.kept_grad_renewals == 0
    assert all(grp.grad.is_pinned() for grp in store._groups.values() if grp.grad.numel())
    fabric.strategy.teardown()
