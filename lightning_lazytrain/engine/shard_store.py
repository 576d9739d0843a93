"""``ShardedParamStore``: a ``ParamStore`` whose block masters are this rank's shard (the
sharded data-parallel mode; layout in ``shard_layout.py``, design in docs/ARCHITECTURE.md).

Every parameter's host master, host gradient and optimizer-facing ``param.data`` become this rank's
dim-0 shard (``param.data`` is re-pointed to it, so the Parameter objects stay the same and an
optimizer built afterwards holds 1/N of every group's state), the non-block group's (embedding,
final norm, head) as every block's. The device side is unchanged: a slot holds a group's full
compute copy, param-major, and ``bind`` views it.

``stage`` (any group): cast the shard on the host lane, one H2D of 1/N of the block, an all-gather of
the ranks' shards on the devices into a rank-major buffer, and a copy-out into the slot.
``send_grads`` (any group): the slot's gradients copied into rank-major order, a reduce-scatter (sum),
divided by the world size (DDP's average), one D2H of this rank's shard; ``finish_grads`` then
accumulates it into the shard's host ``.grad`` on the host lane as for any group. Which parameters a
gradient reached is the union over the ranks (one small all-reduce of flags), as under DDP. These
collectives run off the launching thread, and the D2H waits for them (Note: [overlapped
reduce-scatter] in shard_grads.py); in line with ``overlap=False``.

Note: [overlapped all-gather]
    The collectives are issued on the calling thread in program order (every rank stages and sends
    the same groups in the same order, so they match across ranks). A block's all-gather is issued
    asynchronously once its shard's H2D is in (CPU: the copy thread done; CUDA: the store's collective
    stream waits for the copy's event and the all-gather is issued on it, so neither the host nor the
    compute stream waits for the H2D; not yet run on a GPU) and finished at ``bind``
    (``_Gathered.sync_current_stream``: wait for the collective -- gloo: the host waits; NCCL: the
    compute stream does -- then copy the rank-major buffer out into the slot), so the executor's
    prefetch (stage layer j+1, compute layer j) overlaps the all-gather with compute, as the plan's
    collective lane has it. With ``overlap=False`` (the strategy sets it for a profiled step, whose
    collective times price the plan's collective lane) the all-gather runs to completion in
    ``stage``. Either way the same collective fills the slot: bit-identical. During the backward the
    all-gathers are the only collectives the launching thread issues on gloo: the gradients' run on a
    group of their own (shard_grads.py).

Clip norms from ``grad_norms`` are per shard; the strategy sums their squares over the shard group
(``GradSync.combine_shard_norms``, ``LazyTrainStrategy.clip_sharded``). With a ``replica_group`` (Note:
[hybrid sharding] in core/grad_sync.py) each reduce-scattered shard is also summed over the ranks holding
the same shard in the other shard groups before the division.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from lightning_lazytrain.engine.copy_engine import CopyHandle
from lightning_lazytrain.engine.param_binding import merge_edit
from lightning_lazytrain.engine.param_groups import ParamEntry
from lightning_lazytrain.engine.param_store import REST, ParamStore, PendingGrads
from lightning_lazytrain.engine.shard_grads import ShardGradLane
from lightning_lazytrain.engine.shard_layout import ShardLayout

__all__ = ["ShardedParamStore"]


class _Gathered(CopyHandle):
    """A staged shard's all-gather in flight (Note: [overlapped all-gather]): finishing it waits for
    the collective and copies the gathered buffer out into the slot's weights, once."""

    lane = "h2d"  # what it completes: the weights' arrival in the slot

    def __init__(self, h2d: CopyHandle, work: Any, gathered: torch.Tensor, shard: torch.Tensor, layout: ShardLayout,
                 weights: torch.Tensor, store: ShardedParamStore) -> None:
        self.h2d, self.nbytes = h2d, h2d.nbytes
        self._work, self._gathered, self._shard, self._layout, self._weights = work, gathered, shard, layout, weights
        self._store = store
        self._lock = threading.Lock()
        self._finished = False
        self._event: Any = None

    def _finish(self) -> None:
        with self._lock:
            if self._finished:
                return
            t0 = time.perf_counter()
            self._work.wait()  # gloo: until it is done; NCCL: the current stream waits for it
            self._store.collective_seconds += time.perf_counter() - t0
            with torch.no_grad():
                self._layout.gather_into(self._gathered, self._weights)
            if self._weights.device.type == "cuda":
                # the gathered buffer came from the collective stream's pool: the copy-out just queued
                # on this stream must finish before that pool hands it out again
                self._gathered.record_stream(torch.cuda.current_stream(self._weights.device))
                # and the shard it read: NCCL no longer records its inputs on its own stream (torch >= 2.8), and
                # neither the H2D stream that owns the shard nor the collective stream waits for the all-gather;
                # this stream has (work.wait above), so the next shard cannot take the block while NCCL reads it
                self._shard.record_stream(torch.cuda.current_stream(self._weights.device))
                self._event = torch.cuda.Event()
                self._event.record()
            self._work = self._gathered = self._shard = self._weights = None
            self._finished = True

    def sync_current_stream(self) -> None:
        self._finish()

    def wait(self) -> None:
        self._finish()
        if self._event is not None:
            self._event.synchronize()

    def done(self) -> bool:
        return self._finished and (self._event is None or self._event.query())


