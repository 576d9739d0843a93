"""Non-block parts whose gradients are complete early in the backward are written back and handed to the
optimizer then (Note: [early non-block parts] in engine/early_parts.py): exact, tied weights wait."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lazytrain.engine.early_parts import EarlyParts
from test_updates_in_backward import fit_tiny


def test_a_part_is_sent_once_all_of_its_gradients_arrived_and_late_ones_are_flagged():
    a, b, c, frozen = (nn.Parameter(torch.zeros(2)) for _ in range(4))
    frozen.requires_grad_(False)
    sent: list[int] = []
    watch = EarlyParts({1: [a, b, frozen], 2: [c]}, lambda p: sent.append(p) is None)
    watch.arrived(a)
    assert sent == []  # b still to come (a frozen parameter is not waited for)
    watch.arrived(b)
    assert sent == [1] and watch.sent == {1} and not watch.late
    watch.arrived(nn.Parameter(torch.zeros(1)))  # not a watched part: ignored
    watch.arrived(a)  # a second gradient for a part written back already
    assert watch.late
    declined = EarlyParts({2: [c]}, lambda p: False)
    declined.arrived(c)
    assert declined.sent == set()  # the executor declined: left for T
    declined.arrived(c)
    assert not declined.late  # and a later gradient for it is T's


def test_requires_grad_is_read_when_gradients_arrive():
    """A parameter made trainable after the watch began is waited for; one made trainable after its part
    went marks the part late (found by a review: the watch read requires_grad once, at the start)."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    b.requires_grad_(False)
    sent: list[int] = []
    watch = EarlyParts({1: [a, b]}, lambda p: sent.append(p) is None)
    b.requires_grad_(True)  # the training step makes it trainable before the forward
    watch.arrived(a)
    assert sent == []
    watch.arrived(b)
    assert sent == [1]
    c, d = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    d.requires_grad_(False)
    watch = EarlyParts({1: [c, d]}, lambda p: True)
    watch.arrived(c)
    d.requires_grad_(True)
    watch.arrived(d)
    assert watch.late


@pytest.mark.parametrize("tied", [False, True])
def test_the_head_goes_first_and_the_fit_stays_exact(tied):
    """Under the Trainer (updates in the backward): the head part is handed over before block 3 each
    step and the run equals the serial one bit for bit; with the head tied to the embedding its part holds
    only the final norm (the tied weight is the embedding's, complete at the backward's end)."""
    over = {"tied_embeddings": True} if tied else {}
    want, want_params, _ = fit_tiny(False, model_overrides=over)
    got, got_params, opt = fit_tiny(True, model_overrides=over)
    assert got == want and all(torch.equal(x, y) for x, y in zip(got_params, want_params))
    assert opt.in_backward == ["head", 3, 2, 1] * 4
