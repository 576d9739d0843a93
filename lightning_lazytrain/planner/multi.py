"""Several GPUs and nodes: one rank's problem, and the data-parallel modes compared in one simulator.

Data parallel with ``W = gpus_per_node x nodes`` ranks, each training its own micro-batch: every rank
runs the same windows at the same time, so one rank's timeline is the iteration's, and the per-rank
problem is the single-GPU problem with different per-layer lane costs (``rank_workload``) on a
per-rank view of the hardware (``rank_hardware``). The MILP and the simulator then run unchanged but
for the ``collective`` lane the workload's ``data_parallel`` adds to ``Schedule.windows()``.

Modes (``MODES``):

- ``shard`` (hybrid sharding): inside a node each local rank owns ``1/n`` of every
  block's fp32 masters, gradients and optimizer states in host memory; it casts and stages only its
  shard over its own host link (``link_fraction = 1/n``), the devices assemble the block with an
  all-gather before each use (forward, backward prefetch, recompute); the backward reduce-scatters
  each block's gradients on the devices, widened to the masters' fp32 first as the engine averages
  them (``grad_widen``: the reduce-scatter and the shard's D2H move fp32), then (``nodes > 1``)
  all-reduces the shard between the ranks that own it on the other nodes; each rank moves and
  accumulates only its shard and updates
  only its shard (host optimizer work split ``n`` ways, still layer-pipelined). Host memory per node
  ~ one copy of the model's host state.
- ``replicate`` (the engine today): full blocks over each rank's own link, one full host copy per
  rank (``n`` per node), every host gradient all-reduced on the host (gloo) after the backward,
  serially, before the step.
- ``replicate_overlap``: as ``replicate``, each group's host all-reduce right after its accumulate
  in the backward.
- ``fsdp`` (FSDP2 with ``CPUOffloadPolicy``, as a fixed policy): sharded like ``shard`` but no
  activation planning (every layer keeps its activations, or every layer is recomputed: FSDP's
  activation checkpointing; the faster that fits), the fp32 sharded masters cross the link (cast on
  the device, so ``link_fraction = 4 / e / n`` and no host cast), gradients reduce-scattered and
  moved in fp32, the host optimizer serial after the backward.

Shared node resources: the host optimizer and the host lane's elementwise rate (``cpu_adam*``,
``host_bytes_per_s``) are whole-host figures shared by the node's ranks; each rank's link gets
``host_link_share`` of ``h2d``/``d2h`` (ranks behind one PCIe switch); host memory
(``cpu_memory_bytes``) is per node, each rank's share ``1/n``. Collective costs (bus-bandwidth
model, bytes per rank): all-gather and reduce-scatter ``(n-1)/n`` of the block over
``intra_node_bytes_per_s``; cross-node all-reduce of a shard ``2 (M-1)/M`` of it, the node's NICs
(``inter_node_bytes_per_s``) shared by its ``n`` ranks; host all-reduce ``2 (W-1)/W`` of the fp32
gradients over ``host_collective_bytes_per_s`` (across nodes at most ``inter_node_bytes_per_s``).

Byte convention of the host all-reduce (``allreduce_bytes``, ``host_allreduce_bytes``): an
all-reduce of ``N`` bytes over ``W`` ranks counts ``2 (W-1)/W x N`` per rank, what each rank sends
(and receives) in a ring all-reduce (gloo's; the bus-bandwidth convention of nccl-tests), with
``N = params x HOST_GRAD_BYTES``: the group's fp32 host gradient. For a measured workload
``params`` is the engine's group size (every parameter padded to 64 elements), so this is exactly
what the core's ``core/grad_sync.GradSync`` all-reduces and counts (its Note: [collective bytes]);
``bf16-true`` runs (16-bit host gradients) move half of it (``measured_rank_workload(grad_element_bytes=2)``).
Not modelled: the reduce-scatter's 1/n output buffer and NCCL's channels on the device (small),
contention between the collective lane and compute (SM sharing), stragglers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import InfeasibleSchedule, InvalidInput
from .hardware import Hardware
from .milp import MilpOptions
from .model import ModelSpec, TrainSpec
from .placement import HOST_ONLY, Placement
from .plan import diagnose, plan_workload
from .policies import keep_all, recompute_all
from .schedule import Schedule
from .simulator import SimResult, simulate
from .workload import HOST_GRAD_BYTES, HOST_MASTER_BYTES, Workload

MODES = ("shard", "replicate", "replicate_overlap", "fsdp")
_DATA_PARALLEL = {"shard": "shard", "fsdp": "shard", "replicate": "replicate",
                  "replicate_overlap": "replicate_overlap"}


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise InvalidInput("mode", mode, f"must be one of {MODES}")


def host_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank moves in an all-reduce of an ``nbytes`` buffer over ``world_size`` ranks:
    ``2 (W-1)/W x nbytes`` (see the module docstring); 0 for one rank. The unit of
    ``LayerWork.allreduce_bytes``; ``core/grad_sync.GradSync`` counts with this very function."""
    if world_size <= 1:
        return 0.0
    return 2 * (world_size - 1) / world_size * nbytes


