"""Non-block parts whose gradients are complete before the backward ends, written back and handed over then.

Note: [early non-block parts]
    The non-block weights are staged for the whole step and their gradients are written back in T,
    after the backward (Note: [non-block parts] in planner/schedule_windows.py). With the updates in the backward
    (Note: [updates in the backward pass] in core/optimizer_steps.py), a part whose gradients are complete
    while blocks' backwards are still to come -- an untied head with the final norm: autograd
    accumulates them before the last block's backward begins -- is written back at once (its D2H and
    host accumulation) and handed to the optimizer, so its host update runs under the blocks' backward
    instead of in T, before the next forward. A part is complete when every parameter of it that
    requires grad has had its gradient accumulated in this micro-batch (the post-accumulate-grad hooks of
    the bound weights; autograd accumulates a leaf once per backward, after its every use, so a weight
    tied to the embedding completes only at the end). Only in an armed micro-batch (a step's last),
    only for parts that the optimizer's layers lie wholly inside and never part 0 (its write-back
    collects the whole buffer: ``Executor.early_part_set``), only while a block's backward is still to
    come, and never the last part left for T. Which parameters require grad is read at each arrival (a
    training step may set it on a master after the micro-batch began: the bind follows it), and a part
    written back early collects its own parameters' gradients first (under ``create_graph`` autograd
    replaces a bound weight's ``.grad`` instead of adding into the buffer). A gradient arriving for a
    part after it was written back (a second backward in one micro-batch, a parameter made trainable
    after its part went) marks the non-block group late, and the training core raises
    (``PipelinedSteps.check_late``: an update cannot be taken back). The plan prices them where they run
    (``Workload.early_parts``, from ``PipelinedSteps.planned_early_parts``: the last micro-batch's first B
    window, planner/schedule_windows.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from torch import nn

from lightning_lazytrain.engine.grad_writeback import REST

__all__ = ["EarlyParts"]


class EarlyParts:
    """One micro-batch's watch: which eligible parts' gradients are complete (``arrived``, from the bound
    weights' post-accumulate-grad hooks), and ``send(part) -> bool`` for each that completes."""

    def __init__(self, parts: Mapping[int, Iterable[nn.Parameter]], send: Callable[[int], bool]) -> None:
        self._params = {p: list(params) for p, params in parts.items()}
        self._part_of = {id(q): p for p, params in self._params.items() for q in params}
        self._arrived: dict[int, set[int]] = {p: set() for p in self._params}
        self._send = send
        self.sent: set[int] = set()
        self.declined: set[int] = set()
        self.late = False

    def arrived(self, master: nn.Parameter) -> None:
        p = self._part_of.get(id(master))
        if p is None or p in self.declined:
            return
        if p in self.sent:  # written back already: this gradient came too late for it
            self.late = True
            return
        got = self._arrived[p]
        got.add(id(master))
        # complete: every parameter that requires grad now has its gradient (read now, not at the start)
        if all(id(q) in got for q in self._params[p] if q.requires_grad):
            if self._send(p):
                self.sent.add(p)
            else:
                self.declined.add(p)


class EarlyPartsWatch:
    """``Executor``'s side of Note: [early non-block parts]: which parts a micro-batch watches, and what it does
    when one's gradients are complete (a mixin: its ``params``, ``stats``, ``_micro``, ``_b_next``)."""

    def _watch_early_parts(self, last: bool) -> None:
        """Note: [early non-block parts]: watch this micro-batch's non-block gradients (an armed last one)."""
        assert self.params is not None
        self._early = None
        if last and self.early_parts_armed and self.early_part_set and self.on_part_final is not None:
            parts = {p: self.params.rest_part_parameters(p) for p in self.early_part_set
                     if 0 < p < len(self.params.rest_parts)}
            if parts:
                self._early = EarlyParts(parts, self._send_early_part)
        elif last and self.profiling and len(self.params.rest_parts) > 1:  # observe only: which could go early
            self._early = EarlyParts({p: self.params.rest_part_parameters(p) for p in range(1, len(self.params.rest_parts))},
                                     self._saw_early_part)
        self.params.arrival_watch = self._early.arrived if self._early is not None else None

    def _saw_early_part(self, part: int) -> bool:
        """A profiled step: part ``part``'s gradients are complete; recorded where a block's backward is
        still to come (``StepStats.early_complete_parts``); nothing is sent."""
        if self._micro is not None and self._b_next >= 0:
            self.stats.early_complete_parts.add(part)
        return False

    def _send_early_part(self, part: int) -> bool:
        """Part ``part``'s gradients are complete (autograd's thread, during the backward): write it back
        and hand it to the optimizer, while a block's backward is still to come and a part is left for T."""
        assert self.params is not None and self._early is not None and self.on_part_final is not None
        if self._micro is None or self._b_next < 0 or len(self._early.sent) + 2 > len(self.params.rest_parts):
            return False
        pending = self.params.send_grads(REST, part=part)
        self.params.finish_grads(pending, norm=False, final=False, wait=False)
        assert pending.slot.accumulated is not None
        self.on_part_final(part, pending.slot.accumulated)
        return True
