"""Conformance: ordinary Lightning patterns train exactly as under ``strategy="auto"`` — or are
refused before the first optimizer step with a message that names the pattern.

Every case runs under ``auto`` and under four lazytrain schedules that route tensors differently:
the default MILP plan, ``recompute_all``, ``megatrain`` and a plan.json mixing a host home,
recomputation and kept internals. Compared: per-step losses, final parameters and buffers,
call counts of user code, gradients seen in ``on_after_backward`` (fp32 on CPU: bit-equal).
"""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lazytrain.planner import Schedule
from lightning_lazytrain.strategy import LazyTrainStrategy
from models import DropoutBlock, StackNet

LAYERS = 4
STEPS = 4


def mixed_plan(path) -> str:
    s = Schedule(num_layers=LAYERS, homes=("gpu", "cpu", "recompute", "gpu", "gpu"),
                 keep_internals=(True, False, False, False), resident_weights=(False,) * LAYERS,
                 offload_window=(None, 1, None, None, None), reload_window=(None, 3, None, None, None),
                 # layer 0 keeps its internals in host memory from F2 to B3 (Note: [offloaded internals])
                 internals_offload_window=(2, None, None, None), internals_reload_window=(3, None, None, None),
                 policy="test-mixed")
    path.write_text(json.dumps({"schedule": s.to_json()}))
    return str(path)


@pytest.fixture(params=["milp", "recompute_all", "megatrain", "mixed"])
def policy(request, tmp_path):
    return mixed_plan(tmp_path / "plan.json") if request.param == "mixed" else request.param


Block = DropoutBlock  # (other tests import it from here)


class Net(StackNet):
    """A small model with a block stack; optional dropout, BatchNorm, a second head (GAN-like
    manual optimization) and counters of every user hook."""

    def __init__(self, dropout=0.0, bn=False, d=16):
        super().__init__(lambda: Block(d, dropout, bn), d, layers=LAYERS, critic=True)
        self.calls = {"training_step": 0, "on_after_backward": 0}
        self.hook_grads: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        loss = self.head(self(batch)).square().mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for n, p in self.named_parameters() if not n.startswith("critic")], lr=1e-2)


class SGDNet(Net):
    def configure_optimizers(self):
        return torch.optim.SGD([p for n, p in self.named_parameters() if not n.startswith("critic")], lr=0.05)


class HookNet(Net):
    def on_after_backward(self):
        self.calls["on_after_backward"] += 1
        self.hook_grads.append({n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})


