"""Review: gradient clipping, non-finite steps, manual optimization and precisions under lazytrain,
compared against ``strategy="auto"`` (fp32 on CPU: bit for bit; bf16-true with fp32 masters: bit for bit
against an fp32-master reference under auto, and within 2e-2 (losses) / 3e-2 (weights) of plain bf16-true).

Every lazytrain fit runs a plan file: ``serial`` (recompute_all, serial optimizer) or ``pipelined`` (keep_all,
HybridAdamW's layer-pipelined step; HybridAdamW is grouped one layer per block so that it pipelines).

The tests that fail show defects (see each docstring): the Trainer's precision plugin turns every
``clip_gradients`` call into HybridAdamW's persistent ``max_grad_norm`` (own clip erased, conditional
clips persist, manual clips deferred); a non-finite fused-clip norm always skips (fp16 norm overflow,
``skip_nonfinite=False``); the gradients of parameters frozen between micro-batches are dropped; a block
parameter used outside its block loses that gradient; manual optimization and gradient-reading callbacks
see a pipelined step before it has finished."""

from __future__ import annotations

import dataclasses
import math
import time

import lightning as L
import pytest
import torch
from models import StackNet, WideBlock
from test_fp32_masters import MasterSteps
from test_updates_in_backward import plan_file
from torch import nn

from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.planner import keep_all, recompute_all
from lightning_lazytrain.strategy import LazyTrainStrategy

LAYERS = 4
D = 16


def pipelined() -> str:
    """A plan file forcing the layer-pipelined HybridAdamW step."""
    return plan_file(dataclasses.replace(keep_all(LAYERS), optimizer="pipelined", policy="review-pipelined"))


def serial() -> str:
    """A plan file forcing the serial step (recompute_all's homes)."""
    return plan_file(dataclasses.replace(recompute_all(LAYERS), optimizer="serial", policy="review-serial"))


class SlowHybridAdamW(HybridAdamW):
    """Each layer's host update takes 20 ms: a pipelined step still runs when the optimizer step returns."""

    def _update_layer(self, layer, plan):
        time.sleep(0.02)
        super()._update_layer(layer, plan)


class Net(StackNet):
    """Linear(6, D) -> 4 WideBlocks -> Linear(D, 1); HybridAdamW grouped per block (``layer`` = block
    index, the non-block weights one layer "rest") so that a pipelined plan pipelines it; or torch AdamW."""

    def __init__(self, opt="hybrid", **opt_kw):
        super().__init__(lambda: WideBlock(D), D, layers=LAYERS)
        self.opt, self.opt_kw = opt, opt_kw

    def groups(self):
        rest = [p for n, p in self.named_parameters() if not n.startswith("layers.")]
        return [{"params": rest, "layer": "rest"}] + [
            {"params": list(b.parameters()), "layer": i} for i, b in enumerate(self.layers)]

    def configure_optimizers(self):
        if self.opt == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        return HybridAdamW(self.groups(), lr=1e-2, weight_decay=0.1, **self.opt_kw)


class Record(L.Callback):
    reads_gradients_only = True  # records losses only

    def __init__(self):
        self.losses, self.pipelined, self.norms = [], [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        out = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(out) if out is not None else float(trainer.callback_metrics.get("loss", math.nan)))
        opt = trainer.optimizers[0]
        inner = getattr(opt, "optimizer", opt)
        self.norms.append(getattr(inner, "last_grad_norm", None))
        if isinstance(trainer.strategy, LazyTrainStrategy):  # does this plan step HybridAdamW pipelined?
            self.pipelined.append(trainer.strategy.core.pipelined_order(inner) is not None)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, 6, generator=g) for _ in range(n)]


def fit(strategy, module, *, steps=4, accum=1, batches=None, callbacks=(), **kw):
    rec = Record()
    torch.manual_seed(11)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, callbacks=[rec, *callbacks], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        accumulate_grad_batches=accum, **kw)
    batches = batches if batches is not None else data(steps * accum * (2 if not module.automatic_optimization
                                                                        else 1))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    trainer.record = rec
    return rec.losses, {k: v.clone() for k, v in module.state_dict().items()}, trainer


