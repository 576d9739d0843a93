"""Review 4: host gradients for what trains, blocks no gradient reaches, the plan checked by measurement.

Probes of the changes adb111c..e06c33e against ``strategy="auto"`` (fp32 on CPU: bit for bit). Tests marked
``xfail(strict=True, reason="DEFECT: ...")`` show defects; the others stay as regression tests."""

from __future__ import annotations

import lightning
import pytest
import torch
from test_plan_race import RACE, SlowOn
from test_review2_finetune import LAYERS, D, LoRANet, PartNet, PlainBlock, data, fit, fit_like_auto, lazy
from test_review_clip_manual import assert_same
from torch import nn

from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.strategy import LazyTrainStrategy


class At(lightning.Callback):
    """Run ``fn(module)`` before the micro-batches in ``at`` (batch_idx -> fn)."""

    def __init__(self, at: dict) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        fn = self.at.get(batch_idx)
        if fn is not None:
            fn(module)


class HeldPartNet(PartNet):
    """PartNet whose HybridAdamW holds every parameter (frozen included, one group per block + rest): a
    weight thawed later trains without a new param group."""

    def configure_optimizers(self):
        rest = [p for n, p in self.named_parameters() if not n.startswith("layers.")]
        groups = [{"params": rest, "layer": "rest"}] + [
            {"params": list(b.parameters()), "layer": i} for i, b in enumerate(self.layers)]
        return HybridAdamW(groups, lr=1e-2, weight_decay=0.1)


def thaw(path: str, on: bool = True):
    def fn(module):
        module.get_submodule(path).requires_grad_(on) if not path.endswith(("weight", "bias")) else \
            module.get_parameter(path).requires_grad_(on)
    return fn


# ---- 1. host gradients for what trains -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["serial", "pipelined"])
@pytest.mark.parametrize("at", [1, 2], ids=["between-micro-batches", "between-steps"])
def test_thaw_only_the_last_parameter_of_a_frozen_block(kind, at):
    """Every block and the embedding frozen (host gradients of 0 elements for the blocks); block 1's out.bias
    -- the group's last parameter, nothing before it -- thaws: the copy starts and ends at it."""
    kw = {"accum": 2, "steps": 3, "gradient_clip_val": 0.05}
    fit_like_auto(lazy(kind), lambda: HeldPartNet(LAYERS, True), extra=lambda: [At({at: thaw("layers.1.out.bias")})],
                  **kw)


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
def test_thaw_the_second_of_two_then_the_first(kind):
    """Block 2's out.weight thaws at batch 1, its lin.weight (before it in the group) at batch 3."""
    kw = {"accum": 2, "steps": 3}
    fit_like_auto(lazy(kind), lambda: HeldPartNet(LAYERS, True),
                  extra=lambda: [At({1: thaw("layers.2.out.weight"), 3: thaw("layers.2.lin.weight")})], **kw)


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
@pytest.mark.parametrize("at", [1, 2], ids=["between-micro-batches", "between-steps"])
def test_thaw_the_embedding_in_the_rest_group(kind, at):
    """The frozen embedding (REST group, held by the optimizer) thaws: blocks 0, 1 (frozen, below nothing that
    trained) become reachable through their input, and the REST host gradient grows."""
    kw = {"accum": 2, "steps": 3, "gradient_clip_val": 0.05}
    fit_like_auto(lazy(kind), lambda: HeldPartNet(2, True), extra=lambda: [At({at: thaw("emb")})], **kw)


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
def test_freeze_after_thaw(kind):
    """A LoRA base Linear thaws at batch 1 and freezes again at batch 4 (accumulated: mid-step)."""
    kw = {"accum": 2, "steps": 3}
    fit_like_auto(lazy(kind), lambda: LoRANet("hybrid", trainable_only=False),
                  extra=lambda: [At({1: thaw("layers.1.lin.base"), 4: thaw("layers.1.lin.base", False)})], **kw)


class InBwHeld(HeldPartNet):
    def configure_optimizers(self):
        groups = [{"params": [p for n, p in self.named_parameters() if not n.startswith("layers.")], "layer": "rest"}]
        groups += [{"params": list(b.parameters()), "layer": i} for i, b in enumerate(self.layers)]
        return HybridAdamW(groups, lr=1e-2, weight_decay=0.1, skip_nonfinite=False, updates_in_backward=True)


@pytest.mark.parametrize("accum", [1, 2])
def test_thaw_with_updates_in_the_backward(accum):
    from test_review2_finetune import plan_in_backward

    kw = {"accum": accum, "steps": 4}
    at = {2 * accum: thaw("layers.2"), 2 * accum + 1: thaw("layers.1.out.bias")}
    got = fit(LazyTrainStrategy(policy=plan_in_backward()), InBwHeld(LAYERS, True), callbacks=[At(at)], **kw)
    want = fit("auto", InBwHeld(LAYERS, True), callbacks=[At(at)], **kw)
    assert_same(got, want)


