"""Host gradient buffers hold what trains (Note: [host gradients for what trains] in engine/host_grads.py).

A group's flat host gradient reaches as far as its trainable prefix: a LoRA fine-tune's blocks hold fp32 host
gradients for their adapters, not for the frozen base weights (page-locked on CUDA: at 27B, ~108 GB that were
never written). Weights thawed later grow their group's buffer when its gradient copy starts; every
gradient already there (an earlier micro-batch's, a direct landing's) is kept. Checked bit for bit against
``strategy="auto"`` on the same data, and on the store itself.
"""

from __future__ import annotations

import copy

import lightning
import pytest
import torch
from test_param_store import L, SlowHostEngine, Tiny, _batch, _reference, streamed_step
from test_review2_finetune import LoRANet, Traffic, fit, fit_like_auto, lazy
from torch import nn

from lightning_lazytrain.engine.copy_cpu import ThreadCopyEngine

from lightning_lazytrain.engine.param_groups import aligned_end
from lightning_lazytrain.engine.param_store import REST, ParamStore


class Thaw(lightning.Callback):
    """Thaw block ``block``'s frozen base Linear before micro-batch ``at`` (between the micro-batches of a step
    when ``at`` is odd with two per step); the optimizer holds it from the start (``trainable_only=False``)."""

    def __init__(self, at: int, block: int = 1) -> None:
        self.at, self.block = at, block

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.at:
            module.layers[self.block].lin.base.requires_grad_(True)


class Sizes(lightning.Callback):
    """The host gradient's elements per group at the end of each step, and whether every ``.grad`` of a
    master lies inside its group's buffer."""

    reads_gradients_only = True

    def __init__(self) -> None:
        self.numel: list[dict[int, int]] = []
        self.inside: list[bool] = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        params = trainer.strategy.core.executor.params
        groups = [REST, *range(params.num_layers)]
        self.numel.append({j: params.grad_flat(j).numel() for j in groups})
        ok = True
        for j in groups:
            flat = params.grad_flat(j)
            lo, hi = flat.data_ptr(), flat.data_ptr() + flat.nbytes
            for p in params.group_parameters(j):
                if p.grad is not None:
                    ok &= lo <= p.grad.data_ptr() < hi
        self.inside.append(ok)


def test_each_block_holds_host_gradients_up_to_its_last_trainable_parameter():
    t, sizes = Traffic(), Sizes()
    module = LoRANet("hybrid")
    fit(lazy("serial"), module, steps=2, callbacks=[t, sizes])
    for j, block in enumerate(module.layers):
        trainable = sum(p.numel() for p in block.parameters() if p.requires_grad)
        total = sum(p.numel() for p in block.parameters())
        # the adapters, aligned: far below the block (the frozen base Linear)
        assert trainable <= sizes.numel[-1][j] < total / 2, (j, sizes.numel[-1][j], trainable, total)
    assert all(sizes.inside)
    blocks = sum(sizes.numel[-1][j] for j in range(len(module.layers)))
    assert t.host_grad_bytes == 4 * (blocks + sizes.numel[-1][REST])


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
@pytest.mark.parametrize("at", [1, 2], ids=["between-micro-batches", "between-steps"])
def test_a_base_weight_thawed_mid_run_grows_its_host_gradient_and_matches_auto(kind, at):
    """Two micro-batches a step: at=1 thaws block 1's base Linear between the first and second micro-batch
    of step 0 (the first one's adapter gradients landed straight in the old buffer: fp32 compute), at=2
    between steps. Every gradient the optimizer sees, and every weight, equals auto's bit for bit."""
    sizes = Sizes()
    kw = {"accum": 2, "gradient_clip_val": 0.05, "steps": 3}
    fit_like_auto(lazy(kind), lambda: LoRANet("hybrid", trainable_only=False), extra=lambda: [Thaw(at)], **kw)
    module = LoRANet("hybrid", trainable_only=False)
    fit(lazy(kind), module, callbacks=[Thaw(at), sizes], **kw)
    base = module.layers[1].lin.base
    grown = sizes.numel[-1][1]
    assert grown >= aligned_end_of(module.layers[1], base.weight), (grown,)
    assert sizes.numel[0][1] < grown if at == 2 else sizes.numel[0][1] == grown
    assert sizes.numel[-1][2] == sizes.numel[0][2]  # the other blocks keep theirs
    assert all(sizes.inside)


def aligned_end_of(block: nn.Module, weight: nn.Parameter) -> int:
    """A loose lower bound of where ``weight`` ends in its block's layout: the elements of every parameter
    of the block that trains now (the base weight among them)."""
    return sum(p.numel() for p in block.parameters() if p.requires_grad)


@pytest.mark.parametrize("slow", [False, True], ids=["thread-engine", "host-lane-late"])
def test_the_store_grows_a_group_and_keeps_its_gradients(slow):
    """On the store (fp32: gradients land straight in the host buffer): every block's ``proj`` Linear is
    frozen, so each block holds a host gradient for ``ln`` and ``fc`` only. Block 1's ``proj`` thaws between
    two accumulated micro-batches: its buffer grows, the first micro-batch's gradients stay and the second's
    add to them -- plain autograd's gradients bit for bit, with every host job started 20 ms late too."""
    torch.manual_seed(0)
    m = Tiny(tied=False)
    for b in m.layers:
        b.proj.requires_grad_(False)
    ref = copy.deepcopy(m)
    engine = SlowHostEngine() if slow else ThreadCopyEngine()
    ps = ParamStore(m, "layers", copy_engine=engine)
    try:
        before = {j: ps.grad_flat(j).numel() for j in range(L)}
        for j in range(L):
            g = ps._group(j)
            assert before[j] == aligned_end(i for i in g.params if i.param.requires_grad) < g.numel
        assert ps.host_grad_bytes == 4 * (sum(before.values()) + ps.grad_flat(REST).numel())
        streamed_step(m, ps, *_batch(1))
        _reference(ref, [_batch(1)])
        m.layers[1].proj.requires_grad_(True)
        ref.layers[1].proj.requires_grad_(True)
        streamed_step(m, ps, *_batch(2))
        _reference(ref, [_batch(2)])
        assert ps.grad_flat(1).numel() == ps._group(1).numel > before[1]
        assert all(ps.grad_flat(j).numel() == before[j] for j in (0, 2, 3))
        want = dict(ref.named_parameters())
        for name, p in m.named_parameters():
            if want[name].grad is None:
                assert p.grad is None, name
            else:
                assert p.grad is not None and torch.equal(p.grad, want[name].grad), name
        for j in range(L):
            flat = ps.grad_flat(j)
            for p in ps.group_parameters(j):
                if p.grad is not None:
                    assert flat.data_ptr() <= p.grad.data_ptr() < flat.data_ptr() + flat.nbytes
        # the arena slice the grown group left stays reserved and is counted
        assert ps.host_grad_bytes == 4 * (sum(ps.grad_flat(j).numel() for j in range(L)) + before[1]
                                          + ps.grad_flat(REST).numel())
    finally:
        ps.close()
        engine.close()
