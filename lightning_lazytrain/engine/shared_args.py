"""Tensors the blocks pass each other outside the hidden state, through a container every block is given.

Note: [containers the blocks share]
    A block call's argument may be a mutable container the pytree flattening keeps whole (a mutable mapping
    or sequence it does not open): Gemma 3n's and Gemma 4's ``shared_kv_states``, a ``UserDict`` into which
    a layer writes its keys and values for later layers to read. Tensors then flow from block to block
    outside the hidden state: the block node neither routes their gradients (a streamed block runs its
    forward without recording it) nor can a re-run write them again, so a later block that reads them gets
    constants and the earlier block's weights lose that part of their gradient -- wrong gradients, no error.
    ``SharedWrites`` (one per micro-batch, the executor's) notes each such container's contents before a
    block's forward and the tensors the block wrote into it after; while any are written, the later blocks'
    forwards run under ``_SharedReads``, a dispatch mode that refuses (``UnsupportedBlockPattern``, naming
    the argument and both blocks) an op reading one of them. A container written and never read (Gemma 4
    stores its full-length keys and values whether or not a later layer shares them) trains as before; once a
    micro-batch ran its blocks with something written and nothing read, the executor stops watching (the
    same code runs every step: the mode's cost per op is paid in one micro-batch, not every step), and a
    model that passes no such container pays nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import MutableMapping, MutableSequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_lazytrain.engine.block_io import BlockCall, UnsupportedBlockPattern

__all__ = ["SharedWrites"]


def _contents(container: Any) -> dict:
    items = container.items() if isinstance(container, MutableMapping) else enumerate(container)
    return {k: v for k, v in items}


class _Watch:
    """One block call's shared containers and their contents before it ran."""

    def __init__(self, call: BlockCall, kwargs: dict) -> None:
        self.kwargs = kwargs
        self.before = [(leaf, {k: id(v) for k, v in _contents(leaf).items()}) for leaf in call.leaves
                       if isinstance(leaf, (MutableMapping, MutableSequence))]


class SharedWrites:
    """The tensors blocks wrote into shared containers in this micro-batch (Note: [containers the blocks share])."""

    def __init__(self, active: bool = True) -> None:
        self.active = active  # off once a micro-batch showed the blocks' sharing is never read (the same code runs)
        self.written: dict[int, tuple[int, str]] = {}  # storage data_ptr -> (block that wrote it, argument)

    def watch(self, call: BlockCall, kwargs: dict) -> _Watch | None:
        return _Watch(call, kwargs) if self.active else None

    def after(self, j: int, watch: _Watch | None) -> None:
        """Note the tensors block ``j`` wrote into the watched containers."""
        if watch is None:
            return
        for leaf, before in watch.before:
            for key, value in _contents(leaf).items():
                if before.get(key) == id(value):
                    continue
                name = next((k for k, v in watch.kwargs.items() if v is leaf), None) or type(leaf).__name__
                for t in pytree.tree_leaves(value):
                    if isinstance(t, torch.Tensor) and t.device.type != "meta":
                        self.written[t.untyped_storage().data_ptr()] = (j, name)

    def reads(self, j: int, stack: str) -> contextlib.AbstractContextManager:
        """Around block ``j``'s forward: refuse reading what an earlier block wrote (nothing while none is)."""
        return _SharedReads(self.written, j, stack) if self.written else contextlib.nullcontext()


class _SharedReads(TorchDispatchMode):
    def __init__(self, written: dict[int, tuple[int, str]], j: int, stack: str) -> None:
        super().__init__()
        self.written, self.j, self.stack = written, j, stack

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                hit = self.written.get(t.untyped_storage().data_ptr())
                if hit is not None and hit[0] != self.j:
                    raise UnsupportedBlockPattern(
                        f"block {self.j} of {self.stack!r} reads a tensor block {hit[0]} wrote into its argument "
                        f"{hit[1]!r} (a container every block is given): tensors then flow from block to block "
                        "outside the hidden state, and a streamed block can neither route their gradients nor write "
                        "them again in a re-run. Turn the sharing off (e.g. Gemma 3n's num_kv_shared_layers=0) or "
                        "train this model with strategy='auto'")
        return func(*args, **(kwargs or {}))