class ManualNet(Net):
    """Two optimizers, toggle_optimizer, two forwards per step, manual accumulation over two
    batches and self.clip_gradients."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        opt_g, opt_c = self.optimizers()
        # critic step (non-block head only; the stack runs without grad for it)
        self.toggle_optimizer(opt_c)
        with torch.no_grad():
            feats = self(batch)
        loss_c = self.critic(feats).square().mean()
        self.manual_backward(loss_c)
        opt_c.step()
        opt_c.zero_grad()
        self.untoggle_optimizer(opt_c)
        # generator step: two forwards, one backward, accumulated over two batches, clipped
        self.toggle_optimizer(opt_g)
        h1, h2 = self(batch), self(batch.flip(1))
        loss = (self.head(h1).square().mean() + 0.5 * self.critic(h2).square().mean()) / 2
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt_g, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            opt_g.step()
            opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.log("train_loss", loss)

    def configure_optimizers(self):
        gen = [p for n, p in self.named_parameters() if not n.startswith("critic")]
        return torch.optim.AdamW(gen, lr=1e-2), torch.optim.SGD(self.critic.parameters(), lr=0.1)


class Losses(L.Callback):
    reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train_loss"]))


def data(n=STEPS * 2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 5, 6, generator=g) for _ in range(n)]


def fit(strategy, module, *, steps=STEPS, callbacks_extra=(), **kw):
    losses = Losses()
    torch.manual_seed(11)
    kw.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                        callbacks=[losses, *callbacks_extra], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, **kw)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(), batch_size=None))
    return module, losses.values


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def lazytrain(policy):
    return LazyTrainStrategy(policy=policy)


@pytest.mark.parametrize("kind", ["dropout", "batchnorm"])
@pytest.mark.slow
def test_same_training_call_counts_and_buffers(policy, kind):
    kw = {"dropout": 0.3} if kind == "dropout" else {"bn": True}
    ref, want = fit("auto", Net(**kw))
    got_model, got = fit(lazytrain(policy), Net(**kw))
    assert got == want
    assert got_model.calls == ref.calls  # training_step ran once per batch: no profiling re-runs
    assert_same_model(got_model, ref)  # parameters and BatchNorm running statistics


@pytest.mark.slow
def test_hooks_see_the_gradients_auto_shows(policy):
    ref, want = fit("auto", HookNet(dropout=0.1), accumulate_grad_batches=2)
    got_model, got = fit(lazytrain(policy), HookNet(dropout=0.1), accumulate_grad_batches=2)
    assert got == want
    assert got_model.calls == ref.calls
    assert len(got_model.hook_grads) == len(ref.hook_grads) == 2 * STEPS
    for g, r in zip(got_model.hook_grads, ref.hook_grads):
        assert g.keys() == r.keys()
        assert all(torch.equal(g[k], r[k]) for k in g)
    assert_same_model(got_model, ref)


@pytest.mark.slow
def test_manual_optimization(policy):
    ref, want = fit("auto", ManualNet(dropout=0.1), steps=STEPS * 3 // 2)
    got_model, got = fit(lazytrain(policy), ManualNet(dropout=0.1), steps=STEPS * 3 // 2)
    assert got == want
    assert got_model.calls == ref.calls
    assert_same_model(got_model, ref)


@pytest.mark.slow
def test_bf16_mixed_is_plain_bf16_mixed(policy):
    """Autocast over fp32 masters, as Lightning's bf16-mixed; re-runs replay autocast."""
    ref, want = fit("auto", Net(dropout=0.1), precision="bf16-mixed")
    got_model, got = fit(lazytrain(policy), Net(dropout=0.1), precision="bf16-mixed")
    assert got == want
    assert_same_model(got_model, ref)


@pytest.mark.slow
def test_bf16_true_keeps_bf16_parameters(policy):
    ref, want = fit("auto", Net(), precision="bf16-true")
    got_model, got = fit(lazytrain(policy), Net(), precision="bf16-true")
    assert all(p.dtype == torch.bfloat16 for p in got_model.parameters())
    assert got == want
    assert_same_model(got_model, ref)


def test_bf16_true_checkpoints_hold_bf16_weights_and_states(tmp_path):
    """A checkpoint of a ``bf16-true`` run holds what ``auto``'s holds: bf16 weights and states."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saved = {}
    for name in ("auto", "lazytrain"):
        ckpt = ModelCheckpoint(dirpath=tmp_path / name, every_n_train_steps=STEPS)
        strategy = "auto" if name == "auto" else lazytrain("milp")
        fit(strategy, Net(), precision="bf16-true", callbacks_extra=[ckpt], enable_checkpointing=True)
        saved[name] = torch.load(ckpt.best_model_path, weights_only=False)
    for key, value in saved["auto"]["state_dict"].items():
        got = saved["lazytrain"]["state_dict"][key]
        assert got.dtype == value.dtype == torch.bfloat16 and torch.equal(got, value), key
    want_states, got_states = (saved[k]["optimizer_states"][0]["state"] for k in ("auto", "lazytrain"))
    assert want_states.keys() == got_states.keys()
    for pid, state in want_states.items():
        for key, value in state.items():
            assert got_states[pid][key].dtype == value.dtype and torch.equal(got_states[pid][key], value), (pid, key)


@pytest.mark.parametrize("precision", ["16-true", "16-mixed"])
@pytest.mark.slow
def test_16_bit_precisions_train_as_auto(policy, precision):
    """fp16 weights (``16-true``; SGD: AdamW's eps underflows in fp16, under ``auto`` too) and fp16
    autocast with a loss scaler (``16-mixed``: the plugin given explicitly, as Lightning turns
    ``precision="16-mixed"`` into bf16-mixed on CPU)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def kw():
        if precision == "16-true":
            return {"precision": "16-true"}
        return {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]}

    net = SGDNet if precision == "16-true" else Net
    ref, want = fit("auto", net(dropout=0.1), **kw())
    got_model, got = fit(lazytrain(policy), net(dropout=0.1), **kw())
    assert all(map(math.isfinite, want)) and got == want
    assert_same_model(got_model, ref)