def same(a, b) -> bool:
    """Bit for bit, NaN where NaN."""
    return torch.equal(a, b) or (a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))


def assert_same(got, want):
    (l_got, s_got, _), (l_want, s_want, _) = got, want
    assert [None if math.isnan(x) else x for x in l_got] == [None if math.isnan(x) else x for x in l_want]
    assert s_got.keys() == s_want.keys()
    bad = [k for k in s_want if not same(s_got[k], s_want[k])]
    assert not bad, bad


def lazy(plan):
    return LazyTrainStrategy(policy=pipelined() if plan == "pipelined" else serial())


# ---- (1) clipping: the Trainer's norm/value clip, torch AdamW, accumulation, serial/pipelined plans -------------
@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("opt, algo, accum", [
    ("hybrid", "norm", 1), ("hybrid", "norm", 2), ("hybrid", "value", 2), ("adamw", "norm", 2), ("adamw", "value", 1)])
def test_trainer_clip_matches_auto(plan, opt, algo, accum):
    clip = 0.05 if algo == "norm" else 0.002
    kw = {"accum": accum, "gradient_clip_val": clip, "gradient_clip_algorithm": algo}
    got = fit(lazy(plan), Net(opt), **kw)
    assert_same(got, fit("auto", Net(opt), **kw))
    if opt == "hybrid":
        assert any(got[2].record.pipelined) == (plan == "pipelined")
        if algo == "norm":  # the fused clip was active on every step
            assert all(n > clip for n in got[2].record.norms if not math.isnan(n))


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_hybrid_adamws_own_max_grad_norm_without_a_trainer_clip(plan):
    """HybridAdamW(max_grad_norm=0.05), no gradient_clip_val: under auto the optimizer clips itself."""
    got, want = fit(lazy(plan), Net(max_grad_norm=0.05)), fit("auto", Net(max_grad_norm=0.05))
    assert_same(got, want)
    assert got[2].optimizers[0].max_grad_norm == 0.05


def test_hybrid_adamws_own_max_grad_norm_under_the_trainers_value_clip():
    """gradient_clip_algorithm="value": Lightning's clip_grad_value_ (in place, at once), then the optimizer's own."""
    kw = {"gradient_clip_val": 0.002, "gradient_clip_algorithm": "value", "accum": 2}
    assert_same(fit(lazy("pipelined"), Net(max_grad_norm=0.05), **kw), fit("auto", Net(max_grad_norm=0.05), **kw))


def test_hybrid_adamws_own_max_grad_norm_below_the_trainers_clip():
    """gradient_clip_val=1.0 and HybridAdamW(max_grad_norm=0.05): auto clips to 1.0, then the optimizer to 0.05."""
    kw = {"gradient_clip_val": 1.0}
    assert_same(fit(lazy("serial"), Net(max_grad_norm=0.05), **kw), fit("auto", Net(max_grad_norm=0.05), **kw))


