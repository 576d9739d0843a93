"""Where each parameter group's dtype conversions run: a decision of the plan.

Note: [conversion placement] With fp32 masters and 16-bit compute copies (``fp32_masters``, the
papers' setup) every weight fetch needs a cast and every gradient copy a widening. The engine runs
each on either side of the link (engine/copy_engine.py, Note: [conversion on the device]):

============  =====================================  ===========================================
              host (the host lane)                   device
============  =====================================  ===========================================
cast masters  reads 4 + writes e bytes per parameter  4 bytes per parameter cross the link (not
              before a fetch (once per micro-batch    e); the device casts at memory speed
              with kept copies); e bytes cross
widen grads   e bytes cross; the host widens and      4 bytes cross; the host adds fp32 to fp32
              adds them into the fp32 gradient (a     (16 bytes per parameter, norm included), or,
              mixed-dtype add: slow on CPUs)          for a step's first copy of a group, nothing
                                                      but the norm: the copy lands in the host
                                                      gradient itself (Note: [direct landing])
============  =====================================  ===========================================

So a device conversion moves work from the host lane to a link (and adds one bounded fp32 buffer
per lane on the device). Which is faster depends on the rates: a host lane that cannot keep up with
the device wants the device; a slow link with a fast host wants the host. The choice is per
parameter group class (the blocks; the non-block group), priced by :func:`price` from the hardware's
host rates and link bandwidths, and made by the plan (``plan.make_plan``/``autoplan``): every
candidate's workload is simulated over the baseline schedules, the MILP solves for the best, and its
schedule is re-simulated under every candidate (another candidate that is faster there is solved
once more). The priced workload is the one the plan's figures come from.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from .hardware import Hardware
from .schedule import Schedule
from .workload import HOST_GRAD_BYTES, HOST_MASTER_BYTES, PARAM_SLOTS, Workload, host_lane_seconds_per_param

__all__ = ["CONVERSION_BUFFER_ELEMENTS", "HOST_ONLY", "Placement", "calibrate_host_rates", "candidates", "median_host_seconds",
           "opposite", "price", "priced_from_rates"]

# Elements of the device buffer each copy lane converts through (the engine's ``VIA_NUMEL``): 64 MiB
# in fp32; larger groups are copied through it in chunks.
CONVERSION_BUFFER_ELEMENTS = 1 << 24
# calibrate_host_rates: the most of a kind's measured seconds per job its fixed cost may take
JOB_SHARE_MAX = 0.9


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """True: that conversion runs on the device; False: on the host."""

    cast_blocks: bool = False
    widen_blocks: bool = False
    cast_rest: bool = False
    widen_rest: bool = False

    @classmethod
    def from_names(cls, names: tuple[str, ...] | list[str]) -> Placement:
        known = {f.name for f in fields(cls)}
        unknown = set(names) - known
        if unknown:
            raise ValueError(f"unknown conversions {sorted(unknown)}; they are {sorted(known)}")
        return cls(**{name: True for name in names})

    @property
    def names(self) -> tuple[str, ...]:
        """The conversions on the device."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name))

    def label(self) -> str:
        """One line for the plan's report, e.g. ``blocks: cast device, widen host; non-block: ...``."""
        side = {True: "device", False: "host"}
        return (f"blocks: cast on {side[self.cast_blocks]}, grads widened on {side[self.widen_blocks]}; "
                f"non-block: cast on {side[self.cast_rest]}, grads widened on {side[self.widen_rest]}")

    def groups(self, num_layers: int) -> dict[str, list[int]]:
        """The engine's ``Executor.set_placement`` arguments (group ids; -1: the non-block group)."""
        blocks = list(range(num_layers))
        return {"cast_on_device": (blocks if self.cast_blocks else []) + ([-1] if self.cast_rest else []),
                "widen_on_device": (blocks if self.widen_blocks else []) + ([-1] if self.widen_rest else [])}


HOST_ONLY = Placement()


