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


class Block(nn.Module):
    def __init__(self, d, dropout, bn):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.lin(x)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return x + self.drop(torch.tanh(h))


class Net(L.LightningModule):
    """A small model with a block stack; optional dropout, BatchNorm, a second head (GAN-like
    manual optimization) and counters of every user hook."""

    def __init__(self, dropout=0.0, bn=False, d=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(6, d)
        self.layers = nn.ModuleList(Block(d, dropout, bn) for _ in range(LAYERS))
        self.head = nn.Linear(d, 1)
        self.critic = nn.Linear(d, 1)
        self.calls = {"training_step": 0, "on_after_backward": 0}
        self.hook_grads: list[dict[str, torch.Tensor]] = []

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h)
        return h

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
def test_same_training_call_counts_and_buffers(policy, kind):
    kw = {"dropout": 0.3} if kind == "dropout" else {"bn": True}
    ref, want = fit("auto", Net(**kw))
    got_model, got = fit(lazytrain(policy), Net(**kw))
    assert got == want
    assert got_model.calls == ref.calls  # training_step ran once per batch: no profiling re-runs
    assert_same_model(got_model, ref)  # parameters and BatchNorm running statistics


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


def test_manual_optimization(policy):
    ref, want = fit("auto", ManualNet(dropout=0.1), steps=STEPS * 3 // 2)
    got_model, got = fit(lazytrain(policy), ManualNet(dropout=0.1), steps=STEPS * 3 // 2)
    assert got == want
    assert got_model.calls == ref.calls
    assert_same_model(got_model, ref)


def test_bf16_mixed_is_plain_bf16_mixed(policy):
    """Autocast over fp32 masters, as Lightning's bf16-mixed; re-runs replay autocast."""
    ref, want = fit("auto", Net(dropout=0.1), precision="bf16-mixed")
    got_model, got = fit(lazytrain(policy), Net(dropout=0.1), precision="bf16-mixed")
    assert got == want
    assert_same_model(got_model, ref)


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