# ---- (3) manual optimization ------------------------------------------------------------------------------------
class ManualNet(Net):
    """Manual optimization: HybridAdamW (per-block groups) and SGD on a critic, toggle_optimizer, a step
    with a closure, a StepLR stepped by hand. ``clip``: which batches call ``self.clip_gradients`` (norm
    0.05) -- "all", "first" (batch 0 only) or "none"; ``accum``: manual accumulation over two batches with
    a clip after every backward; ``read``: the weights read right after each step (as an EMA would)."""

    def __init__(self, clip="all", accum=False, read=False, **kw):
        super().__init__(**kw)
        self.critic = nn.Linear(D, 1)
        self.automatic_optimization = False
        self.clip, self.accum, self.read = clip, accum, read
        self.seen = []

    def groups(self):
        return [{**g, "params": [p for p in g["params"] if all(p is not q for q in self.critic.parameters())]}
                for g in super().groups()]

    def training_step(self, batch, batch_idx):
        opt, opt_c = self.optimizers()
        sched = self.lr_schedulers()
        self.toggle_optimizer(opt_c)
        with torch.no_grad():
            feats = self(batch)
        loss_c = self.critic(feats).square().mean()
        self.manual_backward(loss_c)
        opt_c.step()
        opt_c.zero_grad()
        self.untoggle_optimizer(opt_c)

        self.toggle_optimizer(opt)
        stepping = not self.accum or batch_idx % 2 == 1

        def closure():
            loss = self.head(self(batch)).square().mean() + 0.1 * self.critic(self(batch.flip(1))).square().mean()
            self.manual_backward(loss / (2 if self.accum else 1))
            if self.clip == "all" or (self.clip == "first" and batch_idx == 0):
                self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            return loss

        if stepping and not self.accum:
            loss = opt.step(closure=closure)
        else:
            loss = closure()
            if stepping:
                opt.step()
        if stepping:
            opt.zero_grad()
            sched.step()
            if self.read:
                self.seen.append([p.detach().clone() for p in self.parameters()])
        self.untoggle_optimizer(opt)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        cls = SlowHybridAdamW if self.read else HybridAdamW  # read: a pipelined step still runs at the read
        opt = cls(self.groups(), lr=1e-2, weight_decay=0.1, **self.opt_kw)
        return [opt, torch.optim.SGD(self.critic.parameters(), lr=0.1)], [torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)]


def manual_fit(strategy, module, steps=6):
    # manual optimization: max_steps counts every optimizer's steps
    return fit(strategy, module, steps=steps, batches=data(8))


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_manual_clip_gradients_every_step(plan):
    assert_same(manual_fit(lazy(plan), ManualNet(clip="all")), manual_fit("auto", ManualNet(clip="all")))


def test_manual_clip_gradients_on_the_first_step_only():
    """``self.clip_gradients`` on batch 0 only: auto clips that step and no other."""
    assert_same(manual_fit(lazy("serial"), ManualNet(clip="first")), manual_fit("auto", ManualNet(clip="first")))


