"""Partial keep: a layer's forward keeps only the outputs of its matmul-class ops; its backward
re-runs the elementwise ops (``Schedule.partial_keep``).

Note: [partial keep]
    The forward of layer j runs in ``F{j}`` with grad inside PyTorch's selective activation
    checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False, context_fn=...)``):
    ``policy`` answers ``MUST_SAVE`` for matmul-class aten ops (``MATMUL_OPS``: mm, addmm, bmm,
    baddbmm, grouped mm and every ``_scaled_dot_product_*attention*`` kernel, whose outputs include
    the log-sum-exp) and ``PREFER_RECOMPUTE`` for everything else. The checkpoint keeps those outputs
    (counted once per storage, by ``MatmulOutputs`` inside the checkpoint's mode, as the layer's partial bytes) and nothing else
    but its inputs; the autograd graph of the forward stays (no saved tensors in it). When ``B{j}``'s
    backprop first unpacks a saved tensor, the checkpoint re-runs the forward function: the matmul
    ops hand back their stored outputs, the elementwise ops run again. Bit-exact: the same kernels on
    the same inputs.

    What the re-run must reproduce is the executor's rules for every re-run (``block_io``): it uses
    the stored re-run call (``Executor._calls[j]``: KV caches replaced by a ``CacheReplay`` of their
    state before the block ran, so the cache's ``torch.cat`` sees the same shapes, and nothing is
    appended to the real cache), forward hooks are silenced (``first=False``: MoE router logits are
    recorded once), and ``ForwardState.replay`` gives it the forward's RNG and autocast state and
    restores the buffers the forward changed (the checkpoint's own RNG preservation is off, so there
    is one mechanism). The re-run happens inside ``B{j}``'s backprop, with layer j's weights bound
    in its slot again (the executor binds before it backpropagates). The roots are gradient edges,
    as for a kept layer (``Note: [kept roots hold no data]``).

    The simulator counts the partial bytes from ``F{j}`` to ``B{j}``; the partial recompute is not a
    re-run of the layer (``StepStats.recomputed_forwards`` does not count it; its FLOPs are not
    matmul FLOPs).

    ``MatmulOutputs`` is the profile's measurement (a dispatch mode around the local recompute of a
    profiled step): the bytes a partial keep would store, the saved tensors its recompute would
    re-materialise (those that are not stored outputs) and the seconds of the elementwise ops.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_lazytrain.engine.block_fn import CountingHooks

__all__ = ["MATMUL_OPS", "MatmulOutputs", "PartialForward", "is_matmul"]

_aten = torch.ops.aten
MATMUL_OPS = frozenset(op for op in (
    getattr(_aten, name, None) for name in (
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward", "_efficient_attention_forward")) if op is not None)


def is_matmul(func: Any) -> bool:
    return getattr(func, "overloadpacket", func) in MATMUL_OPS


def _storages(out: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


class PartialForward:
    """One layer's partial-keep forward: run it under selective checkpointing, re-run it in B{j}."""

    def __init__(self, j: int, device: torch.device, count: Callable[[int], None], skip: Iterable[int] = ()) -> None:
        self.j = j
        self.device = device
        self.count = count
        self.seen: set[int] = set(skip)
        self.nbytes = 0
        self.recomputing = False
        self.recomputes = 0

    @staticmethod
    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if is_matmul(func) else CheckpointPolicy.PREFER_RECOMPUTE

    def stored(self, storage: torch.UntypedStorage) -> None:
        """A matmul-class op's output in the forward (``MatmulOutputs``, inside the checkpoint's mode): the policy
        keeps it; counted once per storage. (Not from the policy's context: torch before 2.12 calls the policy
        before the op runs, without its output.)"""
        ptr = storage.data_ptr()
        if ptr not in self.seen:
            self.seen.add(ptr)
            self.nbytes += storage.nbytes()
            self.count(storage.nbytes())

    def run(self, forward: Callable[..., list[torch.Tensor]], rerun: Callable[..., list[torch.Tensor]],
            x: torch.Tensor, routed: list[torch.Tensor]) -> list[torch.Tensor]:
        """``forward(x, routed)``: the block's forward (hooks fire); ``rerun(x, routed)``: its re-run
        (the stored re-run call, hooks silenced, the forward's state replayed). Returns the node's
        outputs as ``forward`` does."""
        watch = MatmulOutputs(self.device, timed=False, on_output=self.stored)

        def fn(xx: torch.Tensor, *rr: torch.Tensor) -> tuple:
            if self.recomputing:
                self.recomputes += 1
                return tuple(rerun(xx, list(rr)))
            with watch:
                return tuple(forward(xx, list(rr)))

        context = functools.partial(create_selective_checkpoint_contexts, self.policy)
        with torch.enable_grad():
            outs = list(checkpoint(fn, x, *routed, use_reentrant=False, context_fn=context,
                                   preserve_rng_state=False))
        # A kept output changed in place after its op (Falcon: ``attention_scores /= sqrt(d)`` on the
        # QK^T product, through an ``_unsafe_view`` that does not share its version counter) would be
        # handed to the re-run changed, and the re-run would change it again: found by storage.
        if watch.mutated:
            from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern

            raise UnsupportedBlockPattern(
                f"block {self.j} changes the output of a matmul-class op ({watch.mutated}) in place: a partial "
                "keep (Schedule.partial_keep) cannot re-run it exactly. Plan without it (plan.partial_keep=false / "
                "MilpOptions(partial_keep=False)); a plan from this block's profile never partially keeps it.")
        return outs


