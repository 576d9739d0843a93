"""The CUDA caching allocator and the plan's device budget.

Note: [the budget is what the allocator reserves]
    What runs out of device memory is the caching allocator's *reserved* bytes (its segments), not
    the bytes tensors hold (*allocated*): on the first GPU run the plan held allocated bytes to its
    prediction while the allocator reserved 7-36% more (fragmentation of its segments, its
    rounding). So ``gpu_memory_budget_gb`` (or 90% of the free memory) bounds what the allocator may
    reserve, and the plan's peak of allocated bytes is held to ``budget / reserve_ratio``:

    - the allocator is configured with expandable segments (``configure_allocator``, unless the
      user configured it through ``PYTORCH_CUDA_ALLOC_CONF``): a segment grows in place instead of
      a new one per size class, so reserved stays close to allocated; the starting ratio is then
      ``RESERVE_RATIO_EXPANDABLE`` = 1.05, else ``RESERVE_RATIO`` = 1.15 (the first run measured
      1.14 at b32 and 1.07 at b8 on a 1B model without them);
    - every step's own ``max_memory_reserved`` / ``max_memory_allocated`` is read (``MemoryWatch``):
      a ratio above the one planned for (+2%), or reserved bytes over the budget, raise the ratio to
      what was measured (+2%) -- or, if larger, to the ratio that leaves room for the measured
      overhead in bytes (reserved - allocated, +2%) under the budget -- and re-plan at the next step
      (the drift mechanism: re-profile, solve, switch when the current schedule no longer fits); allocated bytes above the plan's peak
      re-profile too, so the plan counts what the step left untracked (Note: [untracked device
      bytes] in engine/step_stats.py). Each is logged; at most ``max_replans`` per run (a step over
      the budget after the last is still logged, once). Reserved bytes close to the budget with the
      planned ratio are the plan working as meant, not a reason. With several processes every rank's
      peaks are read and the worst decides (``MemoryWatch.worst``: the one that needs the largest
      ratio, else the most allocated bytes); a re-plan wanted for another reason (drift, blocks thawed)
      in the same step takes the raised ratio and both reasons. A schedule kept by a re-plan is
      watched against its own peak re-simulated on the new profile, not the old plan's;
    - the first plan already leaves room for the byte overhead the profiled step showed
      (``MemoryWatch.prime``; that step starts with the allocator's cache released);
    - a switch to a new schedule gives the allocator's cached segments back (``release_cache``):
      the cache of the old schedule's buffer sizes would otherwise stay reserved under the new one,
      and the next step's ratio would measure the old plan's cache against the new plan's tensors
      (on the first H200 fit this fed three memory re-plans in a row, each ratio higher).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

__all__ = ["MemoryWatch", "RESERVE_RATIO", "RESERVE_RATIO_EXPANDABLE", "configure_allocator", "release_cache"]

log = logging.getLogger(__name__)

RESERVE_RATIO_EXPANDABLE = 1.05
RESERVE_RATIO = 1.15


def configure_allocator(device: torch.device) -> bool:
    """Expandable segments for the CUDA allocator (Note: [the budget is what the allocator reserves]),
    unless ``PYTORCH_CUDA_ALLOC_CONF`` sets it either way; True when expandable segments are on."""
    if device.type != "cuda":
        return False
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return "expandable_segments:True" in conf.replace(" ", "")
    try:
        # torch >= 2.10 names the setter per accelerator (the CUDA one warns that it is deprecated)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
        setter("expandable_segments:True")
    except Exception as err:  # noqa: BLE001 - an allocator that refuses: the larger ratio
        log.info("lazytrain: the CUDA allocator refused expandable segments (%s); planning with a reserve "
                 "ratio of %.2f", err, RESERVE_RATIO)
        return False
    return True


def release_cache(device: torch.device) -> bool:
    """A new schedule runs from the next step: give the allocator's cached, unused segments back
    (Note: [the budget is what the allocator reserves]); True on CUDA."""
    if device.type != "cuda":
        return False
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return True


@dataclass
class MemoryWatch:
    """A run's allocator against its plan: the reserve ratio the plan uses, and when to re-plan."""

    ratio: float = 1.0  # reserved / allocated the plan allows for (1.0: not a CUDA device)
    max_replans: int = 3
    replans: int = 0
    warned: bool = False  # a step over the budget after the last re-plan was logged

    @classmethod
    def for_device(cls, device: torch.device, expandable: bool) -> MemoryWatch:
        if device.type != "cuda":
            return cls(ratio=1.0)
        return cls(ratio=RESERVE_RATIO_EXPANDABLE if expandable else RESERVE_RATIO)

    def cap(self, budget_bytes: float) -> float:
        """The plan's cap on allocated bytes for a budget of reserved bytes."""
        return budget_bytes / self.ratio

    @staticmethod
    def _room_ratio(extra: float, budget_bytes: float) -> float:
        """The ratio that leaves ``extra`` bytes of the budget to the allocator's overhead (20 when it
        would leave the plan under 5% of the budget)."""
        return budget_bytes / (budget_bytes - extra) if extra < 0.95 * budget_bytes else 20.0

    def prime(self, *, reserved: int | None, allocated: int | None, budget_bytes: float | None) -> bool:
        """The profiled step's peaks, before the first plan: room for the byte overhead the allocator
        showed there (reserved - allocated, +2%: its fixed part, small-block segments and workspaces),
        when that needs a larger ratio than the starting one; True if it did (not a re-plan)."""
        if reserved is None or allocated is None or allocated <= 0 or not budget_bytes:
            return False
        extra = (reserved - allocated) * 1.02
        if extra <= 0 or extra >= 0.95 * budget_bytes:
            return False
        ratio = self._room_ratio(extra, budget_bytes)
        if ratio <= self.ratio:
            return False
        self.ratio = ratio
        return True

    @classmethod
    def worst(cls, readings: list[tuple[int | None, int | None]], budget_bytes: float, ratio: float) -> int:
        """Which of several processes' ``(reserved, allocated)`` peaks decides (Note: [the budget is what the
        allocator reserves]): of those that call for a larger ratio than ``ratio`` (+2%) or exceed the budget,
        the one calling for the largest; else the one that allocated the most. Readings of None are skipped."""
        def wanted(r: tuple[int | None, int | None]) -> float:
            reserved, allocated = r
            if reserved is None or allocated is None or allocated <= 0:
                return 0.0
            if reserved / allocated <= ratio * 1.02 and reserved <= budget_bytes:
                return 0.0
            return max(reserved / allocated * 1.02, cls._room_ratio((reserved - allocated) * 1.02, budget_bytes))

        needs = [wanted(r) for r in readings]
        if max(needs, default=0.0) > 0.0:
            return max(range(len(readings)), key=needs.__getitem__)
        return max(range(len(readings)), key=lambda i: readings[i][1] or 0)

    def observe(self, *, reserved: int | None, allocated: int | None, budget_bytes: float,
                predicted_peak: float, replanning: bool = True) -> str | None:
        """A step's allocator peaks (CUDA; None elsewhere): the reason to re-plan, or None. ``replanning``: the
        run re-plans on it (else the reason says it does not: a named policy, or re-planning off)."""
        if reserved is None or allocated is None or allocated <= 0:
            return None
        if self.replans >= self.max_replans:
            if reserved > budget_bytes and not self.warned:
                self.warned = True
                log.warning("lazytrain: memory: the allocator reserved %.3g GB, over the budget of %.3g GB, after the "
                            "last of %d memory re-plans: not re-planned again. Lower gpu_memory_budget_gb below what "
                            "the device has, or free what else holds the GPU", reserved / 1e9, budget_bytes / 1e9,
                            self.max_replans)
            return None
        measured = reserved / allocated
        reason = None
        if measured > self.ratio * 1.02 or reserved > budget_bytes:
            # the overhead as a ratio (fragmentation grows with the tensors) and as bytes (the allocator's
            # fixed part: small-block segments, workspaces; on a 0.4 GB model 0.2 GB, so each smaller plan
            # measured a larger ratio); the plan takes the larger cut
            additive = self._room_ratio((reserved - allocated) * 1.02, budget_bytes)
            self.ratio = max(self.ratio, measured * 1.02, additive)
            then = (f"re-planning with a reserve ratio of {self.ratio:.3f}" if replanning else
                    f"a reserve ratio of {self.ratio:.3f} would cover it")
            reason = (f"memory: the allocator reserved {reserved / 1e9:.3g} GB, {measured:.3f}x what it allocated "
                      f"({(reserved - allocated) / 1e9:.3g} GB over), against a budget of {budget_bytes / 1e9:.3g} GB: "
                      + then)
        elif allocated > predicted_peak * 1.02 + (64 << 20):
            then = ("re-profiling to count what the step leaves untracked" if replanning else
                    "the step left bytes the plan does not count")
            reason = (f"memory: {allocated / 1e9:.3g} GB allocated, above the plan's peak of "
                      f"{predicted_peak / 1e9:.3g} GB: " + then)
        if reason is not None:
            self.replans += 1
        return reason
