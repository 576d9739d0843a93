"""Replay a ``Schedule`` on a ``Workload`` and ``Hardware``: timeline, memory curve, checks.

Independent of the MILP: it derives every load and every tensor's lifetime from the schedule's
window/op list, and raises ``InfeasibleSchedule`` on the first violated resource.

Timing rule (the contract the MILP's algebra also encodes): windows run one after another; within
a window each lane runs its ops in list order from the window's start, an op with ``after`` starts
no earlier than that op's end, and the window ends when its last op ends.

Memory rule: a tensor occupies the device in every window of its lifetime interval (window
granularity, so the figure is the peak within the window). See ``_lifetimes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InfeasibleSchedule
from .hardware import Hardware
from .schedule import LANES, Op, Schedule, Window
from .units import format_bytes
from .workload import Workload, host_page_bytes

# Memory checks allow this many bytes over a capacity (float noise; the MILP uses the same).
MEM_TOL = 1024.0


@dataclass(frozen=True, slots=True)
class Segment:
    window: str
    lane: str
    kind: str
    index: int
    start: float
    end: float
    bytes: float = 0.0


@dataclass(kw_only=True)
class SimResult:
    iteration_seconds: float
    tokens_per_second: float
    tflops: float
    peak_gpu_bytes: float
    peak_window: str
    peak_cpu_bytes: float
    nvme_bytes: float
    exposed_transfer_seconds: float
    compute_seconds: float
    recompute_seconds: float
    lane_bytes: dict[str, float]  # per lane that ran an op; compute, cpu and host move 0 bytes
    recomputed_forwards: dict[int, int]  # layer -> extra forward runs per iteration (block + local; not partial)
    window_seconds: dict[str, float]  # one micro-batch (the first), plus T
    window_bytes: dict[str, float]  # device bytes per window
    timeline: list[Segment] = field(default_factory=list)
    memory_curve: list[tuple[float, float, float]] = field(default_factory=list)  # (start, end, bytes)

    def predicted(self) -> dict:
        """The ``predicted`` block of plan.json."""
        return {
            "iteration_seconds": self.iteration_seconds,
            "tokens_per_second": self.tokens_per_second,
            "tflops": self.tflops,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "peak_cpu_bytes": self.peak_cpu_bytes,
            "nvme_bytes": self.nvme_bytes,
            "exposed_transfer_seconds": self.exposed_transfer_seconds,
        }


def op_cost(op: Op, wl: Workload, hw: Hardware) -> tuple[float, float]:
    """(seconds, bytes) of one op."""
    layers, A = wl.layers, wl.boundary_bytes
    if op.lane == "compute":
        if op.kind == "head":
            return wl.head_seconds, 0.0
        layer = layers[op.index]
        if op.kind == "partial_recompute":  # a partial keep's elementwise recompute
            return layer.partial_seconds, 0.0
        return (layer.bwd_seconds if op.kind == "backward" else layer.fwd_seconds), 0.0
    nb = wl.nonblock_part  # the non-block group's figures, for op index < 0 (a part of it)
    if op.lane == "cpu":
        return (nb(wl.nonblock_opt_seconds, op.index) if op.index < 0 else layers[op.index].opt_seconds), 0.0
    if op.lane == "host":  # cast before a weight fetch, or accumulate after a gradient D2H
        if op.kind == "cast":
            return (nb(wl.nonblock_cast_seconds, op.index) if op.index < 0 else layers[op.index].cast_seconds), 0.0
        return (nb(wl.nonblock_accum_seconds, op.index) if op.index < 0 else layers[op.index].accum_seconds), 0.0
    if op.lane == "collective":  # gather / reduce on the devices, allreduce on the host (see schedule)
        if op.index < 0:
            return {"gather": (wl.nonblock_gather_seconds, wl.nonblock_gather_bytes),
                    "reduce": (wl.nonblock_reduce_seconds, wl.nonblock_reduce_bytes),
                    "allreduce": (wl.nonblock_allreduce_seconds, wl.nonblock_allreduce_bytes)}[op.kind]
        layer = layers[op.index]
        return {"gather": (layer.gather_seconds, layer.gather_bytes),
                "reduce": (layer.reduce_seconds, layer.reduce_bytes),
                "allreduce": (layer.allreduce_seconds, layer.allreduce_bytes)}[op.kind]
    if op.kind in ("weights", "recompute_weights"):  # this rank's part of them (link_fraction; 1 on one GPU)
        nbytes = (nb(wl.nonblock_param_bytes * wl.nonblock_link_fraction * wl.nonblock_param_widen, op.index)
                  if op.index < 0 else
                  layers[op.index].param_bytes * layers[op.index].link_fraction * layers[op.index].param_widen)
    elif op.kind == "grads":
        nbytes = (nb(wl.nonblock_grad_bytes * wl.nonblock_link_fraction * wl.nonblock_grad_widen, op.index)
                  if op.index < 0 else
                  layers[op.index].grad_bytes * layers[op.index].link_fraction * layers[op.index].grad_widen)
    elif op.kind in ("offload_internals", "reload_internals"):  # a layer's saved tensors but its input
        nbytes = layers[op.index].internal_bytes - A[op.index]
    else:  # offload / reload / nvme legs move a boundary
        nbytes = A[op.index]
    bandwidth = {"h2d": hw.h2d_bytes_per_s, "d2h": hw.d2h_bytes_per_s,
                 "nvme_read": hw.nvme_read_bytes_per_s, "nvme_write": hw.nvme_write_bytes_per_s}[op.lane]
    if bandwidth <= 0:
        raise InfeasibleSchedule(op.lane, f"the schedule uses the {op.lane} lane but the hardware has no bandwidth there")
    return nbytes / bandwidth, nbytes


def _run_window(window: Window, start: float, wl: Workload, hw: Hardware,
                out: list[Segment], lane_bytes: dict[str, float]) -> tuple[float, float]:
    """Place one window's ops; return (end time, compute seconds)."""
    cursor = {lane: start for lane in LANES}
    ends: list[float] = []
    compute = 0.0
    refetch = window.name == "H" or window.name.startswith("B")  # a layer's second fetch in a micro-batch
    for op in window.ops:
        if refetch and op.kind == "cast" and op.index >= 0:
            seconds, nbytes = wl.recast_seconds(op.index), 0.0
        else:
            seconds, nbytes = op_cost(op, wl, hw)
        begin = cursor[op.lane]
        if op.after >= 0:
            begin = max(begin, ends[op.after])
        end = begin + seconds
        cursor[op.lane] = end
        ends.append(end)
        lane_bytes[op.lane] = lane_bytes.get(op.lane, 0.0) + nbytes
        if op.lane == "compute":
            compute += seconds
        out.append(Segment(window.name, op.lane, op.kind, op.index, begin, end, nbytes))
    return max([start] + ends), compute


