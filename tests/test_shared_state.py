"""State a block changes in place and tensors blocks pass each other outside the hidden state, with small
modules of our own (no transformers): Note: [recurrent cache state] (engine/block_io.py) and Note:
[containers the blocks share] (engine/shared_args.py). fp32 on CPU, against plain autograd, bit for bit."""

from __future__ import annotations

import copy
from collections import UserDict

import pytest
import torch
from torch import nn

from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.planner import keep_all, megatrain, recompute_all

L, D = 4, 8
SCHEDULES = {"recompute_all": recompute_all(L), "megatrain_K2": megatrain(L, 2), "keep_all": keep_all(L)}


class StateLayer:
    """A cache layer as transformers' linear-attention layers keep one: dicts and a counter changed in place."""

    def __init__(self) -> None:
        self.conv_states: dict = {0: None}
        self.has_previous_state = {0: False}
        self.cumulative_length_linear = torch.tensor(0)


class StateCache:
    """A cache object with ``layers`` (what CacheReplay knows), one StateLayer per block, passed as ``cache=``
    (a keyword rerun_call swaps for a CacheReplay, as Hugging Face's hybrid models pass theirs)."""

    def __init__(self) -> None:
        self.layers = [StateLayer() for _ in range(L)]


class StateBlock(nn.Module):
    """Takes the decode path (mixes in the cached state) once its layer says it has a previous state, as
    a Mamba layer does; its first forward sets that state in place."""

    def __init__(self, j: int) -> None:
        super().__init__()
        self.j = j
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, cache: StateCache | None = None) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if cache is not None:
            layer = cache.layers[self.j]
            if layer.has_previous_state[0]:  # a decode step: the cached state joins in
                h = h + layer.conv_states[0]
            layer.conv_states[0] = h.detach().clone()
            layer.has_previous_state[0] = True
            layer.cumulative_length_linear.add_(x.shape[1])
        return x + h


class SharingBlock(nn.Module):
    """Block 0 writes its keys into the container every block is given; with ``read``, block 2 reads them."""

    def __init__(self, j: int, read: bool) -> None:
        super().__init__()
        self.j, self.read = j, read
        self.k = nn.Linear(D, D)
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor, shared: UserDict | None = None) -> torch.Tensor:
        h = self.lin(x)
        if shared is not None and self.j == 0:
            shared["k"] = self.k(x)
        if shared is not None and self.read and self.j == 2:
            h = h + shared["k"]
        return x + torch.tanh(h)


class Net(nn.Module):
    def __init__(self, kind: str, read: bool = True) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Linear(5, D)
        self.layers = nn.ModuleList(StateBlock(j) if kind == "state" else SharingBlock(j, read) for j in range(L))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        extra = StateCache() if self.kind == "state" else UserDict()
        for layer in self.layers:
            h = layer(h, cache=extra) if self.kind == "state" else layer(h, shared=extra)
        return self.head(h).square().mean()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(model: nn.Module, x: torch.Tensor, schedule) -> tuple[torch.Tensor, dict]:
    m = copy.deepcopy(model)
    ex = Executor(m, schedule)
    try:
        ex.begin_microbatch(first=True, last=True)
        loss = m(x)
        loss.backward()
        ex.end_microbatch()
        return loss.detach(), grads(m)
    finally:
        ex.close()


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_re_run_starts_from_the_state_the_block_found(name):
    """Before the fix the re-run shared the layer's dicts with the forward, saw has_previous_state set by it
    and took the decode path: different gradients, no error."""
    torch.manual_seed(0)
    model, x = Net("state"), torch.randn(3, 6, 5)
    ref = copy.deepcopy(model)
    want_loss = ref(x)
    want_loss.backward()
    loss, got = run(model, x, SCHEDULES[name])
    assert torch.equal(loss, want_loss.detach())
    want = grads(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_later_block_reading_what_an_earlier_one_shared_is_refused(name):
    torch.manual_seed(0)
    with pytest.raises(UnsupportedBlockPattern, match=r"block 2 of 'layers' reads a tensor block 0 wrote into its "
                                                       r"argument 'shared'"):
        run(Net("share", read=True), torch.randn(3, 6, 5), SCHEDULES[name])


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_container_written_and_never_read_trains_exactly(name):
    torch.manual_seed(0)
    model, x = Net("share", read=False), torch.randn(3, 6, 5)
    ref = copy.deepcopy(model)
    ref(x).backward()
    _, got = run(model, x, SCHEDULES[name])
    want = grads(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_watch_stops_once_a_micro_batch_shared_without_reading():
    """The read check is a dispatch mode on every later block's forward: once one micro-batch wrote into the
    container and no block read it, the next micro-batches run without it (and stay exact)."""
    torch.manual_seed(0)
    model, x = Net("share", read=False), torch.randn(3, 6, 5)
    ref = copy.deepcopy(model)
    m = copy.deepcopy(model)
    ex = Executor(m, recompute_all(L))
    try:
        for step in range(2):
            ex.begin_microbatch(first=True, last=True)
            assert ex._shared_writes.active == (step == 0)
            m(x).backward()
            ex.end_microbatch()
            ref(x).backward()
            if step == 0:
                assert ex._shared_writes.written  # block 0 wrote: noted in the first micro-batch
        want = grads(ref)
        got = grads(m)
        assert all(torch.equal(got[k], want[k]) for k in want)
    finally:
        ex.close()
