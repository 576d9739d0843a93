"""Review 2: (1) user-written Fabric loops under ``strategy="lazytrain"`` against ``Fabric(strategy="auto")``
(accumulation with ``fabric.no_backward_sync``, ``fabric.clip_gradients`` by norm and by value, two
optimizers, an LR scheduler, ``fabric.save``/``fabric.load`` and resume, no-grad evaluation between steps,
two ``fabric.backward`` calls per step, two forwards per loss; HybridAdamW, torch AdamW, SGD with momentum);
(2) Trainer precisions and optimizers: ``16-mixed`` with steps the GradScaler skips (accumulation, clip),
``bf16-mixed`` with accumulation and clip, LBFGS (a closure called several times), AdamW without
fused/foreach kernels, Adam with amsgrad, SGD nesterov, two param groups of different lr mixing block and
non-block parameters, a per-step LR scheduler.

Everything is compared bit for bit (per-step losses, final state dict) with ``strategy="auto"`` at the same
precision, as README "What is exact" promises. Tiny models (Linear(6, 16) -> 4 blocks -> Linear(16, 1))."""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern
from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy  # (registers the Fabric strategies)
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.planner import Schedule, keep_all, recompute_all
from lightning_lazytrain.strategy import LazyTrainStrategy

LAYERS = 4
D = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2 * D)
        self.norm = nn.LayerNorm(2 * D)
        self.out = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.out(torch.tanh(self.norm(self.lin(x))))


def plan_json(schedule: Schedule) -> str:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"schedule": schedule.to_json()}, f)
    return f.name


def mixed_plan() -> str:
    """A CPU home, a recomputed boundary and a layer that keeps its internals (tests/test_fabric.py's)."""
    return plan_json(Schedule(num_layers=LAYERS, homes=("gpu", "cpu", "recompute", "gpu", "gpu"),
                              keep_internals=(True, False, False, False), resident_weights=(False,) * LAYERS,
                              offload_window=(None, 1, None, None, None), reload_window=(None, 3, None, None, None),
                              policy="review2-mixed"))


def pipelined_plan() -> str:
    return plan_json(dataclasses.replace(keep_all(LAYERS), optimizer="pipelined", policy="review2-pipelined"))


def serial_plan() -> str:
    return plan_json(dataclasses.replace(recompute_all(LAYERS), optimizer="serial", policy="review2-serial"))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN."""
    return torch.equal(a, b) or (a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                                 and torch.equal(a.nan_to_num(), b.nan_to_num()))


def assert_same(got, want):
    (l_got, s_got), (l_want, s_want) = got[:2], want[:2]
    norm = lambda ls: [None if (isinstance(x, float) and math.isnan(x)) else x for x in ls]  # noqa: E731
    assert len(l_got) == len(l_want)
    diffs = [(i, a, b) for i, (a, b) in enumerate(zip(norm(l_got), norm(l_want))) if a != b]
    assert not diffs, f"losses differ (step, lazytrain, auto): {diffs[:4]}"
    assert s_got.keys() == s_want.keys()
    bad = {k: float((s_got[k] - s_want[k]).abs().max()) for k in s_want if not same(s_got[k], s_want[k])}
    assert not bad, f"state differs (max abs diff): {bad}"


# =====================================================================================================================
# (1) Fabric
# =====================================================================================================================
class FNet(nn.Module):
    """A plain nn.Module: Linear(6, D) -> 4 blocks (``layers``) -> Linear(D, 1)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(6, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h)
        return self.head(h)


def fdata(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, 6, generator=g) for _ in range(n)]


FDATA = fdata(40)
EVAL = fdata(1, seed=7)[0]