def _lifetimes(s: Schedule, wl: Workload) -> list[tuple[int, int, float, str]]:
    """(first window, last window, bytes, what) of every non-static device tensor in a micro-batch.

    Window indices: F{j}=j, H=L, B{t}=2L-t, T=2L+1 (see ``schedule.window_index``).
    """
    L, A, layers = s.num_layers, wl.boundary_bytes, wl.layers
    nxt = s.next_materialised()
    runs = wl.backward_runs  # Note: [layers without a backward]: such a layer keeps and re-runs nothing
    out: list[tuple[int, int, float, str]] = []
    for i, home in enumerate(s.homes):
        produced = max(i - 1, 0)  # boundary i is written by F{i-1} (boundary 0 by the embedding in F0)
        consumed = 2 * L - i  # ... and last read by B{i} (boundary L by the head)
        if home == "gpu":
            out.append((produced, consumed, A[i], f"boundary {i} (gpu)"))
        elif home in ("cpu", "nvme"):
            out.append((produced, s.offload_window[i], A[i], f"boundary {i} before offload"))
            out.append((2 * L - s.reload_window[i], consumed, A[i], f"boundary {i} reloaded"))
        else:
            out.append((produced, i, A[i], f"boundary {i} (forward)"))
            if runs(nxt[i] - 1):  # the block ending at nxt[i] is re-run in B{nxt[i] - 1}
                out.append((2 * L - (nxt[i] - 1), consumed, A[i], f"boundary {i} (recomputed)"))
    for j, layer in enumerate(layers):
        if not runs(j):  # its forward's work and its resident weights; no internals, no backward, no grads
            out.append((j, j, layer.fwd_work_bytes, f"layer {j} forward work"))
            if s.resident_weights[j]:
                out.append((j - 1 if j else 0, 2 * L - j, layer.param_bytes, f"layer {j} resident weights"))
                if j == 0:
                    out.append((2 * L + 1, 2 * L + 1, layer.param_bytes, "layer 0 resident weights (T)"))
            continue
        off, rel = s.internals_offload_window[j], s.internals_reload_window[j]
        if s.keep_internals[j] and off is not None:  # on the host from the end of F{off} to B{rel}
            out.append((j, off, layer.internal_bytes - A[j], f"layer {j} kept internals before offload"))
            out.append((2 * L - rel, 2 * L - j, layer.internal_bytes - A[j], f"layer {j} kept internals reloaded"))
        elif s.keep_internals[j]:
            out.append((j, 2 * L - j, layer.internal_bytes - A[j], f"layer {j} kept internals"))
        if s.partial_keep[j]:  # its matmul outputs, F{j}..B{j}; B{j} re-materialises the rest (below)
            out.append((j, 2 * L - j, layer.partial_bytes, f"layer {j} partial keep"))
        if s.resident_weights[j]:
            # Its own buffer from the fetch (in F{j-1}; layer 0's in T) to B{j}; its gradients from
            # F{j} until their D2H in the next window (B{j-1}; layer 0's in T) is done.
            out.append((j - 1 if j else 0, 2 * L - j, layer.param_bytes, f"layer {j} resident weights"))
            out.append((j, 2 * L - j + 1, layer.grad_buffer_bytes, f"layer {j} resident gradients"))
            if j == 0:
                out.append((2 * L + 1, 2 * L + 1, layer.param_bytes, "layer 0 resident weights (T)"))
        out.append((j, j, layer.fwd_work_bytes, f"layer {j} forward work"))
        # B{j}: a local recompute re-materialises every saved tensor; a partial keep's recompute those that
        # are not its kept matmul outputs (counted in its lifetime above)
        saved = (0.0 if s.keep_internals[j] else layer.partial_recompute_bytes if s.partial_keep[j]
                 else layer.internal_bytes - A[j])
        out.append((2 * L - j, 2 * L - j, saved + layer.bwd_work_bytes, f"layer {j} backward"))
        if s.block_ending_at(j + 1) is not None:
            out.append((2 * L - j, 2 * L - j, wl.max_param_bytes, f"recompute weight buffer B{j}"))
    out.append((L, L, wl.head_work_bytes, "head work"))
    return out