class Refused:
    """Blocks the executor refuses: the error comes in the first step, before any optimizer step."""

    @staticmethod
    def hook_that_changes_an_output(module: Net) -> None:
        module.layers[1].lin.register_forward_hook(lambda mod, args, out: out * 1.0)

    @staticmethod
    def block_whose_rerun_differs(module: Net) -> None:
        class Flaky(Block):  # a second, hooked sub-module's output joins every other call only
            def __init__(self):
                super().__init__(16, 0.0, False)
                self.sub, self.calls = nn.Linear(16, 16), 0
                self.sub.register_forward_hook(lambda mod, args, out: None)

            def forward(self, x):
                self.calls += 1
                y = super().forward(x)
                return y + self.sub(x) if self.calls % 2 == 1 else y

        module.layers = nn.ModuleList(Flaky() for _ in range(LAYERS))


@pytest.mark.parametrize("pattern, policy_name, match", [
    ("hook_that_changes_an_output", "milp", r"hook.*layers\.1\.lin"),
    ("block_whose_rerun_differs", "recompute_all", r"block \d's re-run produced .* policy='keep_all'"),
])
def test_patterns_that_cannot_be_exact_are_refused_before_the_first_optimizer_step(pattern, policy_name, match):
    module = Net()
    getattr(Refused, pattern)(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(Exception, match=match):
        fit(lazytrain(policy_name), module)
    assert module.calls["training_step"] == 1  # the first step, which is the profile
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # no optimizer step


def test_64_true_is_refused_before_training():
    module = Net()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError, match="64-true.*not supported"):
        fit(lazytrain("milp"), module, precision="64-true")
    assert module.calls["training_step"] == 0
    assert all(torch.equal(v.float(), before[k].float()) for k, v in module.state_dict().items())


def test_parameter_tied_between_a_block_and_a_non_block_module_is_refused_by_name():
    class Tied(Net):
        def __init__(self):
            super().__init__()
            self.head2 = nn.Linear(16, 16)
            self.head2.weight = self.layers[1].lin.weight

    with pytest.raises(NotImplementedError, match=r"tied between head2\.weight .*layers\.1\.lin\.weight \(block 1\)"):
        fit(lazytrain("milp"), Tied())


# ---- parameter hooks, edited gradients, detached forwards, inference_mode (the last four patterns) ----

