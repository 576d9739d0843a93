"""Small hand-made workloads and hardware for planner tests (units: GB = 1e9 bytes)."""

from __future__ import annotations

from lightning_lazytrain.planner import Hardware, Workload

G = 1e9
FAST = 1e15  # bytes/s: transfers take ~nothing


def workload(fwd, bwd=None, *, A=1 * G, internal=4 * G, params=1_000_000, param_bytes=1e6, fwd_work=0.0,
             bwd_work=0.0, head=0.5, opt=1e-6, host_static=1 * G, grad_accum=1) -> Workload:
    L = len(fwd)
    bwd = bwd if bwd is not None else [2 * f for f in fwd]
    return Workload.from_measured(
        fwd_seconds=list(fwd), bwd_seconds=list(bwd), params=[params] * L, param_bytes=[param_bytes] * L,
        grad_bytes=[param_bytes] * L, boundary_bytes=[A] * (L + 1), internal_bytes=[internal] * L,
        fwd_work_bytes=[fwd_work] * L, bwd_work_bytes=[bwd_work] * L, opt_seconds=[opt] * L,
        head_seconds=head, head_work_bytes=0.0, nonblock_params=0, nonblock_gpu_bytes=0.0,
        nonblock_param_bytes=0.0, nonblock_grad_bytes=0.0, nonblock_opt_seconds=0.0, host_static_bytes=host_static, tokens=1000,
        grad_accum=grad_accum, name="hand")


def hardware(cap, *, cpu=1000 * G, h2d=FAST, d2h=FAST, nvme_cap=0.0, nvme_bw=0.0) -> Hardware:
    return Hardware(name="hand", gpu_memory_bytes=cap, gpu_memory_cap_bytes=cap, peak_tflops=1.0, efficiency=1.0,
                    h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, nvme_read_bytes_per_s=nvme_bw,
                    nvme_write_bytes_per_s=nvme_bw, nvme_capacity_bytes=nvme_cap, cpu_memory_bytes=cpu,
                    cpu_adam_params_per_s=1e12, cpu_adam8_params_per_s=1e12).validate()


def with_host_costs(wl: Workload, cast, accum, *, nonblock_cast: float = 0.0, nonblock_accum: float = 0.0) -> Workload:
    """``wl`` with per-layer host-lane seconds (a number for every layer, or a list)."""
    from dataclasses import replace

    L = wl.num_layers
    cast = [cast] * L if isinstance(cast, (int, float)) else list(cast)
    accum = [accum] * L if isinstance(accum, (int, float)) else list(accum)
    layers = tuple(replace(layer, cast_seconds=c, accum_seconds=a) for layer, c, a in zip(wl.layers, cast, accum))
    return replace(wl, layers=layers, nonblock_cast_seconds=nonblock_cast,
                   nonblock_accum_seconds=nonblock_accum).validate()


def internals_choices(L: int, j: int, options=None) -> list[tuple[int | None, int | None]]:
    """The MILP's (offload window, reload window) choices for a kept layer ``j``'s internals, ``(None,
    None)`` (they stay) first: F{j+1} .. F{j+internals_offload_horizon}, and B{j+1} ..
    B{j+internals_reload_slack} or H (``milp_internals``)."""
    from lightning_lazytrain.planner.milp import MilpOptions

    opt = options or MilpOptions()
    out = [(None, None)]
    if not (opt.offload_internals and opt.keep_internals and opt.window_memory):
        return out
    offs = range(j + 1, min(L - 1, j + opt.internals_offload_horizon) + 1)
    rels = sorted(set(range(j + 1, min(L, j + opt.internals_reload_slack) + 1)) | {L})
    return out + [(w, t) for w in offs for t in rels]


def milp_space(L: int, *, nvme: bool = False, pipelined: bool | None = True, internals: bool = True,
               partial: bool = False):
    """Every schedule in the MILP's space for ``L`` layers (L <= 8 = max_block; offload in the
    boundary's own forward window, any legal reload window, backward prefetch; with ``internals``,
    each kept layer's internals stay or move in any of the default ``MilpOptions``' windows).
    ``pipelined``: the optimizer mode (True: pipelined, False: serial, None: each schedule in both
    modes, the space of ``MilpOptions(optimizer_mode="auto")``)."""
    from itertools import product

    from lightning_lazytrain.planner import InvalidInput, Schedule

    modes = ("serial", "pipelined") if pipelined is None else ("pipelined",) if pipelined else ("serial",)
    # per layer with its input on the GPU: 0 local recompute, 1 keep internals, 2 partial keep (with ``partial``:
    # the MILP offers it where the workload has partial bytes, milp_partial)
    choices = (0, 1, 2) if partial else (0, 1)
    tiers = ("gpu", "cpu", "nvme", "recompute") if nvme else ("gpu", "cpu", "recompute")
    for inner in product(tiers, repeat=L - 1):
        homes = ("gpu",) + inner + ("gpu",)
        try:  # the latest reload windows: legal unless an NVMe boundary has none (boundary L - 1)
            probe = Schedule(num_layers=L, homes=homes, keep_internals=(False,) * L, resident_weights=(False,) * L,
                             offload_window=tuple(i if h in ("cpu", "nvme") else None for i, h in enumerate(homes)),
                             reload_window=tuple(L if h == "cpu" else L - 1 if h == "nvme" else None for h in homes))
        except InvalidInput:
            continue
        nxt = probe.next_materialised()
        moved = [i for i, h in enumerate(homes) if h in ("cpu", "nvme")]
        reloads = [range(nxt[i], (L if homes[i] == "cpu" else L - 1) + 1) for i in moved]
        in_block = {j for s, e in probe.recompute_blocks for j in range(s, e - 1)}
        kept = [j for j in range(L) if homes[j] == "gpu"]
        free = [j for j in range(L) if j not in in_block]
        for rel in product(*reloads):
            reload_window = [None] * (L + 1)
            for i, t in zip(moved, rel):
                reload_window[i] = t
            for keep in product(choices, repeat=len(kept)):
                keep_internals, partial_keep = [False] * L, [False] * L
                for j, k in zip(kept, keep):
                    keep_internals[j], partial_keep[j] = k == 1, k == 2
                moving = [j for j in range(L) if keep_internals[j]] if internals else []
                for moves in product(*(internals_choices(L, j) for j in moving)):
                    off, back = [None] * L, [None] * L
                    for j, (w, t) in zip(moving, moves):
                        off[j], back[j] = w, t
                    for res in product((False, True), repeat=len(free)):
                        resident = [False] * L
                        for j, r in zip(free, res):
                            resident[j] = r
                        for mode in modes:
                            yield Schedule(num_layers=L, homes=homes, keep_internals=tuple(keep_internals),
                                           resident_weights=tuple(resident), offload_window=probe.offload_window,
                                           reload_window=tuple(reload_window), internals_offload_window=tuple(off),
                                           internals_reload_window=tuple(back), partial_keep=tuple(partial_keep),
                                           optimizer=mode)