def _host_allreduce(params: int, world_size: int, bytes_per_s: float,
                    element_bytes: float = HOST_GRAD_BYTES) -> tuple[float, float]:
    """(seconds, bytes) of one group's host all-reduce: its host gradient (fp32 unless told) over
    ``world_size`` ranks."""
    nbytes = host_allreduce_bytes(params * element_bytes, world_size)
    return nbytes / bytes_per_s, nbytes


def rank_hardware(hw: Hardware) -> Hardware:
    """One rank's view of a node: its share of the host link while every rank copies, of host memory
    and the NVMe drives (``1/n``), of the host optimizer and of the host lane's rate. The same ``hw`` for one GPU."""
    hw.validate()
    n = hw.gpus_per_node
    if hw.world_size == 1:
        return hw
    return hw.replace(name=f"{hw.name}/rank", h2d_bytes_per_s=hw.h2d_bytes_per_s * hw.host_link_share,
                      d2h_bytes_per_s=hw.d2h_bytes_per_s * hw.host_link_share, cpu_memory_bytes=hw.cpu_memory_bytes / n,
                      cpu_adam_params_per_s=hw.cpu_adam_params_per_s / n,
                      cpu_adam8_params_per_s=hw.cpu_adam8_params_per_s / n, host_bytes_per_s=hw.host_bytes_per_s / n,
                      host_widen_bytes_per_s=hw.host_widen_bytes_per_s / n,
                      host_add_bytes_per_s=hw.host_add_bytes_per_s / n,
                      host_norm_bytes_per_s=hw.host_norm_bytes_per_s / n,
                      nvme_read_bytes_per_s=hw.nvme_read_bytes_per_s / n, nvme_write_bytes_per_s=hw.nvme_write_bytes_per_s / n,
                      nvme_capacity_bytes=hw.nvme_capacity_bytes / n, gpus_per_node=1, nodes=1)


