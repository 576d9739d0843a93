"""Which budget is short: the floors a plan can use, and the error when none of them fits.

Note: [no schedule fits]
``diagnose`` names a tier that is short on its own: the host without room for the static state, the GPU
without room for its floor even with every activation off it. Past that, the budgets can still be short
*together*: the GPU fits only with the activations on the host, the host fits only with them on the GPU
(recomputed). Whether some mix of homes fits is the MILP's question, so this is asked when it found none:
each floor -- every boundary on the host (the least device memory), every boundary recomputed (no host
activations), every boundary the drive can take on NVMe -- is replayed, and the error names the tier that
is short on the floor that needs the GPU least, with what each floor needs. Before, the answer was "gpu
memory short by 0 B" and a pointer to ``diagnose``, which had passed.
"""

from __future__ import annotations

from .errors import InfeasibleBudget
from .hardware import Hardware
from .policies import min_memory, recompute_all
from .schedule import Schedule
from .simulator import MEM_TOL, SimResult, simulate
from .units import format_bytes, format_bytes_at_least
from .workload import Workload

#: a resource of ``cap_violations`` -> the tier ``InfeasibleBudget`` names
TIERS = {"gpu_memory": "gpu", "cpu_memory": "cpu", "nvme_capacity": "nvme"}


def cap_violations(sim: SimResult, hw: Hardware) -> list[dict]:
    """The budgets a replayed schedule exceeds (the checks ``simulate`` makes, as data): per resource the
    need, the cap, the excess (bytes) and, for device memory, the peak window. Empty when it fits."""
    checks = (("gpu_memory", sim.peak_gpu_bytes, hw.gpu_memory_cap_bytes, sim.peak_window),
              ("cpu_memory", sim.peak_cpu_bytes, hw.cpu_memory_bytes, None),
              ("nvme_capacity", sim.nvme_bytes, hw.nvme_capacity_bytes, None))
    return [{"resource": name, "need_bytes": need, "cap_bytes": cap, "excess_bytes": need - cap, "window": window}
            for name, need, cap, window in checks if need > cap + MEM_TOL]


def floors(wl: Workload, hw: Hardware) -> list[tuple[str, Schedule, SimResult]]:
    """(what, schedule, replay unchecked) of each floor: every boundary on the host, on NVMe (with a drive),
    recomputed."""
    L = wl.num_layers
    named = [("every activation on the host", min_memory(L))]
    if hw.nvme_capacity_bytes > 0:
        named.append(("every activation the drive can take on NVMe", min_memory(L, "nvme")))
    named.append(("every boundary recomputed", recompute_all(L)))
    out = []
    for what, s in named:
        s = s.in_mode(wl.data_parallel)
        out.append((what, s, simulate(s, wl, hw, check=False)))
    return out


def workload_fits(wl: Workload, hw: Hardware) -> bool:
    """Does a schedule fit: the static state within the host and the GPU cap, and a floor within every budget?"""
    if wl.host_static_bytes > hw.cpu_memory_bytes or wl.static_gpu_bytes > hw.gpu_memory_cap_bytes:
        return False
    return fitting_floor(wl, hw) is not None


def fitting_floor(wl: Workload, hw: Hardware) -> tuple[Schedule, SimResult] | None:
    """The fastest floor within every budget, or None."""
    ok = [(s, sim) for _, s, sim in floors(wl, hw) if not cap_violations(sim, hw)]
    return min(ok, key=lambda f: f[1].iteration_seconds) if ok else None


def no_schedule(wl: Workload, hw: Hardware, why: str) -> InfeasibleBudget:
    """The error for "no schedule fits" (Note: [no schedule fits]); ``why``: what found none."""
    found = [(what, cap_violations(sim, hw), sim) for what, _, sim in floors(wl, hw)]
    lines, fixes = [], []
    for what, short, _ in found:
        text = ", ".join(f"{TIERS[v['resource']]} short by {format_bytes(v['excess_bytes'])} (needs "
                         f"{format_bytes(v['need_bytes'], digits=4)})" for v in short) or "fits"
        lines.append(f"with {what}: {text}")
        if len(short) == 1:  # short of one tier only: enough of it is a fix
            v = short[0]
            fixes.append(f"{TIERS[v['resource']]} memory of at least {format_bytes_at_least(v['need_bytes'])} "
                         f"({what})")
    # the tier named: the smallest host-side shortage of a floor whose GPU fits (the GPU's own shortage is
    # diagnose's); when no floor fits the GPU, the GPU's on the floor that needs it least
    host_side = [v for _, short, _ in found if not any(v["resource"] == "gpu_memory" for v in short)
                 for v in short]
    if host_side:
        named = min(host_side, key=lambda v: v["excess_bytes"])
    else:
        least = min(found, key=lambda f: f[2].peak_gpu_bytes)
        named = {"resource": "gpu_memory", "excess_bytes": least[2].peak_gpu_bytes - hw.gpu_memory_cap_bytes}
    suggestion = ("any one of: " + ", ".join(fixes) if fixes else "more memory in each tier named") + \
        "; or a smaller micro-batch"
    return InfeasibleBudget(TIERS[named["resource"]], max(named["excess_bytes"], 0.0),
                            f"{why}: the budgets are short together ({'; '.join(lines)})", suggestion)
