"""``lazytrain-plan``: plan one run from the Hydra configs in ``conf/`` and compare it with the baselines.

    lazytrain-plan hardware=h800 model=qwen3.6-27b train.micro_batch_size=72 train.seq_len=1024
    lazytrain-plan model=qwen2.5-7b train.micro_batch_size=auto          # search the batch first
    lazytrain-plan -m hardware=h800,rtx3090 model=qwen2.5-3b,qwen2.5-7b,qwen2.5-14b,qwen3.6-27b

Prints a table (this plan vs megatrain / keep_all / recompute_all) and writes into Hydra's output
directory ``plan.json`` (``PlanResult.to_json()`` plus the resolved config), ``timeline.png`` and
``summary_row.json``. A multirun also writes one ``sweep.csv`` in the sweep directory (``SweepSummary``,
registered under ``hydra.callbacks`` in ``conf/plan.yaml``). A config that cannot run (a key the typed schema
does not know, ``+`` or not, checked before Hydra runs by ``config.check_command_line``; a bad value) or an
infeasible plan: one line on stderr, exit code 2 and no output directory it made left behind (cli/run_dir.py) (in a multirun the job records
the reason in its row and the sweep goes on).

Several GPUs (``hardware.gpus_per_node x hardware.nodes > 1``, e.g. ``hardware=h800x8``): one rank is planned with
``planner.multi.plan_cluster`` in ``plan.data_parallel`` (replicate, the default and ``LazyTrainStrategy``'s |
replicate_overlap | shard | fsdp; capped by ``plan.host_gb_per_node_cap`` if set), ``train.micro_batch_size`` is
per rank (``auto`` searches it on one rank's share of the node), the baselines run on the same rank problem, a line
above the table gives the mode (saying when it is the default), world size, the cluster's tokens/s and the host
memory per node, and plan.json gains ``data_parallel``. One GPU ignores both options (its output is what it was).

``plan_job(cfg, out_dir)`` is the app without Hydra's runtime (tests call it with ``hydra.compose``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from ..config import (CONF_DIR, DEFAULT_DATA_PARALLEL, data_parallel_mode, host_cap_setting, in_config_units,
                      resolve_micro_batch, to_container, to_hardware, to_milp_options, to_model, to_train)
from ..config_checks import check_command_line, check_schema
from ..planner import PlannerError, SimResult, make_plan, search_batch, simulate
from ..planner.errors import InfeasibleBudget, InfeasibleSchedule, InvalidInput
from ..planner.multi import ClusterResult, plan_cluster, rank_hardware
from ..planner.multi_batch import search_cluster_batch
from ..planner.plan import PlanResult, cap_violations
from ..planner.policies import BASELINES, baseline
from ..planner.report import SWEEP_COLUMNS, format_table, plot_timeline, write_sweep_csv
from .run_dir import RunDir, check_output_dirs

GB = 1e9
ROW_FILE = "summary_row.json"
EXIT_INFEASIBLE = 2
#: the config groups of this app (``--help`` lists these; conf/data/ and conf/trainer/ belong to lazytrain-train)
PLAN_GROUPS = ("hardware", "model", "train")


def _params(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _sim_fields(prefix: str, sim: SimResult) -> dict:
    return {f"{prefix}_iteration_s": sim.iteration_seconds, f"{prefix}_tokens_per_s": sim.tokens_per_second,
            f"{prefix}_tflops": sim.tflops, f"{prefix}_peak_gpu_gb": sim.peak_gpu_bytes / GB,
            f"{prefix}_exposed_s": sim.exposed_transfer_seconds}


def _base_row(cfg: Any, out_dir: Path, job: int | None) -> dict:
    row: dict[str, Any] = {"job": job, "hardware": cfg.hardware.name, "model": cfg.model.name,
                           "seq_len": cfg.train.seq_len, "output_dir": str(out_dir)}
    try:
        row["params_b"] = to_model(cfg).total_params / 1e9
    except PlannerError:
        pass
    return row


def plan_job(cfg: Any, out_dir: str | Path, *, job: int | None = None, out: TextIO | None = None) -> dict:
    """Plan ``cfg`` (a composed ``PlanAppConfig``), print the comparison, write plan.json / timeline.png /
    summary_row.json into ``out_dir`` and return the summary row. Raises ``PlannerError`` on infeasible input."""
    out = out or sys.stdout
    out_dir = Path(out_dir)
    check_schema(cfg)  # a key the schema does not know (added with +): ConfigKeyError, before anything is written
    hw, model = to_hardware(cfg), to_model(cfg)
    options = to_milp_options(cfg)
    mode, cap_setting = data_parallel_mode(cfg), host_cap_setting(cfg)  # checked even where ignored (one GPU)
    multi = hw.world_size > 1
    if multi and cfg.plan.policy != "milp":
        raise InvalidInput("plan.policy", cfg.plan.policy, f"{hw.name} has {hw.world_size} GPUs: several GPUs are "
                           "planned with plan.policy=milp (plan.data_parallel=fsdp is FSDP's fixed policy)")
    batch, batch_source = resolve_micro_batch(cfg)
    search_json = None
    if batch == "auto":
        candidates = list(cfg.plan.batch_candidates) if cfg.plan.batch_candidates else None
        search_hw = rank_hardware(hw) if multi else hw  # several GPUs: the batch per rank, on one rank's share
        if multi:  # Note: [the batch search on several GPUs] (planner/multi_batch.py); a "<f>x" host cap is the
            # single-GPU plan's at a batch, so it is applied to the batch found (_plan_ranks), not in the search
            search = search_cluster_batch(model, to_train(cfg, micro_batch_size=1), hw, mode, options=options,
                                          candidates=candidates, host_bytes_per_node=cap_setting[1]
                                          if cap_setting is not None and cap_setting[0] == "bytes" else None)
        else:
            search = search_batch(model, to_train(cfg, micro_batch_size=1), hw, options=options,
                                  candidates=candidates)
        print(f"micro-batch search for {model.name} on {search_hw.name}: largest feasible {search.largest_feasible}, "
              f"best predicted throughput at {search.best_throughput}", file=out)
        print(format_table(search.table), file=out)
        print(file=out)
        batch = search.best_throughput
        search_json = {"largest_feasible": search.largest_feasible, "best_throughput": search.best_throughput,
                       "table": search.table}
    train = to_train(cfg, micro_batch_size=batch)
    out_dir.mkdir(parents=True, exist_ok=True)
    cluster: ClusterResult | None = None
    cap_bytes = None
    if multi:
        result, cluster, cap_bytes = _plan_ranks(model, train, hw, mode, cap_setting, options, cfg.plan.K)
    else:
        result = make_plan(model, train, hw, policy=cfg.plan.policy, options=options, K=cfg.plan.K)

    # ---- print ------------------------------------------------------------------------------------
    sim, solver = result.sim, result.solver
    note = str(cfg.model.get("params_note") or "") if isinstance(cfg, DictConfig) else \
        str(getattr(cfg.model, "params_note", "") or "")
    params = f"{_params(model.total_params)} params" + (f": {note}" if note else "")
    print(f"lazytrain-plan: {model.name} ({params}) on {hw.name}, micro-batch "
          f"{train.micro_batch_size} ({batch_source}) x seq {train.seq_len}, grad_accum {train.grad_accum}", file=out)
    if cfg.plan.policy == "milp" and result.status != "policy":
        gap = solver.get("mip_gap")
        print(f"solver: {solver.get('name')} {solver.get('version', '')}, status {result.status}, gap "
              f"{'-' if gap is None else f'{100 * gap:.3f}%'}, build {solver.get('build_seconds', 0):.2f} s, "
              f"solve {solver.get('solve_seconds', 0):.2f} s", file=out)
    else:
        print(f"policy: {result.schedule.policy} (no solver)", file=out)
    if cluster is not None:
        print(_cluster_line(cluster, hw, train, cap_bytes), file=out)
    print(format_table(result.rows()), file=out)
    if cluster is not None and not cluster.host_fits:
        per_rank = cluster.workload.host_static_bytes / GB
        print(f"warning: the host state of {cluster.gpus_per_node} ranks ({per_rank:.1f} "
              f"GB each) does not fit a node's {(cap_bytes or hw.cpu_memory_bytes) / GB:.1f} GB of host memory "
              "(planned and timed as if it did; plan.data_parallel=shard keeps one copy per node)", file=out)
    if result.over_cap:
        print(f"warning: replayed window by window, the plan exceeds its budget: {result.over_cap_note()}"
              + ("; plan.window_memory=false checks memory as one aggregate sum (the paper's constraint), "
                 "plan.window_memory=true keeps every window under the cap" if not options.window_memory else ""),
              file=out)
    mega = result.baselines.get("megatrain")
    speedup = sim.tokens_per_second / mega.tokens_per_second if isinstance(mega, SimResult) else None
    if speedup is not None:
        print(f"speedup over megatrain: {speedup:.3f}x tokens/s", file=out)
    else:
        print("speedup over megatrain: n/a (megatrain does not fit at this batch, see its note)", file=out)

    # ---- files ------------------------------------------------------------------------------------
    data = result.to_json()
    data["micro_batch"] = {"setting": str(cfg.train.micro_batch_size), "source": batch_source,
                           "value": train.micro_batch_size}
    if search_json is not None:
        data["batch_search"] = search_json
    if cluster is not None:
        data["data_parallel"] = _cluster_json(cluster, train, cap_bytes)
    data["config"] = to_container(cfg)
    (out_dir / "plan.json").write_text(json.dumps(data, indent=1, default=str))
    written = ["plan.json"]
    if cfg.plan.plot:
        title = (f"{model.name} on {hw.name}, batch {train.micro_batch_size} x {train.seq_len}: "
                 f"{result.schedule.policy or 'milp'}, {sim.iteration_seconds:.2f} s/iter"
                 + ("" if cluster is None else f" (one rank of {cluster.world_size}, {cluster.mode})"))
        cap_gpu = result.hardware.gpu_memory_cap_bytes
        plot_timeline(sim, out_dir / "timeline.png", title, cap_bytes=cap_gpu)
        written.append("timeline.png")
        if cfg.plan.plot_baselines:
            for name, base in result.baselines.items():
                if isinstance(base, SimResult):
                    plot_timeline(base, out_dir / f"timeline_{name}.png",
                                  f"{model.name} on {hw.name}, batch {train.micro_batch_size}: {name}",
                                  cap_bytes=cap_gpu)
                    written.append(f"timeline_{name}.png")

    homes = result.schedule.count_homes()
    row = _base_row(cfg, out_dir, job)
    row.update({"micro_batch_size": train.micro_batch_size, "batch_source": batch_source, "status": "ok",
                "reason": "", **_sim_fields("plan", sim),
                "plan_homes": "/".join(str(homes.get(h, 0)) for h in ("gpu", "cpu", "nvme", "recompute")),
                "over_cap": result.over_cap,
                "over_cap_gb": max((v["excess_bytes"] for v in result.violations), default=0.0) / GB,
                "speedup": speedup, "solver_status": result.status, "mip_gap": solver.get("mip_gap"),
                "solve_seconds": solver.get("solve_seconds")})
    if cluster is not None:
        row.update({"data_parallel": cluster.mode, "world_size": cluster.world_size,
                    "cluster_tokens_per_s": cluster.tokens_per_second,
                    "host_gb_per_node": cluster.host_bytes_per_node / GB, "host_fits": cluster.host_fits})
    if isinstance(mega, SimResult):
        row.update(_sim_fields("megatrain", mega))
    else:
        row["megatrain_reason"] = mega
    (out_dir / ROW_FILE).write_text(json.dumps(row, indent=1, default=str))
    print(f"wrote {', '.join(written)} to {out_dir}", file=out)
    return row


def _plan_ranks(model, train, hw, mode: str, cap_setting, options,
                K: int) -> tuple[PlanResult, ClusterResult, float | None]:
    """Several GPUs: ``planner.multi.plan_cluster`` plans one rank in ``mode`` (``train`` is per rank); the
    baselines run on the same rank problem. Returns (the rank's ``PlanResult``, the cluster, the host cap per
    node in bytes or None)."""
    cap_bytes = None
    if cap_setting is not None:
        kind, value = cap_setting
        if kind == "single":  # as bench_scaling's "shard<=1.1x": f x the single-GPU plan's host memory
            one = plan_cluster(model, train, hw.replace(gpus_per_node=1, nodes=1), "shard", options=options)
            value = value * one.host_bytes_per_node
        cap_bytes = value
    cluster = plan_cluster(model, train, hw, mode, options=options, host_bytes_per_node=cap_bytes)
    wl, rhw = cluster.workload, cluster.hardware
    results: dict[str, SimResult | str] = {}
    schedules = {}
    for name in BASELINES:
        s = replace(baseline(name, wl.num_layers, K), data_parallel=wl.data_parallel)
        schedules[name] = s
        try:
            results[name] = simulate(s, wl, rhw)
        except InfeasibleSchedule as err:
            results[name] = str(err)
    violations = cap_violations(cluster.sim, rhw)
    if not cluster.host_fits:  # replicate's n copies: planned and timed as if the node had the memory; it has not
        need, cap = cluster.host_bytes_per_node, hw.cpu_memory_bytes if cap_bytes is None else min(cap_bytes,
                                                                                                  hw.cpu_memory_bytes)
        violations.append({"resource": "cpu_memory_per_node", "need_bytes": need, "cap_bytes": cap,
                           "excess_bytes": need - cap, "window": None})
    result = PlanResult(status=cluster.status, schedule=cluster.schedule, sim=cluster.sim, workload=wl, hardware=rhw,
                        solver=cluster.solver, baselines=results, baseline_schedules=schedules, model=model,
                        train=train, violations=violations, placement=cluster.placement)
    return result, cluster, cap_bytes


def _cluster_line(c: ClusterResult, hw, train, cap_bytes: float | None) -> str:
    nodes = f"{c.gpus_per_node} GPUs x {c.nodes} node{'s' if c.nodes > 1 else ''}"
    cap = f"{hw.cpu_memory_bytes / GB:.0f} GB" if cap_bytes is None else \
        f"cap {min(cap_bytes, hw.cpu_memory_bytes) / GB:.1f} GB"
    mode = c.mode
    if mode == DEFAULT_DATA_PARALLEL:
        mode += " (the default, as LazyTrainStrategy's; plan.data_parallel=shard|replicate_overlap|fsdp for the others)"
    return (f"data parallel: {mode}, world size {c.world_size} ({nodes}); figures per rank (micro-batch "
            f"{train.micro_batch_size} each); whole cluster: {c.tokens_per_second:.1f} tokens/s, host memory "
            f"{c.host_bytes_per_node / GB:.1f} GB per node (of {cap})")


def _cluster_json(c: ClusterResult, train, cap_bytes: float | None) -> dict:
    sim = c.sim
    return {"mode": c.mode, "world_size": c.world_size, "gpus_per_node": c.gpus_per_node, "nodes": c.nodes,
            "host_fits": c.host_fits, "host_bytes_per_node_cap": cap_bytes,
            "per_rank": {"micro_batch_size": train.micro_batch_size, "iteration_seconds": sim.iteration_seconds,
                         "tokens_per_second": sim.tokens_per_second, "tflops": sim.tflops,
                         "peak_gpu_bytes": sim.peak_gpu_bytes, "peak_cpu_bytes": sim.peak_cpu_bytes,
                         "host_static_bytes": c.workload.host_static_bytes},
            "cluster": {"micro_batch_size": train.micro_batch_size * c.world_size,
                        "iteration_seconds": sim.iteration_seconds, "tokens_per_second": c.tokens_per_second,
                        "tflops": sim.tflops * c.world_size, "host_bytes_per_node": c.host_bytes_per_node}}


def infeasible_row(cfg: Any, out_dir: str | Path, err: Exception, *, job: int | None = None) -> dict:
    """The summary row of a job whose input is infeasible (also written to ``out_dir``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    row = _base_row(cfg, out_dir, job)
    batch = cfg.train.micro_batch_size
    try:
        batch = resolve_micro_batch(cfg)[0]
    except PlannerError:
        pass
    row.update({"micro_batch_size": batch, "status": "infeasible", "reason": str(err)})
    (out_dir / ROW_FILE).write_text(json.dumps(row, indent=1, default=str))
    return row


def error_line(err: PlannerError) -> str:
    """One line for a job that cannot be planned: ``infeasible (<kind>): ...`` for a plan that does not fit, the
    config's own words (keys as written, GB for the hardware keys) for a config that cannot run."""
    text = in_config_units(" ".join(str(err).split()))
    if isinstance(err, (InfeasibleBudget, InfeasibleSchedule)):
        return f"infeasible ({type(err).__name__}): {text}"
    return text


def _task(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    job = int(hc.job.num) if multirun and hc.job.get("num") is not None else None
    run_dir = RunDir(out_dir, hc.job.name)  # what the directory held as the job began
    try:
        return plan_job(cfg, out_dir, job=job)
    except PlannerError as err:
        print(f"lazytrain-plan: {error_line(err)}", file=sys.stderr)
        if multirun:  # record the reason and let the sweep go on
            return infeasible_row(cfg, out_dir, err, job=job)
        run_dir.remove_created()  # nothing to keep: Note: [a failed run leaves what it found] (run_dir.py)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(EXIT_INFEASIBLE)


class SweepSummary(Callback):
    """Hydra callback: after a multirun, write one CSV (``filename``) in the sweep directory with one row per
    job, read from each job's ``summary_row.json``. Jobs that left no row get ``status=error``."""

    columns: tuple = SWEEP_COLUMNS  # the CSV's leading columns (then any other keys)

    def __init__(self, filename: str = "sweep.csv") -> None:
        self.filename = filename
        self.job_dirs: list[Path] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.job_dirs = []

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        try:
            self.job_dirs.append(Path(str(config.hydra.runtime.output_dir)))
        except Exception:  # noqa: BLE001 - a launcher that does not pass the job config: fall back to globbing
            pass

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> list[dict]:
        sweep_dir = self._sweep_dir(config)
        dirs = list(self.job_dirs) or sorted(p.parent for p in sweep_dir.glob(f"*/{ROW_FILE}"))
        rows = []
        for d in dirs:
            f = d / ROW_FILE
            if f.exists():
                rows.append(json.loads(f.read_text()))
            else:
                rows.append({"job": None, "status": "error", "reason": "the job wrote no summary row",
                             "output_dir": str(d)})
        rows.sort(key=lambda r: (r.get("job") is None, r.get("job") or 0))
        path = write_sweep_csv(sweep_dir / self.filename, rows, self.columns)
        print(f"sweep summary: {path} ({len(rows)} jobs)")
        return rows

    def _sweep_dir(self, config: DictConfig) -> Path:
        if self.job_dirs:
            parents = {d.parent for d in self.job_dirs}
            if len(parents) == 1:
                return parents.pop()
        return Path(str(config.hydra.sweep.dir))


_hydra_main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="plan")(_task)


def main() -> None:
    """Console script ``lazytrain-plan`` (Hydra app over conf/plan.yaml). The command line is composed and checked
    against the typed schema first (``config.check_command_line``): a key it does not know (``+`` or not) or a value
    of the wrong type is one line on stderr and exit code 2, before Hydra creates an output directory."""
    problem = check_command_line("plan", sys.argv[1:], PLAN_GROUPS) or check_output_dirs(sys.argv[1:])
    if problem is not None:
        print(f"lazytrain-plan: {problem}", file=sys.stderr, flush=True)
        sys.exit(EXIT_INFEASIBLE)
    _hydra_main()

if __name__ == "__main__":
    main()
