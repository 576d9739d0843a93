"""A hook that may read the weights between an optimizer step and the next forward sees them all updated,
as under strategy="auto" (Note: [weights read after the step] in adapters/weight_readers.py)."""

from __future__ import annotations

import dataclasses
import time

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, LambdaCallback, ModelCheckpoint, TQDMProgressBar

from lightning_lazytrain.adapters.weight_readers import weights_read_after_step
from lightning_lazytrain.lit_module import CausalLMModule
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.planner import keep_all
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_updates_in_backward import plan_file

STEPS = 4


class SlowHybridAdamW(HybridAdamW):
    """Each layer's host update takes 30 ms: a pipelined step is still running when the step returns."""

    def _update_layer(self, layer, plan):
        time.sleep(0.03)
        super()._update_layer(layer, plan)


class WeightReader(L.Callback):
    """Copies every weight at each batch's end (as an EMA callback reads them)."""

    def __init__(self):
        self.seen: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append([p.detach().clone() for p in pl_module.parameters()])


class Plans(L.Callback):
    reads_gradients_only = True  # reads the plan, no weight

    def __init__(self):
        self.optimizer = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = trainer.strategy.core.plan
        if plan is not None:
            self.optimizer = plan.result.schedule.optimizer


def pipelined_plan(updates_in_backward: bool) -> str:
    """A plan file forcing a pipelined step."""
    return plan_file(dataclasses.replace(keep_all(4), optimizer="pipelined", updates_in_backward=updates_in_backward,
                                         policy="t"))


def fit(strategy, callbacks=(), *, updates_in_backward=False):
    """The tiny CausalLMModule with ``SlowHybridAdamW`` for ``STEPS`` steps: its weights, and its optimizer."""
    class Module(CausalLMModule):
        def configure_optimizers(self):
            return SlowHybridAdamW(self.param_groups(), lr=self.lr, eight_bit="none", skip_nonfinite=False,
                                   updates_in_backward=updates_in_backward)

    torch.manual_seed(0)
    module = Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=list(callbacks))
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(STEPS)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return [p.detach().clone() for p in module.parameters()], trainer.optimizers[0]


@pytest.mark.parametrize("updates_in_backward", [False, True])
def test_a_callback_reading_weights_after_the_step_sees_what_auto_shows(updates_in_backward, caplog):
    """A plan file forces a pipelined step with a slow host update: the weights a callback reads at each
    batch's end equal strategy="auto"'s bit for bit (before: steps 2..4 saw layers not yet updated)."""
    want_reader, got_reader = WeightReader(), WeightReader()
    want, _ = fit("auto", [want_reader], updates_in_backward=updates_in_backward)
    with caplog.at_level("INFO", logger="lightning_lazytrain"):
        got, _ = fit(LazyTrainStrategy(policy=pipelined_plan(updates_in_backward)), [got_reader],
                     updates_in_backward=updates_in_backward)
    assert "WeightReader.on_train_batch_end may read the weights" in caplog.text
    assert len(got_reader.seen) == len(want_reader.seen) == STEPS
    for a, b in zip(want_reader.seen, got_reader.seen):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(want, got))


def test_the_plan_steps_serially_where_a_hook_may_read_weights():
    """The MILP is told: with a weight-reading callback the plan's optimizer step is serial."""
    plans = Plans()
    fit(LazyTrainStrategy(), [WeightReader(), plans])
    assert plans.optimizer == "serial"


class Logger(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pass


class DeclaredLogger(Logger):
    reads_gradients_only = True


class EpochModule(CausalLMModule):
    def on_train_epoch_end(self):
        pass


def test_which_hooks_count():
    module = CausalLMModule(model_name="tiny")
    assert weights_read_after_step(module, []) is None
    builtin = [ModelCheckpoint(), TQDMProgressBar(), DeclaredLogger()]
    assert weights_read_after_step(module, builtin) is None  # Lightning's own that read no weights; declared
    assert "Logger.on_train_batch_end" in weights_read_after_step(module, [Logger()])
    assert "EMAWeightAveraging" in weights_read_after_step(module, [EMAWeightAveraging()])
    assert "LambdaCallback.on_train_batch_end" in weights_read_after_step(
        module, [LambdaCallback(on_train_batch_end=lambda *a: None)])
    assert "the LightningModule's on_train_epoch_end" in weights_read_after_step(EpochModule(model_name="tiny"), [])
    declared = EpochModule(model_name="tiny")
    declared.reads_gradients_only = True
    assert weights_read_after_step(declared, []) is None
