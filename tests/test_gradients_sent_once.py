"""A slot's gradients reach the host once (Note: [gradients sent once] in engine/grad_writeback.py).

Block 0's slot lives on between micro-batches; its gradients leave at the next micro-batch's F0 or at T. A
micro-batch whose forward does not bind block 0 with gradients (manual optimization: a ``no_grad`` forward
then a loss on non-block weights only) must not send the previous backward's gradients a second time; and
parameters frozen between the micro-batches of a step keep the gradients that reached them while they
required one (as under ``auto``: ``requires_grad_(False)`` does not clear ``.grad``)."""

from __future__ import annotations

import pytest
import torch
from test_review_clip_manual import Grads, Net, assert_same, data, fit, grad_diffs, lazy


class HeadOnlyAfterNoGrad(Net):
    """Manual optimization, two optimizer steps per batch: the whole model, then the head alone on
    features from a ``no_grad`` forward (block 0 is called, without gradients)."""

    def __init__(self, **kw):
        super().__init__(opt="adamw", **kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.head(self(batch)).square().mean()
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            feats = self(batch)
        loss2 = self.head(feats).square().mean()
        self.manual_backward(loss2)
        opt.step()  # under auto the blocks have no gradient here: AdamW leaves them alone
        opt.zero_grad()
        self.log("loss", loss2)
        return loss2


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_a_backward_without_the_blocks_sends_no_stale_block_gradients(plan):
    got = fit(lazy(plan), HeadOnlyAfterNoGrad(), steps=6, batches=data(3))
    want = fit("auto", HeadOnlyAfterNoGrad(), steps=6, batches=data(3))
    assert_same(got, want)


class FreezeAll(Grads):
    """Freezes block 0, block 2 and the head at batch ``at`` (a step's second micro-batch); records the
    gradients the optimizer gets."""

    reads_gradients_only = False

    def __init__(self, at):
        super().__init__("before")
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.at:
            for m in (module.layers[0], module.layers[2], module.head):
                m.requires_grad_(False)


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_frozen_mid_step_keeps_the_first_micro_batchs_gradients(plan):
    g_got, g_want = FreezeAll(3), FreezeAll(3)
    kw = {"accum": 2, "steps": 3}
    got = fit(lazy(plan), Net(opt="adamw"), callbacks=[g_got], **kw)
    want = fit("auto", Net(opt="adamw"), callbacks=[g_want], **kw)
    diffs = grad_diffs(g_got, g_want)
    assert diffs == [[]] * len(g_want.seen)
    assert all(g_want.seen[1][n] is not None for n in ("layers.0.lin.weight", "head.weight")), g_want.seen[1].keys()
    assert_same(got, want)
