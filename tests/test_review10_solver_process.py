"""Review 10: the planner's solver process (planner/solver_process.py, Note: [the solver's process]).

Defects found, all fixed in planner/solver_process.py (the tests below were strict xfails and now pass):

- test_an_unbounded_time_limit_is_solved_as_in_this_process: time_limit=math.inf (HiGHS's own default; also
  ``lazytrain-plan plan.time_limit=inf``) solves in this process but the guard makes an infinite deadline and
  select() raises OverflowError ("timestamp out of range for platform time_t").
- test_a_process_with_many_open_files_can_still_solve: the guard waits with select.select(), which refuses
  file descriptors >= 1024 (FD_SETSIZE): in a training process with >1024 open files every solve raises
  ValueError("filedescriptor out of range in select()").
- test_an_error_from_the_worker_keeps_where_it_was_raised: a planner error raised in the worker arrives
  without the worker's traceback (it ends at solver_process.solve_guarded's ``raise value``); the worker's
  traceback text is thrown away whenever the exception pickles.
- test_a_dead_worker_is_replaced_without_leaking_its_pipes: _current() drops a dead worker without closing
  its pipes: ResourceWarning "unclosed file <_io.FileIO ...>" twice (and the fds live until GC).
- test_a_log_record_with_a_traceback_keeps_it: records are replayed from their message alone: a
  ``log.exception`` record loses its traceback (exc_info/exc_text) and every record claims
  solver_process.py/_exchange as its origin (pathname, funcName, lineno).
- test_pyomo_log_records_reach_the_callers_logging: the worker forwards only the ``lightning_lazytrain``
  logger tree; records of Pyomo's loggers (or any other library's) go to the worker's stderr via logging's
  last-resort handler and never reach the caller's handlers/caplog, as they would in this process.
- test_a_worker_outlives_the_thread_that_started_it: PR_SET_PDEATHSIG (_die_with_parent) fires when the
  *thread* that spawned the worker exits, not the process: a worker started by a planning thread is SIGKILLed
  when that thread ends, and a solve running on it from another thread sees "the solver process died (exit
  code -9)", is retried with presolve off, or falls back (seen with 4 threads solving at once: 3 such warnings, and
  a schedule unlike this process's).
- test_a_fork_while_another_thread_solves_can_still_solve: a fork (os.fork, DataLoader/multiprocessing
  "fork") taken while another thread is inside solve() inherits ``_lock`` held: every solve in the child
  deadlocks (no os.register_at_fork hook to renew the lock).
- test_a_package_of_that_name_in_the_working_directory_does_not_replace_the_workers: ``python -c`` puts the
  cwd first on the worker's sys.path, unlike the parent's (``python script.py``: the script's folder): a
  directory holding another ``lightning_lazytrain`` (an old checkout) makes every worker die at import, and
  every plan becomes a baseline fallback (one warning); with only its ``__init__.py`` there, the worker ran a
  mix of that copy and another, editable-installed copy's planner.

The fixes: no deadline for an unbounded limit; poll() instead of select(); the worker's traceback as the error's
``__cause__`` (RemoteTraceback); a dead worker reaped and its pipes closed; records sent whole (message and
traceback as text, origin) and handled by the caller's loggers; the worker forwards its root logger at the
caller's lowest level, libraries' own handlers dropped; os.register_at_fork renews the lock in a child; a thread
of its own starts the worker and lives as long as it (Note: [the worker's own thread]); the worker imports from
the caller's sys.path.

Probes that pass (plain regression tests): log records keep their logger names and levels, and the caller's
level filters them; 50 solves (with a worker killed midway) leave no extra fds and no zombies; messages of several MB both ways and a worker
printing MBs to stdout/stderr do not deadlock or corrupt the protocol; SolveResult's build/solve seconds
fit inside the call's wall time; a parent started with -I (isolated) gets the same answer and its worker
does not outlive it (atexit); a Lightning fit with strategy="lazytrain" on CPU, with fork DataLoader
workers, plans through the worker (measured workloads pickle) and the worker stays in step; (slow) a 27B
config via hydra gives the in-process schedule; (slow) ``lazytrain-plan -m`` sweeps work.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import subprocess
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import pytest

pytest.importorskip("pyomo")
pytest.importorskip("highspy")

from lightning_lazytrain.planner import solver_process  # noqa: E402
from lightning_lazytrain.planner.errors import InfeasibleBudget  # noqa: E402
from lightning_lazytrain.planner.milp import MilpOptions  # noqa: E402
from lightning_lazytrain.planner.solve import solve  # noqa: E402
from planner_helpers import G, hardware, workload  # noqa: E402

ROOT = Path(solver_process.__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def own_worker():
    """A worker of this test's own, stopped afterwards (the next solve starts the real one again)."""
    solver_process._stop_current()
    yield
    solver_process._stop_current()