class HookedNet(SGDNet):
    """Gradient hooks on parameters, as a user puts them: ``register_hook`` on a streamed block's
    weight (scales its gradient) and on the head's (records it), ``register_post_accumulate_grad_hook``
    on the embedding (records the accumulated ``.grad``) and on a block's bias (clamps it in place)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: dict[str, list[torch.Tensor]] = {"block": [], "head": [], "emb": [], "bias": []}

        def scale(g):
            self.seen["block"].append(g.clone())
            return g * 3.0

        def record_head(g):
            self.seen["head"].append(g.clone())

        def record_emb(p):
            self.seen["emb"].append(p.grad.clone())

        def clamp_bias(p):
            self.seen["bias"].append(p.grad.clone())
            p.grad.clamp_(-0.01, 0.01)

        self.layers[1].lin.weight.register_hook(scale)
        self.head.weight.register_hook(record_head)
        self.emb.weight.register_post_accumulate_grad_hook(record_emb)
        self.layers[2].lin.bias.register_post_accumulate_grad_hook(clamp_bias)


def resident_plan(path) -> str:
    """A plan.json whose layers 1 and 3 keep their weights resident (slots of their own)."""
    s = Schedule(num_layers=LAYERS, homes=("gpu",) * (LAYERS + 1), keep_internals=(False,) * LAYERS,
                 resident_weights=(False, True, False, True), offload_window=(None,) * (LAYERS + 1),
                 reload_window=(None,) * (LAYERS + 1), policy="test-resident")
    path.write_text(json.dumps({"schedule": s.to_json()}))
    return str(path)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_parameter_hooks_fire_and_act_as_under_auto(policy, accumulate):
    """Each hook fires as often as under ``auto`` (once per backward), sees the same gradient (a
    pre-hook: this backward's; a post-accumulate hook: the accumulated ``.grad`` on the parameter
    itself) and what it returns or edits is what the optimizer uses."""
    ref, want = fit("auto", HookedNet(dropout=0.1), accumulate_grad_batches=accumulate)
    got_model, got = fit(lazytrain(policy), HookedNet(dropout=0.1), accumulate_grad_batches=accumulate)
    assert got == want
    for kind, seen in ref.seen.items():
        assert len(seen) == STEPS * accumulate, kind
        assert len(got_model.seen[kind]) == len(seen), kind
        assert all(torch.equal(g, r) for g, r in zip(got_model.seen[kind], seen)), kind
    assert_same_model(got_model, ref)


def test_parameter_hooks_on_resident_weights(tmp_path):
    ref, want = fit("auto", HookedNet(), accumulate_grad_batches=2)
    got_model, got = fit(lazytrain(resident_plan(tmp_path / "plan.json")), HookedNet(), accumulate_grad_batches=2)
    assert got == want
    assert all(len(got_model.seen[k]) == len(v) == 2 * STEPS for k, v in ref.seen.items())
    assert all(torch.equal(g, r) for k in ref.seen for g, r in zip(got_model.seen[k], ref.seen[k]))
    assert_same_model(got_model, ref)


def test_backpropagating_a_forward_of_an_earlier_step_is_refused_by_name():
    """A forward kept from the previous step and backpropagated now: plain autograd refuses it too
    (the optimizer changed the weights it saved); the error says what happened."""

    class Stale(Net):
        def training_step(self, batch, batch_idx):
            self.calls["training_step"] += 1
            out = self(batch)
            loss = self.head(out).square().mean()
            if batch_idx == 1:
                loss = loss + self.kept.sum()
            self.kept = self(batch.flip(1)).mean()
            self.log("train_loss", loss)
            return loss

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fit("auto", Stale())
    with pytest.raises(RuntimeError, match=r"forward of an earlier micro-batch"):
        fit(lazytrain("milp"), Stale())


def test_a_removed_hook_stops_firing_and_a_late_one_is_seen():
    """Hooks are read when they fire: one removed after the first step no longer fires; one added
    during training (in ``on_train_batch_start``, on a non-block and on a block parameter) does."""

    class Late(SGDNet):
        def __init__(self):
            super().__init__()
            self.fired = {"early": 0, "late_head": 0, "late_block": 0}
            self.handle = self.layers[0].lin.weight.register_hook(lambda g: self._count("early"))

        def _count(self, key):
            self.fired[key] += 1

        def on_train_batch_start(self, batch, batch_idx):
            if batch_idx == 1:
                self.handle.remove()
                self.head.weight.register_hook(lambda g: self._count("late_head"))
                self.layers[3].lin.weight.register_hook(lambda g: g * 0.5 if self._count("late_block") is None else g)

    ref, want = fit("auto", Late())
    got_model, got = fit(lazytrain("milp"), Late())
    assert ref.fired == {"early": 1, "late_head": STEPS - 1, "late_block": STEPS - 1}
    assert got_model.fired == ref.fired and got == want
    assert_same_model(got_model, ref)


def test_a_hooked_block_backpropagated_twice_in_one_backward_is_refused_by_name():
    """Two passes of one block reaching one backward: autograd fires the hook once on the sum, the
    executor would run two backwards; refused in the first step, before any optimizer step."""

    class Twice(SGDNet):
        def __init__(self):
            super().__init__()
            self.layers[2].lin.weight.register_hook(lambda g: g)

        def training_step(self, batch, batch_idx):
            self.calls["training_step"] += 1
            loss = self.head(self(batch)).square().mean() + self.head(self(batch.flip(1))).square().mean()
            self.log("train_loss", loss)
            return loss

    module = Twice()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(Exception, match=r"register_hook.*layers\.2\.lin\.weight.*fire twice"):
        fit(lazytrain("milp"), module)
    assert module.calls["training_step"] == 1
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


class DetachedTarget(Net):
    """A forward with grad enabled whose result is detached (a target), then the forward that is
    backpropagated: the first pass never gets a gradient."""

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        target = self(batch).detach()
        loss = self.head(self(batch) - 0.5 * target).square().mean()
        self.log("train_loss", loss)
        return loss


class DroppedOutput(Net):
    """A forward with grad enabled whose output is only logged (never backpropagated), before the real one."""

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        self.last_features = self(batch.flip(1))
        loss = self.head(self(batch)).square().mean()
        self.log("train_loss", loss)
        return loss


class GAN(L.LightningModule):
    """Lightning's GAN example with the block stack in the generator: manual optimization, two
    optimizers, ``toggle_optimizer``, the discriminator trained on a detached fake batch (a forward
    with grad whose output is never backpropagated); ``stash``: as the example, the generator also
    runs once more for a batch kept for logging, never backpropagated either."""

    def __init__(self, d=16, stash=True):
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.stash = stash
        self.emb = nn.Linear(6, d)
        self.layers = nn.ModuleList(Block(d, 0.1, False) for _ in range(LAYERS))
        self.out = nn.Linear(d, 6)
        self.disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.calls = {"training_step": 0}

    def generator(self, z):
        h = self.emb(z)
        for b in self.layers:
            h = b(h)
        return self.out(h)

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        opt_g, opt_d = self.optimizers()
        z = torch.randn_like(batch)
        self.toggle_optimizer(opt_g)
        if self.stash:
            self.generated = self.generator(z)  # kept for logging, never backpropagated
        g_loss = -self.disc(self.generator(z)).sigmoid().log().mean()
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        real = -self.disc(batch).sigmoid().log().mean()
        fake = -(1 - self.disc(self.generator(z).detach()).sigmoid()).log().mean()
        d_loss = (real + fake) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log("train_loss", d_loss + g_loss)

    def configure_optimizers(self):
        gen = [p for n, p in self.named_parameters() if not n.startswith("disc")]
        return torch.optim.Adam(gen, lr=1e-2), torch.optim.Adam(self.disc.parameters(), lr=1e-2)


@pytest.mark.parametrize("module", [DetachedTarget, DroppedOutput, GAN, lambda: GAN(stash=False)],
                         ids=["detached_target", "dropped_output", "gan", "gan_without_stash"])
def test_forwards_with_grad_that_are_never_backpropagated_train_as_auto(policy, module):
    ref, want = fit("auto", module())
    got_model, got = fit(lazytrain(policy), module())
    assert got == want
    assert got_model.calls == ref.calls
    assert_same_model(got_model, ref)


def test_a_step_whose_backward_skips_blocks_is_not_the_profile(caplog):
    """The profile waits for a micro-batch whose backward reaches every block of its planned pass:
    the GAN without the stashed batch plans after its generator step; with it no step qualifies, and
    the strategy says so once and trains on, exactly, without a plan."""
    import logging

    class Planned(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def __init__(self):
            self.after_step = []

        def on_train_batch_end(self, trainer, *args):
            self.after_step.append(trainer.strategy.plan is not None)

    plain = Planned()
    fit(lazytrain("milp"), GAN(stash=False), callbacks_extra=[plain])
    assert plain.after_step and all(plain.after_step)  # planned after the first step's generator backward
    stashing = Planned()
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain.strategy"):
        fit(lazytrain("milp"), GAN(), callbacks_extra=[stashing])
    assert stashing.after_step and not any(stashing.after_step)
    warned = [r.getMessage() for r in caplog.records if "without a backward" in r.getMessage()]
    assert len(warned) == 1 and "torch.no_grad()" in warned[0]


class InferenceTeacher(Net):
    """A teacher pass under ``torch.inference_mode()`` inside ``training_step``."""

    def training_step(self, batch, batch_idx):
        self.calls["training_step"] += 1
        with torch.inference_mode():
            teacher = self.head(self(batch))
        student = self.head(self(batch))
        loss = student.square().mean() + (student - teacher.clone()).square().mean()
        self.log("train_loss", loss)
        return loss


def test_an_inference_mode_sub_forward_in_training_step_trains_as_auto(policy):
    ref, want = fit("auto", InferenceTeacher(dropout=0.1))
    got_model, got = fit(lazytrain(policy), InferenceTeacher(dropout=0.1))
    assert got == want
    assert_same_model(got_model, ref)
