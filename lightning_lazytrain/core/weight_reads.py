"""Weights read by ``training_step`` before its forward, while a pipelined step is still updating them.

Note: [weights read before the forward]
    A pipelined step (Note: [pipelined step] in core/optimizer_steps.py) returns with host masters still
    being updated; the next forward waits for each block before it stages it. ``training_step`` runs
    before that forward: code there that reads the weights first -- a logged weight norm, a penalty on
    the weights computed before the model is called, an EMA kept by the module -- would read layers
    not yet updated (or being written), where under ``strategy="auto"`` every weight holds its new value.
    The hooks between step and forward are found by name (Note: [weights read after the step] in
    adapters/weight_readers.py), but every module overrides ``training_step`` and nearly all read the
    weights only through the model. So while updates are in flight, ``training_step`` runs under
    ``ReadGuard``, a ``TorchFunctionMode``: the first torch call that reads the values of a parameter the
    pending updates write (``p.detach()``, ``p.data``, ``p.norm()``, ``torch.stack(params)``, an in-place
    edit) waits for every update in flight first, and logs once that the step's overlap is lost for such
    a read. Metadata (``p.shape``, ``p.numel()``, ...) waits for nothing. Only the blocks (and non-block
    parts) whose update is still in flight are watched; as the forward waits for each before staging it,
    that one is released (``released``: the forward reads the staged copies, never the masters, so its own
    calls do not trigger the guard, but a hook in block 0 reading block 3's weights does), and with none
    left the mode leaves the stack (the rest of the forward pays nothing for it). After a wait it is a
    pass-through. (Pushed and popped by hand -- torch's ``_push_mode``/``_pop_mode``, what
    ``TorchFunctionMode.__enter__``/``__exit__`` call -- because it leaves in the middle of training_step.) Nothing is guarded when no update is in flight
    (a serial step, the first step, evaluation).

    The mode is thread-local: the updates' worker threads do not see it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode, _push_mode

log = logging.getLogger(__name__)

# methods of a parameter that read no value of it: its shape, layout, where it lives, hooks registered on it
# (a property reads none unless it is one of ``VALUE_PROPERTIES``)
METADATA = frozenset({
    "size", "dim", "numel", "nelement", "ndimension", "element_size", "stride", "is_contiguous", "data_ptr",
    "storage_offset", "get_device", "is_floating_point", "is_complex", "is_signed", "requires_grad_",
    "__len__", "is_shared", "is_pinned", "register_hook", "register_post_accumulate_grad_hook",
})
# the properties whose value is (a view of) the weights; any other property reads none (``shape``, ``grad``,
# the hooks' dicts the engine itself looks at when the micro-batch begins)
VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


def _name(func: Any) -> str:
    """The attribute a call is for: a method's name, or a property's (``__get__`` of its descriptor)."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    return name


class ReadGuard(TorchFunctionMode):
    """Waits for the updates in flight (``wait``) before the first call that reads a watched parameter
    (Note: [weights read before the forward])."""

    def __init__(self, watched: dict[Any, set[int]], wait: Callable[[], None]) -> None:
        super().__init__()
        self.by_key = {k: set(v) for k, v in watched.items()}  # block j / part -1-p / None (neither) -> ids
        self.watched = set().union(*self.by_key.values()) if self.by_key else set()
        self.wait = wait
        self.active = bool(self.watched)
        self.waited = False
        self._thread = threading.get_ident()
        self._pushed = False

    def push(self) -> None:
        _push_mode(self)
        self._pushed = True

    def pop(self) -> None:
        """Off the mode stack where it is on top (a mode the user entered inside it keeps it on as a
        pass-through until the user's ends): no cost per call from there."""
        if self._pushed and threading.get_ident() == self._thread and _get_current_function_mode() is self:
            _pop_mode()
            self._pushed = False

    def released(self, key: Any) -> None:
        """The forward waited for block ``key`` (part ``-1 - p`` of the non-block weights): its weights are
        updated, a read of them waits for nothing; with none left, the guard leaves the stack."""
        self.watched -= self.by_key.pop(key, set())
        if not self.watched:
            self.active = False
            self.pop()

    def _reads_watched(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        name = _name(func)
        if name in METADATA or (getattr(func, "__name__", "") in ("__get__", "__set__") and name not in VALUE_PROPERTIES):
            return False
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, torch.Tensor):
                if id(a) in self.watched:
                    return True
            elif isinstance(a, (list, tuple)):
                if any(isinstance(x, torch.Tensor) and id(x) in self.watched for x in a):
                    return True
        return False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.active and self._reads_watched(func, args, kwargs):
            self.active = False
            self.waited = True
            self.by_key, self.watched = {}, set()
            self.wait()
            log.info("lazytrain: training_step read the weights (%s) before its forward while the pipelined "
                     "optimizer step was updating them: it waited for the updates (Note: [weights read before the "
                     "forward]); the step's overlap with the forward is lost where that happens", _name(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def guarded(watched: dict[Any, set[int]], wait: Callable[[], None],
            on_guard: Callable[[ReadGuard | None], None]) -> Iterator[None]:
    """``training_step`` under a ``ReadGuard`` when ``watched`` (the parameter ids of each block / part whose
    update is in flight) is not empty; ``on_guard`` is told the guard (and None after), so the forward's waits
    release what they waited for."""
    if not any(watched.values()):
        yield
        return
    guard = ReadGuard(watched, wait)
    on_guard(guard)
    guard.push()
    try:
        yield
    finally:
        on_guard(None)
        guard.pop()