def instance(last=1.0):
    return workload([1.0, 2.0, 1.5, last], internal=2 * G), hardware(6 * G)


def run_python(code: str, *args: str, cwd=None, timeout=120, flags=()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS)]))
    return subprocess.run([sys.executable, *flags, *args] if not code else [sys.executable, *flags, "-c", code],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ---- defects -------------------------------------------------------------------------------------------


def test_an_unbounded_time_limit_is_solved_as_in_this_process():
    wl, hw = instance()
    here = solve(wl, hw, time_limit=math.inf, solver_process=False)
    there = solve(wl, hw, time_limit=math.inf)
    assert there.status == here.status == "optimal"
    assert there.schedule == here.schedule


def test_a_process_with_many_open_files_can_still_solve(own_worker):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1300
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip("cannot open 1100 files here")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    fds = []
    try:
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # a dataset's shards, sockets, ...
        wl, hw = instance()
        assert solve(wl, hw).status == "optimal"
    finally:
        solver_process._stop_current()
        for fd in fds:
            os.close(fd)
        if soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_error_from_the_worker_keeps_where_it_was_raised():
    wl, hw = workload([1.0, 1.0, 1.0], internal=4 * G), hardware(0.5 * G)
    with pytest.raises(InfeasibleBudget) as here:
        solve(wl, hw, solver_process=False)
    assert "in solve_here" in "".join(traceback.format_exception(here.value))
    with pytest.raises(InfeasibleBudget) as there:
        solve(wl, hw)
    text = "".join(traceback.format_exception(there.value))
    assert "in solve_here" in text and "in fallback" in text, text


def test_a_dead_worker_is_replaced_without_leaking_its_pipes(own_worker):
    wl, hw = instance()
    solve(wl, hw)
    dead = solver_process._worker[0].proc
    dead.kill()
    dead.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert solve(wl, hw).status == "optimal"
        del dead
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks


LOGGING_WORKER = """
import logging
from lightning_lazytrain.planner import solver_process as sp
from lightning_lazytrain.planner import solver_worker as sw

def handle(request, send):
    log = logging.getLogger("lightning_lazytrain.planner.solve")
    log.debug("a debug record")
    log.info("an info record")
    try:
        raise ValueError("the inner detail")
    except ValueError:
        log.exception("a step failed")
    logging.getLogger("pyomo.contrib.appsi.solvers.highs").warning("pyomo says so")
    send(("done", "the answer", []))

sw.serve_with(handle)
"""


def solve_with_logging_worker(monkeypatch, caplog):
    monkeypatch.setattr(solver_process, "WORKER_CODE", LOGGING_WORKER)
    caplog.set_level(logging.INFO)
    wl, hw = instance()
    assert solver_process.solve_guarded(wl, hw, MilpOptions(), None) == "the answer"
    return caplog.records


def test_a_log_record_with_a_traceback_keeps_it(own_worker, monkeypatch, caplog):
    records = solve_with_logging_worker(monkeypatch, caplog)
    failed = [r for r in records if r.getMessage() == "a step failed"]
    assert len(failed) == 1
    assert "the inner detail" in (failed[0].exc_text or caplog.text)
    assert failed[0].funcName == "handle" and failed[0].pathname != solver_process.__file__


def test_pyomo_log_records_reach_the_callers_logging(own_worker, monkeypatch, caplog):
    records = solve_with_logging_worker(monkeypatch, caplog)
    assert [(r.name, r.levelno) for r in records if r.getMessage() == "pyomo says so"] == \
        [("pyomo.contrib.appsi.solvers.highs", logging.WARNING)]


FORK_WHILE_SOLVING = """
import os, signal, sys, threading, time
from planner_helpers import G, hardware, workload
from lightning_lazytrain.planner.solve import solve
from lightning_lazytrain.planner import solver_process as sp
from lightning_lazytrain.planner import solver_worker as sw

wl, hw = workload([1.0, 2.0, 1.5, 1.0], internal=2 * G), hardware(6 * G)
real = sp.WORKER_CODE
sp.WORKER_CODE = ("import time\\nfrom lightning_lazytrain.planner import solver_worker as sw\\n"
                  "sw.serve_with(lambda request, send: (time.sleep(3), sw._solve_request(request, send)))\\n")
th = threading.Thread(target=solve, args=(wl, hw))  # a slow solve on another thread
th.start()
while not sp._worker:
    time.sleep(0.01)
sp.WORKER_CODE = real
pid = os.fork()  # a DataLoader worker, a multiprocessing 'fork' child
if pid == 0:
    signal.alarm(8)  # default action: the child ends if it hangs
    res = solve(wl, hw)
    os._exit(0 if res.status == "optimal" else 3)
_, status = os.waitpid(pid, 0)
th.join()
print("child", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_fork_while_another_thread_solves_can_still_solve():
    proc = run_python(FORK_WHILE_SOLVING, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "child 0", proc.stdout


SLOW_WORKER = ("import time\nfrom lightning_lazytrain.planner import solver_worker as sw\n"
               "sw.serve_with(lambda request, send: (time.sleep(1.0), sw._solve_request(request, send)))\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_outlives_the_thread_that_started_it(own_worker, monkeypatch):
    monkeypatch.setattr(solver_process, "WORKER_CODE", SLOW_WORKER)  # each answer takes 1 s more
    wl, hw = instance()
    first_done, may_end = threading.Event(), threading.Event()

    def planner_thread():  # a thread pool's planning task, say: starts the worker, then ends
        solve(wl, hw)
        first_done.set()
        may_end.wait(30)

    t = threading.Thread(target=planner_thread)
    t.start()
    assert first_done.wait(60)
    threading.Timer(0.3, may_end.set).start()  # the thread ends while the next solve runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = solve(wl, hw)
    t.join()
    assert "retried" not in res.solver, res.solver
    assert solver_process._worker and solver_process._worker[0].proc.poll() is None


STALE_PACKAGE_SCRIPT = """
from planner_helpers import G, hardware, workload
from lightning_lazytrain.planner.solve import solve
wl, hw = workload([1.0, 2.0, 1.5, 1.0], internal=2 * G), hardware(6 * G)
print(solve(wl, hw).status)
"""


def test_a_package_of_that_name_in_the_working_directory_does_not_replace_the_workers(tmp_path):
    project = tmp_path / "old_checkout"  # e.g. a clone of an older release, the run started from its root
    (project / "lightning_lazytrain").mkdir(parents=True)
    (project / "lightning_lazytrain" / "__init__.py").write_text('__version__ = "0.0.1"\n')
    (project / "lightning_lazytrain" / "planner").mkdir()
    (project / "lightning_lazytrain" / "planner" / "__init__.py").write_text('raise ImportError("an old copy")\n')
    script = tmp_path / "scripts" / "plan_it.py"
    script.parent.mkdir()
    script.write_text(STALE_PACKAGE_SCRIPT)
    proc = run_python("", str(script), cwd=project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "optimal", proc.stderr[-3000:]


# ---- probes that pass ----------------------------------------------------------------------------------


def test_log_records_keep_their_logger_names_and_levels(own_worker, monkeypatch, caplog):
    records = solve_with_logging_worker(monkeypatch, caplog)
    mine = [(r.name, r.levelno, r.getMessage()) for r in records if r.name.startswith("lightning_lazytrain")]
    assert mine == [("lightning_lazytrain.planner.solve", logging.INFO, "an info record"),
                    ("lightning_lazytrain.planner.solve", logging.ERROR, "a step failed")]  # no DEBUG: filtered here


def _children_states() -> list[str]:
    me, states = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[1] == me:
                states.append(fields[0])
    return states


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="Linux /proc")
def test_fifty_solves_leave_no_fds_and_no_zombies(own_worker):
    wl, hw = instance()
    solve(wl, hw)
    before = len(os.listdir("/proc/self/fd"))
    zombies = _children_states().count("Z")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the dead worker's pipes: its own test above
        for i in range(50):
            if i == 25:
                solver_process._worker[0].proc.kill()
            assert solve(wl, hw).status == "optimal"
        gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before
    assert _children_states().count("Z") == zombies


ECHO_WORKER = """
import os, sys
from lightning_lazytrain.planner import solver_process as sp
from lightning_lazytrain.planner import solver_worker as sw

def handle(request, send):
    print("o" * (1 << 20))  # fd 1 points at stderr: never into a message
    sys.stdout.flush()
    os.write(2, b"e" * (1 << 20))
    send(("done", request[1][::-1], []))

sw.serve_with(handle)
"""


def test_messages_of_megabytes_and_a_chatty_worker(own_worker, monkeypatch, capfd):
    monkeypatch.setattr(solver_process, "WORKER_CODE", ECHO_WORKER)
    big = os.urandom(8 << 20)  # far over a pipe's 64 KiB, both ways
    kind, value, caught = solver_process._exchange(("solve", big, None, None, None, True))
    assert kind == "done" and value == big[::-1] and caught == []
    out, err = capfd.readouterr()
    assert "o" * 1000 not in out and err.count("o") >= 1 << 20 and err.count("e") >= 1 << 20


def test_solve_seconds_and_build_seconds_fit_the_call():
    wl, hw = instance()
    t = time.perf_counter()
    res = solve(wl, hw)
    wall = time.perf_counter() - t
    assert res.status == "optimal"
    assert 0 < res.build_seconds and 0 < res.solve_seconds and res.build_seconds + res.solve_seconds <= wall


ISOLATED_PARENT = f"""
import sys
sys.path[:0] = [{str(ROOT)!r}, {str(TESTS)!r}]  # -I: PYTHONPATH is ignored here
from planner_helpers import G, hardware, workload
from lightning_lazytrain.planner.solve import solve
from lightning_lazytrain.planner import solver_process as sp
from lightning_lazytrain.planner import solver_worker as sw
wl, hw = workload([1.0, 2.0, 1.5, 1.0], internal=2 * G), hardware(6 * G)
print(solve(wl, hw).status, solve(wl, hw, solver_process=False).status, sp._worker[0].proc.pid)
"""


@pytest.mark.skipif(not Path("/proc").exists(), reason="Linux /proc")
def test_an_isolated_parent_solves_and_its_worker_ends_with_it():
    proc = run_python(ISOLATED_PARENT, flags=("-I",))
    assert proc.returncode == 0, proc.stderr[-3000:]
    there, here, pid = proc.stdout.split()
    assert there == here == "optimal"
    for _ in range(100):
        try:
            if "zombie" in Path(f"/proc/{pid}/status").read_text():
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the worker outlived its parent's normal exit (atexit)")


def test_a_lightning_fit_plans_through_the_worker_and_forked_loaders_leave_it_in_step(monkeypatch):
    pytest.importorskip("transformers")
    L = pytest.importorskip("lightning")
    import torch

    import lightning_lazytrain.strategy  # noqa: F401 - registers strategy="lazytrain"
    from models import tiny_llama

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama(0, layers=4)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    seen = []
    exchange = solver_process._exchange

    def spy(request):
        answer = exchange(request)
        seen.append((type(request[1]).__name__, answer[0], getattr(answer[1], "status", None)))
        return answer

    monkeypatch.setattr(solver_process, "_exchange", spy)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(4)]
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2, multiprocessing_context="fork")
    trainer = L.Trainer(strategy="lazytrain", accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0)
    from quiet_logs import quiet_logs

    with quiet_logs("lightning", "lightning.pytorch", "lightning_lazytrain"):
        trainer.fit(Module(), train_dataloaders=loader)
    assert seen and all(s == ("Workload", "done", "optimal") for s in seen), seen
    wl, hw = instance()
    assert solve(wl, hw).schedule == solve(wl, hw, solver_process=False).schedule  # the worker is in step


@pytest.mark.slow
def test_a_27b_config_gives_this_process_schedule():
    from hydra import compose, initialize_config_dir

    from lightning_lazytrain.config import CONF_DIR, to_hardware, to_model, to_train
    from lightning_lazytrain.planner import Workload

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose(config_name="plan", overrides=["hardware=h800", "model=qwen3.6-27b"])
    hw = to_hardware(cfg)
    wl = Workload.analytic(to_model(cfg), to_train(cfg), hw)
    there = solve(wl, hw, time_limit=20)
    here = solve(wl, hw, time_limit=20, solver_process=False)
    assert there.status == here.status == "optimal"
    assert there.schedule == here.schedule and there.objective == pytest.approx(here.objective)


@pytest.mark.slow
def test_the_plan_cli_multirun_plans_each_job(tmp_path):
    import csv

    sweep = tmp_path / "sweep"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HYDRA_FULL_ERROR="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "lightning_lazytrain.cli.plan", "-m", "hardware=rtx3090",
                           "model=tiny", "train=cpu", "plan.time_limit=5,10", "plan.plot=false",
                           f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(sweep / "sweep.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