def make_opts(model: FNet, kind: str):
    block = [p for n, p in model.named_parameters() if n.startswith("layers.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    if kind == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)]
    if kind == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)]
    if kind == "hybrid":
        return [HybridAdamW([{"params": rest, "layer": "rest"}] + [
            {"params": list(b.parameters()), "layer": i} for i, b in enumerate(model.layers)],
            lr=1e-2, weight_decay=0.1)]
    if kind == "hybrid_clip":  # HybridAdamW's own max_grad_norm under Fabric
        return [HybridAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.05)]
    if kind == "two":  # blocks: AdamW; embedding and head: SGD with momentum
        return [torch.optim.AdamW(block, lr=1e-2), torch.optim.SGD(rest, lr=1e-2, momentum=0.9)]
    raise ValueError(kind)


def lazy_fabric(policy="recompute_all"):
    return LazyTrainFabricStrategy(policy=mixed_plan() if policy == "mixed" else policy)


def run_fabric(strategy, loop, *, opt="adamw", precision="32-true", sched=None, steps=4):
    """``loop(fabric, model, opts, scheds, steps) -> losses``; returns (losses, state dict, fabric)."""
    model = FNet()
    opts = make_opts(model, opt)
    torch.manual_seed(11)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    model, *opts = fabric.setup(model, *opts)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in opts] if sched else []
    losses = loop(fabric, model, opts, scheds, steps)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if isinstance(fabric.strategy, LazyTrainFabricStrategy):
        fabric.strategy.teardown()
    return [float(x) for x in losses], state, fabric


def loss_of(model, x):
    return model(x).square().mean()


def step_all(opts, scheds):
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    for s in scheds:
        s.step()


def loop_accumulate(clip=None):
    """Two micro-batches per step, the first under ``fabric.no_backward_sync``; then a clip."""
    def loop(fabric, model, opts, scheds, steps):
        data, losses = iter(FDATA), []
        for _ in range(steps):
            for k in range(2):
                with fabric.no_backward_sync(model, enabled=k == 0):
                    loss = loss_of(model, next(data))
                    fabric.backward(loss / 2)
                losses.append(loss.detach())
            for o in opts:
                if clip == "norm":
                    fabric.clip_gradients(model, o, max_norm=0.05)
                elif clip == "value":
                    fabric.clip_gradients(model, o, clip_val=0.002)
            step_all(opts, scheds)
        return losses
    return loop


@pytest.mark.parametrize("opt", ["adamw", "sgd", "hybrid"])
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fabric_accumulation_no_backward_sync_and_clip(opt, clip):
    kw = dict(opt=opt, steps=3)
    assert_same(run_fabric(lazy_fabric("mixed"), loop_accumulate(clip), **kw), run_fabric("auto", loop_accumulate(clip), **kw))


def loop_eval_between_micro_batches(fabric, model, opts, scheds, steps):
    """Accumulation over two micro-batches with a no-grad evaluation after the first backward."""
    data, losses = iter(FDATA), []
    for _ in range(steps):
        for k in range(2):
            loss = loss_of(model, next(data))
            fabric.backward(loss / 2)
            losses.append(loss.detach())
            if k == 0:
                with torch.no_grad():
                    losses.append(loss_of(model, EVAL))
        fabric.clip_gradients(model, opts[0], max_norm=0.05)
        step_all(opts, scheds)
    return losses


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_evaluation_between_accumulated_micro_batches(precision):
    kw = dict(opt="hybrid", steps=3, precision=precision)
    assert_same(run_fabric(lazy_fabric("mixed"), loop_eval_between_micro_batches, **kw),
                run_fabric("auto", loop_eval_between_micro_batches, **kw))


def test_fabric_lbfgs_with_a_closure():
    """``opt.step(closure)``: LBFGS runs forward + ``fabric.backward`` up to three times per step."""
    def run(strategy):
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        model = FNet()
        model, opt = fabric.setup(model, torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, history_size=4))
        losses = []
        for b in FDATA[:3]:
            def closure():
                opt.zero_grad()
                loss = loss_of(model, b)
                fabric.backward(loss)
                losses.append(float(loss))
                return loss
            opt.step(closure)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if isinstance(fabric.strategy, LazyTrainFabricStrategy):
            fabric.strategy.teardown()
        return losses, state

    assert_same(run(lazy_fabric("mixed")), run("auto"))