def candidates(wl: Workload) -> list[Placement]:
    """Every placement that changes something: none (the host) when nothing is converted (masters
    in the compute dtype, or compute copies of unknown size, ``Workload.compute_bytes == 0``)."""
    if not 0 < wl.compute_bytes < HOST_MASTER_BYTES or wl.data_parallel == "shard":
        return [HOST_ONLY]
    return [Placement(cast_blocks=a, widen_blocks=b, cast_rest=c, widen_rest=d)
            for a, b, c, d in itertools.product((False, True), repeat=4)]


def _host_rates(hw: Hardware) -> tuple[float, float, float, float]:
    """Bytes/s of the host lane's casts (``host_bytes_per_s``), its widening add (16-bit into fp32;
    ``host_widen_bytes_per_s``), its fp32 adds (``host_add_bytes_per_s``) and its gradient norms
    (``host_norm_bytes_per_s``); the widening and fp32 adds default to the casts', the norms to the adds'."""
    add = hw.host_add_bytes_per_s or hw.host_bytes_per_s
    return (hw.host_bytes_per_s, hw.host_widen_bytes_per_s or hw.host_bytes_per_s, add,
            hw.host_norm_bytes_per_s or add)


def _cast_seconds(params: float, e: int, device: bool, hw: Hardware, jobs: int = 1) -> tuple[float, float]:
    """(param_widen: link bytes per byte of the device's copy, host seconds) of one weight fetch:
    its bytes at the cast rate plus ``jobs`` host-lane jobs' fixed cost (``host_job_seconds``; the
    non-block group casts in one job per part)."""
    if device:
        return HOST_MASTER_BYTES / e, 0.0
    return 1.0, params * (HOST_MASTER_BYTES + e) / _host_rates(hw)[0] + jobs * hw.host_job_seconds


def _accum_seconds(params: float, e: int, device: bool, copies_per_step: float, hw: Hardware,
                   jobs: int = 1, norms: bool = True) -> tuple[float, float]:
    """(grad_widen, host seconds per gradient copy, on average over a step's ``copies_per_step``).

    Host: read the e-byte gradient, widen-add it into the fp32 gradient (read + write). Device: a
    step's first copy lands in the host gradient, the others add fp32 to fp32 (read 4, read + write 8).
    Either way the step's last copy then reads it for the norms (``HOST_GRAD_BYTES``, at the norm rate;
    not with ``norms=False``, ``Workload.host_norms``).
    Every copy is ``jobs`` host-lane jobs (one per part of the non-block group), each with its fixed
    cost (``host_job_seconds``), whatever it does."""
    fixed = jobs * hw.host_job_seconds
    if not device:  # the analytic workload's own host-side figure (planner/workload.py)
        return 1.0, params * host_lane_seconds_per_param(e, e, hw, copies_per_step, norms)[1] + fixed
    _, _, same, norm = _host_rates(hw)
    n = max(1.0, copies_per_step)
    return HOST_MASTER_BYTES / e, params * ((n - 1) * 3 * HOST_GRAD_BYTES / n / same
                                            + (HOST_GRAD_BYTES / norm / n if norms else 0.0)) + fixed


def price(wl: Workload, p: Placement, hw: Hardware) -> Workload:
    """``wl`` with its conversions placed as ``p`` (what moves over each link, what the host lane
    does, the device's conversion buffers, the host's landing and cast buffers). Groups whose
    conversions stay where ``wl`` has them keep its (possibly measured) figures."""
    e = wl.compute_bytes
    cur = Placement.from_names(wl.device_conversions)
    if p == cur or p not in candidates(wl):
        return wl
    g = wl.grad_accum
    layers = []
    for layer in wl.layers:
        new = {}
        if p.cast_blocks != cur.cast_blocks:
            new["param_widen"], new["cast_seconds"] = _cast_seconds(layer.params, e, p.cast_blocks, hw)
        if p.widen_blocks != cur.widen_blocks:
            new["grad_widen"], new["accum_seconds"] = _accum_seconds(layer.params, e, p.widen_blocks, g, hw,
                                                                     norms=wl.host_norms)
        layers.append(replace(layer, **new) if new else layer)
    out: dict = {"layers": tuple(layers), "device_conversions": p.names}
    n, parts = wl.nonblock_params, wl.nonblock_part_count  # a job per part (the figures: the parts' sum)
    if p.cast_rest != cur.cast_rest:
        out["nonblock_param_widen"], out["nonblock_cast_seconds"] = _cast_seconds(n, e, p.cast_rest, hw, parts)
    if p.widen_rest != cur.widen_rest:  # one copy per step (accumulated on the device over micro-batches)
        out["nonblock_grad_widen"], out["nonblock_accum_seconds"] = _accum_seconds(n, e, p.widen_rest, 1, hw, parts,
                                                                                   norms=wl.host_norms)
    out["conversion_gpu_bytes"] = float(_conversion_gpu_bytes(wl, p))
    out["host_static_bytes"] = wl.host_static_bytes + _host_delta(wl, cur, p)
    return replace(wl, **out).validate()


