"""The numbers the planner works on: per-layer seconds and bytes for one micro-batch.

A ``Workload`` is hardware-specific (times are seconds on that hardware). It is built analytically
from (ModelSpec, TrainSpec, Hardware) or from measured numbers (``Workload.from_measured``; the
engine's profiler fills it). Boundary ``i`` is the hidden state entering layer ``i``; boundary
``L`` enters the head. Everything is bytes and seconds. Host-lane seconds (``cast_seconds`` per
weight fetch, ``accum_seconds`` per gradient D2H) come from ``Hardware.host_bytes_per_s`` (and the
other host rates, plus ``host_job_seconds`` per job) in the analytic workload and default to 0 in a
measured one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace

from .errors import InvalidInput
from .hardware import Hardware
from .memory_model import embedding_backward_bytes, head_work_bytes as loss_head_bytes
from .model import ModelSpec, TrainSpec, block_cost
from .units import DTYPE_BYTES

# Host bytes per parameter for the master copy and its fp32 gradient accumulator.
HOST_MASTER_BYTES = 4
HOST_GRAD_BYTES = 4
STATE_BYTES_32 = 8.0  # exp_avg + exp_avg_sq in fp32
STATE_BYTES_8 = 2.0 + 2 * 4 / 256  # two uint8 states + one fp32 absmax per 256-element block each

# Host arenas (``engine/host_arena.py``): one buffer per kind, whole pages, slices at 256-byte offsets.
HOST_ARENA_ALIGN = 256
HOST_PAGE = 4096
# A partial keep's elementwise recompute (norms, rotary, activation, products) is memory-bound: its
# time is the bytes those ops read and write (memory_model.Tape.partial) at this fraction of the
# device's memory bandwidth (Hardware.gpu_memory_bytes_per_s). PyTorch eager runs each as its own
# streaming kernel; such kernels reach 70-90% of HBM bandwidth on large tensors, the lower end taken
# (an estimate, not measured on a GPU here). Unknown bandwidth: priced as a full re-run (no gain).
ELEMENTWISE_EFFICIENCY = 0.7
# The engine's ParamStore: block slots (0/1 double buffering, 2 the recompute buffer; residents add more).
PARAM_SLOTS = 3


def host_page_bytes(nbytes: float) -> float:
    """A host activation buffer's size: ``nbytes`` rounded up to whole pages (the engine's pool,
    engine/activation_store.py, keeps O_DIRECT-ready buffers of whole pages)."""
    return -(-nbytes // HOST_PAGE) * HOST_PAGE


def host_arena_bytes(sizes: Iterable[float]) -> int:
    """Bytes a host arena holding slices of ``sizes`` bytes reserves (and pins on CUDA): every slice
    rounded up to ``HOST_ARENA_ALIGN``, the sum rounded up to whole pages; 0 for no bytes."""
    total = sum(-(-int(n) // HOST_ARENA_ALIGN) * HOST_ARENA_ALIGN for n in sizes)
    return -(-total // HOST_PAGE) * HOST_PAGE


def param_store_host_bytes(block_numel: Sequence[int], rest_numel: int, *, master_bytes: int, compute_bytes: int,
                           cast: bool, block_slots: int = PARAM_SLOTS, copies: bool = False) -> int:
    """Pinned host bytes of the engine's ``ParamStore`` (its ``host_pinned_bytes``).

    One arena of packed masters (per group ``numel * master_bytes``; ``numel`` counts the 64-element
    alignment of every parameter, as ``ParamStore.group_numel`` does), and one staging arena: per
    slot (``block_slots`` slots sized to the largest block, plus the non-block weights' own) a
    landing buffer for the gradient D2H; compute dtype. When ``cast`` (16-bit compute copies of
    masters in another dtype) a third arena: a cast buffer per slot for its H2D, or, with ``copies``
    (the engine's Note: [kept compute copy]), every group's compute copy instead."""
    masters = host_arena_bytes([n * master_bytes for n in block_numel] + [rest_numel * master_bytes])
    slots = [max(block_numel, default=0) * compute_bytes] * block_slots + [rest_numel * compute_bytes]
    if not cast:
        third = 0
    elif copies:
        third = host_arena_bytes([n * compute_bytes for n in [*block_numel, rest_numel]])
    else:
        third = host_arena_bytes(slots)
    return masters + host_arena_bytes(slots) + third


def host_lane_seconds_per_param(compute_bytes: int, grad_bytes: int, hardware: Hardware,
                                copies_per_step: float = 1.0, norms: bool = True) -> tuple[float, float]:
    """Host-lane seconds per parameter, conversions on the host (the plan may move them to the
    device: planner/placement.py):

    - cast, before each weight fetch: read the master, write the compute copy into pinned staging
      (``HOST_MASTER_BYTES + compute_bytes`` at ``host_bytes_per_s``; 0 when the masters already are in
      the compute dtype);
    - accumulate, after each gradient D2H: read the landed gradient (``grad_bytes``), read and write
      the fp32 host gradient (``2 * HOST_GRAD_BYTES``; a 16-bit gradient's widening add at
      ``host_widen_bytes_per_s``), and at a step's last copy read it again for the norms
      (``HOST_GRAD_BYTES``, at ``host_norm_bytes_per_s``, else as an fp32 add; not with
      ``norms=False``: a run that takes none, ``Workload.host_norms``): per copy, averaged over a
      step's ``copies_per_step``.
    """
    cast_rate = hardware.host_bytes_per_s
    add = hardware.host_add_bytes_per_s or cast_rate
    widen = (hardware.host_widen_bytes_per_s or cast_rate) if grad_bytes != HOST_GRAD_BYTES else add
    cast = HOST_MASTER_BYTES + compute_bytes if compute_bytes != HOST_MASTER_BYTES else 0
    norm = hardware.host_norm_bytes_per_s or add
    accum = (grad_bytes + 2 * HOST_GRAD_BYTES) / widen + (HOST_GRAD_BYTES / norm / max(1.0, copies_per_step)
                                                         if norms else 0.0)
    return cast / cast_rate, accum


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerWork:
    params: int
    param_bytes: float  # weights streamed host -> device (compute dtype)
    grad_bytes: float  # weight gradients streamed device -> host
    fwd_seconds: float
    bwd_seconds: float  # backward only; a local recompute adds fwd_seconds
    internal_bytes: float  # saved activations incl. the input boundary
    fwd_work_bytes: float
    bwd_work_bytes: float
    opt_seconds: float  # host optimizer update of this layer's parameters
    # host lane, seconds: cast the masters to the compute dtype before ONE weight fetch (0: same dtype);
    # add ONE landed gradient D2H into the fp32 host grads, plus the layer's squared norm
    cast_seconds: float = 0.0
    accum_seconds: float = 0.0
    # several devices (``multi.rank_workload``; the defaults are one GPU): the fraction of param_bytes /
    # grad_bytes this rank moves over its host link (shard: 1/N); the device all-gather before every use
    # of the weights (seconds, bytes received); the backward's device reduce-scatter (+ cross-node
    # all-reduce of the shard) before the gradient D2H; the host all-reduce of the fp32 host gradient
    # (replicate modes)
    link_fraction: float = 1.0
    # bytes the gradient copy moves per byte of grad_bytes (before link_fraction): 1, or the masters'
    # over the compute dtype's element size where the gradients land widened (the sharded mode
    # averages 16-bit gradients in fp32 before its D2H: 2)
    grad_widen: float = 1.0
    # bytes a weight fetch moves per byte of param_bytes (the compute copy on the device): 1, or the
    # masters' over the compute dtype's element size where the device casts them (placement.py: 2)
    param_widen: float = 1.0
    gather_seconds: float = 0.0
    gather_bytes: float = 0.0
    reduce_seconds: float = 0.0
    reduce_bytes: float = 0.0
    allreduce_seconds: float = 0.0
    allreduce_bytes: float = 0.0
    # partial keep (``Schedule.partial_keep``): bytes a partial-keep forward keeps beyond its input (the
    # matmul-class ops' outputs, F{j}..B{j}), the seconds of its elementwise recompute in B{j}, and the
    # saved tensors that recompute re-materialises there (those that are not kept outputs: in B{j} it
    # takes the place of a local recompute's internal_bytes - boundary); 0 partial bytes = not known for
    # this layer (a measured workload without them), the MILP then offers no partial keep
    partial_bytes: float = 0.0
    partial_seconds: float = 0.0
    partial_recompute_bytes: float = 0.0

    @property
    def grad_buffer_bytes(self) -> float:
        """Device bytes of the gradient buffer a backward of this layer binds: the whole group in the compute
        dtype, whatever trains (engine/param_store.py allocates it so), or ``grad_bytes`` where those are
        more (an analytic workload with wider gradients). A fine-tune's gradient copy moves less
        (``grad_bytes``: what trains), its slot holds this."""
        return max(self.grad_bytes, self.param_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    layers: tuple[LayerWork, ...]
    boundary_bytes: tuple[float, ...]  # L + 1 entries
    head_seconds: float  # embedding fwd/bwd + final norm + LM head + loss, fwd and bwd
    head_work_bytes: float  # the head window's working set: final norm, loss chunk, d(hidden), d(head weight)
    nonblock_params: int
    nonblock_gpu_bytes: float  # resident embedding/norm/head weights + their device grads (+ call_bytes)
    # of nonblock_gpu_bytes, the tensors every block call receives besides the hidden state (masks, rotary
    # tables, biases; measured, 0 in an analytic workload): they grow with the batch (``scaled``)
    call_bytes: float = 0.0
    nonblock_param_bytes: float  # their weights, sent to the device once per step (after the update)
    nonblock_grad_bytes: float  # their grads, sent to the host once per step
    nonblock_opt_seconds: float
    nonblock_cast_seconds: float = 0.0  # host lane, non-block group (index -1): as LayerWork.cast_seconds
    nonblock_accum_seconds: float = 0.0  # ... and as LayerWork.accum_seconds
    host_static_bytes: float  # pinned masters and staging (param_store_host_bytes), host grads, optimizer states
    tokens: int  # per micro-batch
    grad_accum: int = 1
    total_params: int  # for MegaTrain's TFLOPS convention (6 * N * tokens / time)
    name: str = ""
    # several devices (``multi.rank_workload``): the per-rank problem of ``ranks`` data-parallel ranks
    # (``ranks_per_node`` per node); ``data_parallel`` names the collectives ``Schedule.windows()`` adds
    # (none | shard | replicate | replicate_overlap); the non-block group's collectives as LayerWork's
    data_parallel: str = "none"
    ranks: int = 1
    ranks_per_node: int = 1
    nonblock_link_fraction: float = 1.0
    nonblock_grad_widen: float = 1.0  # as LayerWork.grad_widen
    nonblock_param_widen: float = 1.0  # as LayerWork.param_widen
    nonblock_gather_seconds: float = 0.0
    nonblock_gather_bytes: float = 0.0
    nonblock_reduce_seconds: float = 0.0
    nonblock_reduce_bytes: float = 0.0
    nonblock_allreduce_seconds: float = 0.0
    nonblock_allreduce_bytes: float = 0.0
    # the non-block group in parts (elements per part, in the order T moves and updates them; empty:
    # one part). One rank only (``data_parallel == "none"``): T pipelines the parts (Note: [non-block
    # parts] in schedule_windows.py); the costs of part ``p`` (op index ``-1 - p``) are its share of the
    # ``nonblock_*`` figures.
    nonblock_parts: tuple[int, ...] = ()
    # the host keeps each group's compute copy for a micro-batch (engine/param_store.py, Note: [kept
    # compute copy]): a group's first fetch in a micro-batch casts (its forward's, or T's), the H and
    # B windows' fetches of the same weights (backward, re-runs) do not
    kept_copies: bool = False
    # Note: [conversion placement] (placement.py): bytes per element of the streamed compute copies
    # (0: unknown, no placement to choose), the conversions these figures put on the device
    # (``Placement`` field names) and the device's conversion buffers for them (static device bytes)
    compute_bytes: int = 0
    device_conversions: tuple[str, ...] = ()
    conversion_gpu_bytes: float = 0.0
    # device bytes present in every window that neither the engine's buffers nor the windows' working
    # sets account for (measured: what the allocator still held after the profiled step beyond what the
    # executor tracks: library workspaces, module buffers and caches; engine/step_stats.py, Note:
    # [untracked device bytes]); 0 in an analytic workload
    device_overhead_bytes: float = 0.0
    # the run's optimizer updates each block during the backward, as soon as its gradient is complete (a
    # ``HybridAdamW(updates_in_backward=True)`` the fit lets do so; Note: [updates in the backward pass]
    # in core/optimizer_steps.py): a pipelined schedule's updates run in the B windows (schedule_windows.py)
    updates_in_backward: bool = False
    # with the updates in the backward: the parts of the non-block group (indices into
    # ``nonblock_parts``, never 0) whose gradients are complete before the blocks' backward (an untied
    # head with the final norm) -- written back, accumulated and updated in the last micro-batch's first
    # B window instead of in T (schedule_windows.py; Note: [early non-block parts] in engine/early_parts.py)
    early_parts: tuple[int, ...] = ()
    # the host lane takes every gradient's norm at a step's last copy (engine/executor.py, Note: [norms
    # only when wanted]): False for a run that uses none (no clip, no non-finite skip, one process)
    host_norms: bool = True
    # Note: [layers without a backward] the layers no gradient reaches in the profiled step (ascending; in
    # practice a prefix of the stack: a frozen first part under a frozen embedding, or every layer of a
    # head-only fine-tune; engine/block_calls.py, Note: [blocks no gradient reaches]). The engine runs their
    # forward and no backward: their B windows compute nothing, fetch no weights (but layer 0's, which the
    # next micro-batch's F0 reads), send no gradients and keep no internals, and no block ending at one of
    # them is re-run (a block ending above them still re-runs them: the layer above needs its input).
    # ``Schedule.windows(no_backward=...)`` leaves those ops out; the simulator and the MILP price that.
    # Empty in an analytic workload (every layer trains).
    no_backward: tuple[int, ...] = ()

    # ---- derived ------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def nonblock_part_count(self) -> int:
        """How many parts T moves the non-block group in (1 with several ranks)."""
        return len(self.nonblock_parts) if self.nonblock_parts and self.data_parallel == "none" else 1

    def nonblock_part(self, value: float, index: int) -> float:
        """The share of a non-block figure (seconds or bytes) that op index ``index`` (< 0: part
        ``-1 - index``) carries, by elements (``value * n_p / n``: exact bytes for integral ones)."""
        if self.nonblock_part_count == 1:
            return value
        return value * self.nonblock_parts[-1 - index] / self.nonblock_params

    def backward_parts(self, in_backward: bool) -> tuple[int, ...]:
        """The parts a schedule writes back and updates in the backward (``early_parts``), where its
        updates run there (``in_backward``: the schedule's choice, which the run must allow) and T moves
        the group in parts; else none."""
        return self.early_parts if in_backward and self.updates_in_backward and self.nonblock_part_count > 1 else ()

    def backward_runs(self, j: int) -> bool:
        """Does layer ``j`` run a backward (Note: [layers without a backward])?"""
        return j not in self.no_backward

    def recast_seconds(self, j: int) -> float:
        """Host-lane seconds of the cast before a fetch of layer ``j`` in the H or a B window (its
        weights were fetched in this micro-batch's forward already): 0 with ``kept_copies``."""
        return 0.0 if self.kept_copies else self.layers[j].cast_seconds

    @property
    def max_param_bytes(self) -> float:
        return max(layer.param_bytes for layer in self.layers)

    @property
    def max_grad_bytes(self) -> float:
        return max(layer.grad_bytes for layer in self.layers)

    @property
    def weight_buffer_bytes(self) -> float:
        """Two device slots sized to the largest layer (double buffering), each holding the layer's
        compute weights and the gradient buffer its backward writes before they go to the host (the whole
        group's: ``LayerWork.grad_buffer_bytes``, also where only part of it trains)."""
        return 2 * (self.max_param_bytes + max(layer.grad_buffer_bytes for layer in self.layers))

    @property
    def static_gpu_bytes(self) -> float:
        """Device bytes present in every window: resident non-block weights/grads + weight buffers
        (+ the copy lanes' conversion buffers, placement.py, + measured untracked bytes)."""
        return self.nonblock_gpu_bytes + self.weight_buffer_bytes + self.conversion_gpu_bytes + self.device_overhead_bytes

    def validate(self) -> Workload:
        if not self.layers:
            raise InvalidInput("workload.layers", 0, "need at least one layer")
        if len(self.boundary_bytes) != len(self.layers) + 1:
            raise InvalidInput("workload.boundary_bytes", len(self.boundary_bytes),
                               f"need num_layers + 1 = {len(self.layers) + 1} entries")
        for j, layer in enumerate(self.layers):
            for key, value in asdict(layer).items():
                if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                    raise InvalidInput(f"workload.layers[{j}].{key}", value, "must be a finite number >= 0")
        for key in ("head_seconds", "head_work_bytes", "nonblock_gpu_bytes", "nonblock_param_bytes", "nonblock_grad_bytes",
                    "nonblock_opt_seconds", "nonblock_cast_seconds", "nonblock_accum_seconds",
                    "host_static_bytes", "conversion_gpu_bytes", "device_overhead_bytes"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidInput(f"workload.{key}", value, "must be a finite number >= 0")
        if self.grad_accum < 1:
            raise InvalidInput("workload.grad_accum", self.grad_accum, "must be >= 1")
        for key in ("nonblock_link_fraction", "nonblock_grad_widen", "nonblock_param_widen", "nonblock_gather_seconds",
                    "nonblock_gather_bytes",
                    "nonblock_reduce_seconds", "nonblock_reduce_bytes", "nonblock_allreduce_seconds",
                    "nonblock_allreduce_bytes"):
            value = getattr(self, key)
            if not (math.isfinite(value) and value >= 0):
                raise InvalidInput(f"workload.{key}", value, "must be a finite number >= 0")
        if self.nonblock_parts and (any(int(n) != n or n <= 0 for n in self.nonblock_parts)
                                    or sum(self.nonblock_parts) != self.nonblock_params):
            raise InvalidInput("workload.nonblock_parts", self.nonblock_parts,
                               f"need positive element counts summing to nonblock_params = {self.nonblock_params}")
        if any(not 0 < p < max(len(self.nonblock_parts), 1) for p in self.early_parts) or \
                len(set(self.early_parts)) != len(self.early_parts):
            raise InvalidInput("workload.early_parts", self.early_parts,
                               f"need distinct part indices 1..{len(self.nonblock_parts) - 1} of nonblock_parts "
                               "(part 0 is always written back in T)")
        if list(self.no_backward) != sorted(set(self.no_backward)) or \
                any(not 0 <= j < len(self.layers) for j in self.no_backward):
            raise InvalidInput("workload.no_backward", self.no_backward,
                               f"need distinct ascending layer indices in 0..{len(self.layers) - 1}")
        from .schedule import DATA_PARALLEL
        if self.data_parallel not in DATA_PARALLEL:
            raise InvalidInput("workload.data_parallel", self.data_parallel, f"must be one of {DATA_PARALLEL}")
        if self.ranks < 1 or self.ranks_per_node < 1 or self.ranks % self.ranks_per_node:
            raise InvalidInput("workload.ranks", (self.ranks, self.ranks_per_node),
                               "ranks and ranks_per_node must be >= 1, ranks a multiple of ranks_per_node")
        return self

    def scaled(self, factor: float) -> Workload:
        """The same run on micro-batches ``factor`` times as large (more tokens): activation bytes,
        working sets and compute seconds scale by ``factor``; weights, gradients, optimizer, host
        lane and static bytes do not (the engine's Note: [batches larger than the plan], in
        core/batch_size.py: a first-order model, linear in the tokens) -- but the block calls' tensors
        (``call_bytes``: an attention mask or bias grows with the square of the length) by ``factor**2``,
        erring large."""
        f = float(factor)
        layers = tuple(replace(w, fwd_seconds=w.fwd_seconds * f, bwd_seconds=w.bwd_seconds * f,
                               internal_bytes=w.internal_bytes * f, fwd_work_bytes=w.fwd_work_bytes * f,
                               bwd_work_bytes=w.bwd_work_bytes * f, partial_bytes=w.partial_bytes * f,
                               partial_seconds=w.partial_seconds * f,
                               partial_recompute_bytes=w.partial_recompute_bytes * f)
                       for w in self.layers)
        calls = self.call_bytes * f * f
        return replace(self, layers=layers, boundary_bytes=tuple(b * f for b in self.boundary_bytes),
                       nonblock_gpu_bytes=self.nonblock_gpu_bytes - self.call_bytes + calls, call_bytes=calls,
                       head_seconds=self.head_seconds * f, head_work_bytes=self.head_work_bytes * f,
                       tokens=max(1, int(round(self.tokens * f)))).validate()

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Workload:
        data = dict(data)
        data["layers"] = tuple(LayerWork(**layer) for layer in data["layers"])
        data["boundary_bytes"] = tuple(data["boundary_bytes"])
        data["nonblock_parts"] = tuple(data.get("nonblock_parts", ()))
        data["early_parts"] = tuple(data.get("early_parts", ()))
        data["no_backward"] = tuple(data.get("no_backward", ()))
        data["device_conversions"] = tuple(data.get("device_conversions", ()))
        return cls(**data).validate()

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_measured(cls, *, fwd_seconds: list[float], bwd_seconds: list[float], params: list[int],
                      param_bytes: list[float], grad_bytes: list[float], boundary_bytes: list[float],
                      internal_bytes: list[float], fwd_work_bytes: list[float], bwd_work_bytes: list[float],
                      opt_seconds: list[float], head_seconds: float, head_work_bytes: float,
                      nonblock_params: int, nonblock_gpu_bytes: float, nonblock_param_bytes: float,
                      nonblock_grad_bytes: float,
                      nonblock_opt_seconds: float, host_static_bytes: float, tokens: int, grad_accum: int = 1,
                      name: str = "measured", cast_seconds: list[float] | None = None,
                      accum_seconds: list[float] | None = None, nonblock_cast_seconds: float = 0.0,
                      nonblock_accum_seconds: float = 0.0, partial_bytes: list[float] | None = None,
                      partial_seconds: list[float] | None = None,
                      partial_recompute_bytes: list[float] | None = None,
                      nonblock_parts: tuple[int, ...] = ()) -> Workload:
        """Build from measured per-layer lists (the profiler's output). The host-lane costs
        (``cast_seconds``, ``accum_seconds``: per layer, per fetch / per gradient D2H) default to 0."""
        n = len(fwd_seconds)
        cast_seconds = [0.0] * n if cast_seconds is None else cast_seconds
        accum_seconds = [0.0] * n if accum_seconds is None else accum_seconds
        partial_bytes = [0.0] * n if partial_bytes is None else partial_bytes
        partial_seconds = [0.0] * n if partial_seconds is None else partial_seconds
        partial_recompute_bytes = [0.0] * n if partial_recompute_bytes is None else partial_recompute_bytes
        lists = dict(bwd_seconds=bwd_seconds, params=params, param_bytes=param_bytes, grad_bytes=grad_bytes,
                     internal_bytes=internal_bytes, fwd_work_bytes=fwd_work_bytes,
                     bwd_work_bytes=bwd_work_bytes, opt_seconds=opt_seconds, cast_seconds=cast_seconds,
                     accum_seconds=accum_seconds, partial_bytes=partial_bytes, partial_seconds=partial_seconds,
                     partial_recompute_bytes=partial_recompute_bytes)
        for key, values in lists.items():
            if len(values) != n:
                raise InvalidInput(key, len(values), f"need {n} entries (one per layer, like fwd_seconds)")
        layers = tuple(
            LayerWork(params=int(params[j]), param_bytes=float(param_bytes[j]), grad_bytes=float(grad_bytes[j]),
                      fwd_seconds=float(fwd_seconds[j]), bwd_seconds=float(bwd_seconds[j]),
                      internal_bytes=float(internal_bytes[j]), fwd_work_bytes=float(fwd_work_bytes[j]),
                      bwd_work_bytes=float(bwd_work_bytes[j]), opt_seconds=float(opt_seconds[j]),
                      cast_seconds=float(cast_seconds[j]), accum_seconds=float(accum_seconds[j]),
                      partial_bytes=float(partial_bytes[j]), partial_seconds=float(partial_seconds[j]),
                      partial_recompute_bytes=float(partial_recompute_bytes[j]))
            for j in range(n))
        return cls(layers=layers, boundary_bytes=tuple(float(a) for a in boundary_bytes),
                   head_seconds=head_seconds, head_work_bytes=head_work_bytes, nonblock_params=nonblock_params,
                   nonblock_gpu_bytes=nonblock_gpu_bytes, nonblock_param_bytes=nonblock_param_bytes,
                   nonblock_grad_bytes=nonblock_grad_bytes,
                   nonblock_opt_seconds=nonblock_opt_seconds, nonblock_cast_seconds=float(nonblock_cast_seconds),
                   nonblock_accum_seconds=float(nonblock_accum_seconds), host_static_bytes=host_static_bytes,
                   tokens=tokens, grad_accum=grad_accum, total_params=sum(params) + nonblock_params,
                   nonblock_parts=tuple(int(n) for n in nonblock_parts) if len(nonblock_parts) > 1 else (),
                   name=name).validate()

    @classmethod
    def analytic(cls, model: ModelSpec, train: TrainSpec, hardware: Hardware) -> Workload:
        """Costs from shapes: FLOPs / (peak * efficiency), bytes from dtypes."""
        model.validate()
        train.validate()
        hardware.validate()
        cost = block_cost(model, train)
        e = DTYPE_BYTES[train.dtype]
        ge = DTYPE_BYTES[train.grad_dtype]
        rate = hardware.flops_per_s
        frac8 = train.eight_bit_fraction
        opt_per_param = (1 - frac8) / hardware.cpu_adam_params_per_s + frac8 / hardware.cpu_adam8_params_per_s
        cast_per_param, accum_per_param = host_lane_seconds_per_param(e, ge, hardware, train.grad_accum)
        # the non-block gradients are accumulated on the device: one copy per step
        _, nonblock_accum_per_param = host_lane_seconds_per_param(e, ge, hardware)
        # and every host-lane job its fixed cost (``Hardware.host_job_seconds``): one per fetch that casts,
        # one per gradient copy
        job = hardware.host_job_seconds
        cast_job = job if cast_per_param > 0 else 0.0
        fwd_seconds = cost.fwd_flops / rate
        partial_seconds = (cost.elementwise_bytes / (hardware.gpu_memory_bytes_per_s * ELEMENTWISE_EFFICIENCY)
                           if hardware.gpu_memory_bytes_per_s > 0 else fwd_seconds)
        layer = LayerWork(params=cost.params, param_bytes=cost.params * e, grad_bytes=cost.params * ge,
                          fwd_seconds=cost.fwd_flops / rate, bwd_seconds=cost.bwd_flops / rate,
                          internal_bytes=cost.internal_bytes, fwd_work_bytes=cost.fwd_work_bytes,
                          bwd_work_bytes=cost.bwd_work_bytes, opt_seconds=cost.params * opt_per_param,
                          cast_seconds=cost.params * cast_per_param + cast_job,
                          accum_seconds=cost.params * accum_per_param + job,
                          partial_bytes=float(cost.partial_bytes), partial_seconds=min(partial_seconds, fwd_seconds),
                          partial_recompute_bytes=float(cost.partial_recompute_bytes))
        n_tok = train.tokens
        nonblock = model.embedding_params + model.head_params
        head_matmul = model.vocab * model.hidden  # LM head (tied or not, same FLOPs)
        head_flops = 6.0 * n_tok * head_matmul  # fwd + bwd of the LM head; embedding lookup ~ free
        # the final norm and models/loss.py's chunked cross-entropy (memory_model.head_tape)
        head_work = loss_head_bytes(model, train)
        # B0 ends with the embedding's backward: layer 0's input gradient and a dense [V, h] weight gradient
        # (before it joins .grad) once layer 0's saved tensors are gone
        layer0 = replace(layer, bwd_work_bytes=max(layer.bwd_work_bytes, embedding_backward_bytes(model, train)
                                                   - (layer.internal_bytes - cost.boundary_bytes)))
        state_bytes = (1 - frac8) * STATE_BYTES_32 + frac8 * STATE_BYTES_8
        # Pinned: packed fp32 masters and the slots' staging (param_store_host_bytes); then the fp32 host
        # grads and the optimizer states.
        pinned = param_store_host_bytes([cost.params] * model.num_layers, nonblock, master_bytes=HOST_MASTER_BYTES,
                                        compute_bytes=e, cast=e != HOST_MASTER_BYTES)
        host = (pinned + model.num_layers * cost.params * (HOST_GRAD_BYTES + state_bytes)
                + nonblock * (HOST_GRAD_BYTES + STATE_BYTES_32))
        return cls(
            layers=(layer0,) + (layer,) * (model.num_layers - 1),
            boundary_bytes=(float(cost.boundary_bytes),) * (model.num_layers + 1),
            head_seconds=head_flops / rate,
            head_work_bytes=float(head_work),
            nonblock_params=nonblock,
            nonblock_gpu_bytes=float(nonblock * (e + ge)),
            nonblock_param_bytes=float(nonblock * e),
            nonblock_grad_bytes=float(nonblock * ge),
            nonblock_opt_seconds=nonblock / hardware.cpu_adam_params_per_s,
            nonblock_cast_seconds=nonblock * cast_per_param + cast_job,
            nonblock_accum_seconds=nonblock * nonblock_accum_per_param + job,
            host_static_bytes=float(host),
            tokens=n_tok,
            grad_accum=train.grad_accum,
            total_params=model.total_params,
            compute_bytes=e,
            # the embedding, then the final norm and the LM head (one part when tied)
            nonblock_parts=(model.embedding_params, model.head_params) if not model.tied_embeddings else (),
            name=f"{model.name}/b{train.micro_batch_size}x{train.seq_len}",
        ).validate()
