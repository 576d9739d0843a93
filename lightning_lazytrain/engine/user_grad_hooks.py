"""The user's gradient hooks on parameters, honoured while the parameters stream.

A streamed parameter never takes part in autograd itself: ``ParamStore.bind`` puts a fresh leaf
(a *wrapper*, a view of a device slot) in its place for each window, and the gradient reaches the
master (the module's own parameter, on the host) by a copy. Hooks the user put on the master are
therefore not seen by autograd. Two kinds exist (torch 2.x), and each is honoured where its
contract can be kept:

Note: [gradient hooks on streamed parameters]
    ``p.register_hook(fn)`` (a tensor pre-hook: ``fn(grad)`` may return a replacement) fires under
    plain autograd once per backward, with the gradient of that backward (summed over every use of
    ``p`` first), *before* it is accumulated into ``p.grad``, on the device, in the compute dtype.
    The wrapper is that leaf here: :func:`forward_tensor_hooks` registers one pre-hook on it that
    runs the master's hooks (``p._backward_hooks``, read at call time, so hooks added or removed
    later are seen), in their order, each one's result feeding the next, as torch does. It fires
    inside the block's backward window (also for kept internals, re-runs and partial keeps: the
    wrapper that autograd accumulates into carries it), once per backward of the block. The one
    case that cannot be honoured is a block whose two passes (the planned one and an ad-hoc second
    forward in the same micro-batch) are both backpropagated: the executor runs them as two
    backwards, so the hook would fire twice on partial gradients where autograd fires once on their
    sum; that is refused when it happens (``Executor._count_backprop``, from the block node's
    ``adhoc_backward`` / ``backward_window``). A weight several blocks use (Note: [modules shared by
    blocks] in param_store.py) is another such case: each block's backward is an autograd call of its
    own, so a hook on its wrapper would fire once per block, on that block's share. Its hooks are not
    put on the wrapper; they run once the micro-batch's backward is over (``run_shared_tensor_hooks``,
    from ``Executor.end_microbatch``, before the non-block gradients leave the device), on the sum of
    every use in that backward, and what they return replaces it (a shared weight makes every
    micro-batch write its gradients back, so that sum is this backward's alone).

    ``p.register_post_accumulate_grad_hook(fn)`` fires with ``p`` itself after a backward has
    accumulated into ``p.grad``; ``fn`` typically reads or edits ``p.grad`` or steps an optimizer
    keyed by ``p``. Both need the master, with the gradient accumulated over the micro-batches of
    the step, as under plain autograd. So :class:`PostAccumulateHooks` fires them on the masters
    once the micro-batch's gradients have joined the host ``.grad`` (the strategy makes every
    micro-batch write back while such hooks exist), for exactly the parameters a gradient reached
    in this backward, in the order autograd accumulated them on the device (their wrappers'
    accumulation order), before ``on_after_backward``. With several processes they see this rank's
    own gradients before the average (as under DDP); in the sharded mode, the shard after the
    reduce-scatter (as FSDP2 fires them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["PostAccumulateHooks", "forward_tensor_hooks", "has_post_accumulate_hooks", "run_tensor_hooks",
           "tensor_hook_names"]


def forward_tensor_hooks(master: nn.Parameter, wrapper: nn.Parameter, *, always: bool = False) -> None:
    """Make ``wrapper``'s backward run ``master``'s tensor pre-hooks (Note: [gradient hooks on
    streamed parameters]). ``always``: also when the master has none yet (a long bind, during which
    the user may register one)."""
    if not always and not master._backward_hooks:
        return

    wrapper.register_hook(lambda grad: run_tensor_hooks(master, grad))


def run_tensor_hooks(master: nn.Parameter, grad: torch.Tensor) -> torch.Tensor | None:
    """``master``'s tensor pre-hooks on ``grad``, in their order, each one's result feeding the next, as torch
    runs them: the last result (None: none returned one)."""
    hooks = master._backward_hooks
    if not hooks:
        return None
    out = None
    for fn in list(hooks.values()):
        result = fn(grad if out is None else out)
        if result is not None:
            out = result
    return out


def user_post_accumulate_hooks(p: nn.Parameter) -> list:
    """``p``'s post-accumulate-grad hooks but the engine's own (marked ``_lazytrain_internal``: Note: [a
    master used outside its block] in outside_uses.py)."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None) or {}
    return [fn for fn in hooks.values() if not getattr(fn, "_lazytrain_internal", False)]


def has_post_accumulate_hooks(params: Iterable[nn.Parameter]) -> bool:
    return any(user_post_accumulate_hooks(p) for p in params)


def tensor_hook_names(named: Iterable[tuple[str, nn.Parameter]]) -> list[str]:
    """The names of the parameters that carry tensor pre-hooks (``register_hook``)."""
    return [name for name, p in named if p._backward_hooks]


class PostAccumulateHooks:
    """Which masters a micro-batch's backward reached, in autograd's order, and firing their
    post-accumulate-grad hooks once their host gradients are complete."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: dict[int, nn.Parameter] = {}  # id(key) -> master, in device accumulation order
        self._landed: dict[int, nn.Parameter] = {}  # joined the host grads (host lane thread)

    def arrived(self, key: int, master: nn.Parameter) -> None:
        """A wrapper of ``master`` accumulated a gradient on the device (autograd's thread)."""
        if key not in self._arrived:
            with self._lock:
                self._arrived.setdefault(key, master)

    def landed(self, items: Iterable[tuple[int, nn.Parameter]]) -> None:
        """These masters' host gradients received this micro-batch's gradient (host lane)."""
        with self._lock:
            for key, master in items:
                self._landed.setdefault(key, master)

    def reset(self) -> None:
        with self._lock:
            self._arrived, self._landed = {}, {}

    def fire(self) -> int:
        """Call the hooks of every landed master that has some (arrival order first, then masters
        only other ranks' gradients reached), then forget this micro-batch. Returns how many
        masters' hooks ran. After the host lane has finished the micro-batch's accumulations."""
        with self._lock:
            arrived, landed = self._arrived, self._landed
            self._arrived, self._landed = {}, {}
        order = [k for k in arrived if k in landed] + [k for k in landed if k not in arrived]
        fired = 0
        with torch.no_grad():  # as autograd runs them (no create_graph)
            for key in order:
                p = landed[key]
                hooks = user_post_accumulate_hooks(p)
                if not hooks or not p.requires_grad:
                    continue
                for fn in hooks:
                    if fn(p) is not None:  # torch's own check
                        raise RuntimeError("Tensor post accumulate grad hooks should return None.")
                fired += 1
        return fired