@pytest.mark.parametrize("clip", [None, "norm", "value"])
def test_fabric_hybrid_adamw_own_max_grad_norm(clip):
    """HybridAdamW(max_grad_norm=0.05), alone or after ``fabric.clip_gradients`` edited the gradients."""
    kw = dict(opt="hybrid_clip", steps=3)
    assert_same(run_fabric(lazy_fabric(), loop_accumulate(clip), **kw), run_fabric("auto", loop_accumulate(clip), **kw))


def loop_two_optimizers(fabric, model, opts, scheds, steps):
    """Two optimizers; on odd steps only the second steps (the first's gradients accumulate on)."""
    opt_a, opt_b = opts
    data, losses = iter(FDATA), []
    for step in range(steps):
        loss = loss_of(model, next(data))
        fabric.backward(loss)
        fabric.clip_gradients(model, opt_a, max_norm=0.05)
        if step % 2 == 0:
            opt_a.step()
            opt_a.zero_grad()
        opt_b.step()
        opt_b.zero_grad()
        for s in scheds:
            s.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("sched", [False, True])
def test_fabric_two_optimizers_and_lr_scheduler(sched):
    kw = dict(opt="two", steps=4, sched=sched)
    assert_same(run_fabric(lazy_fabric("milp"), loop_two_optimizers, **kw), run_fabric("auto", loop_two_optimizers, **kw))


def loop_eval_between(fabric, model, opts, scheds, steps):
    """A no-grad evaluation before and after each step (its loss recorded too)."""
    data, losses = iter(FDATA), []
    for _ in range(steps):
        with torch.no_grad():
            losses.append(loss_of(model, EVAL))
        loss = loss_of(model, next(data))
        fabric.backward(loss)
        losses.append(loss.detach())
        step_all(opts, scheds)
        with torch.no_grad():
            losses.append(loss_of(model, EVAL))
    return losses


@pytest.mark.parametrize("opt", ["hybrid", "sgd"])
def test_fabric_no_grad_evaluation_between_steps(opt):
    kw = dict(opt=opt, steps=3, sched=True)
    assert_same(run_fabric(lazy_fabric("mixed"), loop_eval_between, **kw), run_fabric("auto", loop_eval_between, **kw))


def loop_two_backwards(fabric, model, opts, scheds, steps):
    """Two losses per step, each from its own forward, each through ``fabric.backward``."""
    data, losses = iter(FDATA), []
    for _ in range(steps):
        a, b = next(data), next(data)
        l1 = loss_of(model, a)
        fabric.backward(l1)
        l2 = model(b).abs().mean()
        fabric.backward(0.5 * l2)
        fabric.clip_gradients(model, opts[0], max_norm=0.05)
        step_all(opts, scheds)
        losses += [l1.detach(), l2.detach()]
    return losses


def loop_two_losses_one_forward(fabric, model, opts, scheds, steps):
    """Two losses of one forward, two ``fabric.backward`` calls (``retain_graph=True`` on the first)."""
    data, losses = iter(FDATA), []
    for _ in range(steps):
        out = model(next(data))
        l1, l2 = out.square().mean(), out.abs().mean()
        fabric.backward(l1, retain_graph=True)
        fabric.backward(0.5 * l2)
        step_all(opts, scheds)
        losses += [l1.detach(), l2.detach()]
    return losses


def loop_two_forwards(fabric, model, opts, scheds, steps):
    """The model called twice (different inputs) into one loss, one backward."""
    data, losses = iter(FDATA), []
    for _ in range(steps):
        a, b = next(data), next(data)
        loss = loss_of(model, a) + 0.3 * model(b).abs().mean()
        fabric.backward(loss)
        step_all(opts, scheds)
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("opt", ["hybrid", "adamw"])
@pytest.mark.parametrize("loop", [loop_two_backwards, loop_two_forwards], ids=["two_backwards", "two_forwards"])
def test_fabric_two_backwards_or_two_forwards_per_step(loop, opt):
    kw = dict(opt=opt, steps=3)
    assert_same(run_fabric(lazy_fabric("mixed"), loop, **kw), run_fabric("auto", loop, **kw))