def conversions_note(wl: Workload, p: Placement) -> str:
    """``"; conversions: <label>"`` for a report's header when ``wl`` has conversions to place, else ""."""
    return f"; conversions: {p.label()}" if len(candidates(wl)) > 1 else ""


def opposite(p: Placement) -> Placement:
    """Every conversion on the other side."""
    return Placement(**{f.name: not getattr(p, f.name) for f in fields(p)})


def priced_from_rates(wl: Workload, p: Placement, hw: Hardware) -> Workload:
    """``wl`` placed as ``p`` with every host-lane figure priced from ``hw``'s rates (none of the
    workload's measured per-layer host seconds reused)."""
    return price(replace(wl, device_conversions=opposite(p).names), p, hw)


def calibrate_host_rates(wl: Workload, schedule: Schedule, hw: Hardware) -> Hardware:
    """Note: [host rates in place] The host lane's rates measured alone (``autoplan.host_rates``)
    are faster than the lane runs beside compute and the copy threads (cores and memory bandwidth
    shared: 2.2-3.5x on a 2-core machine), and not alike for every kind of work. A profiled step
    measured the lane as it runs: a host-lane job takes ``host_job_seconds`` (measured in place,
    ``autoplan.host_job_seconds``) plus its bytes at its rate; the cast rate is scaled so that the
    profiled schedule's casts, priced from it, take what they measured, the adds' rates (widening,
    like-to-like, norms) so that its gradient accumulations do -- each after the fixed cost of its
    jobs. The other placements are priced with the scaled rates and the same fixed cost: a placement
    whose host jobs are small (the norms alone) is then not priced as their bytes alone. The fixed
    cost is kept below ``JOB_SHARE_MAX`` of a kind's measured seconds per job (the profile bounds
    it: a job took no less than its fixed cost). ``hw`` unchanged when the workload has no
    conversions or no host work."""
    from .simulator import simulate

    cur = Placement.from_names(wl.device_conversions)
    if len(candidates(wl)) == 1:
        return hw

    def host_seconds(w: Workload, h: Hardware) -> tuple[dict[str, float], dict[str, int]]:
        seconds: dict[str, float] = {}
        jobs: dict[str, int] = {}
        for s in simulate(schedule, w, h, check=False).timeline:
            if s.lane == "host" and s.end > s.start:
                seconds[s.kind] = seconds.get(s.kind, 0.0) + s.end - s.start
                jobs[s.kind] = jobs.get(s.kind, 0) + 1
        return seconds, jobs

    measured, _ = host_seconds(wl, hw)
    _, jobs = host_seconds(priced_from_rates(wl, cur, hw.replace(host_job_seconds=0.0)), hw)
    job = hw.host_job_seconds
    for kind in ("cast", "accumulate"):
        if measured.get(kind, 0) > 0 and jobs.get(kind, 0) > 0:
            job = min(job, JOB_SHARE_MAX * measured[kind] / jobs[kind])
    base = hw.replace(host_job_seconds=job)
    predicted, _ = host_seconds(priced_from_rates(wl, cur, base), base)
    # the bytes' share of each kind, measured over predicted (the fixed part is the same in both)
    factors = {kind: (measured[kind] - jobs.get(kind, 0) * job) / (predicted[kind] - jobs.get(kind, 0) * job)
               for kind in ("cast", "accumulate")
               if measured.get(kind, 0) > 0 and predicted.get(kind, 0) - jobs.get(kind, 0) * job > 0}
    if not factors:
        return hw
    cast, widen, add, norm = _host_rates(hw)
    k_cast = factors.get("cast", factors.get("accumulate"))
    k_acc = factors.get("accumulate", k_cast)
    return base.replace(host_bytes_per_s=cast / k_cast, host_widen_bytes_per_s=widen / k_acc,
                        host_add_bytes_per_s=add / k_acc, host_norm_bytes_per_s=norm / k_acc)


