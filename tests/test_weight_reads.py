"""core/weight_reads.py's guard on its own (Note: [weights read before the forward]); the fits that use it are
test_review6_lightning.py's."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode, _len_torch_function_stack

from lightning_lazytrain.core.weight_reads import guarded


class Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def run(body, params):
    waits, seen = [], []
    with guarded({0: list(params)}, lambda: waits.append(1), seen.append):
        body(seen[0])
    assert seen[-1] is None
    return len(waits)


def test_a_value_read_waits_once_and_metadata_waits_for_nothing():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    other = torch.ones(3)
    assert run(lambda g: (p.shape, p.numel(), p.dtype, p.requires_grad, len(p), other * 2), [p, q]) == 0
    assert run(lambda g: (p.detach(), q.norm()), [p, q]) == 1
    # getters and views make aliases, reading no value
    assert run(lambda g: (p.data, p.data.numel(), p.real.shape, p.grad, p.detach(), p[1:], p[0], p.view(3, 1)),
               [p, q]) == 0
    assert run(lambda g: p[0].item(), [p]) == 1
    assert run(lambda g: p[torch.tensor([0, 2])], [p]) == 1  # advanced indexing copies: a read
    assert run(lambda g: p.detach()[1:].clone(), [p]) == 1
    assert run(lambda g: torch.stack([q, q]), [p, q]) == 1
    assert run(lambda g: p.data.mul_(1.0), [p]) == 1  # an in-place edit waits too


def test_nothing_watched_pushes_nothing():
    depth = _len_torch_function_stack()
    with guarded({}, lambda: None, lambda g: None):
        assert _len_torch_function_stack() == depth


def test_the_forward_releasing_every_block_takes_the_guard_off_the_stack():
    p = torch.nn.Parameter(torch.ones(3))
    depth = _len_torch_function_stack()

    def body(g):
        assert _len_torch_function_stack() == depth + 1
        g.released(0)
        assert _len_torch_function_stack() == depth  # the forward pays nothing for it
        p.detach()

    assert run(body, [p]) == 0
    assert _len_torch_function_stack() == depth


def test_a_users_mode_inside_keeps_the_stack_nested():
    p = torch.nn.Parameter(torch.ones(3))
    depth = _len_torch_function_stack()
    user = Counting()

    def body(g):
        with user:
            g.released(0)  # not on top: stays, as a pass-through
            assert _len_torch_function_stack() == depth + 2
            p.detach()
        assert _len_torch_function_stack() == depth + 1

    assert run(body, [p]) == 0 and user.calls == 1
    assert _len_torch_function_stack() == depth


def test_a_block_the_forward_has_not_reached_is_still_watched():
    """Block 0 released (the forward waited for it), block 3 not: a read of block 0 waits for nothing, one of
    block 3 (a hook in block 0 reading a later block's weights) waits; releasing the last takes it off."""
    b0, b3 = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    depth = _len_torch_function_stack()
    waits, seen = [], []
    with guarded({0: [b0], 3: [b3]}, lambda: waits.append(1), seen.append):
        g = seen[0]
        g.released(0)
        assert _len_torch_function_stack() == depth + 1
        b0.detach().clone()
        assert waits == []
        b3.detach().clone()
        assert waits == [1]
    assert _len_torch_function_stack() == depth
    waits, seen = [], []
    with guarded({0: [b0], 3: [b3]}, lambda: waits.append(1), seen.append):
        seen[0].released(0)
        seen[0].released(3)
        assert _len_torch_function_stack() == depth
        b3.detach().clone()
    assert waits == []


def test_aliases_and_views_are_watched_as_their_storage():
    """An alias kept from before the guard (``p.data``, ``p.detach()``, a view) shares the watched storage: a read
    of it waits; a tensor of its own (a clone taken earlier) does not."""
    p = torch.nn.Parameter(torch.ones(4))
    alias, view, copy = p.data, p.detach()[1:], p.detach().clone()
    assert run(lambda g: alias.sum(), [p]) == 1
    assert run(lambda g: view * 2, [p]) == 1
    assert run(lambda g: copy * 2, [p]) == 0


def test_a_neighbour_in_one_buffer_is_not_watched():
    """The host masters are views into one arena: a released block's bytes beside a watched one's wait for nothing
    (the engine views the whole arena as it stages the released block)."""
    arena = torch.zeros(10)
    a, b = torch.nn.Parameter(arena[:4]), torch.nn.Parameter(arena[4:])
    assert run(lambda g: (arena[:4].sum(), a * 2, arena[3]), [b]) == 0
    assert run(lambda g: arena[3:5].sum(), [b]) == 1
    assert run(lambda g: arena.sum(), [b]) == 1


def test_assigning_a_value_property_waits():
    p = torch.nn.Parameter(torch.ones(3))

    def body(g):
        p.data = torch.zeros(3)

    assert run(body, [p]) == 1


def test_optimizer_states_given_are_watched():
    p = torch.nn.Parameter(torch.ones(3))
    state = {"exp_avg": torch.zeros(3), "step": torch.zeros(())}
    waits, seen = [], []
    with guarded({0: [p, *state.values()]}, lambda: waits.append(1), seen.append):
        state["exp_avg"].clone()
    assert waits == [1]


def test_empty_tensors_watch_nothing():
    depth = _len_torch_function_stack()
    with guarded({0: [torch.nn.Parameter(torch.ones(0))]}, lambda: None, lambda g: None):
        assert _len_torch_function_stack() == depth
