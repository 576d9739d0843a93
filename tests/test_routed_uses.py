"""A tensor routed into blocks (a keyword: the encoder's output, a skip connection) that is also used elsewhere: each
use's gradient added as plain autograd adds it (Note: [one gradient per boundary use], engine/boundary_uses.py).

Bit for bit against plain autograd / ``strategy="auto"`` in fp32 on CPU (``torch.equal`` on losses and every
``.grad``), and the walk's restraint: a routed tensor only blocks take (chained: Note: [one gradient per shared
input]) marks no node."""

from __future__ import annotations


import pytest
import torch
from test_hf_matrix import SCHEDULES, build
from test_review11_fabric import check
from test_review13_boundary_uses import XS, Net, SkipBlock, custom_loop, exec_check, grad_of, sgd, skip_net

from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern
from lightning_lazytrain.engine.executor import Executor

transformers = pytest.importorskip("transformers")


def marked_and_exact(name: str, sched: str, extra, tmp_path) -> int:
    """``out.loss + extra(out)`` through the Executor against plain autograd (asserted equal); returns how many block
    nodes the walk marked."""
    return exec_check(tmp_path, name, sched, extra, hidden=False)[0]


@pytest.mark.parametrize("name", ["bart", "t5-nocache"])
def test_routed_tensors_only_blocks_take_mark_nothing(tmp_path, name):
    """The model's own loss: the encoder's output (and T5's position bias) are routed into every decoder block and
    chained through them; nothing else reads them, so no node is marked (no cost)."""
    assert marked_and_exact(name, "recompute_all", lambda out: 0.0 * out.loss, tmp_path) == 0


@pytest.mark.parametrize("sched", ["mixed", "recompute_all", "partial_keep"])
@pytest.mark.parametrize("name", ["bart", "t5-nocache"])
def test_a_term_on_the_routed_encoder_output_marks_every_decoder_block(tmp_path, name, sched):
    """A loss term on the encoder's output: every decoder block that takes it returns its uses apart."""
    model, _ = build(name)
    n_dec = len(model.get_decoder().layers if hasattr(model.get_decoder(), "layers") else model.get_decoder().block)
    extra = lambda out: 0.1 * out.encoder_last_hidden_state.pow(2).mean()  # noqa: E731
    assert marked_and_exact(name, sched, extra, tmp_path) >= n_dec


def two_forward_loop(fabric, model, opt, steps):
    """Two forwards before one backward (the second block passes run ad hoc), a term on the routed boundary of each."""
    out = []
    for s in range(steps):
        pred_a, hid_a = model(XS[s])
        pred_b, hid_b = model(XS[s + 1] * 0.5)
        loss = pred_a.square().mean() + pred_b.abs().mean() + 0.1 * hid_a[1].pow(2).mean() + 0.2 * hid_b[1].sin().mean()
        fabric.backward(loss)
        out.append(loss)
        out += [grad_of(p) for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return out


def test_two_forwards_with_a_routed_boundary_in_the_loss():
    """The ad-hoc passes' nodes take the routed boundary without a chain key: they are marked and exact too."""
    check(two_forward_loop, "recompute_all", steps=2, model_fn=skip_net, opt_fn=sgd)


@pytest.mark.parametrize("policy", ["keep_all", "megatrain"])
def test_routed_boundary_in_the_loss_other_schedules(policy):
    check(custom_loop(1), policy, steps=2, model_fn=skip_net, opt_fn=sgd)


class DetachedNet(Net):
    """``side`` (no block's input) routed as ``skip=`` into blocks 1..3; ``cut``: block 1's output detached before
    block 2 (the backward reaches blocks 3 and 2, not 1 and 0); ``loss_at``: the boundary the loss reads."""

    def __init__(self, cut):
        super().__init__(SkipBlock)
        self.side = torch.nn.Linear(6, 16)
        self.cut = cut

    def forward(self, x):
        h = self.emb(x)
        side = torch.tanh(self.side(x))
        hidden = [h]
        for j, b in enumerate(self.layers):
            h = b(h, skip=side) if j >= 1 else b(h)
            if self.cut and j == 1:
                h = h.detach()
            hidden.append(h)
        return self.head(h), hidden


def engine_run(model, loss_of, *, walk: bool, sched="recompute_all"):
    """One micro-batch through the Executor (``walk``: ``mark_boundary_uses`` before the backward, as the strategies
    call it); returns the parameters' gradients."""
    ex = Executor(model, SCHEDULES[sched])
    try:
        ex.begin_microbatch()
        loss = loss_of(model(XS[0]))
        if walk:
            ex.mark_boundary_uses(loss)
        loss.backward()
        ex.end_microbatch()
    finally:
        ex.close()
    return {n: p.grad for n, p in model.named_parameters()}


def plain_grads(model, loss_of):
    loss_of(model(XS[0])).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def assert_equal_grads(got, want):
    assert got.keys() == want.keys()
    bad = [n for n in want if (got[n] is None) != (want[n] is None) or (want[n] is not None
                                                                         and not torch.equal(got[n], want[n]))]
    assert bad == []


@pytest.mark.parametrize("walk", [True, False])
def test_a_chained_tensor_when_the_loss_does_not_reach_the_top_blocks(walk):
    """The loss on hidden[2] (block 1's output): blocks 2 and 3 take ``side`` but get no backward. Their windows pass
    (their claim on the chain goes with them), so block 1 returns the whole gradient, with or without the walk."""
    loss_of = lambda out: out[1][2].pow(2).mean()  # noqa: E731
    want = plain_grads(DetachedNet(cut=False), loss_of)
    got = engine_run(DetachedNet(cut=False), loss_of, walk=walk)
    assert want["side.weight"] is not None and want["side.weight"].abs().sum() > 0
    assert_equal_grads(got, want)


def test_a_chained_tensor_when_the_backward_does_not_reach_the_lowest_block_taking_it():
    """Block 1's output detached: the backward runs blocks 3 and 2 only. With the walk (the strategies' path) block 2
    knows it is the last and returns the total; without it, the total would be lost: refused by name."""
    loss_of = lambda out: out[0].square().mean()  # noqa: E731
    want = plain_grads(DetachedNet(cut=True), loss_of)
    assert want["side.weight"].abs().sum() > 0
    assert_equal_grads(engine_run(DetachedNet(cut=True), loss_of, walk=True), want)
    with pytest.raises(UnsupportedBlockPattern, match="mark_boundary_uses"):
        engine_run(DetachedNet(cut=True), loss_of, walk=False)