def test_manual_clip_gradients_after_each_accumulated_backward():
    """Manual accumulation over two batches with ``self.clip_gradients`` after every backward: auto clips the
    first batch's gradients, then the sum of the clipped first and the second."""
    got = manual_fit(lazy("serial"), ManualNet(clip="all", accum=True), steps=8)
    want = manual_fit("auto", ManualNet(clip="all", accum=True), steps=8)
    assert_same(got, want)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_manual_accumulation_without_a_clip(plan):
    got = manual_fit(lazy(plan), ManualNet(clip="none", accum=True), steps=8)
    assert_same(got, manual_fit("auto", ManualNet(clip="none", accum=True), steps=8))
    assert any(got[2].record.pipelined) == (plan == "pipelined")


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_manual_weights_read_right_after_the_step(plan):
    """training_step reads every weight right after ``opt.step()`` (an EMA in the step)."""
    got_m, want_m = ManualNet(clip="none", read=True), ManualNet(clip="none", read=True)
    got, want = manual_fit(lazy(plan), got_m), manual_fit("auto", want_m)
    assert len(got_m.seen) == len(want_m.seen)
    for i, (a, b) in enumerate(zip(got_m.seen, want_m.seen)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {i}"
    assert_same(got, want)


# ---- parameters frozen mid-run, parameters without a gradient in some steps --------------------------------------
class Freeze(L.Callback):
    """Freezes block 1 and the embedding (``requires_grad_(False)``, as a finetuning callback does) at
    batch ``at`` (with accumulation 2, an odd batch is the step's second micro-batch: the first one's
    gradients stay and are stepped); ``thaw``: unfreezes them at batch ``at`` instead (frozen before the fit)."""

    def __init__(self, declared, at=4, thaw=False):
        self.reads_gradients_only = declared  # declared: the pipelined step keeps running after the step
        self.at, self.thaw = at, thaw

    def setup(self, trainer, module, stage):
        if self.thaw:
            module.layers[1].requires_grad_(False)
            module.emb.requires_grad_(False)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.at:
            module.layers[1].requires_grad_(self.thaw)
            module.emb.requires_grad_(self.thaw)


@pytest.mark.parametrize("plan, declared", [("serial", False), ("pipelined", False), ("pipelined", True)])
@pytest.mark.parametrize("accum, at, thaw", [(1, 2, False), (2, 4, False), (2, 5, True), (1, 2, True)])
def test_parameters_frozen_mid_run(plan, declared, accum, at, thaw):
    kw = {"accum": accum, "gradient_clip_val": 0.05, "steps": 5}
    got = fit(lazy(plan), Net(), callbacks=[Freeze(declared, at, thaw)], **kw)
    want = fit("auto", Net(), callbacks=[Freeze(declared, at, thaw)], **kw)
    assert_same(got, want)


class Grads(L.Callback):
    """Each step's gradients as the optimizer gets them (``when="before"``: on_before_optimizer_step, after
    Lightning's clip) or right after the step (``when="after"``: on_train_batch_end, before any zero_grad)."""

    reads_gradients_only = True  # reads gradients, no weight (the documented trusted kind)

    def __init__(self, when="before"):
        self.when, self.seen = when, []

    def _take(self, module):
        self.seen.append({n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()})

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.when == "before":
            self._take(module)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.when == "after" and trainer.global_step > len(self.seen):
            self._take(module)


def grad_diffs(got: Grads, want: Grads) -> list:
    """Per step, (name, auto's grad is None, lazytrain's is None) of the gradients that differ."""
    return [[(n, a[n] is None, b[n] is None) for n in a
             if (a[n] is None) != (b[n] is None) or (a[n] is not None and not same(a[n], b[n]))]
            for a, b in zip(want.seen, got.seen)]


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_parameters_frozen_between_the_micro_batches_of_a_step(plan):
    """Accumulation 2; block 1 and the embedding frozen at batch 5 (step 2's second micro-batch). Under auto
    their gradients from batch 4 stay in ``.grad`` (requires_grad_(False) does not clear it) and are clipped and
    stepped. Also block 0 and block 2 frozen there (block 0, like the non-block weights, keeps its gradient
    on the device until the step's last micro-batch)."""

    class FreezeMore(Freeze):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            super().on_train_batch_start(trainer, module, batch, batch_idx)
            if batch_idx == self.at:
                module.layers[0].requires_grad_(False)
                module.layers[2].requires_grad_(False)

    kw = {"accum": 2, "gradient_clip_val": 0.05, "steps": 4}
    g_got, g_want = Grads(), Grads()
    got = fit(lazy(plan), Net(), callbacks=[FreezeMore(False, 5), g_got], **kw)
    want = fit("auto", Net(), callbacks=[FreezeMore(False, 5), g_want], **kw)
    assert grad_diffs(g_got, g_want)[2] == []
    assert_same(got, want)


class SometimesNet(Net):
    """Parameters without a gradient in some steps: an auxiliary head used on odd batches only, the head
    on even ones."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.aux = nn.Linear(D, 1)

    def training_step(self, batch, batch_idx):
        head = self.head if batch_idx % 2 == 0 else self.aux
        return head(self(batch)).square().mean()


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("opt, accum", [("hybrid", 1), ("hybrid", 2), ("adamw", 1)])
def test_parameters_without_a_gradient_in_some_steps(plan, opt, accum):
    kw = {"accum": accum, "gradient_clip_val": 0.05, "steps": 5}
    assert_same(fit(lazy(plan), SometimesNet(opt=opt), **kw), fit("auto", SometimesNet(opt=opt), **kw))


class PenaltyNet(Net):
    """A weight penalty over block 1's parameters in the loss, computed before the forward (as an L2-SP or
    a hand-written weight decay is): block 1's masters get a gradient outside the streamed block too."""

    def training_step(self, batch, batch_idx):
        penalty = sum(p.square().sum() for p in self.layers[1].parameters())
        return self.head(self(batch)).square().mean() + 1e-3 * penalty


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_block_parameter_used_directly_in_the_loss(plan):
    """Autograd adds the penalty's gradient (2e-3 * w) to block 1's streamed gradient under auto."""
    g_got, g_want = Grads(), Grads()
    got = fit(lazy(plan), PenaltyNet(), callbacks=[g_got], steps=3)
    want = fit("auto", PenaltyNet(), callbacks=[g_want], steps=3)
    assert grad_diffs(g_got, g_want) == [[]] * 3
    assert_same(got, want)