def rank_workload(wl: Workload, hw: Hardware, mode: str) -> Workload:
    """One rank's workload in ``mode`` from the single-GPU workload ``wl`` on ``hw`` (a node's
    hardware: whole-host optimizer and host-lane rates). World size 1 returns ``wl`` itself for
    shard/replicate (the single-GPU problem, exactly); ``fsdp`` still moves fp32 masters."""
    _check_mode(mode)
    hw.validate()
    n, M = hw.gpus_per_node, hw.nodes
    W = n * M
    if W == 1 and mode != "fsdp":
        return wl
    sharded = mode in ("shard", "fsdp")
    # host-side work per rank: the node's rate shared by n ranks, on 1/n of the parameters when sharded
    host = 1.0 if sharded else float(n)
    intra, inter = hw.intra_node_bytes_per_s, hw.inter_node_bytes_per_s

    def costs(params: int, param_bytes: float, grad_bytes: float, opt: float, cast: float, accum: float,
              grad_widen: float = 1.0) -> dict:
        # replicate modes keep the gradient copy's widening (a conversion placement's: placement.py)
        out = dict(opt=opt * host, cast=cast * host, accum=accum * host, link=1.0, gather=(0.0, 0.0),
                   reduce=(0.0, 0.0), allreduce=(0.0, 0.0), grad_widen=1.0 if sharded else grad_widen)
        if sharded:
            widen = 1.0
            if mode == "fsdp":  # fp32 masters and gradients cross the link; the cast runs on the device
                widen = HOST_MASTER_BYTES * params / param_bytes if param_bytes else 1.0
                out["cast"] = 0.0
                rs_widen = widen
            else:  # the engine averages gradients in the masters' dtype (fp32): widened before the
                # reduce-scatter, the shard lands widened (engine/shard_store.py)
                rs_widen = HOST_GRAD_BYTES * params / grad_bytes if grad_bytes else 1.0
                out["grad_widen"] = rs_widen
            out["link"] = widen / n
            gather = (n - 1) / n * param_bytes
            rs = (n - 1) / n * grad_bytes * rs_widen
            cross = 2 * (M - 1) / M * grad_bytes * rs_widen / n
            out["gather"] = (gather / intra if gather else 0.0, gather)
            out["reduce"] = ((rs / intra if rs else 0.0) + (cross / (inter / n) if cross else 0.0), rs + cross)
        else:
            bw = hw.host_collective_bytes_per_s if M == 1 else min(hw.host_collective_bytes_per_s, inter)
            if bw <= 0:
                raise InvalidInput("hardware.host_collective_bytes_per_s", hw.host_collective_bytes_per_s,
                                   f"mode {mode!r} with {W} ranks all-reduces host gradients: needs a bandwidth > 0")
            out["allreduce"] = _host_allreduce(params, W, bw)
        return out

    layers = []
    for layer in wl.layers:
        c = costs(layer.params, layer.param_bytes, layer.grad_bytes, layer.opt_seconds, layer.cast_seconds,
                  layer.accum_seconds, layer.grad_widen)
        layers.append(replace(layer, opt_seconds=c["opt"], cast_seconds=c["cast"], accum_seconds=c["accum"],
                              link_fraction=c["link"], grad_widen=c["grad_widen"],
                              gather_seconds=c["gather"][0], gather_bytes=c["gather"][1],
                              reduce_seconds=c["reduce"][0], reduce_bytes=c["reduce"][1],
                              allreduce_seconds=c["allreduce"][0], allreduce_bytes=c["allreduce"][1]))
    nb = costs(wl.nonblock_params, wl.nonblock_param_bytes, wl.nonblock_grad_bytes, wl.nonblock_opt_seconds,
               wl.nonblock_cast_seconds, wl.nonblock_accum_seconds, wl.nonblock_grad_widen)
    return replace(
        wl, layers=tuple(layers), data_parallel=_DATA_PARALLEL[mode], ranks=W, ranks_per_node=n,
        nonblock_opt_seconds=nb["opt"], nonblock_cast_seconds=nb["cast"], nonblock_accum_seconds=nb["accum"],
        nonblock_link_fraction=nb["link"], nonblock_grad_widen=nb["grad_widen"], nonblock_gather_seconds=nb["gather"][0],
        nonblock_gather_bytes=nb["gather"][1], nonblock_reduce_seconds=nb["reduce"][0],
        nonblock_reduce_bytes=nb["reduce"][1], nonblock_allreduce_seconds=nb["allreduce"][0],
        nonblock_allreduce_bytes=nb["allreduce"][1],
        # sharded: 1/n of the masters, grads, states and (shard-sized) staging slots per rank
        host_static_bytes=wl.host_static_bytes / n if sharded else wl.host_static_bytes,
        name=f"{wl.name}/{mode}x{W}",
    ).validate()


def measured_rank_workload(wl: Workload, world_size: int, ranks_per_node: int, host_collective_bytes_per_s: float,
                           mode: str = "replicate", grad_element_bytes: float = HOST_GRAD_BYTES,
                           grad_elements: list[int] | None = None, nonblock_grad_elements: int | None = None
                           ) -> Workload:
    """One rank's workload of a running ``replicate``/``replicate_overlap`` job, from the workload that
    rank measured (its host-lane and optimizer times were taken while every rank of its node worked,
    so they are not rescaled as ``rank_workload`` rescales a one-GPU workload): every group gets its
    host all-reduce (``host_allreduce_bytes`` of its host gradient, ``grad_element_bytes`` per element:
    the masters' dtype, 2 with 16-bit masters; at the measured bandwidth). ``grad_elements`` /
    ``nonblock_grad_elements``: each group's host gradient as the store holds it (up to its last trainable
    parameter: Note: [host gradients for what trains] in engine/host_grads.py); default: every parameter."""
    if mode not in ("replicate", "replicate_overlap"):
        raise InvalidInput("mode", mode, "a running job averages host gradients: 'replicate' or 'replicate_overlap'")
    if world_size <= 1:
        return wl
    if host_collective_bytes_per_s <= 0:
        raise InvalidInput("host_collective_bytes_per_s", host_collective_bytes_per_s, "must be > 0")

    if grad_elements is not None and len(grad_elements) != len(wl.layers):
        raise InvalidInput("grad_elements", grad_elements, f"one count per layer ({len(wl.layers)})")
    elements = grad_elements if grad_elements is not None else [layer.params for layer in wl.layers]
    layers = []
    for layer, n in zip(wl.layers, elements):
        sec, nbytes = _host_allreduce(n, world_size, host_collective_bytes_per_s, grad_element_bytes)
        layers.append(replace(layer, allreduce_seconds=sec, allreduce_bytes=nbytes))
    rest = wl.nonblock_params if nonblock_grad_elements is None else nonblock_grad_elements
    sec, nbytes = _host_allreduce(rest, world_size, host_collective_bytes_per_s, grad_element_bytes)
    return replace(wl, layers=tuple(layers), data_parallel=mode, ranks=world_size, ranks_per_node=ranks_per_node,
                   nonblock_allreduce_seconds=sec, nonblock_allreduce_bytes=nbytes,
                   name=f"{wl.name}/{mode}x{world_size}").validate()


