"""A ``loss.backward()`` the user calls directly instead of ``manual_backward`` / ``fabric.backward`` (Note: [a
backward outside the strategy] in core/microbatches.py): its micro-batch is ended at the clip, the optimizer step or
the next forward, so the step trains as under ``strategy="auto"`` bit for bit (fp32, CPU), with a warning once.
Fabric refuses a raw backward itself under this strategy (it requires ``fabric.backward``).
Before, the micro-batch was dropped there: block 0's and the non-block gradients never reached the host (review 17:
layers.0 .grad None, the others up to 0.043 off)."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from test_conformance import Net, assert_same_model, fit

from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy
from lightning_lazytrain.strategy import LazyTrainStrategy


class RawBackwardNet(Net):
    """Manual optimization with ``loss.backward()``; ``accumulate``: micro-batches per step; ``clip``: a norm clip."""

    def __init__(self, accumulate=1, clip=False):
        super().__init__()
        self.automatic_optimization = False
        self.accumulate, self.clip = accumulate, clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.head(self(batch)).square().mean()
        (loss / self.accumulate).backward()
        if (batch_idx + 1) % self.accumulate == 0:
            if self.clip:
                self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
        self.log("train_loss", loss)


@pytest.mark.parametrize("accumulate,clip", [(1, False), (1, True), (2, False), (2, True)])
def test_a_raw_backward_in_manual_optimization_trains_as_auto(caplog, accumulate, clip):
    want_model, want = fit("auto", RawBackwardNet(accumulate, clip), steps=8)
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain"):
        got_model, got = fit(LazyTrainStrategy(policy="megatrain"), RawBackwardNet(accumulate, clip), steps=8)
    assert got == want
    assert_same_model(got_model, want_model)
    warned = [r for r in caplog.records if "a backward ran outside the strategy" in r.getMessage()]
    assert len(warned) == 1


def fabric_run(strategy, accumulate):
    torch.manual_seed(5)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    net = Net()
    opt = torch.optim.AdamW([p for n, p in net.named_parameters() if not n.startswith("critic")], lr=1e-2)
    net, opt = fabric.setup(net, opt)
    g = torch.Generator().manual_seed(3)
    losses = []
    for k in range(6):
        x = torch.randn(3, 5, 6, generator=g)
        loss = net.head(net(x)).square().mean()
        (loss / accumulate).backward()  # not fabric.backward
        losses.append(loss.item())
        if (k + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
    return losses, {n: p.detach().clone() for n, p in net.named_parameters()}


def test_a_raw_backward_in_a_fabric_loop_is_refused_by_fabric():
    """Fabric itself requires fabric.backward under this strategy: a clear error, not a silent step."""
    fabric_run("auto", 1)  # plain Fabric takes it
    with pytest.raises(RuntimeError, match=r"fabric.backward\(loss\)"):
        fabric_run(LazyTrainFabricStrategy(policy="megatrain"), 1)


# An optimizer that steps between a forward and its manual_backward (the open micro-batch stays open, its non-block
# copies refreshed): tests/test_step_inside_microbatch.py (Note: [a step inside a micro-batch]).