# ---- (2) non-finite steps ------------------------------------------------------------------------------------------
class NonFiniteNet(Net):
    """Batch ``at`` gives one gradient an inf (``how="inf"``: the head's bias) or makes every gradient NaN
    (``how="nan"``: a NaN input)."""

    def __init__(self, at=3, how="inf", **kw):
        super().__init__(**kw)
        self.at, self.how = at, how

    def training_step(self, batch, batch_idx):
        if batch_idx == self.at and self.how == "nan":
            batch = batch.clone()
            batch[0, 0, 0] = float("nan")
        loss = self.head(self(batch)).square().mean()
        if batch_idx == self.at and self.how == "inf":
            loss = loss + self.head.bias.sum() * float("inf")
        return loss


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("how, accum, clip", [("inf", 1, None), ("inf", 2, 0.05), ("nan", 2, None), ("nan", 1, 0.05)])
def test_a_non_finite_step_is_skipped_as_under_auto(plan, how, accum, clip):
    kw = {"accum": accum, "gradient_clip_val": clip, "steps": 5}
    got = fit(lazy(plan), NonFiniteNet(how=how), **kw)
    want = fit("auto", NonFiniteNet(how=how), **kw)
    assert want[2].optimizers[0].skipped_steps == 1
    assert got[2].optimizers[0].skipped_steps == 1
    assert_same(got, want)


def test_a_non_finite_step_with_8_bit_states():
    pytest.importorskip("bitsandbytes")
    kw = {"accum": 2, "gradient_clip_val": 0.05, "steps": 5}
    opt = {"eight_bit": "all", "min_8bit_numel": 256}
    got = fit(lazy("pipelined"), NonFiniteNet(how="inf", **opt), **kw)
    want = fit("auto", NonFiniteNet(how="inf", **opt), **kw)
    assert 8 in set(got[2].optimizers[0].assignment.values())
    assert got[2].optimizers[0].skipped_steps == want[2].optimizers[0].skipped_steps == 1
    assert_same(got, want)


class Big16Net(Net):
    """fp16 gradients whose norm is above fp16's range (every element 1e4, 96 of them: norm 9.8e4 > 65504)
    though every element is finite."""

    def training_step(self, batch, batch_idx):
        return self.head(self(batch)).square().mean() + 1e4 * self.emb.weight.sum()


def test_16_true_a_finite_gradient_whose_fp16_norm_overflows():
    """Under auto, clip_grad_norm_ takes the total norm in fp16 (inf), its factor is 0, the gradients become
    zeros, and HybridAdamW (its own fp32-accumulated norm: 0, finite) takes the step: weight decay, moments,
    step counts. Bit for bit that is what a fused clip equal to clip_grad_norm_ + HybridAdamW must do."""
    kw = {"gradient_clip_val": 1.0, "precision": "16-true"}
    got, want = fit(lazy("serial"), Big16Net(), **kw), fit("auto", Big16Net(), **kw)
    assert want[2].optimizers[0].skipped_steps == 0
    assert_same(got, want)
    assert got[2].optimizers[0].skipped_steps == 0


