"""Parameter store: fp32 master weights on the host, streamed compute copies on the device.

Layout
    Every parameter of the model is a *master* in fp32 on the host. Parameters
    are grouped per block (group ``i`` = block ``i``) plus one group ``REST``
    (embeddings, final norm, head: everything outside the block stack). Each
    group is packed into one flat host buffer and the module's own
    ``param.data`` is re-pointed to views into it, so the optimizer keeps
    updating the module's parameters and a group is one contiguous H2D. Each
    group also has a flat host gradient buffer in the masters' dtype (its own "grads" arena, page-locked on
    CUDA); the
    masters' ``.grad`` are views into it and accumulate across micro-batches.

Host memory (``host_pinned_bytes``)
    Pinned on CUDA, in ``HostArena``s (``host_arena.py``: exact sizes, no
    power-of-two rounding): the packed masters of all groups; the staging of
    every slot (the landing buffer of its gradient D2H); and, when masters and
    16-bit compute copies differ in dtype, either the slots' cast buffers for
    their H2Ds or, instead, the kept copies (Note: [kept compute copy] in param_staging.py).
    ``planner.workload.param_store_host_bytes`` predicts the figure.

Compute copies
    Blocks are staged (``stage``: param_staging.py, a mixin, with the kept copies
    and where the dtype conversions run) into one of ``num_slots`` (default 2: double
    buffering) flat device buffers in the compute dtype; REST has its own
    resident device buffer (the slots, lazy ones included: param_slots.py, a mixin).
    ``bind`` (param_binding.py, a mixin) temporarily replaces the entries of the owning
    modules' ``_parameters`` with fresh leaf ``nn.Parameter`` views of that device buffer,
    so ``block(...)`` / ``model(...)`` run unchanged.

Note: [slot reuse] Staging into a slot overwrites weights the previous
    occupant's kernels may still read: ``bind`` records a compute event on exit
    and the next ``stage`` into that slot waits for it (``after=``). Run the
    block's backward inside ``bind`` (or call ``release`` after it) for that
    event to cover the backward kernels too.

Note: [grad write-back ordering] ``send_grads`` issues the D2H after an
    event on the current (compute) stream, so it sees the finished backward;
    ``finish_grads`` accumulates into the fp32 master grad once the bytes have
    landed. The compute stream waits for the D2H (``Slot.sending``) only where
    it next writes the slot's grad buffer: ``bind`` with grads, before zeroing
    it. So compute queued meanwhile (the next micro-batch's F0 after layer 0's
    gradients leave, a forward-only bind) does not wait for the copy.

Note: [host lane] The host-side work of a copy -- casting fp32 masters into a
    slot's 16-bit staging before its H2D, adding a landed gradient into the
    fp32 host grad and taking the group's norm after its D2H -- runs on the copy
    engine's ``host`` lane (one worker thread, FIFO), not on the thread that
    launches compute: the H2D waits for its cast, the accumulation for its D2H,
    the next D2H into the landing buffer for the accumulation reading it. One
    FIFO thread keeps the accumulation order of a group's micro-batches (the
    sums are bit-identical to synchronous ones). The planner counts this work as
    its ``host`` lane. Masters change only between micro-batches (the optimizer;
    the pipelined one before the layer's stage), after the engine has
    synchronised, so a queued cast reads the values the stage saw.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lightning_lazytrain.engine.blocks import BlockStack, find_blocks
from lightning_lazytrain.engine.copy_engine import CopyEngine, CopyHandle
from lightning_lazytrain.engine.copy_factory import make_copy_engine
from lightning_lazytrain.engine.grad_writeback import REST, GradWriteBack, PendingGrads, sq_sum
from lightning_lazytrain.engine.host_arena import HostArena
from lightning_lazytrain.engine.kept_grads import HandedGrads, own_storage
from lightning_lazytrain.engine.host_ops import HostOps, default_host_ops
from lightning_lazytrain.engine.param_groups import ALIGN, ParamEntry, ParamGroup, aligned_span
from lightning_lazytrain.engine.param_binding import ParamBinding
from lightning_lazytrain.engine.param_slots import ParamSlots
from lightning_lazytrain.engine.param_staging import ParamStaging
from lightning_lazytrain.engine.user_grad_hooks import PostAccumulateHooks

# ``fn(store, layer, accumulated_handle, param_norms, sq_norm)``: see ParamStore.set_final_grads_hook
FinalGradsHook = Callable[["ParamStore", int, CopyHandle, "dict | None", "torch.Tensor | None"], None]

__all__ = ["REST", "ParamStore", "PendingGrads", "sq_sum", "upcast_parameters"]

# Every parameter starts at a multiple of ALIGN elements of its packed buffer (256 B in fp32, 128 B
# in bf16; param_groups.ALIGN), as a tensor of its own would: CPU GEMM and reduction kernels round
# differently on misaligned operands, and the streamed training must compute what plain autograd computes.


class ParamStore(ParamSlots, ParamStaging, GradWriteBack, ParamBinding):
    """Host fp32 masters + double-buffered device compute copies of a model's blocks."""

    def __init__(
        self,
        module: nn.Module,
        blocks: BlockStack | str | None = None,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype = torch.float32,
        copy_engine: CopyEngine | None = None,
        *,
        num_slots: int = 2,
        pin_memory: bool | None = None,
        lazy_slots: Iterable[int] = (),
        keep_copies: bool = False,
        host_ops: HostOps | None = None,
    ) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.module = module
        self.blocks = blocks if isinstance(blocks, BlockStack) else find_blocks(module, blocks)
        self.device = torch.device(device)
        self.compute_dtype = compute_dtype
        self.num_slots = num_slots
        self._own_engine = copy_engine is None
        self.engine = copy_engine if copy_engine is not None else make_copy_engine(self.device)
        pin = self.device.type == "cuda" if pin_memory is None else pin_memory
        # the host lane's casts, adds and norms, over the host's threads (Note: [host lane])
        self._ops = host_ops if host_ops is not None else default_host_ops()
        # see set_final_grads_hook
        self._on_final_grads: FinalGradsHook | None = None
        # the user's post-accumulate-grad hooks on the masters (Note: [gradient hooks on streamed parameters])
        self.post_hooks = PostAccumulateHooks()
        # each non-block gradient as it is accumulated (Note: [early non-block parts] in early_parts.py)
        self.arrival_watch: Callable[[nn.Parameter], None] | None = None
        self._groups = self._build_groups()
        self._index = {id(info): k for grp in self._groups.values() for k, info in enumerate(grp.params)}
        self._owner = {id(info): gid for gid, grp in self._groups.items() for info in grp.params}
        self._watch_outside_uses()  # Note: [a master used outside its block] (outside_uses.py)
        self._layouts = self._make_layouts()  # sharded groups (engine/shard_store.py); none here
        g = self._groups[REST]
        self._rest_parts: list[tuple[int, int, tuple[ParamEntry, ...]]] = [(0, g.numel, tuple(g.params))]
        groups = list(self._groups.values())
        for g in groups:
            g.dtype = self._master_dtype(g)
        esize = {dt: torch.empty((), dtype=dt).element_size() for dt in {g.dtype for g in groups} | {compute_dtype}}
        self._masters_arena = HostArena.for_sizes([self._host_numel(g) * esize[g.dtype] for g in groups], pin=pin,
                                                  name="masters")
        # the host gradients: page-locked on CUDA too, so a gradient copy can land in them directly
        # (Note: [direct landing] in grad_writeback.py); their memory lives as long as the .grad views
        # (Note: [host gradients for what trains] in host_grads.py: up to the last parameter that trains)
        self._grads_arena = HostArena.for_sizes([self._grad_capacity(g) * esize[g.dtype] for g in groups], pin=pin,
                                                name="grads")
        self._superseded_grad_bytes = 0  # arena slices a group's grown host gradient left behind
        self._grown_grads: set[int] = set()  # groups whose host gradient grew (grad_writeback._fit_host_grads)
        self._handed = HandedGrads()  # the .grad views handed out (Note: [a kept gradient] in kept_grads.py)
        for g in groups:
            self._pack(g, self._masters_arena)
        self._move_buffers()
        # Where each group's dtype conversions run (set_placement): the masters' cast before an H2D, the
        # gradients' widening before a D2H; on the host unless the plan puts them on the device.
        self._device_cast: frozenset[int] = frozenset()
        self._device_widen: frozenset[int] = frozenset()
        self._via: dict[str, torch.Tensor] = {}  # the lanes' device conversion buffers
        self.direct_landings = 0  # gradient copies that landed in the host gradient (Note: [direct landing])
        max_block = max(self._groups[i].numel for i in range(len(self.blocks)))
        sizes = [max_block] * num_slots + [self._groups[REST].numel]  # REST has its own slot, last
        lazy = set(lazy_slots)
        if not lazy <= set(range(num_slots)):
            raise ValueError(f"lazy_slots must be in 0..{num_slots - 1}, got {sorted(lazy)}")
        self._slots = [self._new_slot(n, lazy=k in lazy) for k, n in enumerate(sizes)]
        self._pin = pin
        self._staging_arena: HostArena | None = None
        self._make_staging()
        # The cast buffers of the slots' H2Ds (an arena of their own), or the kept copies instead
        # (Note: [kept compute copy] in param_staging.py); neither when no master needs a cast.
        self._cast_arena: HostArena | None = None
        self._copies: HostArena | None = None
        self._copy_cast: dict[tuple[int, int, int], CopyHandle] = {}  # (layer, lo, hi) -> its cast this micro-batch
        self.keep_copies(keep_copies)

    # ---- construction ----------------------------------------------------
    def _build_groups(self) -> dict[int, ParamGroup]:
        # Note: [modules shared by blocks]
        #     A module inside several blocks (VeRA's shared projections, one activation module reused) is
        #     not one block's: its parameters join the non-block group, resident on the device and bound
        #     for the whole step (as the embedding is), so every block that calls it reads the same copy
        #     and their gradients add up in it as under plain autograd; its buffers live on the device
        #     with every module's. With accumulation each micro-batch's gradients of such a weight must
        #     be summed on their own before they join the step's (autograd sums a leaf's uses in one
        #     backward first): ``shared_across_blocks`` makes every micro-batch write its gradients back
        #     (TrainingCore's full micro-batches). A block that is itself another block (the same layer
        #     twice in the stack, ALBERT's sharing) is refused. A parameter that modules of their own in
        #     several blocks hold (Zamba2's shared attention block, tied into each hybrid layer) is such a
        #     weight too: it moves to the non-block group. (One tied between a block and a module outside
        #     the stack is refused.)
        blocks_of: dict[int, list[int]] = {}  # id(module) -> the blocks it is in
        for i, block in enumerate(self.blocks):
            if id(block) in blocks_of:
                raise NotImplementedError(
                    f"block {i} of the stack is block {blocks_of[id(block)][0]} again (one layer used several times, "
                    "as ALBERT shares its layer): its weights cannot stream as two blocks. Train it with "
                    "strategy='auto'.")
            for m in block.modules():
                seen = blocks_of.setdefault(id(m), [])
                if i not in seen:
                    seen.append(i)
        where = {mid: b[0] for mid, b in blocks_of.items() if len(b) == 1}  # id(module) -> block index
        # the parameters of modules inside several blocks (ids)
        self.shared_ids = {id(p) for block in self.blocks for m in block.modules() if len(blocks_of[id(m)]) > 1
                           for p in m._parameters.values() if p is not None}
        owner: dict[int, int] = {}
        infos: dict[int, ParamEntry] = {}
        order: dict[int, list[ParamEntry]] = {i: [] for i in range(-1, len(self.blocks))}
        in_stack: dict[int, bool] = {}  # id(p) -> its first site is a module of the block stack
        for mname, m in self.module.named_modules():
            gid = where.get(id(m), REST)
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                first = owner.get(id(p), gid)
                if first != gid and in_stack.get(id(p)) and id(m) in blocks_of:
                    # Note: [modules shared by blocks]: a weight that modules in several blocks hold
                    info = infos[id(p)]
                    if first != REST:
                        order[first].remove(info)
                        order[REST].append(info)
                        owner[id(p)] = REST
                    self.shared_ids.add(id(p))
                    info.sites.append((m, pname))
                    continue
                in_stack.setdefault(id(p), id(m) in blocks_of)
                if owner.setdefault(id(p), gid) != gid:
                    where = {gid: f"{mname}.{pname}".lstrip("."), owner[id(p)]: infos[id(p)].name}
                    names = " and ".join(f"{n} ({'outside the block stack' if g == REST else f'block {g}'})"
                                         for g, n in where.items())
                    raise NotImplementedError(
                        f"parameter tied between {names}: a streamed block's weights live in its own buffer, "
                        f"so a parameter shared with a module outside the stack is not supported. Untie them "
                        f"(e.g. tie_word_embeddings=False) or train with strategy='auto'.")
                if id(p) in infos:
                    infos[id(p)].sites.append((m, pname))
                    continue
                info = ParamEntry(f"{mname}.{pname}".lstrip("."), p, 0, p.numel(), p.shape, [(m, pname)])
                infos[id(p)] = info
                order[gid].append(info)
        groups = {}
        for gid, params in order.items():
            if gid != REST:  # trainable first (stable): a gradient copy moves that prefix only (Note: [only
                # what trained crosses] in grad_writeback.py); the non-block group keeps module order (its parts)
                params.sort(key=lambda info: not info.param.requires_grad)
            off = 0
            for info in params:
                info.offset = off
                off = -(-(off + info.numel) // ALIGN) * ALIGN
            groups[gid] = ParamGroup(gid, params, off)
        self.shared_across_blocks = bool(self.shared_ids)
        return groups

    @staticmethod
    def _master_dtype(g: ParamGroup) -> torch.dtype:
        # Masters keep the module's dtype when all of the group's parameters share a 16-bit one
        # (precision="bf16-true": the optimizer updates bf16 parameters, as under plain Lightning);
        # otherwise fp32.
        dtypes = {info.param.dtype for info in g.params}
        return dtypes.pop() if dtypes in ({torch.bfloat16}, {torch.float16}) else torch.float32

    # ---- host layout hooks (a sharded store, engine/shard_store.py, overrides these) ---------
    def _make_layouts(self) -> dict[int, Any]:
        """Group id -> the ``ShardLayout`` of a group whose host masters are this rank's shard."""
        return {}

    def _landing_dtype(self, block_slot: bool) -> torch.dtype:
        """The dtype of a slot's gradient landing buffer (the D2H's destination): the compute dtype,
        or the masters' where the plan widens that slot's gradients on the device."""
        widened = any(j != REST for j in self._device_widen) if block_slot else REST in self._device_widen
        return torch.float32 if widened else self.compute_dtype

    def set_final_grads_hook(self, fn: FinalGradsHook | None) -> None:
        """Call ``fn(store, layer, accumulated_handle, param_norms, sq_norm)`` at a step's last
        accumulation of a group (``finish_grads`` with ``norm``): several processes average a group's
        gradients as soon as they are complete (core/grad_sync.GradSync, overlap). None: no hook."""
        self._on_final_grads = fn

    @property
    def final_grads_hook(self) -> FinalGradsHook | None:
        """The hook ``set_final_grads_hook`` set (None: none)."""
        return self._on_final_grads

    def sharded(self, layer: int) -> bool:
        """Does this process hold only its shard of group ``layer``'s host state?"""
        return layer in self._layouts

    def _host_numel(self, g: ParamGroup) -> int:
        """Elements of the group's host master, host grad and host staging (its shard, if sharded)."""
        return self._layouts[g.gid].shard_numel if g.gid in self._layouts else g.numel

    def _host_view(self, flat: torch.Tensor, info: ParamEntry) -> torch.Tensor:
        """A parameter's view in a host flat buffer of its group (master, grad, landed grads)."""
        layout = self._layouts.get(self._gid_of(info))
        return self._view(flat, info) if layout is None else layout.local_view(flat, self._index[id(info)])

    def _gid_of(self, info: ParamEntry) -> int:
        return self._owner[id(info)]

    def _fill_host(self, view: torch.Tensor, full: torch.Tensor, info: ParamEntry) -> None:
        """Copy a full-shaped tensor of the parameter into its host view (a shard keeps its rows)."""
        view.copy_(full)

    def _pack(self, g: ParamGroup, arena: HostArena) -> None:
        n = self._host_numel(g)
        g.master = arena.take(n, g.dtype)
        # zero-filled; a storage of its own, whose references are counted (Note: [a kept gradient] in kept_grads.py)
        g.grad = own_storage(self._grads_arena.take(self._grad_capacity(g), g.dtype))
        with torch.no_grad():
            for info in g.params:
                view = self._host_view(g.master, info)
                self._fill_host(view, info.param.data, info)
                info.param.data = view  # the module's parameter now lives in the packed buffer
                if info.param.requires_grad and info.param.grad is not None:
                    self._fill_host(self._host_view(g.grad, info), info.param.grad, info)
                    self._set_grad(g, info, self._host_view(g.grad, info))

    def _move_buffers(self) -> None:
        # Buffers (rotary tables, masks) are small: resident on the device; ``close`` moves them back.
        self._moved_buffers: list[tuple[nn.Module, str, torch.device]] = []
        for m in self.module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.device != self.device:
                    m._buffers[name] = b.to(self.device)
                    self._moved_buffers.append((m, name, b.device))

    @staticmethod
    def _view(flat: torch.Tensor, info: ParamEntry) -> torch.Tensor:
        return flat[info.offset : info.offset + info.numel].view(info.shape)

    # ---- introspection ---------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.blocks)

    def group_numel(self, layer: int) -> int:
        return self._group(layer).numel

    def grad_extent(self, layer: int) -> int:
        """Elements a gradient copy of group ``layer`` moves when every parameter that requires grad now gets
        one: from the first of them up to the aligned end of the last (Note: [only what trained crosses] in
        grad_writeback.py)."""
        g = self._group(layer)
        start, end = aligned_span((i for i in g.params if i.param.requires_grad), 0, g.numel)
        return end - start

    def group_parameters(self, layer: int) -> list[nn.Parameter]:
        """The module's own (master) parameters of group ``layer`` (REST: the non-block ones)."""
        return [p.param for p in self._group(layer).params]

    # ---- the non-block group in parts (Note: [non-block parts] in planner/schedule_windows.py) -----
    def set_rest_parts(self, parts: Iterable[Iterable[nn.Parameter]]) -> bool:
        """Move, accumulate and stage the non-block group in ``parts`` (in that order), e.g. the
        embedding, then the final norm and LM head. Every non-block parameter must be in exactly one
        part and each part must be a run of consecutive parameters of the packed buffer (one range:
        one D2H, one cast, one H2D). Returns False and keeps one part otherwise (or for one part)."""
        g = self._groups[REST]
        index = {id(info.param): k for k, info in enumerate(g.params)}
        runs: list[tuple[int, int]] = []
        for part in parts:
            ks = sorted({index.get(id(p), -1) for p in part})
            if not ks or ks[0] < 0 or ks[-1] - ks[0] + 1 != len(ks):
                return False
            runs.append((ks[0], ks[-1] + 1))
        if len(runs) < 2 or sorted(k for r in runs for k in range(*r)) != list(range(len(g.params))):
            self._rest_parts = [(0, g.numel, tuple(g.params))]
            return False
        bounds = [info.offset for info in g.params] + [g.numel]
        self._rest_parts = [(bounds[a], bounds[b], tuple(g.params[a:b])) for a, b in runs]
        return True

    @property
    def rest_parts(self) -> tuple[int, ...]:
        """Elements of each part of the non-block group (padding included; they sum to its numel)."""
        return tuple(hi - lo for lo, hi, _ in self._rest_parts)

    def rest_part_parameters(self, part: int) -> list[nn.Parameter]:
        return [info.param for info in self._rest_parts[part][2]]

    def _range(self, layer: int, part: int | None) -> tuple[int, int, tuple[ParamEntry, ...] | list[ParamEntry], int]:
        """(lo, hi, params, op index) of a group, or of one part of REST (op index -1 - part)."""
        g = self._group(layer)
        if part is None:
            return 0, g.numel, g.params, layer
        if layer != REST or not 0 <= part < len(self._rest_parts):
            raise ValueError(f"part {part} of group {layer}: only REST has parts (0..{len(self._rest_parts) - 1})")
        lo, hi, infos = self._rest_parts[part]
        return lo, hi, infos, -1 - part

    def site_modules(self, layer: int) -> list[nn.Module]:
        """The modules that register group ``layer``'s parameters (each once)."""
        seen: dict[int, nn.Module] = {}
        for info in self._group(layer).params:
            for m, _ in info.sites:
                seen.setdefault(id(m), m)
        return list(seen.values())

    def param_names(self, layer: int) -> list[str]:
        return [p.name for p in self._group(layer).params]

    def master_flat(self, layer: int) -> torch.Tensor:
        """The packed host master of a group (fp32, or 16-bit for a 16-bit module; views of it are the
        module's params)."""
        return self._group(layer).master

    def grad_flat(self, layer: int) -> torch.Tensor:
        return self._group(layer).grad

    @property
    def host_pinned_bytes(self) -> int:
        """Host bytes of the store's arenas (pinned on CUDA; the same layout on CPU): packed masters,
        slot staging, and the slots' cast buffers or the kept compute copies. Equals
        ``planner.workload.param_store_host_bytes`` for this store; a closed store still counts its
        masters while the module's parameters live in them."""
        return sum(a.reserved_bytes for a in self._arenas())

    def _arenas(self) -> list[HostArena]:
        return [self._masters_arena, self._staging_arena] + [a for a in (self._cast_arena, self._copies) if a is not None]

    @property
    def host_grad_bytes(self) -> int:
        """Host bytes of the flat gradient buffers (the "grads" arena, page-locked on CUDA; master dtype)."""
        return sum(g.grad.nbytes for g in self._groups.values()) + self._superseded_grad_bytes

    def host_arenas(self) -> list[dict[str, Any]]:
        """Per arena: name, reserved and used bytes, how it is pinned, and what PyTorch's pinned
        allocator would have reserved for the same bytes."""
        return [a.report() for a in self._arenas()]

    def _group(self, layer: int) -> ParamGroup:
        if layer not in self._groups:
            raise IndexError(f"layer {layer} out of range: blocks are 0..{len(self.blocks) - 1}, REST is {REST}")
        return self._groups[layer]

    def close(self) -> None:
        """Finish copies and drop the device buffers; the module keeps its host masters."""
        if any(s.bound for s in self._slots):
            raise RuntimeError("close() inside bind()")
        self._remove_outside_watch()
        try:
            self.engine.synchronize()
        finally:
            self._release_cast_buffers()
            for s in self._slots:
                s.gid, s.ready, s.free, s.sending, s.accumulated, s.wrappers = None, None, None, None, None, []
            self._slots = []
            self._staging_arena.release()  # its memory goes with the last slot view
            for m, name, device in self._moved_buffers:  # with what training did to them (BatchNorm)
                if m._buffers.get(name) is not None:
                    m._buffers[name] = m._buffers[name].to(device)
            self._moved_buffers = []
            if self._own_engine:
                self.engine.close()


def upcast_parameters(module: nn.Module) -> int:
    """Make every 16-bit floating parameter of ``module`` fp32 in place (its ``.data``, and its
    ``.grad`` if any), so a ``ParamStore`` over it keeps fp32 masters while it streams 16-bit
    compute copies (``LazyTrainStrategy(fp32_masters=True)``). Buffers keep their dtype. Returns the
    number of parameters changed."""
    changed = 0
    with torch.no_grad():
        for p in {id(p): p for p in module.parameters()}.values():
            if p.dtype in (torch.bfloat16, torch.float16):
                p.data = p.data.float()
                if p.grad is not None:
                    p.grad = p.grad.float()
                changed += 1
    return changed
