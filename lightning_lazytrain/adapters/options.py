"""The strategies' options as read-only attributes: ``strategy.policy`` is ``strategy.core.options.policy``
(the core checked them once, at construction; ``core/options.py``)."""

from __future__ import annotations

from typing import Any

__all__ = ["option"]


def option(name: str) -> property:
    """A read-only attribute of a strategy: its core's option ``name``."""

    def get(self: Any) -> Any:
        return getattr(self.core.options, name)

    return property(get, doc=f"The ``{name}`` option (read-only).")