def window_memory(s: Schedule, wl: Workload) -> list[float]:
    """Device bytes in each window of one micro-batch (2L + 2 windows, T last)."""
    n = 2 * s.num_layers + 2
    level = [wl.static_gpu_bytes] * n
    for first, last, nbytes, _ in _lifetimes(s, wl):
        for w in range(first, last + 1):
            level[w] += nbytes
    return level


def host_bytes(s: Schedule, wl: Workload) -> tuple[float, float]:
    """(peak host bytes, NVMe bytes). Host activation buffers are whole pages (``host_page_bytes``:
    what the engine's pool holds)."""
    A = wl.boundary_bytes
    cpu = sum(host_page_bytes(A[i]) for i, h in enumerate(s.homes) if h == "cpu")
    cpu += sum(wl.layers[j].internal_bytes - A[j] for j in s.offloaded_internals)
    nvme = sum(A[i] for i, h in enumerate(s.homes) if h == "nvme")
    bounce = 2 * host_page_bytes(max(A)) if nvme > 0 else 0.0  # pinned staging for the file legs
    return wl.host_static_bytes + cpu + bounce, nvme


def simulate(schedule: Schedule, workload: Workload, hardware: Hardware, *, check: bool = True) -> SimResult:
    """Time one iteration (``grad_accum`` micro-batches + T) and check every resource."""
    s, wl, hw = schedule, workload, hardware
    if s.num_layers != wl.num_layers:
        raise InfeasibleSchedule("shape", f"schedule has {s.num_layers} layers, workload {wl.num_layers}")
    if s.data_parallel != wl.data_parallel:
        raise InfeasibleSchedule("shape", f"schedule's data_parallel is {s.data_parallel!r}, the workload's "
                                 f"{wl.data_parallel!r} (plan a rank's workload with a schedule of its mode)")
    names = s.window_names()
    mem = window_memory(s, wl)
    peak_index = max(range(len(mem)), key=mem.__getitem__)
    cpu_bytes, nvme_bytes = host_bytes(s, wl)
    if check:
        if mem[peak_index] > hw.gpu_memory_cap_bytes + MEM_TOL:
            raise InfeasibleSchedule(
                "gpu_memory", f"window {names[peak_index]} needs {format_bytes(mem[peak_index])}, "
                f"cap is {format_bytes(hw.gpu_memory_cap_bytes)}", window=names[peak_index],
                need_bytes=mem[peak_index], have_bytes=hw.gpu_memory_cap_bytes)
        if cpu_bytes > hw.cpu_memory_bytes + MEM_TOL:
            raise InfeasibleSchedule("cpu_memory", f"needs {format_bytes(cpu_bytes)} of host memory, "
                                     f"have {format_bytes(hw.cpu_memory_bytes)}", need_bytes=cpu_bytes,
                                     have_bytes=hw.cpu_memory_bytes)
        if nvme_bytes > hw.nvme_capacity_bytes + MEM_TOL:
            raise InfeasibleSchedule("nvme_capacity", f"needs {format_bytes(nvme_bytes)} on NVMe, "
                                     f"have {format_bytes(hw.nvme_capacity_bytes)}", need_bytes=nvme_bytes,
                                     have_bytes=hw.nvme_capacity_bytes)

    timeline: list[Segment] = []
    lane_bytes: dict[str, float] = {}
    window_seconds: dict[str, float] = {}
    curve: list[tuple[float, float, float]] = []
    now = compute = exposed = 0.0
    g = wl.grad_accum
    for k in range(g):
        for w, window in enumerate(s.windows(first_microbatch=k == 0, last_microbatch=k == g - 1,
                                             nonblock_parts=wl.nonblock_part_count,
                                             updates_in_backward=s.updates_in_backward and wl.updates_in_backward,
                                             early_parts=wl.backward_parts(s.updates_in_backward),
                                             no_backward=wl.no_backward)):
            end, busy = _run_window(window, now, wl, hw, timeline, lane_bytes)
            if k == 0 or window.name == "T":
                window_seconds[window.name] = end - now
            curve.append((now, end, mem[w]))
            compute += busy
            exposed += (end - now) - busy
            now = end
    reruns = {j: 0 for j in range(s.num_layers)}
    runs = wl.backward_runs  # Note: [layers without a backward]
    for start, end in s.recompute_blocks:
        for j in range(start, end - 1):
            reruns[j] += g if runs(end - 1) else 0
    for j in range(s.num_layers):  # a partial keep's elementwise recompute is not a re-run of the layer
        reruns[j] += 0 if s.keep_internals[j] or s.partial_keep[j] or not runs(j) else g
    reruns = {j: n for j, n in reruns.items() if n}
    recompute = sum(n * wl.layers[j].fwd_seconds for j, n in reruns.items())
    recompute += g * sum(wl.layers[j].partial_seconds for j in s.partial_layers if runs(j))
    tokens = wl.tokens * g
    return SimResult(
        iteration_seconds=now,
        tokens_per_second=tokens / now,
        tflops=6.0 * wl.total_params * tokens / now / 1e12,
        peak_gpu_bytes=mem[peak_index],
        peak_window=names[peak_index],
        peak_cpu_bytes=cpu_bytes,
        nvme_bytes=nvme_bytes,
        exposed_transfer_seconds=exposed,
        compute_seconds=compute,
        recompute_seconds=recompute,
        lane_bytes=lane_bytes,
        recomputed_forwards=reruns,
        window_seconds=window_seconds,
        window_bytes=dict(zip(names, mem)),
        timeline=timeline,
        memory_curve=curve,
    )