def measured_shard_workload(wl: Workload, world_size: int, ranks_per_node: int, shard_numel: list[int],
                            nonblock_shard_numel: int, collective_bytes_per_s: float,
                            gather_element_bytes: float, reduce_element_bytes: float, replicas: int = 1) -> Workload:
    """One rank's workload of a running ``shard`` job (``LazyTrainStrategy(data_parallel="shard")``,
    engine/shard_store.py), from the workload that rank measured: each layer's fetch moves its shard
    (``shard_numel[j]`` of the group's ``params`` elements: ``link_fraction``), followed by an
    all-gather of ``(W-1)`` shards of ``gather_element_bytes`` each (the compute dtype), and its
    gradient copy moves the shard, in the masters' dtype (``reduce_element_bytes``: 16-bit gradients
    are widened before the reduce-scatter, ``grad_widen``), after a reduce-scatter of ``(W-1)`` shards
    of those; the non-block group likewise. The collectives are
    priced at the bandwidth the profiled step's achieved. Bytes in the engine's unit
    (``ShardedParamStore.collective_bytes``: what this rank sends), so they compare exactly.
    ``world_size`` is the shard group's size; with ``replicas`` shard groups (hybrid sharding) each
    reduce-scatter is followed by an all-reduce of the shard over the replicas, ``2 (R-1)/R`` of it."""
    if world_size <= 1 and replicas <= 1:
        return wl
    if collective_bytes_per_s <= 0:
        raise InvalidInput("collective_bytes_per_s", collective_bytes_per_s, "must be > 0")
    if len(shard_numel) != wl.num_layers:
        raise InvalidInput("shard_numel", len(shard_numel), f"need {wl.num_layers} entries (one per layer)")
    W, bw, R = world_size, collective_bytes_per_s, replicas
    widen = reduce_element_bytes / gather_element_bytes  # the landed gradient's bytes per measured one

    def costs(params: int, shard: int) -> dict:
        gather = (W - 1) * shard * gather_element_bytes
        reduce = ((W - 1) + 2 * (R - 1) / R) * shard * reduce_element_bytes
        return dict(link_fraction=shard / params if params else 1.0, gather_seconds=gather / bw, gather_bytes=gather,
                    reduce_seconds=reduce / bw, reduce_bytes=reduce, grad_widen=widen)

    layers = tuple(replace(layer, **costs(layer.params, n)) for layer, n in zip(wl.layers, shard_numel))
    nb = costs(wl.nonblock_params, nonblock_shard_numel)
    return replace(wl, layers=layers, data_parallel="shard", ranks=W * R, ranks_per_node=ranks_per_node,
                   nonblock_link_fraction=nb["link_fraction"], nonblock_gather_seconds=nb["gather_seconds"],
                   nonblock_grad_widen=widen,
                   nonblock_gather_bytes=nb["gather_bytes"], nonblock_reduce_seconds=nb["reduce_seconds"],
                   nonblock_reduce_bytes=nb["reduce_bytes"], name=f"{wl.name}/shard-measuredx{W}" + (f"x{R}" if R > 1 else "")).validate()


def fsdp_schedules(wl: Workload) -> list[Schedule]:
    """FSDP2-like fixed policies for ``wl``: keep every activation, or recompute every layer (activation
    checkpointing); serial optimizer, backward prefetch, nothing offloaded, nothing resident."""
    out = []
    for base in (keep_all(wl.num_layers), recompute_all(wl.num_layers)):
        out.append(replace(base, optimizer="serial", data_parallel=wl.data_parallel,
                           policy=f"fsdp({'keep_all' if base.policy == 'keep_all' else 'full_ac'})"))
    return out