def median_host_seconds(workloads: Sequence[Workload]) -> Workload:
    """Several profiled steps' host lane as one: the first of ``workloads`` (steps of one model under
    one schedule and placement) with each host-lane figure the mean over them, the casts (every
    layer's ``cast_seconds``, the non-block group's) then scaled together so that their sum is the
    median of the steps' sums, and the gradient accumulations (``accum_seconds``) alike. A step's
    host-lane jobs wait for cores and the interpreter lock as they happen to (long waits now and
    then: skewed): the median step bounds an outlier step's weight, and the sum of per-layer medians
    would fall short of a typical step's total. For ``calibrate_host_rates`` from several steps."""
    if not workloads:
        raise ValueError("median_host_seconds needs at least one workload")
    first = workloads[0]
    if any(len(w.layers) != len(first.layers) for w in workloads):
        raise ValueError("median_host_seconds: the workloads have different numbers of layers")

    def scaled(per_layer: str, rest: str) -> tuple[list[float], float]:
        mean = [statistics.fmean(getattr(w.layers[j], per_layer) for w in workloads) for j in range(len(first.layers))]
        mean_rest = statistics.fmean(getattr(w, rest) for w in workloads)
        total = sum(mean) + mean_rest
        target = statistics.median(sum(getattr(layer, per_layer) for layer in w.layers) + getattr(w, rest)
                                   for w in workloads)
        k = target / total if total > 0 else 1.0
        return [x * k for x in mean], mean_rest * k

    cast, cast_rest = scaled("cast_seconds", "nonblock_cast_seconds")
    accum, accum_rest = scaled("accum_seconds", "nonblock_accum_seconds")
    layers = tuple(replace(layer, cast_seconds=c, accum_seconds=a) for layer, c, a in zip(first.layers, cast, accum))
    return replace(first, layers=layers, nonblock_cast_seconds=cast_rest, nonblock_accum_seconds=accum_rest)


def _conversion_gpu_bytes(wl: Workload, p: Placement) -> int:
    """The device's fp32 conversion buffer per lane in use (``CONVERSION_BUFFER_ELEMENTS`` at most)."""
    largest_block = max(layer.params for layer in wl.layers)
    total = 0
    for blocks, rest in ((p.cast_blocks, p.cast_rest), (p.widen_blocks, p.widen_rest)):
        numel = max(largest_block if blocks else 0, wl.nonblock_params if rest else 0)
        total += min(CONVERSION_BUFFER_ELEMENTS, numel) * HOST_MASTER_BYTES
    return total


def _host_buffers(wl: Workload, p: Placement) -> float:
    """Host bytes of the buffers a placement changes (approximate: parameters, not aligned elements):
    the slots' gradient landing buffers (e bytes, or 4 where the device widens) and the host casts'
    buffers (a cast buffer per slot, or every group's kept copy; none where the device casts)."""
    e = wl.compute_bytes
    block_slot, rest_slot = max(layer.params for layer in wl.layers), wl.nonblock_params
    landing = (PARAM_SLOTS * block_slot * (HOST_MASTER_BYTES if p.widen_blocks else e)
               + rest_slot * (HOST_MASTER_BYTES if p.widen_rest else e))
    if wl.kept_copies:
        casts = (sum(layer.params for layer in wl.layers) if not p.cast_blocks else 0) + (
            rest_slot if not p.cast_rest else 0)
    else:
        casts = (PARAM_SLOTS * block_slot if not p.cast_blocks else 0) + (rest_slot if not p.cast_rest else 0)
    return landing + casts * e


def _host_delta(wl: Workload, cur: Placement, p: Placement) -> float:
    return _host_buffers(wl, p) - _host_buffers(wl, cur)