class MatmulOutputs(TorchDispatchMode):
    """Around a profiled local recompute (with grad): the storages matmul-class ops produce (what a
    partial keep stores: ``nbytes``), which of them are alive (a later op's new storage at the same
    address means the old one is gone), and the seconds the other ops take (``elementwise_seconds``;
    on CUDA each op is synchronised, so the figure includes launch overheads: an upper bound)."""

    def __init__(self, device: torch.device, *, timed: bool = True,
                 on_output: Callable[[torch.UntypedStorage], None] | None = None) -> None:
        super().__init__()
        self.device = device
        self.timed = timed
        self.on_output = on_output  # called with each new matmul output storage
        self.alive: dict[int, int] = {}
        self.nbytes = 0
        self.elementwise_seconds = 0.0
        self.mutated = ""  # the op that wrote into a live matmul output (a partial keep of it is refused)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        matmul = is_matmul(func)
        sync = torch.cuda.synchronize if self.timed and self.device.type == "cuda" and not matmul else None
        if sync is not None:
            sync()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if sync is not None:
            sync()
        if not matmul:
            self.elementwise_seconds += time.perf_counter() - start
        inputs = {s.data_ptr() for s in _storages((args, kwargs))}
        if not matmul and self.alive and func._schema.is_mutable:
            written = [a for a, arg in zip(args, func._schema.arguments) if arg.alias_info is not None
                       and arg.alias_info.is_write]
            written += [v for k, v in kwargs.items() for arg in func._schema.arguments
                        if arg.name == k and arg.alias_info is not None and arg.alias_info.is_write]
            if any(s.data_ptr() in self.alive for s in _storages(written)):
                self.mutated = self.mutated or str(func)
        for storage in _storages(out):
            ptr = storage.data_ptr()
            if ptr in inputs or storage.device != self.device or not storage.nbytes():
                continue  # in place or a view of an input: not a new storage
            if matmul:
                self.alive[ptr] = storage.nbytes()
                self.nbytes += storage.nbytes()
                if self.on_output is not None:
                    self.on_output(storage)
            else:
                self.alive.pop(ptr, None)
        return out


class OverlapHooks(CountingHooks):
    """``CountingHooks`` that also sum the saved bytes that are matmul outputs (``mode.alive``)."""

    def __init__(self, mode: MatmulOutputs, slot_buffer: Callable[[], torch.Tensor] | None,
                 skip: Iterable[int] = ()) -> None:
        super().__init__(slot_buffer, skip)
        self.mode = mode
        self.overlap = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.seen and ptr in self.mode.alive:
            self.overlap += t.untyped_storage().nbytes()
        return super().pack(t)