# ---- 2. blocks no gradient reaches -----------------------------------------------------------------------------
class GateBlock(PlainBlock):
    """A block that reads a trainable tensor it does not own: ``gate`` (the model's, captured without
    registering it: the module tree does not show it) -- as a closure over a model-level parameter does."""

    def __init__(self, d, holder):
        super().__init__(d)
        object.__setattr__(self, "_holder", holder)  # not a submodule

    def forward(self, x):
        return super().forward(x) * self._holder[0]


class GateNet(PartNet):
    """PartNet (blocks 0..frozen-1 and the embedding frozen) whose blocks scale their output by a trainable
    model-level ``gate``."""

    def __init__(self, frozen_blocks=2, frozen_emb=True):
        super().__init__(frozen_blocks, frozen_emb)
        torch.manual_seed(1)
        self.gate = nn.Parameter(torch.ones(1) + 0.1 * torch.randn(1))
        holder = [self.gate]
        self.layers = nn.ModuleList(GateBlock(D, holder) for _ in range(LAYERS))
        for b in self.layers[:frozen_blocks]:
            b.requires_grad_(False)


class ArgBlock(PlainBlock):
    def forward(self, x, scale):
        return super().forward(x) * scale


class ArgNet(PartNet):
    """Blocks take a trainable model-level ``scale`` as a second positional argument."""

    def __init__(self, frozen_blocks=2, frozen_emb=True):
        super().__init__(frozen_blocks, frozen_emb)
        torch.manual_seed(1)
        self.scale = nn.Parameter(torch.ones(D) + 0.1 * torch.randn(D))
        self.layers = nn.ModuleList(ArgBlock(D) for _ in range(LAYERS))
        for b in self.layers[:frozen_blocks]:
            b.requires_grad_(False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h, self.scale)
        return h


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
def test_a_frozen_block_given_a_trainable_tensor_as_an_argument(kind):
    fit_like_auto(lazy(kind), lambda: ArgNet(2, True), accum=2, steps=3)


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
def test_a_frozen_block_reading_a_trainable_model_parameter(kind):
    """Was a defect (review 4): the frozen blocks ran without their node, so the captured 'gate' lost their
    gradient terms. Now the read is caught as the block runs and the node is made over the window that ran
    (Note: [blocks no gradient reaches])."""
    fit_like_auto(lazy(kind), lambda: GateNet(2, True), accum=1, steps=3)
    fit_like_auto(lazy(kind), lambda: GateNet(2, True), accum=2, steps=2)


@pytest.mark.parametrize("kind", ["serial"])
def test_control_trained_blocks_reading_a_trainable_model_parameter(kind):
    fit_like_auto(lazy(kind), lambda: GateNet(0, True), accum=1, steps=3)


class ToggleNet(PartNet):
    """Manual optimization, two optimizers (blocks / emb+head), toggle_optimizer for each (a GAN's pattern);
    the embedding frozen so that under toggle of the head's optimizer no block gets a gradient."""

    def __init__(self):
        super().__init__(0, True)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        o_blocks, o_head = self.optimizers()
        for opt in (o_head, o_blocks):
            self.toggle_optimizer(opt)
            loss = self.head(self(batch)).square().mean()
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)
        return loss

    def configure_optimizers(self):
        blocks = [p for b in self.layers for p in b.parameters()]
        head = [p for n, p in self.named_parameters() if n.startswith("head.")]
        return HybridAdamW(blocks, lr=1e-2), torch.optim.AdamW(head, lr=1e-2)


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
def test_toggle_optimizer_head_then_blocks(kind):
    got = fit(lazy(kind), ToggleNet(), steps=6)
    want = fit("auto", ToggleNet(), steps=6)
    assert_same(got, want)


class FisherNet(PartNet):
    """Block 1 requires grad but no optimizer holds it (its .grad read, e.g. a Fisher estimate); it is frozen
    before batch 1 (the second micro-batch of step 0)."""

    def configure_optimizers(self):
        ps = [p for n, p in self.named_parameters() if p.requires_grad and not n.startswith("layers.1.")]
        return HybridAdamW(ps, lr=1e-2)


def test_grads_of_weights_no_optimizer_holds_kept_when_frozen_mid_step():
    kw = {"accum": 2, "steps": 2}
    from test_review_clip_manual import Grads
    g_got, g_want = Grads(), Grads()
    fit(lazy("serial"), FisherNet(0, False), callbacks=[At({1: thaw("layers.1", False)}), g_got], **kw)
    fit("auto", FisherNet(0, False), callbacks=[At({1: thaw("layers.1", False)}), g_want], **kw)
    for got, want in zip(g_got.seen, g_want.seen):
        for n in want:
            if n.startswith("layers.1."):
                assert (got[n] is None) == (want[n] is None), n
                assert want[n] is None or torch.equal(got[n], want[n]), n


