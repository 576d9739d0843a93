"""What the solver process costs, and what it saves (planner/solver_process.py, Note: [the solver's process]).

For each instance: solve() in this process and in the solver process (the default), alternately, ``--repeats``
times each after one warm-up of each (the worker's start and imports are paid there); prints the medians, the
ratio worker / in-process, and whether the two gave the same schedule and objective. Then the instance on which
HiGHS 1.16's presolve hangs (qwen2.5-3b, H800, micro-batch 128): the guarded solve's wall time and status,
and (``--show-hang``) the same solve in this process, run in a child process that is stopped after
``--hang-timeout`` seconds.

    python bench/bench_solver_process.py                 # ~1 minute on 2 cores
    python bench/bench_solver_process.py --show-hang     # + the unguarded solve, up to --hang-timeout s
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from hydra import compose, initialize_config_dir

from lightning_lazytrain.config import CONF_DIR, to_hardware, to_model, to_train
from lightning_lazytrain.planner import Workload, solve
from lightning_lazytrain.planner import solver_process

INSTANCES = [("h800", "qwen2.5-3b", 8), ("h800", "qwen3.6-27b", 72), ("rtx3090", "qwen2.5-7b", 4)]
HANG = ("h800", "qwen2.5-3b", 128)


def instance(hardware: str, model: str, batch: int):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="plan", overrides=[f"hardware={hardware}", f"model={model}"])
    hw = to_hardware(cfg)
    return Workload.analytic(to_model(cfg), to_train(cfg, micro_batch_size=batch), hw), hw


def timed(wl, hw, **kw):
    t = time.perf_counter()
    res = solve(wl, hw, **kw)
    return time.perf_counter() - t, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=5.0, help="plan.time_limit for the hanging instance")
    ap.add_argument("--show-hang", action="store_true")
    ap.add_argument("--hang-timeout", type=float, default=60.0)
    args = ap.parse_args()

    print(f"{'instance':32} {'in-process [s]':>14} {'worker [s]':>10} {'ratio':>6}  same answer")
    for hardware, model, batch in INSTANCES:
        wl, hw = instance(hardware, model, batch)
        here_t, there_t = [], []
        for i in range(args.repeats + 1):
            a, here = timed(wl, hw, solver_process=False)
            b, there = timed(wl, hw)
            if i:  # the first of each is the warm-up
                here_t.append(a)
                there_t.append(b)
        h, w = statistics.median(here_t), statistics.median(there_t)
        same = here.schedule == there.schedule and here.objective == there.objective
        print(f"{hardware + '/' + model + '/b' + str(batch):32} {h:14.2f} {w:10.2f} {w / h:6.2f}  {same}")

    wl, hw = instance(*HANG)
    t, res = timed(wl, hw, time_limit=args.time_limit)
    print(f"\n{'/'.join(map(str, HANG))} (HiGHS {res.solver.get('version')}), plan.time_limit={args.time_limit:g}, "
          f"grace {solver_process.grace_seconds(args.time_limit):g} s: guarded solve {t:.1f} s, status {res.status}, "
          f"objective {res.objective}, retried: {res.solver.get('retried', 'no')}")
    if args.show_hang:
        code = ("import sys; sys.argv = ['x']\n"
                "from bench_solver_process import instance, HANG\n"
                "from lightning_lazytrain.planner import solve\n"
                f"wl, hw = instance(*HANG); r = solve(wl, hw, time_limit={args.time_limit}, solver_process=False)\n"
                "print(r.status, r.objective)\n")
        t0 = time.perf_counter()
        try:
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 timeout=args.hang_timeout, cwd=sys.path[0])
            print(f"in this process: {out.stdout.strip() or out.stderr[-300:]} in {time.perf_counter() - t0:.1f} s")
        except subprocess.TimeoutExpired:
            print(f"in this process: no answer after {args.hang_timeout:g} s (time_limit {args.time_limit:g} s); stopped")


if __name__ == "__main__":
    main()
