"""HiGHS in a process of its own (planner/solver_process.py, Note: [the solver's process]).

The guard is judged by what a caller sees: the same answer as a solve in this process (schedule,
objective, warnings, errors with their fields), and a solve that cannot hang: a worker that overruns
its deadline or dies is stopped, the solve is tried once more with presolve off, and then falls back to
the best baseline with a warning. The hanging HiGHS of the real instance is a version's bug; the fake
workers here hang or die on purpose, whatever HiGHS does.
"""

from __future__ import annotations

import pickle
import sys
import time
import warnings

import pytest

pytest.importorskip("pyomo")
pytest.importorskip("highspy")

from lightning_lazytrain.planner import solver_process, solver_worker  # noqa: E402
from lightning_lazytrain.planner.errors import InfeasibleBudget, InfeasibleSchedule, InvalidInput  # noqa: E402
from lightning_lazytrain.planner.solve import best_baseline, solve  # noqa: E402
from lightning_lazytrain.planner.milp import MilpOptions  # noqa: E402
from planner_helpers import G, hardware, workload  # noqa: E402


@pytest.fixture
def own_worker():
    """A worker of this test's own, stopped afterwards (the next solve starts the real one again)."""
    solver_process._stop_current()
    yield
    solver_process._stop_current()


def instance():
    return workload([1.0, 2.0, 1.5, 1.0], internal=2 * G), hardware(6 * G)


def test_the_process_gives_the_answer_this_process_gives():
    wl, hw = instance()
    here = solve(wl, hw, solver_process=False)
    there = solve(wl, hw)
    assert there.status == here.status == "optimal"
    assert there.schedule == here.schedule
    assert there.objective == here.objective
    assert there.simulated.iteration_seconds == here.simulated.iteration_seconds
    assert there.seed_policy == here.seed_policy
    again = solve(wl, hw, start=there.schedule)  # the same worker serves the next solve
    assert again.schedule == here.schedule


def test_a_warm_started_re_plan_in_the_process_starts_from_the_current_plan():
    wl, hw = instance()
    first = solve(wl, hw)
    res = solve(wl, hw, start=first.schedule)
    assert res.seed_policy == solve(wl, hw, start=first.schedule, solver_process=False).seed_policy


def test_an_infeasible_budget_arrives_whole():
    wl, hw = workload([1.0, 1.0, 1.0], internal=4 * G), hardware(0.5 * G)
    with pytest.raises(InfeasibleBudget) as here:
        solve(wl, hw, solver_process=False)
    with pytest.raises(InfeasibleBudget) as there:
        solve(wl, hw)
    assert str(there.value) == str(here.value)
    for key in ("tier", "shortfall_bytes", "message", "suggestion", "fits_bytes"):
        assert getattr(there.value, key) == getattr(here.value, key), key


