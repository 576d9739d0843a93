"""The records a ``ParamStore`` keeps (param_store.py) and its gradient methods read
(grad_writeback.py): one parameter's place in its group's packed buffer, a group of parameters
(a block, or the non-block rest) with its host buffers, and a device slot a group is staged into."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import torch
from torch import nn

from lightning_lazytrain.engine.copy_engine import CopyHandle

__all__ = ["ALIGN", "REST", "ParamEntry", "ParamGroup", "Slot", "aligned_end"]

REST: Final[int] = -1  # group id of the non-block parameters (param_store.py)

# Every parameter starts at a multiple of ALIGN elements of its group's packed buffer, and every group
# ends at one (param_store.py explains why).
ALIGN: Final[int] = 64


@dataclass(eq=False)
class ParamEntry:
    """One parameter in its group's packed buffers."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    sites: list[tuple[nn.Module, str]]  # every (module, attribute) registering this param


@dataclass(eq=False)
class ParamGroup:
    """The parameters of one block (or the non-block rest), packed: the master and its host grad."""

    gid: int
    params: list[ParamEntry]
    numel: int
    dtype: torch.dtype = torch.float32  # of the master (16-bit when all its parameters are, else fp32)
    master: torch.Tensor = field(init=False)  # flat host, a slice of the masters arena
    grad: torch.Tensor = field(init=False)  # flat host, master dtype
    copy: torch.Tensor | None = None  # flat host compute-dtype copy of the master (Note: [kept compute copy])
    copy_read: CopyHandle | None = None  # the last H2D that read ``copy``
    accumulating: CopyHandle | None = None  # the last host-lane accumulation into ``grad``


@dataclass(eq=False)
class Slot:
    """A device slot a group is staged into, with its host staging (param_store's Note: [slot reuse])."""

    numel: int
    weights: torch.Tensor | None  # flat device, compute dtype (None: a lazy slot not staged)
    grads: torch.Tensor | None  # flat device, compute dtype; allocated at the first bind with grads
    cast: torch.Tensor | None  # host compute-dtype staging for the H2D (None when no master needs a cast)
    grad_host: torch.Tensor  # host compute-dtype landing buffer for the grad D2H
    gid: int | None = None  # group currently staged here
    ready: CopyHandle | None = None  # its H2D
    free: CopyHandle | None = None  # compute done with it (Note: [slot reuse])
    sending: CopyHandle | None = None  # the last gradient D2H out of it
    accumulated: CopyHandle | None = None  # the host work reading ``grad_host`` after that D2H
    # REST in parts: the H2D / host work that read the staging buffers before the parts' sequence
    # began (a later part's cast or D2H waits only for it, not for the earlier parts: disjoint ranges)
    prior_ready: CopyHandle | None = None
    prior_accumulated: CopyHandle | None = None
    lazy: bool = False  # device buffers exist only from stage() to evict()
    host_numel: int = 0  # elements of its host staging (landing buffer, cast buffer)
    bound: bool = False
    wrappers: list[tuple[ParamEntry, nn.Parameter]] = field(default_factory=list)
    touched: set = field(default_factory=set)  # ids of the ParamEntries a gradient reached since the bind
    edits: Any = None  # a long bind's EditWatch (Note: [an edit of a bound copy] in bound_edits.py)


def aligned_end(infos: Iterable[ParamEntry], start: int = 0) -> int:
    """The end of the last of ``infos`` in their group's buffer, rounded up to ``ALIGN`` (its padding
    included); ``start`` when there are none."""
    last = max((i.offset + i.numel for i in infos), default=start)
    return -(-last // ALIGN) * ALIGN


def aligned_span(infos: Iterable[ParamEntry], lo: int, hi: int) -> tuple[int, int]:
    """``(start, end)`` of ``infos`` within ``[lo, hi)`` of their group's buffer: from the first one's offset
    (offsets are aligned) to the aligned end of the last; ``(lo, lo)`` when there are none."""
    infos = list(infos)
    end = max(lo, min(hi, aligned_end(infos, lo)))
    return max(lo, min(end, min((i.offset for i in infos), default=end))), end
