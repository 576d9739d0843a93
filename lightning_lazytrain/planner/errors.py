"""Errors raised by the planner. Each message names the problem and the fix."""

from __future__ import annotations

from .units import format_bytes, format_bytes_at_least


class PlannerError(ValueError):
    """Base class for planner errors."""


class InvalidInput(PlannerError):
    """A nonsense input (negative bandwidth, zero layers, ...). ``key`` names the offending field."""

    def __init__(self, key: str, value: object, why: str) -> None:
        self.key = key
        self.value = value
        self.why = why
        super().__init__(f"invalid {key}={value!r}: {why}")

    def __reduce__(self):  # pickled whole: solve() returns errors from its solver process (solver_process.py)
        return (type(self), (self.key, self.value, self.why))


class InfeasibleBudget(PlannerError):
    """No schedule fits: ``tier`` is short by ``shortfall_bytes``; ``suggestion`` says what would fit;
    ``fits_bytes``, where known, is the smallest ``tier`` memory that would (what the suggestion names)."""

    def __init__(self, tier: str, shortfall_bytes: float, message: str, suggestion: str = "", *,
                 fits_bytes: float | None = None) -> None:
        self.tier = tier
        self.shortfall_bytes = shortfall_bytes
        self.message = message
        self.suggestion = suggestion
        self.fits_bytes = fits_bytes
        text = f"{message} ({tier} memory short by {format_bytes(shortfall_bytes)})"
        if suggestion:
            text += f"; {suggestion}"
        super().__init__(text)

    def __reduce__(self):
        return (_rebuild_budget, (type(self), self.tier, self.shortfall_bytes, self.message, self.suggestion,
                                  self.fits_bytes))

    def reworded(self, old: str, new: str) -> InfeasibleBudget:
        """The same error with ``old`` in its suggestion written as ``new``: the fix in the caller's terms (the
        planner names lazytrain-plan's keys; the strategy and the train app name their own)."""
        return InfeasibleBudget(self.tier, self.shortfall_bytes, self.message, self.suggestion.replace(old, new),
                                fits_bytes=self.fits_bytes)

    def under_reserve(self, ratio: float, budget_bytes: float) -> InfeasibleBudget:
        """A GPU shortage found against the plan's cap -- the budget of reserved bytes divided by the CUDA
        allocator's reserve ratio (core/allocator.py) -- in the budget's terms: the figure suggested is a
        budget that works (the cap's ``ratio`` times), the shortfall is against the budget, and the message says
        where the cap came from. Other tiers, or no reserve (ratio 1), unchanged."""
        if self.tier != "gpu" or not ratio > 1.0 or not budget_bytes:
            return self
        why = (f"; the cap is the GPU budget of {format_bytes(budget_bytes)} divided by {ratio:.3f}, the CUDA "
               "allocator's reserve (what it reserves beyond what tensors hold, measured)")
        if self.fits_bytes is None:
            return InfeasibleBudget(self.tier, self.shortfall_bytes * ratio, self.message + why,
                                    self.suggestion + (f" (GPU figures here are of allocated bytes: a budget needs "
                                                       f"{ratio:.3f}x them)" if self.suggestion else ""))
        fits = self.fits_bytes * ratio
        suggestion = self.suggestion.replace(format_bytes_at_least(self.fits_bytes), format_bytes_at_least(fits))
        return InfeasibleBudget(self.tier, max(fits - budget_bytes, 0.0), self.message + why, suggestion,
                                fits_bytes=fits)


class InfeasibleSchedule(PlannerError):
    """The simulator found a schedule that violates a resource; ``resource`` names it."""

    def __init__(self, resource: str, message: str, *, window: str | None = None,
                 need_bytes: float = 0.0, have_bytes: float = 0.0) -> None:
        self.resource = resource
        self.window = window
        self.need_bytes = need_bytes
        self.have_bytes = have_bytes
        self.message = message
        super().__init__(f"{resource}: {message}")

    def __reduce__(self):
        return (_rebuild_schedule_error, (type(self), self.resource, self.message, self.window, self.need_bytes,
                                          self.have_bytes))


def _rebuild_budget(cls, tier, shortfall_bytes, message, suggestion, fits_bytes):
    return cls(tier, shortfall_bytes, message, suggestion, fits_bytes=fits_bytes)


def _rebuild_schedule_error(cls, resource, message, window, need_bytes, have_bytes):
    return cls(resource, message, window=window, need_bytes=need_bytes, have_bytes=have_bytes)
