"""Batches larger than the plan.

Note: [batches larger than the plan]
    The plan is made from one profiled step: its activation bytes and compute times are that step's
    micro-batches' (the largest of them: ``engine/forward_windows.py``'s ``_most``). Under dynamic padding a
    later batch may be longer, and its activations larger than the plan holds on the device: the
    budget would silently not hold (the memory watch sees it on CUDA only, and only after the step).

    So the core measures every micro-batch before it runs (``batch_elements``: the elements of the
    batch's tensors, proportional to its tokens) against the largest the plan covers. At a step's first
    micro-batch, one larger by a factor ``r`` is planned for before it runs (``Planner.rescale``): the
    plan's workload with its activation bytes and compute times scaled by ``r`` (``Workload.scaled``);
    if the current schedule still fits the budget there it stays (and now covers ``r``), else the MILP
    solves for it and the executor switches at this step boundary, after the updates in flight. A
    later micro-batch of an accumulated step cannot switch schedules mid-step: it runs on the current
    one (logged once) and the next step plans for it. Smaller batches run on the plan as they are.
    Linear scaling is the first-order model (attention that materialises scores grows faster; on CUDA
    the memory watch re-profiles for what the allocator shows beyond it). With several processes the
    batches differ per rank and the plan is one: the guard is off there (logged once).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BatchSizeGuard", "batch_elements"]


def batch_elements(*items: Any, **named: Any) -> int:
    """Elements of every tensor in a batch (nested in dicts, lists and tuples), each tensor once."""
    seen: set[int] = set()
    total = 0
    stack = [*items, *named.values()]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in seen:
                seen.add(id(item))
                total += item.numel()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


class BatchSizeGuard:
    """The largest micro-batch the plan covers, in batch elements (Note: [batches larger than the plan])."""

    def __init__(self) -> None:
        self.covered = 0  # 0: nothing known (no plan yet, or batches without tensors)
        self.profiled = 0  # the largest micro-batch of the step being profiled
        self.pending = 0  # a later micro-batch larger than the plan: plan for it at the next step
        self._warned_mid_step = False

    def profiling(self, elements: int) -> None:
        """A micro-batch of the profiled step."""
        self.profiled = max(self.profiled, elements)

    def planned(self) -> None:
        """A plan was made from the profiled step: it covers the step's largest micro-batch."""
        self.covered, self.profiled, self.pending = self.profiled, 0, 0

    def factor(self, elements: int, *, first: bool) -> float | None:
        """The factor by which this micro-batch (or, at a step's first, one seen larger earlier) exceeds
        what the plan covers, when a re-plan should run now; None otherwise. A later micro-batch that
        exceeds it is remembered for the next step (``mid_step``)."""
        if not self.covered or not elements:
            return None
        if not first:
            if elements > self.covered:
                self.pending = max(self.pending, elements)
            return None
        want = max(elements, self.pending)
        return want / self.covered if want > self.covered else None

    def cover(self, factor: float) -> None:
        """The plan now covers micro-batches ``factor`` times what it did."""
        self.covered = int(round(self.covered * factor))
        self.pending = 0 if self.pending <= self.covered else self.pending

    def mid_step(self) -> bool:
        """A later micro-batch exceeded the plan (True once: the caller logs it)."""
        if self.pending and not self._warned_mid_step:
            self._warned_mid_step = True
            return True
        return False
