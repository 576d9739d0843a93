"""Weights read by ``training_step`` before its forward, while a pipelined step is still updating them.

Note: [weights read before the forward]
    A pipelined step (Note: [pipelined step] in core/optimizer_steps.py) returns with host masters still being
    updated; the next forward waits for each block before it stages it. ``training_step`` runs before that forward:
    code there that reads the weights first -- a logged weight norm, a penalty on the weights computed before the
    model is called, an EMA kept by the module -- would read layers not yet updated (or being written), where under
    ``strategy="auto"`` every weight holds its new value. The hooks between step and forward are found by name
    (Note: [weights read after the step] in adapters/weight_readers.py), but every module overrides
    ``training_step`` and nearly all read the weights only through the model. So while updates are in flight,
    ``training_step`` runs under ``ReadGuard``, a ``TorchFunctionMode``: the first torch call that reads the values
    of a tensor the pending updates write (``p.norm()``, ``p.detach().clone()``, ``torch.stack(params)``, an
    in-place edit, a ``.clone()`` of an optimizer state) waits for every update in flight first, and logs once that
    the step's overlap is lost for such a read. What is watched is memory, not tensor objects: the bytes of the
    parameters and of their optimizer states (``exp_avg``, the 8-bit states and their absmax, ``step``; not the
    shared quantization maps, which no update writes), so an alias taken at any time (``p.data`` kept from
    ``on_train_start``, a view, ``p.detach()``) is watched as the parameter is (not a numpy array: reads the mode
    cannot see -- TorchScript, another thread, numpy -- are declared, Note: [weights read after the step]). Metadata
    (``p.shape``, ``p.numel()``, ``p.data.numel()``, ``torch.zeros_like(p)``, ...) waits for nothing, nor does
    making an alias: a property's getter (``p.data``), a view (``p.detach()``, ``p[0]``, ``p.view(-1)``; ``VIEWS``),
    a conversion to what it is (``p.to(p.device)``, ``p.float()`` of fp32) read no value, and the values of what
    they return are watched; assigning a value property (``p.data = t``) waits. The gradients the pending updates
    read (and a clip on the worker scales in place) are watched too: a misplaced ``clip_grad_norm_``,
    ``zero_grad(set_to_none=False)``, or a read of ``p.grad`` waits for them. (The engine's own views of the arena,
    made as it stages a released block, read nothing either.) Only the blocks (and non-block parts) whose update is
    still in flight are watched; as the forward waits for each before staging it, that one is released
    (``released``: the forward reads the staged copies, never the masters, so its own calls do not trigger the
    guard, but a hook in block 0 reading block 3's weights does), and with none left the mode leaves the stack (the
    rest of the forward pays nothing for it). After a wait it is a pass-through. (Pushed and popped by hand --
    torch's ``_push_mode``/``_pop_mode``, what ``TorchFunctionMode.__enter__``/``__exit__`` call -- because it
    leaves in the middle of training_step.) Nothing is guarded when no update is in flight (a serial step, the first
    step, evaluation).

    The mode is thread-local: the updates' worker threads do not see it.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode, _push_mode

log = logging.getLogger(__name__)

# methods of a parameter that read no value of it: its shape, layout, where it lives, hooks registered on it
# (no property's getter reads one; assigning one of ``VALUE_PROPERTIES`` writes the weights)
METADATA = frozenset({
    "size", "dim", "numel", "nelement", "ndimension", "element_size", "stride", "is_contiguous", "data_ptr",
    "storage_offset", "get_device", "is_floating_point", "is_complex", "is_signed", "requires_grad_",
    "__len__", "is_shared", "is_pinned", "register_hook", "register_post_accumulate_grad_hook",
    "is_inference", "dim_order", "is_same_size", "is_set_to", "is_neg", "is_conj", "is_nested",
    # new tensors shaped like it: its shape, dtype and device only
    "zeros_like", "empty_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided",
})
# methods that return a view of a tensor (an alias of its bytes, watched as they are) and read no value; ``reshape``
# and ``flatten`` are not among them (they copy a tensor they cannot view); basic indexing is (``BASIC_INDEX``)
VIEWS = frozenset({
    "view", "view_as", "detach", "narrow", "select", "split", "split_with_sizes", "chunk", "tensor_split", "unbind",
    "t", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "expand", "expand_as", "squeeze",
    "unsqueeze", "unflatten", "as_strided", "diagonal", "unfold", "alias", "view_as_real", "view_as_complex",
})
BASIC_INDEX = (int, slice, type(None), type(Ellipsis))
# conversions that return the tensor itself where there is nothing to convert (an alias, as a view is)
SAME_DTYPE = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


def _torch_api(func: Any, name: str) -> bool:
    """``func`` is torch's own ``name`` (a tensor method or a ``torch.`` function), not another library's function
    of that name (``torch.nn.functional.unfold`` copies where ``Tensor.unfold`` views)."""
    return func is getattr(torch.Tensor, name, None) or func is getattr(torch, name, None)


def _same_device(device: torch.device | str | None, t: torch.Tensor) -> bool:
    if device is None:
        return True
    device = torch.device(device)
    return device.type == t.device.type and device.index in (None, t.device.index)


def _returns_self(name: str, args: tuple, kwargs: dict) -> bool:
    """A conversion of ``args[0]`` to what it already is (``p.to(p.device)``, ``p.float()`` of fp32,
    ``p.contiguous()`` of a contiguous ``p``): torch returns ``p`` itself, reading nothing."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    t, rest = args[0], args[1:]
    try:
        if name in SAME_DTYPE:
            return not rest and not kwargs and t.dtype == SAME_DTYPE[name]
        if name == "contiguous":
            return t.is_contiguous(*rest, **kwargs)
        if name == "cpu":
            return not rest and not kwargs and t.device.type == "cpu"
        if name == "type":
            return not rest and not kwargs  # the type's name
        if name == "type_as":
            return (len(rest) == 1 and not kwargs and isinstance(rest[0], torch.Tensor)
                    and rest[0].dtype == t.dtype and rest[0].device.type == t.device.type)
        if name == "to":
            if kwargs.get("copy", False):
                return False
            device, dtype, _, memory_format = torch._C._nn._parse_to(
                *rest, **{k: v for k, v in kwargs.items() if k != "copy"})
            return memory_format is None and (dtype is None or dtype == t.dtype) and _same_device(device, t)
    except (TypeError, RuntimeError, ValueError):
        return False
    return False


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a call's argument, nested lists and tuples included (``torch.tensor([[p[0], p[1]]])``)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 8:
        for x in obj:
            yield from _tensors(x, depth + 1)


