"""The forward pre-hook that begins an armed micro-batch (``Executor.arm``)."""

from __future__ import annotations

from typing import Any


class ArmedHook:
    """The forward pre-hook that begins an armed micro-batch (``Executor.arm``). A copy of the model made while
    it is armed (``copy.deepcopy(model)`` or ``AveragedModel`` in ``training_step``, a pickle) gets an inert one:
    the copy is the user's, not the executor's, and a bound method would have dragged the executor into it."""

    __slots__ = ("call",)

    def __init__(self, call: Any = None) -> None:
        self.call = call

    def __call__(self, module: Any, args: Any) -> None:
        if self.call is not None:
            self.call(module, args)

    def __reduce__(self) -> tuple:
        return (ArmedHook, ())
