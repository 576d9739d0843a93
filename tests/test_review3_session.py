"""Review 3 of the session's changes: trainable-first layout with short gradient copies (a parameter frozen
at construction then thawed, a prefix parameter frozen then thawed, ad-hoc second forwards), shared modules
with HybridAdamW pipelined / updates_in_backward and micro-batches of different sizes. Every case compares
per-step losses and the final state_dict with strategy="auto", bit for bit in fp32."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from test_review_clip_manual import Grads, Net, assert_same, data, fit, grad_diffs, lazy
from test_shared_modules import SharedNet
from test_updates_in_backward import plan_file

from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.planner import InfeasibleBudget, recompute_all
from lightning_lazytrain.strategy import LazyTrainStrategy


class FrozenLin(Net):
    """Each block's first Linear (``lin``, first in module order, so last in the trainable-first layout)
    frozen at construction; AdamW over every parameter (a frozen one has no grad: AdamW skips it)."""

    def __init__(self, opt="adamw", adhoc=False, **kw):
        super().__init__(opt=opt, **kw)
        self.adhoc = adhoc
        for b in self.layers:
            b.lin.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        loss = self.head(self(batch)).square().mean()
        if self.adhoc:  # a second forward through the blocks in the same micro-batch
            loss = loss + 0.5 * self.head(self(batch.flip(1))).square().mean()
        return loss


class Toggle(Grads):
    """At batch ``at`` sets ``requires_grad`` of the named submodules of every block to ``value``;
    records the gradients the optimizer gets."""

    reads_gradients_only = False

    def __init__(self, plan: list[tuple[int, str, bool]]):
        super().__init__("before")
        self.plan = plan

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        for at, name, value in self.plan:
            if batch_idx == at:
                for b in module.layers:
                    getattr(b, name).requires_grad_(value)


def run_pair(plan, make, toggles, **kw):
    g_got, g_want = Toggle(toggles), Toggle(toggles)
    got = fit(lazy(plan), make(), callbacks=[g_got], **kw)
    want = fit("auto", make(), callbacks=[g_want], **kw)
    assert grad_diffs(g_got, g_want) == [[]] * len(g_want.seen)
    assert_same(got, want)
    return got


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum, at", [(1, 2), (2, 3), (2, 2)])
def test_frozen_at_construction_then_thawed(plan, accum, at):
    """``lin`` sits past the trainable prefix: once thawed the copies must reach it."""
    run_pair(plan, FrozenLin, [(at, "lin", True)], accum=accum, steps=3)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_prefix_parameter_frozen_then_thawed(plan):
    """``out`` (inside the trainable prefix) frozen at batch 1, thawed at batch 3; ``lin`` thawed at 2."""
    run_pair(plan, FrozenLin, [(1, "out", False), (2, "lin", True), (3, "out", True)], steps=5)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum", [1, 2])
def test_adhoc_second_forward_with_a_thawed_tail(plan, accum):
    """A second forward through the blocks (its gradients joined via take_grads/extra) with a short copy."""
    run_pair(plan, lambda: FrozenLin(adhoc=True), [(accum, "lin", True), (2 * accum + 1, "out", False)],
             accum=accum, steps=3)


def sized(sizes, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, 5, 6, generator=g) for b in sizes]


class SharedHybrid(SharedNet):
    def __init__(self, **opt_kw):
        super().__init__()
        self.opt_kw = opt_kw

    def configure_optimizers(self):
        return HybridAdamW(self.groups(), lr=1e-2, weight_decay=0.1, **self.opt_kw)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_shared_module_hybrid_accum_of_different_sizes(plan):
    sizes = [2, 5, 3, 1, 4, 2]
    kw = {"accum": 2, "steps": 3, "gradient_clip_val": 0.05, "batches": sized(sizes)}
    assert_same(fit(lazy(plan), SharedHybrid(), **kw), fit("auto", SharedHybrid(), **kw))


def test_shared_module_updates_in_backward():
    policy = plan_file(dataclasses.replace(recompute_all(4), updates_in_backward=True, policy="review3-in-bw"))
    kw = {"steps": 3, "batches": sized([2, 3, 4])}
    assert_same(fit(LazyTrainStrategy(policy=policy), SharedHybrid(updates_in_backward=True, skip_nonfinite=False), **kw),
                fit("auto", SharedHybrid(updates_in_backward=True, skip_nonfinite=False), **kw))


def test_thawed_tail_under_auto_policy_with_growing_batches():
    """The default policy (profile, plan, rescale for larger batches) with a thaw after the plan."""
    sizes = [2, 2, 2, 2, 6, 6, 3, 8]
    kw = {"accum": 2, "steps": 4, "batches": sized(sizes)}
    g_got, g_want = Toggle([(5, "lin", True)]), Toggle([(5, "lin", True)])
    got = fit(LazyTrainStrategy(), FrozenLin(), callbacks=[g_got], **kw)
    want = fit("auto", FrozenLin(), callbacks=[g_want], **kw)
    assert grad_diffs(g_got, g_want) == [[]] * len(g_want.seen)
    assert_same(got, want)


# ---- batches larger than the plan: HybridAdamW pipelined, shared modules, manual optimization ----------------
from test_review2_shapes import BUDGET_GB, LONG, SHORT, batches_of  # noqa: E402
from test_review2_shapes import Net as MaskNet  # noqa: E402
from test_review2_shapes import fit as fit_shapes  # noqa: E402


def assert_same_shapes(got, want):
    (l_got, s_got, _), (l_want, s_want, _) = got, want
    assert l_got == l_want
    assert [k for k in s_want if not torch.equal(s_got[k], s_want[k])] == []


@pytest.mark.parametrize("accum", [1, 2])
def test_longer_batch_replans_a_pipelined_hybrid_step(accum):
    shapes = [SHORT] * 2 * accum + [LONG] * accum + [SHORT] * accum
    steps = len(shapes) // accum
    got = fit_shapes(LazyTrainStrategy(gpu_memory_budget_gb=BUDGET_GB), MaskNet("hybrid"), batches_of(shapes),
                     steps=steps, accum=accum)
    want = fit_shapes("auto", MaskNet("hybrid"), batches_of(shapes), steps=steps, accum=accum)
    assert_same_shapes(got, want)
    rec = got[2].record
    assert all(p <= rec.budget for p, s in zip(rec.peaks, rec.shapes) if p is not None), (rec.peaks, rec.budget)


class MaskShared(MaskNet):
    """The masked net whose blocks all call one Linear (trainable)."""

    def __init__(self, opt="adamw"):
        super().__init__(opt)
        from test_shared_modules import SharedBlock
        shared = torch.nn.Linear(16, 16)
        self.layers = torch.nn.ModuleList(SharedBlock(shared) for _ in range(4))


@pytest.mark.parametrize("accum", [1, 2])
def test_longer_batch_with_a_shared_module(accum):
    shapes = [SHORT] * 2 * accum + [LONG, SHORT] * accum + [SHORT] * accum
    steps = len(shapes) // accum
    got = fit_shapes(LazyTrainStrategy(gpu_memory_budget_gb=BUDGET_GB), MaskShared(), batches_of(shapes),
                     steps=steps, accum=accum)
    want = fit_shapes("auto", MaskShared(), batches_of(shapes), steps=steps, accum=accum)
    assert_same_shapes(got, want)


class ManualMask(MaskNet):
    def __init__(self):
        super().__init__("adamw")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, mask = batch
        y = self.head(self(x)).squeeze(-1).square()
        loss = (y * mask).sum() / mask.sum()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        return loss


def test_longer_batch_under_manual_optimization():
    shapes = [SHORT] * 2 + [LONG] * 2 + [SHORT]
    got = fit_shapes(LazyTrainStrategy(gpu_memory_budget_gb=BUDGET_GB), ManualMask(), batches_of(shapes),
                     steps=len(shapes))
    want = fit_shapes("auto", ManualMask(), batches_of(shapes), steps=len(shapes))
    assert_same_shapes(got, want)
    rec = got[2].record
    assert all(p <= rec.budget for p in rec.peaks if p is not None), (rec.peaks, rec.budget)


from test_review2_finetune import InBwLoRANet, ThawBase, plan_in_backward  # noqa: E402


# ---- a shared module's weights in a non-block part that completes early (updates in the backward) ------------
class SharedInHeadPart(SharedNet):
    """SharedNet; HybridAdamW(updates_in_backward=True) grouped: emb (part 0), head + the shared Linear (a
    part the head's gradient completes -- were the shared weights not still to come), one layer per block."""

    def configure_optimizers(self):
        shared = list(self.layers[0].shared.parameters())
        ids = {id(p) for p in shared}
        return HybridAdamW(
            [{"params": list(self.emb.parameters()), "layer": "emb"},
             {"params": list(self.head.parameters()) + shared, "layer": "head"}]
            + [{"params": [p for p in b.parameters() if id(p) not in ids], "layer": i}
               for i, b in enumerate(self.layers)],
            lr=1e-2, weight_decay=0.1, skip_nonfinite=False, updates_in_backward=True)


@pytest.mark.parametrize("accum", [1, 2])
def test_shared_module_in_an_early_part_with_updates_in_backward(accum):
    policy = plan_file(dataclasses.replace(recompute_all(4), updates_in_backward=True, policy="review3-in-bw2"))
    kw = {"steps": 3, "accum": accum}
    assert_same(fit(LazyTrainStrategy(policy=policy), SharedInHeadPart(), **kw),
                fit("auto", SharedInHeadPart(), **kw))


# ---- a non-block group added mid-run (BaseFinetuning thaws the frozen embedding) ------------------------------
from lightning.pytorch.callbacks import BaseFinetuning  # noqa: E402
from test_review2_finetune import LoRANet  # noqa: E402


class ThawEmb(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        pass  # LoRANet's embedding is frozen from the start

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(modules=pl_module.emb, optimizer=optimizer, initial_denom_lr=10.0)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum", [1, 2])
def test_base_finetuning_thaws_the_embedding(plan, accum):
    kw = {"accum": accum, "gradient_clip_val": 0.05, "steps": -1, "max_epochs": 2, "batches": data(2 * accum)}
    g_got, g_want = Grads(), Grads()
    got = fit(lazy(plan), LoRANet("hybrid"), callbacks=[ThawEmb(), g_got], **kw)
    want = fit("auto", LoRANet("hybrid"), callbacks=[ThawEmb(), g_want], **kw)
    assert grad_diffs(g_got, g_want) == [[]] * len(g_want.seen)
    assert_same(got, want)


# ---- groups added mid-run with updates in the backward: a block's base Linear, or the embedding ----------------
@pytest.mark.parametrize("thaw", [ThawBase, ThawEmb], ids=["block-base", "embedding"])
@pytest.mark.parametrize("accum", [1, 2])
def test_group_added_mid_run_with_updates_in_backward(thaw, accum):
    kw = {"accum": accum, "steps": -1, "max_epochs": 2, "batches": data(2 * accum)}
    got = fit(LazyTrainStrategy(policy=plan_in_backward()), InBwLoRANet(), callbacks=[thaw()], **kw)
    want = fit("auto", InBwLoRANet(), callbacks=[thaw()], **kw)
    assert_same(got, want)


# ---- a longer batch whose blocks also receive a per-batch tensor (a mask / bias: the plan's call bytes) ---------
class BiasBlock(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x, bias):
        return x + torch.tanh(self.lin(torch.bmm(bias, x)))


class BiasNet(MaskNet):
    """Blocks called as ``block(h, bias)`` with ``bias`` (B, T, T) built outside the blocks (as an attention
    bias / mask is): every block call keeps it for its re-run (``StepStats.call_bytes``)."""

    def __init__(self):
        super().__init__("adamw")
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(BiasBlock() for _ in range(4))

    def forward(self, x):
        h = self.emb(x)
        t = x.shape[1]
        bias = torch.softmax(torch.tril(torch.ones(t, t)).log(), -1).expand(x.shape[0], t, t).contiguous()
        for b in self.layers:
            h = b(h, bias)
        return h


class Plans(L.Callback):
    reads_gradients_only = True

    def __init__(self):
        self.workloads = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        plan = trainer.strategy.core.plan
        self.workloads.append(None if plan is None else plan.result.workload)


def test_longer_batch_estimate_counts_the_blocks_call_tensors():
    """Profiled on short batches, then long ones: the scaled estimate keeps the short batch's call bytes
    (Workload.scaled scales activations but not ``nonblock_gpu_bytes``, which holds ``call_bytes``)."""
    shapes = [SHORT] * 2 + [LONG] * 3
    est, ref = Plans(), Plans()
    got = fit_shapes(LazyTrainStrategy(), BiasNet(), batches_of(shapes), steps=len(shapes), callbacks=[est])
    want = fit_shapes("auto", BiasNet(), batches_of(shapes), steps=len(shapes))
    assert_same_shapes(got, want)
    fit_shapes(LazyTrainStrategy(), BiasNet(), batches_of([LONG] * 3), steps=3, callbacks=[ref])
    scaled = est.workloads[2]  # the long step's plan: the short profile's workload scaled 16x
    measured = ref.workloads[-1]  # profiled on the long batches
    assert scaled is not None and measured is not None, (est.workloads, ref.workloads)
    assert scaled.nonblock_gpu_bytes >= measured.nonblock_gpu_bytes, (scaled.nonblock_gpu_bytes,
                                                                       measured.nonblock_gpu_bytes)


def test_longer_batch_with_call_tensors_holds_the_budget():
    """Under a budget the long batch fits (by the plan's model, profiled on it: ~141 kB at the least), the
    long steps hold it; under 140 kB (within ~1 kB of that least, which the measured working sets move from run
    to run) either they hold it or that profile refuses the batch with the shortfall -- never an overrun."""
    shapes = [SHORT] * 2 + [LONG] * 3
    try:
        tight = fit_shapes(LazyTrainStrategy(gpu_memory_budget_gb=BUDGET_GB), BiasNet(), batches_of(shapes),
                           steps=len(shapes))
    except InfeasibleBudget as err:
        assert "gpu memory short by" in str(err)
    else:
        rec = tight[2].record
        assert all(p <= rec.budget for p in rec.peaks if p is not None), (rec.peaks, rec.budget)
    got = fit_shapes(LazyTrainStrategy(gpu_memory_budget_gb=1.6e-4), BiasNet(), batches_of(shapes),
                     steps=len(shapes))
    want = fit_shapes("auto", BiasNet(), batches_of(shapes), steps=len(shapes))
    assert_same_shapes(got, want)
    rec = got[2].record
    assert all(p <= rec.budget for p in rec.peaks if p is not None), (rec.peaks, rec.predicted, rec.budget)


# ---- the plugin's checkpoint key: the precision plugins still pickle ---------------------------------------------
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_the_lazytrain_precision_plugin_pickles_as_autos_does(precision):
    """Pickle resolves a class by ``__module__`` + ``__qualname__``: the plugin classes answering to their base
    class's ``__qualname__`` (Note: [the plugin's checkpoint key]) resolve to Lightning's class instead."""
    import pickle

    from lightning_lazytrain.adapters.precision import lazytrain_precision

    trainer = L.Trainer(strategy="auto", accelerator="cpu", precision=precision, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    base = trainer.precision_plugin
    pickle.loads(pickle.dumps(base))  # auto's plugin pickles
    plugin = lazytrain_precision(base, None)
    back = pickle.loads(pickle.dumps(plugin))
    assert type(back) is type(plugin)


# ---- manual optimization (two forwards per closure, toggle_optimizer) with a thawed tail ----------------------
from test_review_clip_manual import ManualNet  # noqa: E402


class ManualFrozenLin(ManualNet):
    def __init__(self, **kw):
        super().__init__(**kw)
        for b in self.layers:
            b.lin.requires_grad_(False)


class ThawAt(L.Callback):
    reads_gradients_only = True  # changes requires_grad only

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.at:
            for b in module.layers:
                b.lin.requires_grad_(True)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum", [False, True])
def test_manual_optimization_with_a_thawed_tail(plan, accum):
    def run(strategy):
        return fit(strategy, ManualFrozenLin(accum=accum), steps=8, batches=data(8), callbacks=[ThawAt(1)])
    assert_same(run(lazy(plan)), run("auto"))


# ---- Fabric: accumulation whose second micro-batch is longer than the plan (each forward begins a micro-batch) ---
from test_review2_fabric_precision import assert_same as assert_same_fabric  # noqa: E402
from test_review2_fabric_precision import loss_of, run_fabric, step_all  # noqa: E402

from lightning_lazytrain.adapters.fabric import LazyTrainFabricStrategy  # noqa: E402


def fabric_batches(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, t, 6, generator=g) for t in lengths]


def loop_growing(lengths, accum):
    def loop(fabric, model, opts, scheds, steps):
        data, losses = iter(fabric_batches(lengths)), []
        for _ in range(steps):
            for k in range(accum):
                with fabric.no_backward_sync(model, enabled=k < accum - 1):
                    loss = loss_of(model, next(data))
                    fabric.backward(loss / accum)
                losses.append(loss.detach())
            step_all(opts, scheds)
        return losses
    return loop


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("opt", ["adamw", "hybrid"])
def test_fabric_longer_micro_batch_mid_step(accum, opt):
    lengths = [4] * 2 * accum + [4, 64] * accum + [64] * accum
    lengths = lengths[: 4 * accum]
    kw = dict(opt=opt, steps=4)
    got = run_fabric(LazyTrainFabricStrategy(gpu_memory_budget_gb=BUDGET_GB), loop_growing(lengths, accum), **kw)
    assert_same_fabric(got, run_fabric("auto", loop_growing(lengths, accum), **kw))


# ---- a shared module's weights grouped with one block's layer ----------------------------------------------------
class SharedInBlockLayer(SharedNet):
    """HybridAdamW one layer per block, the shared Linear in block 2's layer (a user grouping by block)."""

    def __init__(self, **opt_kw):
        super().__init__()
        self.opt_kw = opt_kw

    def configure_optimizers(self):
        shared = list(self.layers[0].shared.parameters())
        ids = {id(p) for p in shared}
        rest = [p for n, p in self.named_parameters() if not n.startswith("layers.")]
        return HybridAdamW(
            [{"params": rest, "layer": "rest"}]
            + [{"params": [p for p in b.parameters() if id(p) not in ids] + (shared if i == 2 else []), "layer": i}
               for i, b in enumerate(self.layers)],
            lr=1e-2, weight_decay=0.1, **self.opt_kw)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_shared_module_in_a_blocks_layer(plan):
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}
    assert_same(fit(lazy(plan), SharedInBlockLayer(), **kw), fit("auto", SharedInBlockLayer(), **kw))


def test_shared_module_in_a_blocks_layer_updates_in_backward():
    policy = plan_file(dataclasses.replace(recompute_all(4), updates_in_backward=True, policy="review3-in-bw3"))
    kw = {"steps": 3}
    opt = {"updates_in_backward": True, "skip_nonfinite": False}
    assert_same(fit(LazyTrainStrategy(policy=policy), SharedInBlockLayer(**opt), **kw),
                fit("auto", SharedInBlockLayer(**opt), **kw))


# ---- a shared module with an ad-hoc second forward and micro-batches of different sizes -------------------------
class SharedAdhoc(SharedHybrid):
    def training_step(self, batch, batch_idx):
        return self.head(self(batch)).square().mean() + 0.5 * self.head(self(batch.flip(1))).square().mean()


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_shared_module_with_an_adhoc_second_forward(plan):
    kw = {"accum": 2, "steps": 2, "gradient_clip_val": 0.05, "batches": sized([2, 3, 4, 1])}
    assert_same(fit(lazy(plan), SharedAdhoc(), **kw), fit("auto", SharedAdhoc(), **kw))