@pytest.mark.parametrize("policy", ["recompute_all", "keep_all"])
def test_fabric_two_losses_of_one_forward_two_backward_calls(policy):
    """Autograd lets a user backpropagate one forward twice (``retain_graph=True``; auto trains on the sum).
    The blocks' saved state is streamed, not retained: refused by name, with the fix (README's table)."""
    with pytest.raises(UnsupportedBlockPattern, match=r"retain_graph=True.*add the losses and call backward once"):
        run_fabric(lazy_fabric(policy), loop_two_losses_one_forward, opt="adamw", steps=3)


def test_fabric_setup_module_then_optimizers_and_zero_grad_without_none():
    """``fabric.setup_module``, the optimizer built on the wrapped module's parameters afterwards, then
    ``fabric.setup_optimizers``; accumulation with ``zero_grad(set_to_none=False)`` (zeroed host gradients)."""
    def run(strategy):
        torch.manual_seed(11)
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        model = fabric.setup_module(FNet())
        opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
        data, losses = iter(FDATA), []
        for _ in range(3):
            for _ in range(2):
                loss = loss_of(model, next(data))
                fabric.backward(loss / 2)
                losses.append(float(loss))
            fabric.clip_gradients(model, opt, max_norm=0.05)
            opt.step()
            opt.zero_grad(set_to_none=False)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if isinstance(fabric.strategy, LazyTrainFabricStrategy):
            fabric.strategy.teardown()
        return losses, state

    assert_same(run(lazy_fabric("mixed")), run("auto"))


def train_steps(fabric, model, opt, sched, batches):
    losses = []
    for b in batches:
        loss = loss_of(model, b)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=0.05)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(float(loss))
    return losses


def fabric_setup(strategy, opt_kind):
    model = FNet()
    (opt,) = make_opts(model, opt_kind)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    model, opt = fabric.setup(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    return fabric, model, opt, sched


@pytest.mark.parametrize("opt_kind", ["hybrid", "adamw", "sgd"])
def test_fabric_save_load_resume_equals_an_uninterrupted_run(opt_kind, tmp_path):
    """3 steps, ``fabric.save`` (model, optimizer, scheduler), a fresh Fabric ``fabric.load`` s it, 3 more steps:
    the same as 6 uninterrupted steps under auto (and under lazytrain)."""
    batches = FDATA[:6]

    def uninterrupted(strategy):
        fabric, model, opt, sched = fabric_setup(strategy, opt_kind)
        losses = train_steps(fabric, model, opt, sched, batches)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if isinstance(fabric.strategy, LazyTrainFabricStrategy):
            fabric.strategy.teardown()
        return losses, state

    want = uninterrupted("auto")
    assert_same(uninterrupted(lazy_fabric("mixed")), want)

    fabric, model, opt, sched = fabric_setup(lazy_fabric("mixed"), opt_kind)
    losses = train_steps(fabric, model, opt, sched, batches[:3])
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "sched": sched, "step": 3})
    fabric.strategy.teardown()

    fabric, model, opt, sched = fabric_setup(lazy_fabric("mixed"), opt_kind)
    state = {"model": model, "optimizer": opt, "sched": sched, "step": 0}
    fabric.load(tmp_path / "ckpt.pt", state)
    assert state["step"] == 3
    losses += train_steps(fabric, model, opt, sched, batches[3:])
    got = (losses, {k: v.detach().clone() for k, v in model.state_dict().items()})
    fabric.strategy.teardown()
    assert_same(got, want)

    # the lazytrain checkpoint resumes under auto too (plain state dicts)
    fabric, model, opt, sched = fabric_setup("auto", opt_kind)
    state = {"model": model, "optimizer": opt, "sched": sched, "step": 0}
    fabric.load(tmp_path / "ckpt.pt", state)
    tail = train_steps(fabric, model, opt, sched, batches[3:])
    assert tail == want[0][3:]


