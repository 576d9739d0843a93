"""Tensors that cross a streamed block's boundary other than the hidden state, and what re-runs
replay: every case against plain autograd, bit-equal in fp32, under four schedules that route
tensors differently (recompute everything, MegaTrain blocks, host homes + recompute + kept
internals, keep everything)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.planner import Schedule, keep_all, megatrain, recompute_all

L = 4
MIXED = Schedule(num_layers=L, homes=("gpu", "cpu", "recompute", "gpu", "gpu"), keep_internals=(True, False, False, True),
                 resident_weights=(False,) * L, offload_window=(None, 1, None, None, None),
                 reload_window=(None, 3, None, None, None), policy="mixed")
SCHEDULES = {"recompute_all": recompute_all(L), "megatrain_K2": megatrain(L, 2), "mixed": MIXED,
             "keep_all": keep_all(L)}


class Router(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gate = nn.Linear(d, 3, bias=False)

    def forward(self, x):
        return self.gate(x)


class Block(nn.Module):
    """A block with optional extras: an auxiliary output, a cross input, a shared position bias,
    a router whose logits a hook records, dropout, batch norm."""

    def __init__(self, d, index, *, bias=False, bn=False, dropout=0.0):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.cross = nn.Linear(d, d, bias=False)
        self.router = Router(d)
        self.index = index
        self.rel = nn.Parameter(torch.randn(d) * 0.1) if bias and index == 0 else None
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.drop = nn.Dropout(dropout)

    def forward(self, x, enc=None, position_bias=None, *, mode="plain"):
        h = self.lin(x)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        if enc is not None:
            h = h + self.cross(enc).mean(1, keepdim=True)
        if self.rel is not None:
            position_bias = self.rel * 2.0
        if position_bias is not None:
            h = h + position_bias
        logits = self.router(x)
        h = h * torch.softmax(logits, -1)[..., :1]
        y = x + self.drop(torch.tanh(h))
        if mode == "aux":
            return y, (h.square().mean(), "tag")
        if mode == "bias":
            return y, position_bias
        return y


class Net(nn.Module):
    def __init__(self, mode="plain", d=8, **kw):
        super().__init__()
        self.mode = mode
        self.emb = nn.Linear(5, d)
        self.enc = nn.Linear(5, d)
        self.layers = nn.ModuleList(Block(d, i, bias=mode == "bias", **kw) for i in range(L))
        self.head = nn.Linear(d, 1)
        if mode == "hook":  # as Hugging Face's output recorder collects MoE router logits
            for b in self.layers:
                b.router.recorded = []
                b.router.register_forward_hook(lambda m, a, out: m.recorded.append(out))

    @property
    def recorded(self) -> list[torch.Tensor]:
        return [t for b in self.layers for t in getattr(b.router, "recorded", [])]

    def forward(self, x):
        h = self.emb(x)
        enc = torch.tanh(self.enc(x)) if self.mode == "cross" else None
        aux_total, bias = 0.0, None
        for b in self.layers:
            getattr(b.router, "recorded", []).clear()
        for b in self.layers:
            if self.mode == "aux":
                h, (aux, tag) = b(h, mode="aux")
                assert tag == "tag"
                aux_total = aux_total + aux
            elif self.mode == "bias":
                h, bias = b(h, position_bias=bias, mode="bias")
            elif self.mode == "cross":
                h = b(h, enc=enc)  # the encoder's output needs grad: an input routed through the node
            else:
                h = b(h)
        loss = self.head(h).square().mean() + 0.1 * aux_total
        if self.mode == "hook":
            loss = loss + sum(r.logsumexp(-1).square().mean() for r in self.recorded)
        return loss


def plain(net, x, steps=1):
    ref = copy.deepcopy(net)
    losses = []
    for _ in range(steps):
        torch.manual_seed(3)
        loss = ref(x)
        loss.backward()
        losses.append(loss.detach())
    return ref, losses


def clear_records(net):
    for b in net.layers:
        getattr(b.router, "recorded", []).clear()


def streamed(net, schedule, x, tmp_path, steps=1):
    m = copy.deepcopy(net)
    ex = Executor(m, schedule, nvme_dir=tmp_path)
    losses = []
    try:
        for _ in range(steps):
            torch.manual_seed(3)
            ex.begin_microbatch()
            loss = m(x)
            loss.backward()
            ex.end_microbatch()
            losses.append(loss.detach())
    finally:
        ex.close()
    return m, losses


def assert_same(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), name
    for (name, p), q in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("mode", ["aux", "cross", "bias", "hook"])
def test_extra_tensors_get_exact_gradients(tmp_path, mode, schedule):
    torch.manual_seed(0)
    net = Net(mode)
    x = torch.randn(2, 6, 5)
    ref, want = plain(net, x)
    got_model, got = streamed(net, SCHEDULES[schedule], x, tmp_path)
    assert torch.equal(got[0], want[0])
    assert_same(got_model, ref)
    if mode == "hook":  # the hook fired once per block forward, not again in re-runs
        assert len(got_model.recorded) == L


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_reruns_leave_running_statistics_and_dropout_as_the_forward_did(tmp_path, schedule):
    torch.manual_seed(0)
    net = Net("plain", bn=True, dropout=0.3)
    x = torch.randn(2, 6, 5)
    ref, want = plain(net, x, steps=2)
    got_model, got = streamed(net, SCHEDULES[schedule], x, tmp_path, steps=2)
    assert [float(v) for v in got] == [float(v) for v in want]
    assert_same(got_model, ref)  # includes running_mean/var and num_batches_tracked


@pytest.mark.parametrize("schedule", ["recompute_all", "mixed"])
def test_reruns_replay_the_autocast_state(tmp_path, schedule):
    """Lightning enters autocast around training_step only; backward (and so every re-run) runs
    outside it. A re-run outside autocast computes another function (fp32 matmuls here)."""
    torch.manual_seed(0)
    net = Net("plain")
    x = torch.randn(2, 6, 5)
    ref = copy.deepcopy(net)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
    want.backward()
    m = copy.deepcopy(net)
    ex = Executor(m, SCHEDULES[schedule], nvme_dir=tmp_path)
    try:
        ex.begin_microbatch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x)
        loss.backward()
        ex.end_microbatch()
    finally:
        ex.close()
    assert torch.equal(loss, want)
    assert_same(m, ref)


@pytest.mark.parametrize("schedule", ["recompute_all", "mixed", "keep_all"])
def test_second_forward_pass_in_one_microbatch_is_exact(tmp_path, schedule):
    """Two forwards before one backward (two losses, manual optimization): the second pass runs
    ad hoc; both get exact gradients."""
    torch.manual_seed(0)
    net = Net("plain", dropout=0.2)
    x1, x2 = torch.randn(2, 6, 5), torch.randn(2, 6, 5)
    ref = copy.deepcopy(net)
    torch.manual_seed(3)
    want = ref(x1) + 0.5 * ref(x2)
    want.backward()
    m = copy.deepcopy(net)
    ex = Executor(m, SCHEDULES[schedule], nvme_dir=tmp_path)
    try:
        torch.manual_seed(3)
        ex.begin_microbatch()
        loss = m(x1) + 0.5 * m(x2)
        loss.backward()
        stats = ex.end_microbatch()
    finally:
        ex.close()
    assert torch.equal(loss, want)
    assert_same(m, ref)
    assert stats.layer_sq_norms == {}  # norms handed to the optimizer would miss the ad-hoc pass


def test_a_hook_that_changes_an_output_is_refused_where_the_block_reruns(tmp_path):
    torch.manual_seed(0)
    net = Net("plain")
    net.layers[2].router.register_forward_hook(lambda m, a, out: out * 2)
    x = torch.randn(2, 6, 5)
    ex = Executor(copy.deepcopy(net), recompute_all(L), nvme_dir=tmp_path)
    try:
        ex.begin_microbatch()
        with pytest.raises(UnsupportedBlockPattern, match=r"layers\.2\.router .*changes its module's output"):
            ex.module(x)
    finally:
        ex.close()
    # keep_all never re-runs a block: the hook is simply part of the function
    ref, want = plain(net, x)
    got_model, got = streamed(net, keep_all(L), x, tmp_path)
    assert torch.equal(got[0], want[0])
    assert_same(got_model, ref)


def test_close_restores_the_blocks_class_forward(tmp_path):
    net = Net("plain")
    ex = Executor(net, recompute_all(L), nvme_dir=tmp_path)
    ex.close()
    assert all("forward" not in vars(b) for b in net.layers)
    calls = []
    original = Block.forward
    try:
        Block.forward = lambda self, x, **kw: calls.append(1) or original(self, x, **kw)
        net(torch.randn(1, 2, 5))
    finally:
        Block.forward = original
    assert len(calls) == L