@pytest.mark.parametrize("error", [
    InvalidInput("hardware.h2d_bytes_per_s", -1.0, "must be positive"),
    InfeasibleBudget("gpu", 3e9, "no schedule fits", "raise the budget", fits_bytes=9e9),
    InfeasibleSchedule("gpu_memory", "window F2 needs 9 GB", window="F2", need_bytes=9e9, have_bytes=8e9),
])
def test_planner_errors_survive_a_pickle_round_trip(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert vars(back) == vars(error)


def test_the_fallback_warning_comes_back_from_the_process():
    """A time limit too short for any incumbent: the worker falls back and warns; the warning is replayed here."""
    wl, hw = instance()
    with pytest.warns(UserWarning, match="falling back to") as here:
        solve(wl, hw, time_limit=1e-9, seed=False, solver_process=False)
    with pytest.warns(UserWarning, match="falling back to") as there:
        res = solve(wl, hw, time_limit=1e-9, seed=False)
    assert res.status == "fallback"
    assert [str(w.message) for w in there if "falling back" in str(w.message)] == \
        [str(w.message) for w in here if "falling back" in str(w.message)]


HANG = """
import sys, time
from lightning_lazytrain.planner import solver_process as sp
from lightning_lazytrain.planner import solver_worker as sw
sw.serve_with(lambda request, send: (send(("run", 0.2)), time.sleep(3600)))
"""
DIE = """
import os
from lightning_lazytrain.planner import solver_process as sp
from lightning_lazytrain.planner import solver_worker as sw
sw.serve_with(lambda request, send: os._exit(3))
"""


def test_a_solver_that_overruns_is_stopped_tried_without_presolve_and_falls_back(own_worker, monkeypatch):
    monkeypatch.setattr(solver_process, "WORKER_CODE", HANG)
    monkeypatch.setattr(solver_process, "grace_seconds", lambda limit: 0.5)
    wl, hw = instance()
    base = best_baseline(wl, hw, MilpOptions())
    t = time.monotonic()
    with pytest.warns(UserWarning, match=r"HiGHS gave no answer within 1 s of a 60 s time limit, and again "
                                          r"with presolve off; falling back to " + base[0].policy):
        res = solve(wl, hw)
    assert time.monotonic() - t < 30
    assert res.status == "fallback" and res.schedule == base[0]
    assert res.simulated.iteration_seconds == base[1].iteration_seconds
    assert len(res.solver["stopped"]) == 2
    assert not solver_process._worker  # the second hung worker was stopped too


def test_a_solver_process_that_dies_falls_back(own_worker, monkeypatch):
    monkeypatch.setattr(solver_process, "WORKER_CODE", DIE)
    wl, hw = instance()
    with pytest.warns(UserWarning, match=r"the solver process died \(exit code 3\), and again with presolve off"):
        res = solve(wl, hw)
    assert res.status == "fallback"


def test_no_answer_and_no_baseline_names_the_shortage(own_worker, monkeypatch):
    """With nothing to fall back to, the error is the planner's shortage error, as in this process."""
    monkeypatch.setattr(solver_process, "WORKER_CODE", DIE)
    wl, hw = workload([1.0, 1.0, 1.0], internal=4 * G), hardware(0.5 * G)
    with pytest.raises(InfeasibleBudget, match="the solver process died"):
        solve(wl, hw)


def test_a_worker_killed_between_solves_is_replaced(own_worker):
    wl, hw = instance()
    first = solve(wl, hw)
    solver_process._worker[0].proc.kill()
    solver_process._worker[0].proc.wait()
    assert solve(wl, hw).schedule == first.schedule


def test_a_forked_copy_starts_its_own_worker(own_worker):
    """A fork (a DataLoader worker, say) inherits the worker's pipes; it must not talk on them."""
    wl, hw = instance()
    solve(wl, hw)
    parent = solver_process._worker[0]
    parent.owner = -1  # as a fork of this process sees it
    solve(wl, hw)
    assert solver_process._worker[0] is not parent
    parent.stop()


def test_an_error_that_cannot_be_pickled_arrives_as_its_traceback():
    class Odd(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}-{b}")

    assert solver_worker._portable(Odd(1, 2)) is None
    assert solver_worker._portable(ValueError("x")) is not None


@pytest.mark.slow
def test_the_instance_that_hangs_highs_1_16_presolve_is_planned():
    """qwen2.5-3b on the H800 profile at micro-batch 128: HiGHS 1.16.0's presolve hung (the log stopped after
    its first line, past any time limit). Now the guard stops it and the solve without presolve answers; with a
    HiGHS that does not hang, the first solve does. Either way a MILP schedule, in bounded time."""
    from hydra import compose, initialize_config_dir

    from lightning_lazytrain.config import CONF_DIR, to_hardware, to_model, to_train
    from lightning_lazytrain.planner import Workload

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="plan", overrides=["hardware=h800", "model=qwen2.5-3b"])
    hw = to_hardware(cfg)
    wl = Workload.analytic(to_model(cfg), to_train(cfg, micro_batch_size=128), hw)
    limit = 4.0
    t = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        res = solve(wl, hw, time_limit=limit)
    assert time.monotonic() - t < 2 * (limit + solver_process.grace_seconds(limit)) + 10
    assert res.status in ("optimal", "time_limit")
    if "retried" in res.solver:  # the stopped run's time is counted
        assert res.solve_seconds > limit
    assert res.objective <= best_baseline(wl, hw, MilpOptions())[1].iteration_seconds + 1e-9


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_hung_worker_dies_with_its_parent(tmp_path):
    """The parent killed outright (no atexit): its hung worker must not stay behind, burning a core."""
    import os
    import signal
    import subprocess

    pidfile = tmp_path / "worker.pid"
    worker_code = ("import os, time\n"  # says its pid once it serves (past the prctl), then hangs
                   "from lightning_lazytrain.planner import solver_worker as sw\n"
                   f"sw.serve_with(lambda request, send: (open({str(pidfile)!r}, 'w').write(str(os.getpid())), "
                   "time.sleep(3600)))\n")
    code = ("import time\n"
            "from lightning_lazytrain.planner import solver_process as sp\n"
            f"sp.WORKER_CODE = {worker_code!r}\n"
            "sp._current().send(('solve',))\n"
            "print('ready', flush=True)\n"
            "time.sleep(3600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready"
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.05)
    worker = int(pidfile.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    def alive(pid):  # a zombie (no reaper in a container) has ended
        try:
            with open(f"/proc/{pid}/status") as f:
                return "zombie" not in f.read()
        except FileNotFoundError:
            return False

    for _ in range(100):
        if not alive(worker):
            break
        time.sleep(0.05)
    else:
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived its parent")


def test_an_interrupted_wait_stops_the_worker(own_worker, monkeypatch):
    """Ctrl-C while HiGHS runs: the interrupt reaches the caller and the worker is stopped, so that its late
    answer is never read as the next solve's."""
    def interrupt(limit):
        raise KeyboardInterrupt

    wl, hw = instance()
    monkeypatch.setattr(solver_process, "grace_seconds", interrupt)  # called as the run starts
    with pytest.raises(KeyboardInterrupt):
        solve(wl, hw)
    assert not solver_process._worker
    monkeypatch.undo()
    other = workload([2.0, 1.0, 1.0], internal=1 * G), hardware(5 * G)
    assert solve(*other).schedule == solve(*other, solver_process=False).schedule


def test_warnings_made_errors_are_raised_here_as_in_this_process():
    wl, hw = instance()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="falling back to"):
            solve(wl, hw, time_limit=1e-9, seed=False)
    assert solve(wl, hw).status == "optimal"  # the worker is still in step
