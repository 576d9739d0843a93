"""``LazyTrainStrategy(fp32_masters=True)``: fp32 master weights on the host, 16-bit compute copies
streamed (the papers' setup), equal bit for bit to plain PyTorch with fp32 master weights and a
bf16 model copy, written here as a LightningModule under ``strategy="auto"``: each micro-batch's
bf16 gradients are added into the masters' fp32 gradients, the optimizer (and clipping) works on
the masters, and the model copy is the masters rounded to bf16 after every step.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lazytrain.strategy import LazyTrainStrategy
from test_conformance import Net, data, fit, mixed_plan


def fold_into_masters(pairs) -> None:
    """Each (bf16 model parameter, fp32 master) pair: the parameter's gradient added into the master's (and cleared)."""
    for p, m in pairs:
        if p.grad is not None:
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None


class MasterSteps:
    """A LightningModule mixin: the model (bf16) trains through fp32 masters ``self.pairs`` (model
    parameter, master), which its ``configure_optimizers`` sets up and hands to the optimizer."""

    pairs: list

    def on_after_backward(self):  # every micro-batch's gradients join the fp32 ones, as the host grads do
        fold_into_masters(self.pairs)

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        optimizer.step(closure=optimizer_closure)
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)  # round to the model's bf16


class MasterNet(MasterSteps, Net):
    """The reference: a bf16 model (``precision="bf16-true"``) trained through fp32 masters."""

    def configure_optimizers(self):
        params = [p for n, p in self.named_parameters() if not n.startswith("critic")]
        self.pairs = [(p, nn.Parameter(p.detach().float())) for p in params]
        return torch.optim.AdamW([m for _, m in self.pairs], lr=1e-2)

    def masters(self):
        return {n: m for (n, _), (_, m) in zip(((n, p) for n, p in self.named_parameters()
                                                if not n.startswith("critic")), self.pairs)}


@pytest.mark.parametrize("policy", ["milp", "recompute_all", "mixed"])
@pytest.mark.parametrize("keep", [False, True])
def test_fp32_masters_equal_plain_master_weight_training(policy, keep, tmp_path):
    policy = mixed_plan(tmp_path / "plan.json") if policy == "mixed" else policy
    kw = dict(precision="bf16-true", accumulate_grad_batches=2, gradient_clip_val=0.05)
    ref, want = fit("auto", MasterNet(dropout=0.1), **kw)
    got_model, got = fit(LazyTrainStrategy(policy=policy, fp32_masters=True, keep_compute_copy=keep),
                         Net(dropout=0.1), **kw)
    assert got == want
    masters = ref.masters()
    for name, p in got_model.named_parameters():
        if name.startswith("critic"):
            continue
        assert p.dtype == torch.float32, name  # the masters
        assert torch.equal(p, masters[name]), name
    for name, b in got_model.named_buffers():
        assert torch.equal(b, dict(ref.named_buffers())[name]), name


def test_fp32_masters_needs_a_16_bit_precision():
    with pytest.raises(ValueError, match="fp32_masters=True.*bf16-true"):
        fit(LazyTrainStrategy(fp32_masters=True), Net(), precision="32-true", steps=1)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="fp32_masters"):
        LazyTrainStrategy(fp32_masters="yes")
    with pytest.raises(ValueError, match="keep_compute_copy"):
        LazyTrainStrategy(keep_compute_copy="sometimes")


def test_fp32_masters_resume_exactly(tmp_path):
    """A checkpoint holds the fp32 masters; a resume restores them after setup (before it, Lightning's
    bf16-true conversion would round them): the restored masters are the saved ones, bit for bit."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    first, _ = fit(LazyTrainStrategy(policy="recompute_all", fp32_masters=True), Net(), steps=2,
                   precision="bf16-true", callbacks_extra=[ckpt], enable_checkpointing=True)
    path = next(tmp_path.glob("*.ckpt"))
    saved = torch.load(path, weights_only=False)["state_dict"]
    # the saved masters carry bits a bf16 round trip would lose
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved.values() if v.dtype == torch.float32)
    module = Net()
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy="recompute_all", fp32_masters=True), accelerator="cpu",
                        max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0, precision="bf16-true")
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(), batch_size=None), ckpt_path=str(path))
    for (n, p), q in zip(module.named_parameters(), first.parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q) and torch.equal(p, saved[n]), n


def test_fp32_masters_refuse_a_resume_an_on_fit_start_hook_could_see(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)
    fit(LazyTrainStrategy(policy="recompute_all", fp32_masters=True), Net(), steps=1, precision="bf16-true",
        callbacks_extra=[ckpt], enable_checkpointing=True)

    class Hooked(Net):
        def on_fit_start(self):
            pass

    import lightning as L

    trainer = L.Trainer(strategy=LazyTrainStrategy(fp32_masters=True), accelerator="cpu", max_steps=2, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, precision="bf16-true")
    with pytest.raises(ValueError, match="on_fit_start"):
        trainer.fit(Hooked(), train_dataloaders=torch.utils.data.DataLoader(
            [torch.randn(3, 5, 6)] * 4, batch_size=None), ckpt_path=str(next(tmp_path.glob("*.ckpt"))))


@pytest.mark.parametrize("conversions", ["device", "plan"])
@pytest.mark.parametrize("policy", ["milp", "mixed"])
def test_conversions_on_the_device_train_as_on_the_host(conversions, policy, tmp_path):
    """``conversions="device"``: the masters cross in fp32 and the device casts them, the gradients
    are widened by the device and land in the host gradients (planner/placement.py); ``"plan"``: the
    plan chooses. Bit-equal to plain master-weight training either way."""
    policy = mixed_plan(tmp_path / "plan.json") if policy == "mixed" else policy
    kw = dict(precision="bf16-true", accumulate_grad_batches=2, gradient_clip_val=0.05)
    ref, want = fit("auto", MasterNet(dropout=0.1), **kw)
    strategy = LazyTrainStrategy(policy=policy, fp32_masters=True, conversions=conversions)
    placed = []

    class Placed(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def on_train_batch_end(self, trainer, *args):
            placed.append(trainer.strategy.executor.params.placement)

    got_model, got = fit(strategy, Net(dropout=0.1), callbacks_extra=[Placed()], **kw)
    assert got == want
    masters = ref.masters()
    for name, p in got_model.named_parameters():
        if not name.startswith("critic"):
            assert torch.equal(p, masters[name]), name
    if conversions == "device":  # from the plan on (the first step is the profile, on the host)
        assert all(len(p["cast_on_device"]) == len(p["widen_on_device"]) == 5 for p in placed[2:])
