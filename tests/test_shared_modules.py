"""Modules shared by blocks (Note: [modules shared by blocks] in engine/param_store.py): their parameters
join the non-block group, resident on the device for the step; the gradients of every block's use add up
as under ``strategy="auto"`` (bit for bit in fp32), trainable or frozen, under re-running and keeping plans
and the pipelined step. The same block twice in the stack is refused by name."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from test_review_clip_manual import LAYERS, Net, assert_same, fit, lazy
from torch import nn

from lightning_lazytrain.strategy import LazyTrainStrategy

D = 16


class SharedBlock(nn.Module):
    def __init__(self, shared: nn.Module):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.shared = shared

    def forward(self, x):
        return x + torch.tanh(self.lin(x) + self.shared(torch.sin(x)))


class SharedNet(Net):
    """Four blocks calling one ``nn.Linear`` (trainable, or frozen)."""

    def __init__(self, frozen=False, opt="hybrid"):
        super().__init__(opt=opt)
        shared = nn.Linear(D, D)
        shared.requires_grad_(not frozen)
        self.layers = nn.ModuleList(SharedBlock(shared) for _ in range(LAYERS))

    def groups(self):  # HybridAdamW one layer per block; the shared module's weights with the non-block ones
        shared = {id(p) for p in self.layers[0].shared.parameters()}
        rest = [p for n, p in self.named_parameters() if not n.startswith("layers.") or id(p) in shared]
        return [{"params": rest, "layer": "rest"}] + [
            {"params": [p for p in b.parameters() if id(p) not in shared], "layer": i}
            for i, b in enumerate(self.layers)]


class InRest(L.Callback):
    reads_gradients_only = True

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step > len(self.seen):
            store = trainer.strategy.executor.params
            self.seen.append(any(p is module.layers[0].shared.weight for p in store.group_parameters(-1)))


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("accum", [1, 2])
def test_a_module_shared_by_every_block_trains_as_under_auto(plan, frozen, accum):
    kw = {"accum": accum, "gradient_clip_val": 0.05, "steps": 3}
    where = InRest()
    got = fit(lazy(plan), SharedNet(frozen), callbacks=[where], **kw)
    want = fit("auto", SharedNet(frozen), **kw)
    assert_same(got, want)
    assert where.seen == [True] * 3  # with the non-block weights
    shared = got[2].lightning_module.layers[0].shared.weight
    if not frozen:
        init = SharedNet(frozen).layers[0].shared.weight
        assert not torch.equal(shared.detach(), init)


@pytest.mark.parametrize("policy", ["keep_all", "milp"])
def test_a_shared_module_under_the_builtin_policies(policy):
    kw = {"steps": 3, "accum": 2}
    assert_same(fit(LazyTrainStrategy(policy=policy), SharedNet(opt="adamw"), **kw),
                fit("auto", SharedNet(opt="adamw"), **kw))


class TwiceNet(Net):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([self.layers[0], self.layers[1], self.layers[0], self.layers[3]])


def test_the_same_block_twice_in_the_stack_is_refused():
    with pytest.raises(NotImplementedError, match=r"block 2 of the stack is block 0 again"):
        fit(lazy("serial"), TwiceNet(), steps=1)
