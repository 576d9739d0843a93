"""The planner's front door: build the workload, solve (or apply a policy), compare with the
baselines, diagnose infeasible inputs, search the micro-batch size."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from .errors import InfeasibleBudget, InfeasibleSchedule, InvalidInput
from .hardware import Hardware
from .milp import MilpOptions
from .placement import HOST_ONLY, Placement, candidates, price
from .solve import SolveResult, solve
from .model import ModelSpec, TrainSpec
from .policies import BASELINES, baseline, min_memory
from .schedule import Schedule
from .shortage import cap_violations, workload_fits
from .simulator import SimResult, simulate
from .units import format_bytes, format_bytes_at_least
from .workload import Workload

GB = 1e9


@dataclass(kw_only=True)
class PlanResult:
    status: str
    schedule: Schedule
    sim: SimResult
    workload: Workload
    hardware: Hardware
    solver: dict = field(default_factory=dict)
    baselines: dict[str, SimResult | str] = field(default_factory=dict)  # name -> result or reason
    baseline_schedules: dict[str, Schedule] = field(default_factory=dict)
    model: ModelSpec | None = None
    train: TrainSpec | None = None
    # the budgets the replayed plan exceeds (see ``cap_violations``): only possible when the MILP checks memory
    # as one aggregate sum (``MilpOptions.window_memory=False``, the paper's constraint)
    violations: list[dict] = field(default_factory=list)
    # where each parameter group's dtype conversions run (placement.py); ``workload`` is priced for it
    placement: Placement = HOST_ONLY

    @property
    def over_cap(self) -> bool:
        return bool(self.violations)

    def over_cap_note(self) -> str:
        """Each exceeded budget and by how much, on one line ("" if none)."""
        parts = []
        for v in self.violations:
            where = f" in window {v['window']}" if v.get("window") else ""
            parts.append(f"{v['resource']} {format_bytes(v['need_bytes'])}{where} > cap {format_bytes(v['cap_bytes'])} "
                         f"(+{format_bytes(v['excess_bytes'])})")
        return "; ".join(parts)

    def to_json(self) -> dict:
        """The content of plan.json."""
        base = {name: (r.predicted() if isinstance(r, SimResult) else {"infeasible": r})
                for name, r in self.baselines.items()}
        return {
            "status": self.status,
            "over_cap": self.over_cap,
            "over_cap_by": {v["resource"]: {"excess_bytes": v["excess_bytes"], "need_bytes": v["need_bytes"],
                                            "cap_bytes": v["cap_bytes"], "window": v.get("window")}
                            for v in self.violations},
            "solver": self.solver,
            "schedule": self.schedule.to_json(nonblock_parts=self.workload.nonblock_part_count),
            "conversions_on_device": list(self.placement.names),
            "predicted": self.sim.predicted(),
            "baselines": base,
            "hardware": self.hardware.name,
            "model": self.model.name if self.model else self.workload.name,
            "train": None if self.train is None else {
                "micro_batch_size": self.train.micro_batch_size, "seq_len": self.train.seq_len,
                "grad_accum": self.train.grad_accum, "dtype": self.train.dtype},
        }

    def rows(self) -> PlanRows:
        """One row per schedule (this plan first) for the comparison table, with the legend that explains
        its columns (``PlanRows.legend``: ``report.format_table`` prints it under the table); a plan over a
        cap says so in its ``note``. tokens/s and TFLOPS only when the workload counts tokens (more than
        one per micro-batch: a batch without token ids is planned with a count of 1)."""
        tokens = self.workload.tokens > 1
        out = PlanRows([_row("plan (" + (self.schedule.policy or "milp") + ")", self.sim, self.schedule, tokens)])
        if self.over_cap:
            out[0]["note"] = "OVER CAP: " + self.over_cap_note()
        for name, r in self.baselines.items():
            out.append(_row(name, r, self.baseline_schedules.get(name), tokens))
        schedules = [self.schedule, *self.baseline_schedules.values()]
        out.legend = table_legend(self.workload, self.hardware, tokens=tokens,
                                  partial=any(s.partial_layers for s in schedules))
        return out


class PlanRows(list):
    """The rows of a plan's comparison table (dicts, ``report.format_table``'s input), and ``legend``: the
    lines that explain its columns, printed under the table."""

    def __init__(self, rows: Iterable[dict] = (), legend: Iterable[str] = ()) -> None:
        super().__init__(rows)
        self.legend = list(legend)


#: the boundary homes the table's "boundaries g/c/n/r" column counts, in its order, with their letters
HOME_LETTERS = (("gpu", "g"), ("cpu", "c"), ("nvme", "n"), ("recompute", "r"))


def _row(name: str, r: SimResult | str, s: Schedule | None, tokens: bool = True) -> dict:
    """A schedule's row: predicted seconds per step, tokens/s and TFLOPS (``tokens``: the workload counts
    tokens), peak device memory, exposed seconds, the boundaries by home and the layer re-runs."""
    if not isinstance(r, SimResult):
        return {"schedule": name, "infeasible": r}
    row: dict = {"schedule": name, "iteration_s": r.iteration_seconds}
    if tokens:
        row.update(tokens_per_s=r.tokens_per_second, tflops=r.tflops)
    row.update(peak_gpu_gb=r.peak_gpu_bytes / GB, exposed_s=r.exposed_transfer_seconds)
    if s is not None:
        counts = s.count_homes()
        row["homes"] = "/".join(f"{counts.get(h, 0)}" for h, _ in HOME_LETTERS)
        row["reruns"] = s.recomputed_layers
    return row


def table_legend(wl: Workload, hw: Hardware, *, tokens: bool = True, partial: bool = False) -> list[str]:
    """What the comparison table's columns mean, for this workload (its layer count, accumulation and
    where its timings come from)."""
    L, g = wl.num_layers, wl.grad_accum
    step = "per optimizer step" + (f" ({g} micro-batches and the optimizer tail)" if g > 1 else "")
    lines = [f"iter [s]: predicted seconds {step} (the simulator replays the schedule window by window)"]
    if tokens:
        lines.append(f"tokens/s: {wl.tokens * g:,} tokens per step / iter [s]; TFLOPS: 6 x parameters x tokens / "
                     "iter (MegaTrain's convention)")
    else:
        lines.append("no tokens/s or TFLOPS: the batch carries no token count (no token ids): compare iter [s]")
    lines += [
        "peak GPU [GB]: the most compute-device memory any window of the step holds (1 GB = 1e9 bytes)",
        ("exposed [s]: window time not covered by compute, per step (the compute lane waiting for copies, host "
         "casts and gradient adds, or the optimizer)"),
        (f"boundaries g/c/n/r: the {L + 1} boundary activations (each layer's input, and the head's) by where they "
         "wait for the backward: g on the GPU, c in host memory, n on NVMe, r dropped and recomputed from an "
         "earlier boundary"),
        ("re-runs: extra layer forwards per micro-batch: those that recompute r boundaries, plus one for every layer "
         "that does not keep its internals (re-run before its backward, from its kept input): keep_all 0; "
         f"recompute_all {L}, its {L + 1} boundaries all on the GPU"
         + ("; a partially kept layer re-runs only its elementwise ops and is not counted" if partial else "")),
    ]
    if wl.name == "measured":
        lines.append("predicted from one profiled training step (its timings, measured once, vary from run to run "
                     "on a busy machine); the drift monitor re-profiles if the measured step times move away from "
                     "this prediction and stay there")
    else:
        lines.append(f"predicted from the model's shapes and the {hw.name} hardware profile (nothing measured)")
    return lines


def evaluate_baselines(wl: Workload, hw: Hardware, K: int = 4) -> tuple[dict, dict]:
    results: dict[str, SimResult | str] = {}
    schedules: dict[str, Schedule] = {}
    for name in BASELINES:
        s = baseline(name, wl.num_layers, K).in_mode(wl.data_parallel)
        schedules[name] = s
        try:
            results[name] = simulate(s, wl, hw)
        except InfeasibleSchedule as err:
            results[name] = str(err)
    return results, schedules


#: the fix for host memory in lazytrain-plan's terms (InfeasibleBudget.reworded puts it in a caller's)
EIGHT_BIT_FIX = "train.eight_bit_fraction=1.0"


def diagnose(wl: Workload, hw: Hardware, model: ModelSpec | None = None, train: TrainSpec | None = None) -> None:
    """Raise ``InfeasibleBudget`` naming the short tier if no schedule can fit; return otherwise. A "smallest"
    figure it suggests is rounded up (``format_bytes_at_least``): typed back in, it fits."""
    if wl.host_static_bytes > hw.cpu_memory_bytes:
        short = wl.host_static_bytes - hw.cpu_memory_bytes
        eight = ("8-bit optimizer states are already on for every parameter" if train is not None
                 and train.eight_bit_fraction >= 1.0 else f"8-bit optimizer states shrink it: {EIGHT_BIT_FIX}")
        raise InfeasibleBudget(
            "cpu", short, f"master weights, gradients and optimizer states need {format_bytes(wl.host_static_bytes)} "
            f"of host memory, {hw.name} has {format_bytes(hw.cpu_memory_bytes)}",
            f"smallest host memory that works: {format_bytes_at_least(wl.host_static_bytes)} ({eight})",
            fits_bytes=wl.host_static_bytes)
    floor = wl.static_gpu_bytes
    tight = simulate(min_memory(wl.num_layers).in_mode(wl.data_parallel), wl, hw, check=False)
    if floor > hw.gpu_memory_cap_bytes:
        need = max(floor, tight.peak_gpu_bytes)  # above the floor, the smallest schedule's peak must fit too
        raise InfeasibleBudget(
            "gpu", floor - hw.gpu_memory_cap_bytes,
            f"resident non-block weights, their grads and two layer buffers need {format_bytes(floor)} before any "
            f"activation, the cap is {format_bytes(hw.gpu_memory_cap_bytes)}",
            f"smallest GPU budget that works for this batch: {format_bytes_at_least(need)}", fits_bytes=need)
    if tight.peak_gpu_bytes > hw.gpu_memory_cap_bytes:
        hint = ""
        if model is not None and train is not None:
            best = largest_batch(model, train, hw)
            hint = (f"largest micro-batch that fits: {best}; " if best else "no micro-batch fits; ")
        raise InfeasibleBudget(
            "gpu", tight.peak_gpu_bytes - hw.gpu_memory_cap_bytes,
            f"even with every activation on the host the peak is {format_bytes(tight.peak_gpu_bytes)} "
            f"(window {tight.peak_window}), the cap is {format_bytes(hw.gpu_memory_cap_bytes)}",
            hint + f"smallest GPU budget for this batch: {format_bytes_at_least(tight.peak_gpu_bytes)}",
            fits_bytes=tight.peak_gpu_bytes)


def make_plan(model: ModelSpec, train: TrainSpec, hardware: Hardware, *, policy: str = "milp",
              options: MilpOptions | None = None, K: int = 4, workload: Workload | None = None) -> PlanResult:
    """Plan one run. ``policy``: milp | megatrain | keep_all | recompute_all."""
    wl = workload or Workload.analytic(model, train, hardware)
    diagnose(wl, hardware, model, train)
    fixed = None if policy == "milp" else baseline(policy, wl.num_layers, K).in_mode(wl.data_parallel)
    result = plan_workload(wl, hardware, fixed=fixed, options=options, K=K)
    result.model, result.train = model, train
    return result


def plan_workload(wl: Workload, hw: Hardware, *, fixed: Schedule | None = None, options: MilpOptions | None = None,
                  K: int = 4, start: Schedule | None = None) -> PlanResult:
    """Place the conversions, evaluate the baselines and solve (or simulate the ``fixed`` schedule)
    on a workload that has passed ``diagnose``; ``start``: a re-plan's current schedule (``solve``).

    Note: [conversion placement] (placement.py): the placement whose priced workload runs the
    candidate schedules (the baselines, or the fixed one) fastest is solved for; the solved schedule
    is then simulated under every placement, and a faster one is solved once more."""
    mode = (options or MilpOptions()).conversions
    trial = [fixed] if fixed is not None else [s.in_mode(wl.data_parallel) for s in
                                                (baseline(name, wl.num_layers, K) for name in BASELINES)]
    placement, wl = place_conversions(wl, hw, mode, trial)
    results, schedules = evaluate_baselines(wl, hw, K)
    if fixed is not None:
        sim = simulate(fixed, wl, hw)  # raises InfeasibleSchedule naming the resource
        return PlanResult(status="policy", schedule=fixed, sim=sim, workload=wl, hardware=hw,
                          solver={"name": "none", "policy": fixed.policy}, baselines=results,
                          baseline_schedules=schedules, violations=cap_violations(sim, hw), placement=placement)
    sol: SolveResult = solve(wl, hw, options, start=start)
    if mode == "plan":
        better, better_wl = place_conversions(wl, hw, mode, [sol.schedule])
        if better != placement:
            again = solve(better_wl, hw, options, start=sol.schedule)
            if again.simulated.iteration_seconds < sol.simulated.iteration_seconds:
                sol, placement, wl = again, better, better_wl
                results, schedules = evaluate_baselines(wl, hw, K)
    return PlanResult(status=sol.status, schedule=sol.schedule, sim=sol.simulated, workload=wl, hardware=hw,
                      solver=sol.solver_json(), baselines=results, baseline_schedules=schedules,
                      violations=cap_violations(sol.simulated, hw), placement=placement)


def with_update_timing(s: Schedule, wl: Workload, hw: Hardware) -> Schedule:
    """A named policy's schedule where the run lets its optimizer update in the backward
    (``Workload.updates_in_backward``; Note: [updates in the backward pass] in core/optimizer_steps.py):
    with the updates in the backward or at the step, whichever the simulator finds faster (a tie keeps
    the schedule as given). The MILP makes that choice itself for its own schedules; a plan file's is
    kept as written."""
    if not wl.updates_in_backward or s.optimizer != "pipelined" or s.data_parallel != "none" or s.serial_layers:
        return s
    other = replace(s, updates_in_backward=not s.updates_in_backward)
    try:
        if simulate(other, wl, hw).iteration_seconds < simulate(s, wl, hw).iteration_seconds * (1 - 1e-9):
            return other
    except InfeasibleSchedule:  # the same memory either way: the given one says why
        pass
    return s


def place_conversions(wl: Workload, hw: Hardware, mode: str, schedules: list[Schedule]) -> tuple[Placement, Workload]:
    """Where the conversions run (Note: [conversion placement] in placement.py): ``mode`` "host" or
    "device" forces it (as far as the workload has conversions); "plan" takes the candidate whose
    priced workload runs the fastest of ``schedules`` (a tie keeps the host: no device buffers).
    Returns the placement and the workload priced for it."""
    options = candidates(wl)
    if mode not in ("plan", "host", "device"):
        raise InvalidInput("conversions", mode, "must be 'plan', 'host' or 'device'")
    if mode != "plan" or len(options) == 1:
        chosen = options[-1] if mode == "device" else HOST_ONLY if HOST_ONLY in options else options[0]
        return chosen, price(wl, chosen, hw)
    best: tuple[float, int, Placement, Workload] | None = None
    for rank, p in enumerate(options):
        priced = price(wl, p, hw)
        for s in schedules:
            try:
                seconds = simulate(s, priced, hw).iteration_seconds
            except InfeasibleSchedule:
                continue
            key = (seconds * (1 + 1e-9), rank)  # a tie: the candidate with fewer device conversions
            if best is None or key < best[:2]:
                best = (*key, p, priced)
    if best is None:  # nothing fits anywhere: the host, and let the solve say why
        return HOST_ONLY, price(wl, HOST_ONLY, hw)
    return best[2], best[3]


def fits(model: ModelSpec, train: TrainSpec, hw: Hardware) -> bool:
    """Does a schedule of the executor fit? The floors tried: every boundary on the host (the least device
    memory), every boundary recomputed (no host activations) and, with a drive, every boundary it can take
    on NVMe; one within every budget is enough (before, only the first, so a host too small for the
    activations ruled out batches that recompute or spill plan fine)."""
    return workload_fits(Workload.analytic(model, train, hw), hw)


def largest_where(ok, upper: int) -> int:
    """Largest b in [1, upper] with ok(b) (0 if none), for a predicate that is monotone in b."""
    lo, hi = 0, 1
    while hi <= upper and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, upper + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def largest_batch(model: ModelSpec, train: TrainSpec, hw: Hardware, upper: int = 4096) -> int:
    """Largest micro-batch for which some schedule fits (0 if none). Memory grows with the batch."""
    return largest_where(lambda b: fits(model, train.replace(micro_batch_size=b), hw), upper)


def largest_batch_for(schedule_fn, model: ModelSpec, train: TrainSpec, hw: Hardware, upper: int = 4096) -> int:
    """Largest micro-batch for which the fixed policy ``schedule_fn(L)`` fits."""
    def ok(b: int) -> bool:
        wl = Workload.analytic(model, train.replace(micro_batch_size=b), hw)
        try:
            simulate(schedule_fn(wl.num_layers), wl, hw)
            return True
        except InfeasibleSchedule:
            return False

    return largest_where(ok, upper)


@dataclass(kw_only=True)
class BatchSearch:
    largest_feasible: int
    best_throughput: int
    table: list[dict]  # micro_batch_size, tokens_per_s, iteration_s, status


def search_batch(model: ModelSpec, train: TrainSpec, hw: Hardware, options: MilpOptions | None = None,
                 candidates: list[int] | None = None) -> BatchSearch:
    """``micro_batch_size: auto``: the largest feasible batch, and the one with the best predicted tokens/s
    among ``candidates`` (default: powers of two and the largest, solved with the MILP)."""
    top = largest_batch(model, train, hw)
    if top == 0:
        diagnose(Workload.analytic(model, train.replace(micro_batch_size=1), hw), hw, model, train)
        raise InfeasibleBudget("gpu", 0.0, "no micro-batch size fits", "")

    def plan_at(b: int) -> tuple[SimResult, float, str]:
        result = make_plan(model, train.replace(micro_batch_size=b), hw, options=options)
        return result.sim, result.sim.tokens_per_second, result.status

    return search_candidates(top, candidates, plan_at)


def search_candidates(top: int, candidates: list[int] | None, plan_at, where: str = "") -> BatchSearch:
    """The search's table over ``candidates`` up to the largest feasible batch ``top`` (default: powers of two
    and ``top``): ``plan_at(b)`` gives (its replay, its tokens/s, its status); the best is the most tokens/s.
    ``where``: what fits is named for (in the error when no candidate is at most ``top``)."""
    if candidates is None:
        candidates = sorted({b for b in (2**p for p in range(13)) if b < top} | {top})
    table = []
    for b in candidates:
        if b > top:
            continue
        sim, tokens_per_s, status = plan_at(b)
        table.append({"micro_batch_size": b, "tokens_per_s": tokens_per_s, "iteration_s": sim.iteration_seconds,
                      "status": status})
    if not table:
        raise InfeasibleBudget("gpu", 0.0, f"none of the batch candidates {candidates} fits{where} (the largest "
                               f"that fits: {top})", f"add {top} to the candidates")
    best = max(table, key=lambda row: row["tokens_per_s"])["micro_batch_size"]
    return BatchSearch(largest_feasible=top, best_throughput=best, table=table)