def test_fabric_save_between_accumulated_micro_batches(tmp_path):
    """``fabric.save`` of the model between two accumulated backward calls (after the first): the weights
    saved are the masters, as under auto; training then goes on exactly."""
    def loop(fabric, model, opts, scheds, steps):
        data, losses = iter(FDATA), []
        for step in range(steps):
            for k in range(2):
                loss = loss_of(model, next(data))
                fabric.backward(loss / 2)
                losses.append(loss.detach())
                if k == 0 and step == 1:
                    fabric.save(tmp_path / f"{type(fabric.strategy).__name__}.pt", {"model": model})
            step_all(opts, scheds)
        return losses

    want = run_fabric("auto", loop, opt="adamw", steps=3)
    got = run_fabric(lazy_fabric("mixed"), loop, opt="adamw", steps=3)
    assert_same(got, want)
    a = torch.load(tmp_path / "SingleDeviceStrategy.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "LazyTrainFabricStrategy.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_fabric_bf16_mixed_accumulation_and_clip(clip):
    kw = dict(opt="adamw", steps=3, precision="bf16-mixed")
    assert_same(run_fabric(lazy_fabric("mixed"), loop_accumulate(clip), **kw),
                run_fabric("auto", loop_accumulate(clip), **kw))


def test_fabric_16_mixed_is_refused_by_name():
    """README: with Fabric only 32-true and bf16-mixed; a 16-mixed plugin (fp16 autocast + GradScaler; Fabric
    itself turns ``precision="16-mixed"`` into bf16-mixed on the CPU) is refused, naming itself."""
    from lightning.fabric.plugins.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="16-mixed"):
        L.Fabric(accelerator="cpu", strategy="lazytrain", plugins=[plugin])


# =====================================================================================================================
# (2) Trainer precisions and optimizers
# =====================================================================================================================
class Record(L.Callback):
    reads_gradients_only = True  # records losses only

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        out = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(out))


class TNet(L.LightningModule):
    """Linear(6, D) -> 4 blocks -> Linear(D, 1); ``make_opt(module)`` builds the optimizer(s); ``boom``: the
    batches whose input is scaled by 1e4 (fp16 activations overflow: an inf loss, the scaler's to skip)."""

    def __init__(self, make_opt, boom=()):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(6, D)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, 1)
        self.make_opt, self.boom = make_opt, set(boom)

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        if batch_idx in self.boom:
            batch = batch * 1e4
        return self(batch).square().mean()

    def configure_optimizers(self):
        return self.make_opt(self)


def tdata(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, 6, generator=g) for _ in range(n)]


def fit(strategy, module, *, steps=4, accum=1, **kw):
    rec = Record()
    torch.manual_seed(11)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, callbacks=[rec], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        accumulate_grad_batches=accum, **kw)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(tdata(steps * accum), batch_size=None))
    return rec.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}, trainer


def lazy(plan="serial"):
    return LazyTrainStrategy(policy={"serial": serial_plan, "pipelined": pipelined_plan, "mixed": mixed_plan}[plan]())


def per_block_hybrid(m, **kw):
    rest = [p for n, p in m.named_parameters() if not n.startswith("layers.")]
    return HybridAdamW([{"params": rest, "layer": "rest"}] + [
        {"params": list(b.parameters()), "layer": i} for i, b in enumerate(m.layers)], lr=1e-2, weight_decay=0.1, **kw)


OPTS = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1),
    "adamw_plain": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=False, foreach=False),
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True,
                                              weight_decay=1e-3),
    "hybrid": per_block_hybrid,
}


def scaler16(init_scale):
    from lightning.pytorch.plugins.precision import MixedPrecision

    # Lightning turns precision="16-mixed" into bf16-mixed on the CPU: the plugin is given explicitly (as the
    # project's own tests do)
    return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))]


