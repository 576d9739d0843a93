"""A layer's kept internals that travel to host memory between its forward and its backward.

Note: [offloaded internals]
    The planner may move the saved tensors of a layer that keeps its internals (everything its
    forward saved for backward except its input boundary and its streamed weights) to host memory
    over the D2H lane of a later forward window (``Schedule.internals_offload_window``) and bring
    them back over the H2D lane of a backward window before the layer's own backward
    (``internals_reload_window``). Gradients stay bit-exact: the bytes that come back are the bytes
    that left, the backward runs the same autograd graph on them.

    ``OffloadedInternals`` are the ``saved_tensors_hooks`` of such a forward. Packing works as in
    ``block_fn.WeightTokenHooks`` (weights of the layer's slot become tokens, re-viewed at ``B{j}``),
    and every other device tensor is replaced by a token naming its *storage* and its view
    (dtype, offset, size, stride): a storage that several saved tensors view is stored and moved
    once, as the tracker counts it once. Each storage travels as one flat ``uint8`` tensor through
    the ``ActivationStore`` (CPU tier, keys ``("internals", j, k)``), so the store's pooled host
    buffers, its copy engine (per-lane bytes, emulated link) and its ``settle`` rule (the device
    copy goes at the end of the offload window, a late copy costs compute time, never memory)
    are the boundaries' own. Unpacking re-views the device copy that came back.

    The input's storage and the call's other tensors (rotary tables, masks, encoder states: the
    static ``call_bytes``) are left alone, as they are not counted as internals; so are tensors on
    other devices. A storage the rest of the program also holds (the block's output when a later
    op saved it) is copied like any other: its device memory stays with its other owners, which
    the plan counts where they live; the copy is what the plan's per-lane bytes count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_lazytrain.engine.block_fn import WeightTokenHooks

__all__ = ["OffloadedInternals"]


class OffloadedInternals(WeightTokenHooks):
    """Pack/unpack hooks of one kept forward whose saved tensors may go to host memory (the weight
    slot's tensors become tokens as in ``WeightTokenHooks``)."""

    def __init__(self, j: int, device: torch.device, slot_buffer: Callable[[], torch.Tensor],
                 count: Callable[[int], None], skip: Iterable[int] = ()) -> None:
        super().__init__(slot_buffer, count)
        self.j = j
        self.device = device
        self.skip = set(skip)
        self._index: dict[int, int] = {}  # storage data_ptr -> k
        self._device: list[torch.Tensor | None] = []  # k -> the storage as flat uint8 on the device
        self._uses: list[int] = []  # k -> tokens of k not unpacked yet
        self.nbytes = 0
        self.state = "device"  # device -> offloaded (handed to the store) -> settled -> reloaded -> freed

    def key(self, k: int) -> tuple[str, int, int]:
        return ("internals", self.j, k)

    # ---- hooks -----------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        token = self.slot_token(t)
        if token is not None:
            return token
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if t.device != self.device or ptr in self.skip or storage.nbytes() == 0:
            return t
        k = self._index.get(ptr)
        if k is None:
            k = self._index[ptr] = len(self._device)
            flat = torch.empty(0, dtype=torch.uint8, device=t.device)
            flat.set_(storage)
            self._device.append(flat)
            self._uses.append(0)
            self.nbytes += storage.nbytes()
            self.count(storage.nbytes())
        self._uses[k] += 1
        return ("stored", k, t.dtype, t.storage_offset(), tuple(t.shape), tuple(t.stride()))

    def unpack_with(self, acts: Any) -> Callable[[Any], torch.Tensor]:
        """The unpack hook; ``acts`` is the executor's ``ActivationStore`` (read at backward time)."""
        def unpack(obj: Any) -> torch.Tensor:
            if not isinstance(obj, tuple):
                return obj
            if obj[0] == "slot":
                return self.slot_view(obj)
            _, k, dtype, offset, size, stride = obj
            flat = self._device[k]
            if flat is None:
                flat = acts.get(self.key(k))
            out = torch.empty(0, dtype=dtype, device=flat.device)
            out.set_(flat.untyped_storage(), offset, size, stride)
            self._uses[k] -= 1
            if self._uses[k] == 0 and self._device[k] is None and self.key(k) in acts:
                # Its last saved tensor is unpacked: autograd frees the storage after the node that
                # uses it, as it would have freed the original (the backward's working set).
                acts.release(self.key(k))
            return out
        return unpack

    # ---- movement (called by the executor in the planned windows) ---------------------------
    def offload(self, acts: Any) -> None:
        """Hand every stored storage to ``acts`` on the CPU tier (the D2H starts now)."""
        if self.state != "device":
            raise RuntimeError(f"layer {self.j}'s internals offloaded twice ({self.state})")
        for k, flat in enumerate(self._device):
            acts.offload(self.key(k), flat, "cpu")
            self._device[k] = None  # the store holds the source until its copy is settled
        self.state = "offloaded"

    def settle(self, acts: Any) -> None:
        """The plan frees the device copies here (end of the offload window)."""
        if self.state != "offloaded":
            return
        for k in range(len(self._device)):
            acts.settle(self.key(k))
        self.state = "settled"

    def reload(self, acts: Any) -> None:
        """Start the H2D of every stored storage (backward side)."""
        if self.state not in ("offloaded", "settled"):
            raise RuntimeError(f"layer {self.j}'s internals reloaded while {self.state}")
        self.settle(acts)
        for k in range(len(self._device)):
            acts.prefetch(self.key(k))
        self.state = "reloaded"

    def free(self, acts: Any) -> None:
        """After the layer's backward: forget the host and device copies."""
        if self.state in ("offloaded", "settled", "reloaded"):
            for k in range(len(self._device)):
                if self.key(k) in acts:
                    acts.free(self.key(k))
        self._device = []
        self._index = {}
        self.state = "freed"