@dataclass(kw_only=True)
class ClusterResult:
    mode: str
    world_size: int
    gpus_per_node: int
    nodes: int
    schedule: Schedule
    sim: SimResult  # one rank (its tokens/s are the rank's)
    workload: Workload
    hardware: Hardware  # the rank's view
    status: str  # optimal / time_limit / fallback (MILP), policy (fsdp)
    host_fits: bool  # False: the node's host memory is short (replicate keeps n copies); timed anyway
    solver: dict = field(default_factory=dict)  # the MILP's ``SolveResult.solver_json()`` (fsdp: the policy)
    placement: Placement = HOST_ONLY  # where the rank's dtype conversions run (placement.py)

    @property
    def tokens_per_second(self) -> float:
        return self.sim.tokens_per_second * self.world_size

    @property
    def host_bytes_per_node(self) -> float:
        return self.sim.peak_cpu_bytes * self.gpus_per_node


def rank_problem(model: ModelSpec, train: TrainSpec, hw: Hardware, mode: str, *, workload: Workload | None = None,
                 host_bytes_per_node: float | None = None) -> tuple[Workload, Hardware, bool]:
    """(one rank's workload, its hardware, whether the node's host holds every rank's host state) for
    ``plan_cluster``'s arguments. Where the host state does not fit (replicate: ``n`` copies), the rank's host
    memory is raised so that it is planned and timed as if it did (``host_fits`` False says it does not)."""
    _check_mode(mode)
    if host_bytes_per_node is not None:
        if not host_bytes_per_node > 0:
            raise InvalidInput("host_bytes_per_node", host_bytes_per_node, "must be > 0")
        hw = hw.replace(cpu_memory_bytes=min(hw.cpu_memory_bytes, host_bytes_per_node))
    single = workload or Workload.analytic(model, train, hw)
    wl = rank_workload(single, hw, mode)
    rhw = rank_hardware(hw)
    host_fits = wl.host_static_bytes <= rhw.cpu_memory_bytes
    if not host_fits:
        rhw = rhw.replace(cpu_memory_bytes=2 * wl.host_static_bytes + 2 * sum(wl.boundary_bytes))
    return wl, rhw, host_fits


def best_fsdp(wl: Workload, rhw: Hardware) -> tuple[Schedule, SimResult] | None:
    """The faster FSDP policy that fits (None if neither)."""
    best = None
    for s in fsdp_schedules(wl):
        try:
            sim = simulate(s, wl, rhw)
        except InfeasibleSchedule:
            continue
        if best is None or sim.iteration_seconds < best[1].iteration_seconds:
            best = (s, sim)
    return best


def plan_cluster(model: ModelSpec, train: TrainSpec, hw: Hardware, mode: str = "shard", *,
                 options: MilpOptions | None = None, workload: Workload | None = None,
                 host_bytes_per_node: float | None = None) -> ClusterResult:
    """Plan one rank of a data-parallel run (``train`` is per rank) in ``mode``; ``fsdp`` is a fixed
    policy, the others are solved by the MILP on the rank's problem. ``host_bytes_per_node`` caps the
    node's host memory below ``hw.cpu_memory_bytes`` (each rank gets ``1/n`` of it for its share of
    the host state and its host-resident activations). When the host state does not fit the node
    (replicate: ``n`` full copies), the rank is planned and timed as if it did, and ``host_fits`` is
    False."""
    wl, rhw, host_fits = rank_problem(model, train, hw, mode, workload=workload,
                                      host_bytes_per_node=host_bytes_per_node)
    if mode == "fsdp":
        best = best_fsdp(wl, rhw)
        if best is None:
            raise InfeasibleSchedule("gpu_memory", f"neither FSDP policy (keep all, full recompute) fits {hw.name}")
        schedule, sim, status = best[0], best[1], "policy"
        solver = {"name": "none", "policy": schedule.policy}
        placement = HOST_ONLY
    else:
        # as make_plan: the short tier named first (diagnose), the conversions placed (plan.conversions), then the
        # MILP on the priced workload
        diagnose(wl, rhw)
        res = plan_workload(wl, rhw, options=options)
        schedule, sim, status, solver, wl, placement = (res.schedule, res.sim, res.status, res.solver, res.workload,
                                                        res.placement)
    return ClusterResult(mode=mode, world_size=hw.world_size, gpus_per_node=hw.gpus_per_node, nodes=hw.nodes,
                         schedule=schedule, sim=sim, workload=wl, hardware=rhw, status=status, host_fits=host_fits,
                         solver=solver, placement=placement)