# the properties whose value is (a view of) the weights: assigning one writes the weights (``p.data = t``); a
# getter reads no value (an alias shares the watched storage), nor does any other property (``shape``, ``grad``,
# the hooks' dicts the engine itself looks at when the micro-batch begins)
VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})


def span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``t`` addresses, ``[start, end)``: every alias and view of a watched tensor overlaps its span
    (the host masters are views into one arena, so a storage would not tell the blocks apart). None: no
    storage, or no elements."""
    try:
        if t.numel() == 0 or t.layout != torch.strided:
            return None
        start = t.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    if not start:
        return None
    last = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


class Spans:
    """Byte ranges, merged and sorted; ``overlaps`` in O(log n)."""

    def __init__(self, spans: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[list[int]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]

    def __bool__(self) -> bool:
        return bool(self.starts)

    def overlaps(self, s: tuple[int, int] | None) -> bool:
        if s is None:
            return False
        i = bisect.bisect_right(self.starts, s[1] - 1) - 1  # the last range starting before s ends
        return i >= 0 and self.ends[i] > s[0]


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

    def __init__(self, watched: dict[Any, Iterable[torch.Tensor]], wait: Callable[[], None]) -> None:
        super().__init__()
        # block j / part -1-p / None (neither) -> the bytes its pending update writes
        self.by_key = {k: [x for x in map(span, v) if x is not None] for k, v in watched.items()}
        self.by_key = {k: v for k, v in self.by_key.items() if v}
        self.watched = Spans(x for v in self.by_key.values() for x in v)
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
        if self.by_key.pop(key, None) is not None:
            self.watched = Spans(x for v in self.by_key.values() for x in v)
        if not self.watched:
            self.active = False
            self.pop()

    def _reads_watched(self, func: Any, args: tuple, kwargs: dict | None) -> bool:
        name = _name(func)
        accessor = getattr(func, "__name__", "")
        if accessor == "__get__" or (accessor == "__set__" and name not in VALUE_PROPERTIES):
            return False
        if (name in METADATA or name in VIEWS) and _torch_api(func, name):
            return False
        if name in SAME_DTYPE or name in ("contiguous", "cpu", "type", "type_as", "to"):
            if _torch_api(func, name) and _returns_self(name, args, kwargs or {}):
                return False
        if name == "__getitem__" and len(args) == 2:  # a view where the index is basic (ints, slices, ...)
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if all(isinstance(i, BASIC_INDEX) and not isinstance(i, bool) for i in index):
                return False
        return any(self.watched.overlaps(span(t)) for t in _tensors((args, tuple((kwargs or {}).values()))))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.active and self._reads_watched(func, args, kwargs):
            self.active = False
            self.waited = True
            self.by_key, self.watched = {}, Spans()
            self.wait()
            log.info("lazytrain: training_step read the weights (%s) before its forward while the pipelined "
                     "optimizer step was updating them: it waited for the updates (Note: [weights read before the "
                     "forward]); the step's overlap with the forward is lost where that happens", _name(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def guarded(watched: dict[Any, Iterable[torch.Tensor]], wait: Callable[[], None],
            on_guard: Callable[[ReadGuard | None], None]) -> Iterator[None]:
    """``training_step`` under a ``ReadGuard`` when ``watched`` (the tensors -- parameters, optimizer states --
    that the update in flight of each block / part writes) is not empty; ``on_guard`` is told the guard (and
    None after), so the forward's waits release what they waited for."""
    guard = ReadGuard(watched, wait)
    if not guard.watched:
        yield
        return
    on_guard(guard)
    guard.push()
    try:
        yield
    finally:
        on_guard(None)
        guard.pop()
