"""A model's own per-layer gradient checkpointing on the streamed blocks (Note: [a block's own checkpointing],
engine/layer_checkpointing.py): off while the executor streams them, back at close; training exact.

The blocks below checkpoint as transformers up to 5.17 does (``GradientCheckpointingLayer.__call__`` runs
``torch.utils.checkpoint`` around ``Module.__call__``, outside the forward the executor installs): before the
executor turned the flag off, the checkpoint's backward re-ran block 3 first ("called after block(s) []")."""

from __future__ import annotations

import functools

import pytest
from test_hf_matrix import SCHEDULES
from test_review11_fabric import check
from test_review13_boundary_uses import XS, Net, SkipBlock, custom_loop, sgd
from torch.utils.checkpoint import checkpoint

from lightning_lazytrain.engine.executor import Executor


class CheckpointedBlock(SkipBlock):
    """``SkipBlock`` with transformers 5.17's per-layer checkpointing (around ``__call__``)."""

    gradient_checkpointing = False

    def __call__(self, *args, **kwargs):
        if self.gradient_checkpointing and self.training:
            return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
        return super().__call__(*args, **kwargs)


def checkpointed_net(reentrant: bool):
    net = Net(CheckpointedBlock)
    for b in net.layers:
        b.gradient_checkpointing = True
        b._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=reentrant)
    return net


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("policy", ["recompute_all", "keep_all"])
def test_blocks_that_checkpoint_themselves_train_as_under_auto(policy, reentrant):
    """Under ``auto`` the blocks checkpoint themselves; under lazytrain the plan's re-runs do: bit for bit the same."""
    check(custom_loop(None), policy, steps=2, model_fn=functools.partial(checkpointed_net, reentrant), opt_fn=sgd)


def test_the_flag_is_off_while_streaming_and_back_at_close():
    net = checkpointed_net(True)
    ex = Executor(net, SCHEDULES["recompute_all"])
    try:
        assert [b.gradient_checkpointing for b in net.layers] == [False] * 4
        net.layers[2].gradient_checkpointing = True  # set again after the install: caught at the next micro-batch
        ex.begin_microbatch()
        pred, _ = net(XS[0])
        assert not net.layers[2].gradient_checkpointing
        pred.square().mean().backward()
        ex.end_microbatch()
    finally:
        ex.close()
    assert [b.gradient_checkpointing for b in net.layers] == [True] * 4


def test_checkpointing_the_user_turns_off_mid_run_stays_off():
    """``gradient_checkpointing_disable()`` while streaming (transformers binds the function afresh and writes False):
    close leaves it off, as under auto; a block left alone is turned back on."""
    net = checkpointed_net(True)
    ex = Executor(net, SCHEDULES["recompute_all"])
    try:
        for b in net.layers[:2]:  # what transformers' disable does to each module with the flag
            b._gradient_checkpointing_func = checkpoint
            b.gradient_checkpointing = False
        ex.begin_microbatch()
        net(XS[0])[0].square().mean().backward()
        ex.end_microbatch()
    finally:
        ex.close()
    assert [b.gradient_checkpointing for b in net.layers] == [False, False, True, True]
