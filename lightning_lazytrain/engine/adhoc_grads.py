"""The weight gradients of a micro-batch's ad-hoc block passes, per backward call.

Note: [ad-hoc gradients per backward call]
    An ad-hoc pass (a block called again in the micro-batch, Note: [ad-hoc forwards] in
    forward_windows.py) backpropagates through the recompute slot; its weight gradients are taken to
    the host (``ParamStore.take_grads``) and kept here. Plain autograd adds every use of a leaf made in
    ONE backward call before the sum reaches ``.grad``, and adds each backward CALL into ``.grad`` in
    turn. So the ad-hoc gradients of the backward call that also ran the block's planned backward join
    its planned gradients before they reach the host gradient (``joined``: ``finish_grads(extra=)``),
    and those of other calls are added to the host gradient on their own, in call order: a call before
    the planned backward at the planned backward (``earlier``), a later one after the planned copy
    (``remaining``, at the micro-batch's end). Calls are told apart by autograd's graph task id. Before,
    every ad-hoc gradient of a micro-batch joined the planned ones, or was added after them, depending on
    whether the planned copy had left yet: two backward calls in one micro-batch (``loss1.backward();
    loss2.backward()`` around one ``begin_microbatch``/``end_microbatch``) were off by ~1e-8 from plain
    autograd in fp32 (review 15), blocks unlike each other. The non-block group's gradients stay on the
    device over the micro-batch (``.grad`` of the resident copies, all calls in it; in fp32 over the step,
    as plain autograd): with 16-bit compute copies they sum in the compute dtype there, as a 16-bit
    model's ``.grad`` does, and join the fp32 masters at the micro-batch's end, while the blocks' join
    per call; both are what a Trainer micro-batch (one backward) gives alike.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["AdhocGrads", "backward_call"]

Taken = tuple[torch.Tensor, frozenset]


def backward_call() -> int:
    """The running backward call's id (autograd's graph task; -1 outside a backward)."""
    return int(torch._C._current_graph_task_id())


class AdhocGrads:
    """Layer -> the ad-hoc gradients of each backward call, in arrival order (Note: [ad-hoc gradients per
    backward call]); and each layer's planned backward call."""

    def __init__(self) -> None:
        self._by_layer: dict[int, list[tuple[int, torch.Tensor, frozenset]]] = {}
        self._planned: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._by_layer)

    def add(self, j: int, taken: Taken) -> None:
        """An ad-hoc pass's gradients of layer ``j`` (from ``take_grads``), in the running backward call: summed
        with the same call's earlier ones in arrival order, as autograd's input buffer sums them."""
        call = backward_call()
        entries = self._by_layer.setdefault(j, [])
        if entries and entries[-1][0] == call:
            _, acc, touched = entries[-1]
            entries[-1] = (call, acc.add_(taken[0]), touched | taken[1])
        else:
            entries.append((call, taken[0], taken[1]))

    def planned(self, j: int) -> list[Taken]:
        """Layer ``j``'s planned backward runs now: its call is noted, and the gradients of the backward calls
        that came before it are returned (the caller adds them to the host gradient first)."""
        call = self._planned[j] = backward_call()
        entries = self._by_layer.get(j, [])
        before = [(g, t) for c, g, t in entries if c != call]
        self._by_layer[j] = [e for e in entries if e[0] == call]
        if not self._by_layer[j]:
            del self._by_layer[j]
        return before

    def joined(self, j: int) -> Taken | None:
        """The gradients that join layer ``j``'s planned copy: those of its planned backward's call (without a
        planned backward: the first call's); None if there are none. The others stay for ``remaining``."""
        entries = self._by_layer.get(j)
        if not entries:
            return None
        call = self._planned.get(j, entries[0][0])
        mine = [(g, t) for c, g, t in entries if c == call]
        rest = [e for e in entries if e[0] != call]
        if rest:
            self._by_layer[j] = rest
        else:
            del self._by_layer[j]
        if not mine:
            return None
        grads, touched = mine[0]
        for g, t in mine[1:]:
            grads, touched = grads.add_(g), touched | t
        return grads, touched

    def remaining(self) -> Iterator[tuple[int, torch.Tensor, frozenset]]:
        """What joined no planned copy, layer by layer in call order; the store is empty after."""
        by_layer, self._by_layer = self._by_layer, {}
        for j, entries in by_layer.items():
            for _, grads, touched in entries:
                yield j, grads, touched