# ---- 3. the plan checked by measurement ------------------------------------------------------------------------
class ValNet(PartNet):
    def validation_step(self, batch, batch_idx):
        self.log("val", self.head(self(batch)).square().mean())

    def val_dataloader(self):
        return torch.utils.data.DataLoader(data(2, seed=5), batch_size=None)


def fit_val(strategy, module, steps, callbacks=()):
    torch.manual_seed(11)
    trainer = lightning.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=3,
                                callbacks=list(callbacks))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(steps), batch_size=None))
    return {k: v.clone() for k, v in module.state_dict().items()}, trainer


def test_race_with_validation_every_few_steps_matches_auto():
    got, trainer = fit_val(LazyTrainStrategy(replan=RACE), ValNet(0, False), 12, [SlowOn(plan=True, seconds=0.05)])
    want, _ = fit_val("auto", ValNet(0, False), 12)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad
    assert len(trainer.strategy.races) == 1, trainer.strategy.races


def test_race_with_bf16_true_matches_auto():
    kw = {"steps": 10, "precision": "bf16-true"}
    got = fit(LazyTrainStrategy(replan=RACE), PartNet(0, False), callbacks=[SlowOn(plan=True, seconds=0.05)], **kw)
    want = fit("auto", PartNet(0, False), **kw)
    assert len(got[2].strategy.races) == 1
    assert_same(got, want)


def test_race_resumed_from_a_checkpoint_mid_race(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(strategy, sub):
        ckpt = ModelCheckpoint(dirpath=tmp_path / sub, every_n_train_steps=4, save_top_k=-1)
        fit(strategy(), PartNet(0, False), steps=4, batches=data(10), callbacks=[ckpt, SlowOn(plan=True, seconds=0.05)],
            enable_checkpointing=True)
        path = next((tmp_path / sub).glob("*.ckpt"))
        module = PartNet(0, False)
        torch.manual_seed(11)
        trainer = lightning.Trainer(strategy=strategy(), accelerator="cpu", max_steps=10, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    num_sanity_val_steps=0, limit_val_batches=0,
                                    callbacks=[SlowOn(plan=True, seconds=0.05)])
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(10), batch_size=None),
                    ckpt_path=str(path))
        return module.state_dict(), trainer

    (s_got, _), (s_want, _) = run(lambda: LazyTrainStrategy(replan=RACE), "lazy"), run(lambda: "auto", "auto")
    bad = [k for k in s_want if not torch.equal(s_got[k], s_want[k])]
    assert not bad, bad


def test_race_under_fabric_matches_auto():
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    def train(strategy):
        fabric = lightning.Fabric(accelerator="cpu", devices=1, strategy=strategy)
        torch.manual_seed(0)
        module = PartNet(0, False)
        opt = HybridAdamW(module.parameters(), lr=1e-2)
        model, opt = fabric.setup(module, opt)
        losses = []
        for i, x in enumerate(data(10)):
            loss = module.head(model(x)).square().mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
            ex = getattr(fabric.strategy, "executor", None)
            if ex is not None and ex.schedule.policy == "milp":
                import time
                time.sleep(0.05)
        return losses, {k: v.clone() for k, v in module.state_dict().items()}, fabric

    got, want = train(LazyTrainFabricStrategy(replan=RACE)), train("auto")
    assert got[0] == want[0]
    bad = [k for k in want[1] if not torch.equal(got[1][k], want[1][k])]
    assert not bad, bad
    assert len(got[2].strategy.races) == 1, got[2].strategy.races


def test_thaw_then_resume_from_a_checkpoint_after_growth(tmp_path):
    """Block 1's base Linear thaws at batch 1 (its host gradient grows); a checkpoint at step 2; a new run
    resumes from it (the base thawed from its start) -- as under auto."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(strategy, sub):
        ckpt = ModelCheckpoint(dirpath=tmp_path / sub, every_n_train_steps=2, save_top_k=-1)
        fit(strategy(), LoRANet("hybrid", trainable_only=False), steps=2, batches=data(4), accum=2,
            callbacks=[ckpt, At({1: thaw("layers.1.lin.base")})], enable_checkpointing=True)
        path = next((tmp_path / sub).glob("*.ckpt"))
        module = LoRANet("hybrid", trainable_only=False)
        module.layers[1].lin.base.requires_grad_(True)
        torch.manual_seed(11)
        trainer = lightning.Trainer(strategy=strategy(), accelerator="cpu", max_steps=4, logger=False, accumulate_grad_batches=2,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data(8), batch_size=None),
                    ckpt_path=str(path))
        return module.state_dict()

    got, want = run(lambda: lazy("serial"), "lazy"), run(lambda: "auto", "auto")
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad
