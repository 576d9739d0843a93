"""An optimizer step between a forward and its backward (Note: [a step inside a micro-batch] in core/microbatches.py):
the non-block weights' device copies, bound when the micro-batch began, take the step's values, so a later use in
the same micro-batch computes as under ``strategy="auto"`` (fp32, CPU: bit for bit). Before, the use computed with
the weights before the step, silently (Trainer, manual optimization), or the backward was refused (Fabric, which
dropped the micro-batch at the step)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_conformance import Net, assert_same_model, fit

from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy
from lightning_lazytrain.strategy import LazyTrainStrategy


class CriticInside(Net):
    """Manual optimization: the generator's forward, the head's use (it saves the head's weight for the backward),
    then the critic's step, then the critic's use in the same loss. ``probe``: record, after the step, whether the
    critic's weight the module holds equals its master in the module's compute dtype."""

    def __init__(self, probe=False):
        super().__init__()
        self.automatic_optimization = False
        self.probe = probe
        self.seen: list[bool] = []

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        h = self(batch)
        out = self.head(h)
        opt_c.step()  # the critic's gradients of the previous step
        opt_c.zero_grad()
        self.after_critic_step()
        if self.probe:
            master = opt_c.optimizer.param_groups[0]["params"][0]
            held = self.critic.weight
            self.seen.append(torch.equal(held.detach().cpu(), master.detach().to(held.dtype)))
        loss = out.square().mean() + 0.1 * self.critic(h.detach()).square().mean()
        self.manual_backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        self.log("train_loss", loss)

    def after_critic_step(self):
        """What a subclass does right after the critic's step (review 19's WGAN clipping)."""

    def configure_optimizers(self):
        gen = [p for n, p in self.named_parameters() if not n.startswith("critic")]
        return torch.optim.AdamW(gen, lr=1e-2), torch.optim.SGD(self.critic.parameters(), lr=0.1)


@pytest.mark.parametrize("policy", ["megatrain", "recompute_all"])
def test_a_critic_stepped_inside_the_micro_batch_trains_as_auto(policy):
    """The head's weight, saved by the forward before the step, still backpropagates: the refresh moves the stepped
    copy's own version counter only (Note: [one version counter per copy]; a shared one refused this backward)."""
    want_model, want = fit("auto", CriticInside(), steps=5)
    got_model, got = fit(LazyTrainStrategy(policy=policy), CriticInside(), steps=5)
    assert got == want
    assert_same_model(got_model, want_model)


class CriticSaved(CriticInside):
    """The critic is used (and its weight saved, as its input requires grad) BEFORE its step, then backpropagated."""

    def training_step(self, batch, batch_idx):
        opt_g, opt_c = self.optimizers()
        h = self(batch)
        loss = self.head(h).square().mean() + 0.1 * self.critic(h).square().mean()
        opt_c.step()
        opt_c.zero_grad()
        self.manual_backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        self.log("train_loss", loss)


def test_a_step_of_a_weight_the_forward_saved_is_refused_as_under_auto():
    """``auto`` refuses the backward ("modified by an inplace operation": the critic's step changed the weight its
    forward saved); so does lazytrain, from the second batch (the first step has no gradients: nothing changes)."""
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fit("auto", CriticSaved(), steps=4)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        fit(LazyTrainStrategy(policy="megatrain"), CriticSaved(), steps=4)


@pytest.mark.parametrize("options", [
    {"precision": "bf16-true"},
    {"precision": "bf16-true", "fp32_masters": True, "conversions": "host"},
    {"precision": "bf16-true", "fp32_masters": True, "conversions": "device"},
])
def test_the_refreshed_copy_is_the_master_in_the_compute_dtype(options):
    """16-bit compute copies of fp32 masters are cast as staging casts them (round to nearest), wherever the plan
    puts the conversion."""
    options = dict(options)
    precision = options.pop("precision")
    model = CriticInside(probe=True)
    fit(LazyTrainStrategy(policy="megatrain", **options), model, steps=6, precision=precision)
    assert model.seen == [True] * 3  # (two optimizers: two steps a batch)


def fabric_gan(strategy, save_between=None):
    """A Fabric loop: forward, the critic's step, a loss that uses the critic, ``fabric.backward``, the generator's
    step. ``save_between``: a path to save the model at the third step, between its forward and its backward."""
    torch.manual_seed(5)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    net = Net()
    opt_g = torch.optim.AdamW([p for n, p in net.named_parameters() if not n.startswith("critic")], lr=1e-2)
    opt_c = torch.optim.SGD(net.critic.parameters(), lr=0.1)
    net, opt_g, opt_c = fabric.setup(net, opt_g, opt_c)
    g = torch.Generator().manual_seed(3)
    losses, saved = [], None
    for k in range(5):
        h = net(torch.randn(3, 5, 6, generator=g))
        opt_c.step()
        opt_c.zero_grad()
        loss = net.head(h).square().mean() + 0.1 * net.critic(h.detach()).square().mean()
        if save_between is not None and k == 2:
            fabric.save(save_between, {"model": net})
            saved = torch.load(save_between, weights_only=True)["model"]
        fabric.backward(loss)
        opt_g.step()
        opt_g.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in net.module.named_parameters()}, saved


def test_a_fabric_loop_with_the_critic_stepped_inside_trains_as_auto():
    """Was refused: Fabric's step dropped the open micro-batch, and its backward met a released forward."""
    want, want_params, _ = fabric_gan("auto")
    got, got_params, _ = fabric_gan(LazyTrainFabricStrategy(policy="megatrain"))
    assert got == want
    assert got_params.keys() == want_params.keys()
    for n in want_params:
        assert torch.equal(got_params[n], want_params[n]), n


def test_a_fabric_save_between_a_forward_and_its_backward_holds_the_masters(tmp_path):
    """The state dict saved inside the micro-batch is the host masters (Note: [a state dict mid-bind]), as ``auto``
    saves; training goes on as under ``auto`` (was refused: "save or load the model after fabric.backward()")."""
    want, _, want_saved = fabric_gan("auto", tmp_path / "auto.ckpt")
    got, _, got_saved = fabric_gan(LazyTrainFabricStrategy(policy="megatrain"), tmp_path / "lazy.ckpt")
    assert got == want
    assert got_saved.keys() == want_saved.keys()
    for n in want_saved:
        assert torch.equal(got_saved[n], want_saved[n]), n