# ---- (4) precisions -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum, algo", [(1, "norm"), (2, "norm"), (2, "value")])
def test_bf16_mixed_clip_is_auto_bit_for_bit(plan, accum, algo):
    """bf16-mixed: autocast over fp32 weights, fp32 gradients: the same arithmetic as auto, bit for bit."""
    kw = {"accum": accum, "gradient_clip_val": 0.05 if algo == "norm" else 0.002, "gradient_clip_algorithm": algo,
              "precision": "bf16-mixed"}
    assert_same(fit(lazy(plan), Net(), **kw), fit("auto", Net(), **kw))


@pytest.mark.parametrize("how", [None, "inf"])
def test_16_mixed_with_a_loss_scaler_and_hybrid_adamw(how):
    """fp16 autocast with a GradScaler (the plugin given explicitly: Lightning makes "16-mixed" bf16 on CPU);
    an inf step is the scaler's to skip. Same arithmetic as auto: bit for bit."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def run(strategy):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        return fit(strategy, NonFiniteNet(how=how) if how else Net(), accum=2, gradient_clip_val=0.05, steps=5,
                   plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])

    assert_same(run(lazy("pipelined")), run("auto"))


class MasterNet(MasterSteps, Net):
    """The reference for ``fp32_masters=True`` (tests/test_fp32_masters.py's, with HybridAdamW per block): a
    bf16 model (``bf16-true`` under auto) trained through fp32 masters -- each micro-batch's bf16 gradients
    added into the masters' fp32 ones, Lightning's clip and the optimizer on the masters, the model copy the
    masters rounded to bf16 after every step."""

    def configure_optimizers(self):
        self.pairs = [(p, nn.Parameter(p.detach().float())) for p in self.parameters()]
        master = {id(p): m for p, m in self.pairs}
        groups = [{**g, "params": [master[id(p)] for p in g["params"]]} for g in self.groups()]
        return HybridAdamW(groups, lr=1e-2, weight_decay=0.1, **self.opt_kw)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum", [1, 2])
def test_bf16_true_fp32_masters_hybrid_adamw_clip(plan, accum):
    """bf16-true with fp32 masters, HybridAdamW and the Trainer's clip: bit for bit the reference above;
    against plain bf16-true under auto (bf16 weights, states, clip) within bf16's tolerance."""
    kw = {"accum": accum, "gradient_clip_val": 0.05, "precision": "bf16-true"}
    strategy = LazyTrainStrategy(policy=pipelined() if plan == "pipelined" else serial(), fp32_masters=True)
    got_losses, got_state, _trainer = fit(strategy, Net(), **kw)
    ref = MasterNet()
    want_losses, _, _ = fit("auto", ref, **kw)
    assert got_losses == want_losses
    masters = {n: m for (n, _), (_, m) in zip(ref.named_parameters(), ref.pairs)}
    for name, value in got_state.items():
        assert value.dtype == torch.float32 and torch.equal(value, masters[name]), name
    plain_losses, plain_state, _ = fit("auto", Net(), **kw)
    assert max(abs(a - b) for a, b in zip(got_losses, plain_losses)) < 2e-2
    for name, value in got_state.items():
        torch.testing.assert_close(value, plain_state[name].float(), atol=3e-2, rtol=0)


# ---- hooks that edit gradients before the step; a scheduler stepped by Lightning ----------------------------------
class Edit(L.Callback):
    """on_before_optimizer_step: block 2's weight gradient x10, the head's bias gradient dropped (None: that
    parameter is not stepped), a gradient given to the unused ``spare`` parameter."""

    def on_before_optimizer_step(self, trainer, module, optimizer):
        module.layers[2].lin.weight.grad.mul_(10.0)
        module.head.bias.grad = None
        module.spare.grad = torch.full_like(module.spare, 0.5)


class SpareNet(Net):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.spare = nn.Parameter(torch.zeros(5))

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("opt, accum, clip", [("hybrid", 2, 0.05), ("hybrid", 1, None), ("adamw", 2, 0.05)])
def test_on_before_optimizer_step_edits_and_a_scheduler(plan, opt, accum, clip):
    kw = {"accum": accum, "gradient_clip_val": clip, "steps": 5}
    got = fit(lazy(plan), SpareNet(opt=opt), callbacks=[Edit()], **kw)
    want = fit("auto", SpareNet(opt=opt), callbacks=[Edit()], **kw)
    assert_same(got, want)
    assert not torch.equal(got[1]["spare"], torch.zeros(5))
    if opt == "hybrid" and plan == "pipelined":
        assert any(got[2].record.pipelined)


@pytest.mark.parametrize("opt", ["hybrid", "adamw"])
def test_a_non_finite_step_without_the_skip_under_the_trainers_clip(opt):
    """HybridAdamW(skip_nonfinite=False) (or torch AdamW) with gradient_clip_val: under auto the inf step's
    clip factor is 0, the gradients 0*inf = NaN, and the optimizer, told not to skip, writes NaN into the
    weights it updates (torch semantics)."""
    kw = {"gradient_clip_val": 0.05, "steps": 5}
    extra = {"skip_nonfinite": False} if opt == "hybrid" else {}
    got = fit(lazy("serial"), NonFiniteNet(how="inf", opt=opt, **extra), **kw)
    want = fit("auto", NonFiniteNet(how="inf", opt=opt, **extra), **kw)
    assert want[1]["head.bias"].isnan().all()
    assert_same(got, want)


class SlowNet(Net):
    """HybridAdamW whose per-layer host update takes 20 ms (a pipelined step still runs when the step returns)."""

    def configure_optimizers(self):
        return SlowHybridAdamW(self.groups(), lr=1e-2, weight_decay=0.1, **self.opt_kw)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("bits", ["32", "8"])
def test_gradients_read_after_a_clipped_step(plan, bits):
    """A callback declaring ``reads_gradients_only = True`` (trusted: "it logs, times or reads gradients")
    reads the gradients at on_train_batch_end, after the optimizer step: under auto they are the clipped
    ones (clip_grad_norm_ scaled them in place before the step). Note: [gradients read after a clipped
    step]; 8-bit states: the update scales its gradient in place too (bitsandbytes' gnorm_scale would not)."""
    opt = {}
    if bits == "8":
        pytest.importorskip("bitsandbytes")
        opt = {"eight_bit": "all", "min_8bit_numel": 256}
    g_got, g_want = Grads("after"), Grads("after")
    got = fit(lazy(plan), SlowNet(**opt), callbacks=[g_got], gradient_clip_val=0.05)
    want = fit("auto", SlowNet(**opt), callbacks=[g_want], gradient_clip_val=0.05)
    assert_same(got, want)
    assert len(g_got.seen) == len(g_want.seen) == 4
    assert grad_diffs(g_got, g_want) == [[]] * 4


class EarlyClipNet(Net):
    """configure_gradient_clipping overridden: clip (norm 0.05) in the first two steps only."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if self.trainer.global_step < 2:
            self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_configure_gradient_clipping_that_clips_some_steps_only(plan):
    assert_same(fit(lazy(plan), EarlyClipNet(), steps=5), fit("auto", EarlyClipNet(), steps=5))


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("precision, bits", [("32-true", "8"), ("bf16-true", "32"), ("bf16-true", "8")])
def test_trainer_clip_with_8_bit_states_and_bf16_true(plan, precision, bits):
    """bf16-true without fp32 masters: bf16 weights, gradients, clip (norm and factor in bf16) under both: the
    same arithmetic, bit for bit; 8-bit states: bitsandbytes' gnorm_scale or a bf16 gradient scaled first."""
    opt = {}
    if bits == "8":
        pytest.importorskip("bitsandbytes")
        opt = {"eight_bit": "all", "min_8bit_numel": 256}
    kw = {"accum": 2, "gradient_clip_val": 0.05, "precision": precision, "steps": 3}
    got, want = fit(lazy(plan), Net(**opt), **kw), fit("auto", Net(**opt), **kw)
    assert_same(got, want)
    if bits == "8":
        assert 8 in set(got[2].optimizers[0].assignment.values())
    assert any(got[2].record.pipelined) == (plan == "pipelined")