@pytest.mark.parametrize("opt", ["adamw", "sgd_nesterov", "hybrid"])
@pytest.mark.parametrize("accum, clip, algo", [(1, None, "norm"), (2, 0.05, "norm"), (2, 0.002, "value")])
def test_16_mixed_scaler_skips_overflowing_steps_as_auto(opt, accum, clip, algo):
    """GradScaler with init_scale 2**18: the first steps' scaled fp16 gradients overflow in the backward
    (skipped, the scale halves), later ones train; micro-batch 5 overflows in the forward (an inf loss).
    Skipped exactly as auto skips them, the same scale at the end, the same weights."""
    kw = dict(steps=8 if accum == 1 else 5, accum=accum, gradient_clip_val=clip, gradient_clip_algorithm=algo)
    want = fit("auto", TNet(OPTS[opt], boom={5}), plugins=scaler16(2.0**18), **kw)
    got = fit(lazy("pipelined" if opt == "hybrid" else "mixed"), TNet(OPTS[opt], boom={5}), plugins=scaler16(2.0**18),
              **kw)
    scale_want = want[2].precision_plugin.scaler.get_scale()
    assert scale_want <= 2.0**15  # at least three steps were skipped under auto
    assert not torch.equal(want[1]["head.weight"], TNet(OPTS[opt]).head.weight)  # and some trained
    assert math.isinf(want[0][5])
    assert got[2].precision_plugin.scaler.get_scale() == scale_want
    assert_same(got, want)


@pytest.mark.parametrize("plan", ["serial", "mixed"])
@pytest.mark.parametrize("opt", ["adamw", "sgd_nesterov"])
def test_bf16_mixed_accumulation_and_clip(opt, plan):
    kw = dict(steps=3, accum=2, gradient_clip_val=0.05, precision="bf16-mixed")
    assert_same(fit(lazy(plan), TNet(OPTS[opt]), **kw), fit("auto", TNet(OPTS[opt]), **kw))


@pytest.mark.parametrize("opt", ["adamw_plain", "adam_amsgrad", "sgd_nesterov"])
@pytest.mark.parametrize("plan", ["serial", "mixed"])
def test_torch_optimizers_fp32_with_accumulation_and_clip(opt, plan):
    kw = dict(steps=3, accum=2, gradient_clip_val=0.05)
    assert_same(fit(lazy(plan), TNet(OPTS[opt]), **kw), fit("auto", TNet(OPTS[opt]), **kw))


def test_lbfgs_with_its_closure_is_trained_as_auto_or_refused_clearly():
    """LBFGS calls the closure (forward + backward) several times per step."""
    make = lambda m: torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=3, history_size=4)  # noqa: E731
    want = fit("auto", TNet(make), steps=3)
    try:
        got = fit(lazy("mixed"), TNet(make), steps=3)
    except Exception as e:  # a refusal must name LBFGS / the closure
        assert "LBFGS" in str(e) or "closure" in str(e), repr(e)
        return
    assert_same(got, want)


def two_groups(kind):
    """Group 0 (lr 1e-2): the embedding + blocks 0, 1 (block and non-block params mixed); group 1 (lr 3e-3):
    blocks 2, 3 + the head."""
    def make(m):
        g0 = list(m.emb.parameters()) + list(m.layers[0].parameters()) + list(m.layers[1].parameters())
        g1 = list(m.layers[2].parameters()) + list(m.layers[3].parameters()) + list(m.head.parameters())
        groups = [{"params": g0, "lr": 1e-2}, {"params": g1, "lr": 3e-3}]
        if kind == "hybrid":
            return HybridAdamW(groups, lr=1e-2, weight_decay=0.1)
        if kind == "sgd":
            return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
        return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
    return make


@pytest.mark.parametrize("kind, plan", [("adamw", "mixed"), ("sgd", "serial"), ("hybrid", "pipelined"),
                                        ("hybrid", "serial")])
def test_two_param_groups_mixing_block_and_non_block_params(kind, plan):
    kw = dict(steps=3, accum=2, gradient_clip_val=0.05)
    assert_same(fit(lazy(plan), TNet(two_groups(kind)), **kw), fit("auto", TNet(two_groups(kind)), **kw))


def with_step_scheduler(make_opt):
    def make(m):
        opt = make_opt(m)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
    return make