class ShardedParamStore(ParamStore):
    """``ParamStore`` with every block's host state sharded over ``group`` (default: the world)."""

    def __init__(self, *args: Any, group: Any = None, replica_group: Any = None, grad_group: Any = None,
                 **kwargs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedParamStore needs an initialised torch.distributed process group")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # Note: [hybrid sharding] (core/grad_sync.py): the ranks holding the same shard in other groups
        self.replica_group = replica_group
        self.replicas = dist.get_world_size(replica_group) if replica_group is not None else 1
        self.collective_bytes = {"gather": 0, "reduce": 0, "replica": 0}  # what this rank sent, per kind
        self.collective_seconds = 0.0  # blocked in those collectives (Note: [overlapped all-gather])
        self.overlap = True  # Note: [overlapped all-gather]
        self._stream: Any = None  # CUDA: the all-gathers' stream (_collective_stream)
        self._since = (0, 0.0)  # take_collective's last reading
        super().__init__(*args, **kwargs)
        # Note: [overlapped reduce-scatter] (shard_grads.py); ``grad_group``: gloo, over the ranks of ``group``
        self._grad_lane = ShardGradLane(self.device, group, grad_group, replica_group, self.world * self.replicas)

    def _device_sync(self) -> None:
        """CUDA, collectives in line (``overlap`` off: a profiled step, whose collective times price the
        plan): wait for the device, so a host timer measures the collectives, not their launch (NCCL
        does not block the host). The profiled step synchronises at every window mark anyway."""
        if not self.overlap and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _collective_stream(self) -> Any:
        """CUDA: a context on this store's collective stream (the NCCL all-gather is ordered after what
        is queued on the current stream when it is issued: on the compute stream it would wait for the
        compute queued so far, and that compute for the shard's H2D). CPU: no-op."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(self._stream)

    def shard_numel(self, layer: int) -> int:
        """Elements of this rank's shard of group ``layer`` (what one of its fetches moves)."""
        return self._layouts[layer].shard_numel

    def take_collective(self) -> tuple[int, float]:
        """Bytes this rank sent in its all-gathers and reduce-scatters, and the seconds they took,
        since the last call (the ``collective`` lane of a step)."""
        total = sum(self.collective_bytes.values())
        b0, s0 = self._since
        self._since = (total, self.collective_seconds)
        return total - b0, self.collective_seconds - s0

    # ---- the host layout ------------------------------------------------------------------------
    def _make_layouts(self) -> dict[int, ShardLayout]:
        # every group, the non-block one (embedding, final norm, head) included: its host state is
        # the largest of all at large vocabularies
        return {gid: ShardLayout([i.shape for i in g.params], [i.offset for i in g.params], self.world)
                for gid, g in self._groups.items() if g.params}

    def _landing_dtype(self, block_slot: bool) -> torch.dtype:
        # Gradients are averaged in the masters' dtype (fp32 unless the module is 16-bit), as the
        # replicate mode and DDP average them: the 16-bit device gradients are widened (exactly)
        # before the reduce-scatter, and the shard lands in that dtype.
        groups = [j for j in self._layouts if (j != REST) == block_slot]
        if not groups:
            return self.compute_dtype
        dtypes = {self._groups[j].dtype for j in groups}
        return dtypes.pop() if len(dtypes) == 1 else torch.float32

    def _fill_host(self, view: torch.Tensor, full: torch.Tensor, info: ParamEntry) -> None:
        layout = self._layouts.get(self._gid_of(info))
        if layout is None:
            view.copy_(full)
            return
        layout.fill_shard(view, full, self._index[id(info)], self.rank)

    # ---- weights ----------------------------------------------------------------------------
    def stage(self, layer: int, slot: int | None = None, *, part: int | None = None) -> CopyHandle:
        if layer not in self._layouts:
            return super().stage(layer, slot, part=part)
        if part is not None:
            raise ValueError("a sharded group is staged whole (no non-block parts)")
        g, s = self._group(layer), self._slot(layer, slot)
        if s.bound:
            raise RuntimeError(f"slot {slot} is bound (layer {s.gid}); leave bind() before restaging it")
        if isinstance(s.ready, _Gathered):  # staged, never bound: its collective's buffers live until done
            s.ready.sync_current_stream()
        layout = self._layouts[layer]
        self._repair_master(g)
        if s.weights is None:
            self._allocate(s)
        n = layout.shard_numel
        src = g.master[:n]
        after = [s.free] if s.free is not None else []
        if g.copy is not None:  # the shard's kept copy (param_staging's Note: [kept compute copy])
            src, cast = self._from_copy(g, layer, 0, n, layer)
            after.append(cast)
        elif s.cast is not None and g.master.dtype != s.cast.dtype:
            # the cast buffer may still feed this slot's previous shard H2D
            src, master = s.cast[:n], g.master[:n]
            after.append(self.engine.host(lambda: self._ops.cast_into(src, master),
                                          after=[s.prior_ready] if s.prior_ready else [],
                                          tag=f"cast:{layer}", nbytes=master.nbytes + src.nbytes))
        # a fresh buffer the H2D stream owns (CUDA: memory compute freed may still be read by kernels
        # queued before; copy_cuda's Note: [allocator ownership])
        shard = self.engine.new_device_buffer((n,), self.compute_dtype, self.device)
        h = self.engine.h2d(shard, src, after=after, tag=f"param:{layer}")
        s.prior_ready = h
        if g.copy is not None:
            g.copy_read = h
        self.collective_bytes["gather"] += (self.world - 1) * shard.nbytes
        with self._collective_stream():  # CUDA: a stream of its own, so compute never waits for this H2D
            h.sync_current_stream()  # the all-gather reads the landed shard (CPU: the copy thread is done)
            t0 = time.perf_counter()
            gathered = torch.empty(layout.gathered_numel, dtype=self.compute_dtype, device=self.device)
            work = dist.all_gather_into_tensor(gathered, shard, group=self.group, async_op=True)
        self.collective_seconds += time.perf_counter() - t0
        ready = _Gathered(h, work, gathered, shard, layout, s.weights, self)
        if not self.overlap:  # in line (a profiled step): its time is the collective's own
            t0 = time.perf_counter()
            ready.sync_current_stream()
            self._device_sync()
            self.collective_seconds += time.perf_counter() - t0
        s.ready, s.gid = ready, layer
        return ready

    # ---- gradients ------------------------------------------------------------------------------
    def send_grads(self, layer: int, slot: int | None = None, *, part: int | None = None,
                   direct: bool = True) -> PendingGrads:
        if layer not in self._layouts:
            return super().send_grads(layer, slot, part=part, direct=direct)
        if part is not None:
            raise ValueError("a sharded group's gradients move whole (no non-block parts)")
        g, s = self._group(layer), self._slot(layer, slot)
        if s.gid != layer:
            raise RuntimeError(f"layer {layer} is not the one staged in slot {slot} (found {s.gid})")
        layout = self._layouts[layer]
        grads = self._collect_grads(s)
        with torch.no_grad():
            # in the landing dtype (the masters'): 16-bit gradients are widened, exactly, first
            dt = s.grad_host.dtype
            rank_major = torch.empty(layout.gathered_numel, dtype=dt, device=grads.device)
            layout.scatter_into(grads[: g.numel], rank_major)
            mine = torch.empty(layout.shard_numel, dtype=dt, device=grads.device)
        flags = torch.tensor([id(info) in s.touched for info in g.params], dtype=torch.int32)
        s.touched = set()  # Note: [gradients sent once] in grad_writeback.py
        self.collective_bytes["reduce"] += (self.world - 1) * mine.nbytes
        # a ring all-reduce sends 2 (R-1)/R of the buffer (Note: [collective bytes] in core/grad_sync.py)
        self.collective_bytes["replica"] += 2 * (self.replicas - 1) / self.replicas * mine.nbytes
        after = [s.accumulated] if s.accumulated else []
        if self.overlap:  # Note: [overlapped reduce-scatter]: the launching thread goes on at once
            reduced, read_flags = self._grad_lane.submit(rank_major, mine, flags)
            after.append(reduced)
        else:  # in line (a profiled step): its time is the collectives' own
            self._reduce_in_line(rank_major, mine, flags)
            read_flags = flags.tolist
        h = self.engine.d2h(s.grad_host[: layout.shard_numel], mine, after=after, tag=f"grad:{layer}")
        s.sending = h
        params = g.params
        return PendingGrads(layer, s, h, resolve=lambda: frozenset(id(i) for i, f in zip(params, read_flags()) if f))

    def _reduce_in_line(self, rank_major: torch.Tensor, mine: torch.Tensor, flags: torch.Tensor) -> None:
        """The gradient collectives of ``send_grads`` on the launching thread (they price the plan's
        collective lane in a profiled step); the arithmetic of Note: [overlapped reduce-scatter]."""
        with torch.no_grad():
            flags_dev = flags.to(self.device)
            # timed: the reduce-scatter and the replica sum (the flags' bytes are not counted: nor their time)
            self._grad_lane.reduce(rank_major, mine, flags_dev, self.group, timed=self._timed_collective())
            flags.copy_(flags_dev)

    @contextlib.contextmanager
    def _timed_collective(self) -> Any:
        """Adds the seconds of the collectives inside to ``collective_seconds`` (CUDA, in line: from a
        synchronised device to a synchronised device, so the time is theirs, not their launch's)."""
        self._device_sync()  # what is queued before is not the collective's time
        t0 = time.perf_counter()
        yield
        self._device_sync()
        self.collective_seconds += time.perf_counter() - t0

    # ---- end ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish copies and give every block parameter its full value (and gradient) back: an
        all-gather per block, collective (every rank closes), so the module is whole again, as the
        one-process store leaves it, and a store built next (``Executor.set_schedule``) shards it afresh."""
        try:
            if self._slots:
                for s in self._slots:  # all-gathers still in flight (staged, not bound)
                    if isinstance(s.ready, _Gathered):
                        s.ready.wait()
                self.engine.synchronize()  # every gradient D2H, so every reduce-scatter, is done
                with torch.no_grad():
                    for gid, layout in self._layouts.items():
                        g = self._group(gid)
                        had_grad = [info.param.grad is not None for info in g.params]
                        full = self._gather_full(g.master, layout, g.numel)
                        grads = self._gather_full(g.grad, layout, g.numel) if any(had_grad) else None
                        for info, has in zip(g.params, had_grad):
                            info.param.data = self._view(full, info)
                            info.param.grad = self._view(grads, info) if has and grads is not None else None
        finally:
            self._grad_lane.close()  # (idle: every job's D2H is done, or failed)
        super().close()

    def _gather_full(self, shard_flat: torch.Tensor, layout: ShardLayout, numel: int) -> torch.Tensor:
        """The param-major host buffer of a group from every rank's shard buffer (collective)."""
        shard = shard_flat[: layout.shard_numel].to(self.device)
        gathered = torch.empty(layout.gathered_numel, dtype=shard.dtype, device=self.device)
        dist.all_gather_into_tensor(gathered, shard, group=self.group)
        full = torch.zeros(numel, dtype=shard.dtype, device=self.device)
        layout.gather_into(gathered, full)
        return full.cpu() if full.device.type != "cpu" else full

    # ---- checkpoints: whole tensors out, this rank's rows in ------------------------------------
    def _sharded_infos(self) -> dict[int, ParamEntry]:
        """id(parameter) -> its record, for every parameter of a sharded group."""
        return {id(info.param): info for gid in self._layouts for info in self._group(gid).params}

    def _whole(self, shard: torch.Tensor, info: ParamEntry) -> torch.Tensor:
        """A full-shaped tensor from every rank's shard-shaped ``shard`` of parameter ``info``
        (collective: every rank calls it for the same parameters in the same order)."""
        layout = ShardLayout([info.shape], [0], self.world)
        flat = torch.zeros(layout.shard_numel, dtype=shard.dtype)
        flat[: shard.numel()] = shard.detach().reshape(-1).cpu()
        return self._gather_full(flat, layout, info.numel).view(info.shape).clone()

    def _master_value(self, info: ParamEntry) -> torch.Tensor:
        # Note: [a step inside a micro-batch]: this rank holds rows of the master; every rank refreshes
        return self._whole(info.param.detach(), info)

    def _take_edit(self, info: ParamEntry, value: torch.Tensor) -> None:
        # Note: [an edit of a bound copy]: this rank's rows of the edited copy (each rank edited its own copy alike)
        merge_edit(info.param.data, self._rows(value, info))

    def _shard_shape(self, info: ParamEntry) -> tuple[int, ...]:
        """The shape of this rank's shard of a parameter: ``(k, *rest)``, ``k`` rows with padding."""
        spec = self._layouts[self._gid_of(info)].specs[self._index[id(info)]]
        return (spec.rows_per_rank, *spec.shape[1:]) if len(spec.shape) else (spec.rows_per_rank,)

    def _rows(self, full: torch.Tensor, info: ParamEntry) -> torch.Tensor:
        """This rank's shard (``(k, *rest)``, padding rows zero) of a full-shaped tensor."""
        out = torch.zeros(self._shard_shape(info), dtype=full.dtype)
        self._fill_host(out, full.to(out.device), info)
        return out

    def _module_entries(self, state: dict[str, Any], module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, ParamEntry]]:
        """The state dict entries of sharded parameters: (key, parameter, its record)."""
        infos = self._sharded_infos()  # every name of a tied parameter (the state dict has each)
        return [(name, p, infos[id(p)]) for name, p in module.named_parameters(remove_duplicate=False)
                if id(p) in infos and name in state]

    def whole_module_state(self, state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
        """``module``'s state dict with every sharded parameter's entry whole (collective)."""
        return {**state, **{name: self._whole(p.data, info) for name, p, info in self._module_entries(state, module)}}

    def shard_module_state(self, state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
        """A whole state dict with every sharded parameter's entry cut to this rank's rows."""
        return {**state, **{name: self._rows(state[name], info) for name, _, info in self._module_entries(state, module)
                            if tuple(state[name].shape) == tuple(info.shape)}}

    def _optimizer_entries(self, optimizer: Any, state: dict[str, Any]) -> dict[Any, tuple[torch.nn.Parameter, ParamEntry]]:
        """The optimizer state dict's ids of sharded parameters -> (parameter, its record), in id order
        (the same on every rank: the gathers of ``whole_optimizer_state`` are collective)."""
        infos = self._sharded_infos()
        params: dict[Any, torch.nn.Parameter] = {}
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):
            params.update(zip(saved["params"], group["params"]))
        return {pid: (params[pid], infos[id(params[pid])]) for pid in sorted(state["state"])
                if pid in params and id(params[pid]) in infos}

    def checkpoint_layout(self, checkpoint: dict[str, Any], module: torch.nn.Module,
                          optimizers: list[Any]) -> dict[str, tuple]:
        """The entries of a Lightning checkpoint dict (``state_dict`` and ``optimizer_states`` as this
        store leaves them: shard-shaped) that hold this rank's rows of a whole tensor, or a state that
        is this rank's own, keyed as ``sharded_tensors.split_tensors`` keys them: its ``layout``."""
        layout: dict[str, tuple] = {f"state_dict/{name}": ("rows", tuple(info.shape), self.world, self.rank)
                                    for name, _, info in self._module_entries(checkpoint["state_dict"], module)}
        for i, (optimizer, state) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []))):
            optimizer = getattr(optimizer, "optimizer", optimizer)
            for pid, (p, info) in self._optimizer_entries(optimizer, state).items():
                states = state["state"][pid]
                for key, value in states.items():
                    kind = self._state_kind(states, value, p)
                    if kind is not None:
                        layout[f"optimizer_states/{i}/state/{pid}/{key}"] = (
                            ("rows", tuple(info.shape), self.world, self.rank) if kind == "rows"
                            else ("rank", self.world, self.rank))
        return layout

    @staticmethod
    def _state_kind(states: dict[str, Any], value: Any, p: torch.nn.Parameter) -> str | None:
        """What a (shard-shaped) optimizer state of parameter ``p`` is: ``"rows"`` (one per element of
        the shard: rows of a whole tensor), ``"rank"`` (no whole form: 8-bit states -- uint8 codes and
        blockwise scales over the shard, padding rows included -- make every tensor of the parameter
        this rank's own), or None (not a tensor, or a 0-dim one such as the step count: replicated)."""
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return None
        return "rows" if not _quantized(states) and tuple(value.shape) == tuple(p.shape) else "rank"

    def whole_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """``optimizer.state_dict()`` with every sharded parameter's per-element state whole
        (collective). 8-bit states (blockwise over the shard) have no whole form: refused."""
        new_state = dict(state["state"])
        for pid, (p, info) in self._optimizer_entries(optimizer, state).items():
            whole, states = {}, state["state"][pid]
            for key, value in states.items():
                kind = self._state_kind(states, value, p)
                if kind == "rows":
                    whole[key] = self._whole(value, info)
                elif kind == "rank":
                    raise NotImplementedError(
                        f"optimizer state {key!r} of {info.name} ({tuple(value.shape)}, {value.dtype}) is not "
                        "per element of the shard (8-bit states are blockwise over it): a single-file "
                        "checkpoint of data_parallel='shard' holds 32-bit states only (a sharded one, "
                        "checkpoint_format='sharded', holds them per process)")
                else:
                    whole[key] = value
            new_state[pid] = whole
        return {**state, "state": new_state}

    def shard_optimizer_state(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        """A whole optimizer state dict with every sharded parameter's per-element state cut to this
        rank's rows (a checkpoint from any number of processes, one included)."""
        new_state = dict(state["state"])
        for pid, (_, info) in self._optimizer_entries(optimizer, state).items():
            states = new_state[pid]
            if _quantized(states):
                # 8-bit states are this rank's own (blockwise over its rows, as a sharded checkpoint's per-process
                # entries hold them): never cut. A whole tensor's (a replicate run's or one process's) would be cut
                # into rows without their block scales (review 23: a bare "absmax1 must be ... 5 block scales")
                self._refuse_whole_8bit(states, info)
                continue
            new_state[pid] = {key: self._rows(v, info) if self._per_element(key, v, info) else v
                              for key, v in states.items()}
        return {**state, "state": new_state}

    def _refuse_whole_8bit(self, states: dict[str, Any], info: ParamEntry) -> None:
        rows = self._shard_shape(info)
        codes = next(v for v in states.values() if _is_codes(v))
        if tuple(codes.shape) != rows:
            raise ValueError(
                f"the checkpoint's 8-bit optimizer states of {info.name!r} are the whole tensor's (shape "
                f"{tuple(codes.shape)}: saved with data_parallel='replicate' or by one process), and this run is "
                f"data_parallel='shard', whose 8-bit states are blockwise over each process's rows {tuple(rows)}. "
                "Fix: resume with data_parallel='replicate', as the checkpoint was saved (a checkpoint whose states "
                "are 32-bit, HybridAdamW(eight_bit='none'), moves between the modes)")

    @staticmethod
    def _per_element(key: Any, value: Any, info: ParamEntry) -> bool:
        """Is optimizer state ``value`` (whole) one element per element of parameter ``info``? A
        0-dim parameter's states are 0-dim like its step count: told apart by torch's name for that,
        ``step``."""
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(info.shape):
            return False
        return value.ndim > 0 or key != "step"


def _is_codes(v: Any) -> bool:
    """An optimizer state tensor of quantised codes (8-bit states: uint8, not a 0-dim count)."""
    return isinstance(v, torch.Tensor) and not v.is_floating_point() and v.ndim > 0


def _quantized(states: dict[str, Any]) -> bool:
    """A parameter's optimizer states in the 8-bit layout (blockwise over the shard: no whole form)."""
    return any(_is_codes(v) for v in states.values())
