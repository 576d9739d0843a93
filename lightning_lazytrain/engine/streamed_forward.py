"""The forward the executor puts on each block (``Executor._install``), as an object that copies as a plain block.

Note: [a copy of a streamed block] A block's ``forward`` attribute routes its calls through the executor
(``_block_call``: staging, the schedule, the re-runs). ``copy.deepcopy`` of the model -- a snapshot, an EMA or
teacher copy, ``AveragedModel`` -- copies a plain closure by reference, so the copy's blocks computed with the live
model's streamed weights (and failed once the executor closed: review 11). A copy, or a pickle, of this object
is the block's own forward bound to the new block instead: the copy is an independent plain model, as under
``auto``.
"""

from __future__ import annotations

import copy
import types
import weakref
from typing import Any, Callable

from torch import nn


def _plain_forward(block: nn.Module, own: Any) -> Callable:
    """``block``'s forward without the executor: its own instance-level one (``own``), else its class's."""
    return own if own is not None else types.MethodType(type(block).forward, block)


class StreamedForward:
    """``block.forward`` while the executor streams the block: calls ``call(j, x, args, kwargs)`` with the
    hidden state ``x`` (the first parameter, positional or by keyword ``first``)."""

    def __init__(self, call: Callable, j: int, first: str | None, block: nn.Module, own: Any) -> None:
        self._call, self._j, self._first = call, j, first
        self._block = weakref.ref(block)
        self._own = own  # the block's instance-level forward before the executor's, if it had one

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            return self._call(self._j, args[0], args[1:], kwargs)
        if self._first is None or self._first not in kwargs:
            raise TypeError(f"block {self._j} was called without its hidden state (first parameter {self._first!r})")
        x = kwargs.pop(self._first)
        return self._call(self._j, x, (), kwargs)

    def __deepcopy__(self, memo: dict) -> Callable:
        block = self._block()
        new = memo.get(id(block)) if block is not None else None
        if new is None:  # the forward copied on its own, not with its block: it stays the block's
            return self
        return _plain_forward(new, copy.deepcopy(self._own, memo) if self._own is not None else None)

    def __reduce__(self):
        block = self._block()
        if block is None:
            raise TypeError("the streamed forward of a block that no longer exists cannot be pickled")
        return _plain_forward, (block, self._own)