@pytest.mark.parametrize("opt, plan", [("hybrid", "pipelined"), ("adamw", "mixed"), ("sgd_nesterov", "serial")])
def test_lr_scheduler_interval_step(opt, plan):
    kw = dict(steps=4, accum=2, gradient_clip_val=0.05)
    got = fit(lazy(plan), TNet(with_step_scheduler(OPTS[opt])), **kw)
    want = fit("auto", TNet(with_step_scheduler(OPTS[opt])), **kw)
    assert_same(got, want)
    assert got[2].optimizers[0].param_groups[0]["lr"] == want[2].optimizers[0].param_groups[0]["lr"]


class ManualTwoLosses(TNet):
    """Manual optimization: one forward, two losses, ``manual_backward(l1, retain_graph=True)`` then
    ``manual_backward(l2)`` (the Fabric pattern of test_fabric_two_losses_of_one_forward_two_backward_calls)."""

    def __init__(self):
        super().__init__(OPTS["adamw"])
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        out = self(batch)
        l1, l2 = out.square().mean(), out.abs().mean()
        self.manual_backward(l1, retain_graph=True)
        self.manual_backward(0.5 * l2)
        opt.step()
        opt.zero_grad()
        return l1


def test_manual_two_losses_of_one_forward_retain_graph():
    with pytest.raises(UnsupportedBlockPattern, match=r"second backward through block 3.*retain_graph=True"):
        fit(lazy("mixed"), ManualTwoLosses(), steps=3)


def in_backward_plan() -> str:
    return plan_json(dataclasses.replace(recompute_all(LAYERS), updates_in_backward=True, policy="review2-in-backward"))


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_hybrid_adamw_updates_in_backward_under_mixed_precision(precision):
    """HybridAdamW(updates_in_backward=True) with a plan that updates in the backward: under 16-mixed the
    GradScaler must still skip the overflowing steps (README: 16-mixed's unscaling keeps the updates after the
    backward); under bf16-mixed the updates may run in the backward. Both bit for bit auto."""
    make = lambda m: per_block_hybrid(m, updates_in_backward=True, skip_nonfinite=False)  # noqa: E731

    def prec():  # a fresh GradScaler per run
        return {"plugins": scaler16(2.0**18)} if precision == "16-mixed" else {"precision": precision}

    want = fit("auto", TNet(make, boom={4}), steps=6, **prec())
    got = fit(LazyTrainStrategy(policy=in_backward_plan()), TNet(make, boom={4}), steps=6, **prec())
    assert_same(got, want)


def fit_epochs(strategy, epochs, ckpt_in=None, ckpt_out=None):
    """16-mixed (GradScaler from 2**18: the first three steps overflow and are skipped), 3 batches an epoch;
    resumed from ``ckpt_in``, saved to ``ckpt_out``."""
    rec = Record()
    torch.manual_seed(11)
    module = TNet(OPTS["adamw"])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_epochs=epochs, logger=False,
                        enable_checkpointing=False, callbacks=[rec], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        plugins=scaler16(2.0**18))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(tdata(3), batch_size=None), ckpt_path=ckpt_in)
    if ckpt_out:
        trainer.save_checkpoint(ckpt_out)
    return rec.losses, {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("first, then", [("lazytrain", "lazytrain"), ("auto", "lazytrain"), ("lazytrain", "auto")])
def test_16_mixed_resume_keeps_the_grad_scalers_scale(first, then, tmp_path):
    """1 epoch, ``trainer.save_checkpoint``, resumed for 2 more epochs: the same as 3 uninterrupted epochs under
    auto, also across strategies (README: checkpoints are plain and readable by auto). The scaler's scale
    (2**15 after the skips) must come back; reset to 2**18 the resumed run skips three more steps."""
    pick = lambda name: "auto" if name == "auto" else lazy("mixed")  # noqa: E731
    want = fit_epochs("auto", 3)
    losses, _ = fit_epochs(pick(first), 1, ckpt_out=tmp_path / "c.ckpt")
    more, state = fit_epochs(pick(then), 3, ckpt_in=tmp_path / "c.ckpt")
    assert_same((losses + more, state), want)
