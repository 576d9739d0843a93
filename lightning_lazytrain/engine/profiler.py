"""Measure a ``planner.Workload`` from the real model on the real device.

Runs one micro-batch under the executor's current schedule (a ``min_memory`` or
``recompute_all`` schedule is the safe provisional choice) and reads the executor's trace:
per-layer forward and backward seconds, boundary and saved-internal bytes, a partial keep's
bytes and elementwise seconds (``partial_keep.MatmulOutputs``), parameter and
gradient bytes of the streamed compute copies, the head's time. The transient working sets are the real device bytes each window allocates beyond what the executor tracks:
``torch.cuda.max_memory_allocated`` on CUDA, ``live_bytes.LiveBytes`` (a dispatch-mode storage
tracker) on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from lightning_lazytrain.engine.executor import Executor, StepStats
from lightning_lazytrain.engine.param_store import REST
from lightning_lazytrain.planner.workload import STATE_BYTES_32, Workload


def measure_workload(executor: Executor, step: Callable[[], None], *, tokens: int, grad_accum: int = 1,
                     opt_params_per_s: float = 1e9, state_bytes_per_param: float = STATE_BYTES_32,
                     warmup: int = 1) -> Workload:
    """``step()`` runs forward and backward of one micro-batch (``loss.backward()``), nothing else.

    Runs ``warmup`` + 1 micro-batches and measures the last one; gradients it produces are left in
    the host ``.grad`` (zero them before training). The Lightning strategy does not use this: it
    profiles the first real step (``workload_from_stats``), so user code runs no extra time."""
    assert executor.params is not None
    executor.profiling = True
    try:
        for _ in range(warmup + 1):
            executor.begin_microbatch(first=True, last=True)
            step()
            stats = executor.end_microbatch()
    finally:
        executor.profiling = False
    assert stats is not None
    return workload_from_stats(executor, stats, tokens=tokens, grad_accum=grad_accum,
                               opt_params_per_s=opt_params_per_s, state_bytes_per_param=state_bytes_per_param)


def workload_from_stats(executor: Executor, stats: StepStats, *, tokens: int, grad_accum: int = 1,
                        micro_batches: int = 1, opt_params_per_s: float = 1e9,
                        state_bytes_per_param: float = STATE_BYTES_32) -> Workload:
    """A measured ``Workload`` from the stats of a step the executor ran with ``profiling`` on.

    ``micro_batches``: how many micro-batches that step had (its per-layer compute times are summed
    over them; the workload is per micro-batch)."""
    assert executor.params is not None
    L = len(executor.stack)
    seg = stats.segments
    fwd = [0.0] * L
    bwd = [0.0] * L
    for s in seg:
        if s.lane == "compute" and s.kind == "forward":
            fwd[s.index] += s.end - s.start
        elif s.lane == "compute" and s.kind == "backward":
            bwd[s.index] += s.end - s.start
    k = max(1, micro_batches)
    fwd = [t / k for t in fwd]
    bwd = [t / k for t in bwd]
    # Host lane (Note: [host lane] in param_store.py): seconds of one cast (per weight fetch) and of
    # one gradient accumulation (per D2H), averaged per layer; index -1 is the non-block group.
    host: dict[tuple[str, int], list[float]] = {}
    for s in seg:
        if s.lane == "host":
            host.setdefault((s.kind, s.index), []).append(s.end - s.start)
    mean = lambda kind, j: sum(host.get((kind, j), [0.0])) / len(host.get((kind, j), [0.0]))  # noqa: E731
    head = executor.trace.span("H", f"B{L - 1}")  # without the CPU tracker's own time (live_bytes.py)
    e = torch.empty((), dtype=executor.compute_dtype).element_size()
    numel = [executor.params.group_numel(j) for j in range(L)]
    rest = executor.params.group_numel(REST)
    parts = executor.params.rest_parts
    boundary = [float(stats.boundary_bytes[i]) for i in range(L + 1)]
    internal = [float(stats.internal_bytes.get(j, boundary[j])) for j in range(L)]
    # Transient working sets, measured per window (real device bytes beyond what the executor
    # tracks: a layer's temporaries, the loss head's logits and their gradient); see live_bytes.py.
    work = stats.window_work
    # Present in every window: the non-block weights and their grads, and what every block call
    # receives besides the hidden state (rotary tables, masks; kept for the re-runs).
    # Host: what the parameter store holds (its pinned arenas: masters and slot staging, exactly; the
    # flat host grads) plus the optimizer states of the weights that train (a frozen weight -- a LoRA
    # base, a frozen block -- has no optimizer state and no update: Note: [frozen weights in the plan]).
    # Host activations are the schedule's (simulator).
    trained = [_trained_numel(executor, j) for j in range(L)]
    rest_trained = _trained_numel(executor, REST)
    host_static = (executor.params.host_pinned_bytes + executor.params.host_grad_bytes
                   + (sum(trained) + rest_trained) * state_bytes_per_param)
    wl = Workload.from_measured(
        fwd_seconds=fwd, bwd_seconds=bwd, params=numel, param_bytes=[n * e for n in numel],
        # the gradient copies move what trains (Note: [only what trained crosses] in grad_writeback.py)
        grad_bytes=[executor.params.grad_extent(j) * e for j in range(L)], boundary_bytes=boundary,
        internal_bytes=internal,
        fwd_work_bytes=[float(work.get(f"F{j}", 0)) for j in range(L)],
        bwd_work_bytes=[float(work.get(f"B{j}", 0)) for j in range(L)], opt_seconds=[n / opt_params_per_s for n in trained],
        head_seconds=head, head_work_bytes=float(work.get("H", 0)), nonblock_params=rest, nonblock_gpu_bytes=2.0 * rest * e + stats.call_bytes,
        nonblock_param_bytes=float(rest * e), nonblock_grad_bytes=float(executor.params.grad_extent(REST) * e),
        nonblock_opt_seconds=rest_trained / opt_params_per_s,
        cast_seconds=[mean("cast", j) for j in range(L)], accum_seconds=[mean("accumulate", j) for j in range(L)],
        # the non-block group in parts (Note: [non-block parts]): op indices -1, -2, ...
        nonblock_cast_seconds=sum(mean("cast", -1 - p) for p in range(len(parts))),
        nonblock_accum_seconds=sum(mean("accumulate", -1 - p) for p in range(len(parts))), nonblock_parts=parts,
        host_static_bytes=float(host_static),
        # Note: [partial keep] (engine/partial_keep.py): measured in the local recompute of every layer the
        # profiled schedule re-runs (a layer it does not re-run gets 0 bytes: the MILP offers it no partial
        # keep): the matmul outputs a partial keep stores, the saved tensors its recompute re-materialises,
        # the measured seconds of the elementwise ops (dispatch-mode timing, synchronised per op on CUDA)
        partial_bytes=[float(stats.partial_bytes.get(j, 0)) for j in range(L)],
        partial_recompute_bytes=[float(stats.partial_recompute_bytes.get(j, 0)) for j in range(L)],
        partial_seconds=[float(stats.partial_seconds.get(j, 0.0)) for j in range(L)],
        tokens=tokens, grad_accum=grad_accum, name="measured")
    # what the device held after the step beyond the executor's buffers (Note: [untracked device bytes])
    wl = _placed(dataclasses.replace(wl, device_overhead_bytes=float(stats.untracked_bytes),
                                     call_bytes=float(stats.call_bytes)), executor)
    # param_staging's Note: [kept compute copy]: the H and B windows' fetches do not cast; the executor's
    # Note: [norms only when wanted]: whether the host lane took the gradient norms
    # Note: [layers without a backward] (planner/workload.py): the blocks no gradient reached
    return dataclasses.replace(wl, kept_copies=bool(executor.params.keeps_copies), host_norms=executor.take_norms,
                               no_backward=tuple(sorted(stats.no_backward)))


def _trained_numel(executor: Executor, j: int) -> int:
    """Note: [frozen weights in the plan]
        The elements of group ``j``'s parameters that train (``requires_grad`` when the step was
        profiled): an optimizer holds states for those and updates those only, so the plan's host
        bytes and optimizer seconds count them alone. A run that thaws weights later (a finetuning
        callback) grows its optimizer states then; the plan does not foresee it."""
    assert executor.params is not None
    return sum(p.numel() for p in executor.params.group_parameters(j) if p.requires_grad)


def _placed(wl: Workload, executor: Executor) -> Workload:
    """The profiled step's conversion placement in the workload (planner/placement.py, Note:
    [conversion placement]): the compute copies' element size where the masters are fp32 and the
    copies 16-bit (0: nothing to place), which conversions ran on the device, and their link bytes
    (fp32 weights over the H2D, widened gradients over the D2H) and device buffers."""
    from dataclasses import replace

    from lightning_lazytrain.planner.placement import Placement

    store = executor.params
    assert store is not None
    L = len(executor.stack)
    if not all(store.convertible(j) for j in (REST, *range(L))):
        return wl
    e = torch.empty((), dtype=executor.compute_dtype).element_size()
    cast, widen = (set(store.placement[k]) for k in ("cast_on_device", "widen_on_device"))
    blocks = set(range(L))
    p = Placement(cast_blocks=blocks <= cast, widen_blocks=blocks <= widen, cast_rest=REST in cast,
                  widen_rest=REST in widen)
    four = 4 / e
    layers = tuple(replace(layer, param_widen=four if p.cast_blocks else 1.0, grad_widen=four if p.widen_blocks else 1.0)
                   for layer in wl.layers)
    return replace(wl, layers=layers, compute_bytes=e, device_conversions=p.names,
                   nonblock_param_widen=four if p.cast_rest else 1.0, nonblock_grad_widen=four if p.widen_rest else 1.0,
                   conversion_gpu_bytes=float(store.conversion_device_bytes)).validate()
