"""The strategies' read-only views of their training core: an option, ``strategy.policy`` is
``strategy.core.options.policy`` (the core checked them once, at construction; ``core/options.py``),
and what the core holds (``CoreViews``: the executor, the plan, the re-plans, the last step's stats and
figures), alike for the Trainer's and Fabric's strategy."""

from __future__ import annotations

from typing import Any

__all__ = ["CoreViews", "option"]


def option(name: str) -> property:
    """A read-only attribute of a strategy: its core's option ``name``."""

    def get(self: Any) -> Any:
        return getattr(self.core.options, name)

    return property(get, doc=f"The ``{name}`` option (read-only).")


class CoreViews:
    """What the training core (``self.core``) holds, as read-only attributes of a strategy."""

    core: Any

    @property
    def executor(self) -> Any:
        return self.core.executor

    @property
    def plan(self) -> Any:
        return self.core.plan

    @property
    def replans(self) -> list[dict[str, Any]]:
        return self.core.replans

    @property
    def races(self) -> list[dict[str, Any]]:
        """Each timing of a plan against its baselines (Note: [the plan checked by measurement])."""
        return self.core.races

    @property
    def last_stats(self) -> Any:
        return self.core.last_stats

    @property
    def metrics(self) -> dict[str, float]:
        """The last step's ``lazytrain/*`` figures (the Trainer's strategy logs them through
        ``LightningModule.log``; with Fabric, ``fabric.log_dict(fabric.strategy.metrics)``)."""
        return self.core.metrics
