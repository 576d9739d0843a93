"""HiGHS in a process of its own, under a wall-clock guard.

Note: [the solver's process] HiGHS 1.16's presolve can hang on some instances (qwen2.5-3b on the
H800 profile at micro-batch 128: the log stops after presolve's first line), past its time limit and
holding the GIL, so no thread of the process that called it can stop it, and a training run would
hang at its start. So solve() sends each solve to a worker process (``python -c`` running
``solver_worker.serve``, started once per process and reused: not multiprocessing, which would re-run an unguarded
user script in the child) and waits for it with a deadline while HiGHS runs: the run's time limit
plus ``grace_seconds``. Past the deadline the worker is killed (a fresh one serves the next solve)
and the same solve runs once more with presolve off, which does not hang there (0.8 s); if that too
overruns, or the worker dies, the plan falls back to the best feasible baseline, with a warning. The
answer is the one the same solve in this process gives: the worker runs ``solve_here``; its warnings
and log records are replayed here, and errors are raised here as they were raised there.

The protocol: length-prefixed pickles on the worker's stdin and on a copy of its stdout (its fd 1 is
pointed at stderr so that nothing printed there can corrupt a message). Requests:
``("solve", wl, hw, opt, start, presolve, the caller's logger levels)``. Replies: ``("log", record fields)``,
``("run", time_limit)`` / ``("run", None)`` as a HiGHS run starts / ends, then ``("done", result,
warnings)`` or ``("error", exception or None, traceback text, warnings)``.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass

from .hardware import Hardware
from .milp import MilpOptions
from .schedule import Schedule
from .workload import Workload

log = logging.getLogger(__name__)
HEADER = struct.Struct("<Q")  # a message's length


def write_message(f, message: tuple) -> None:
    """One length-prefixed pickle on ``f`` (the protocol of the module docstring)."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[f.write(view):]


def grace_seconds(time_limit: float) -> float:
    """How far past its time limit a HiGHS run may go before its process is stopped: HiGHS checks its
    limit between steps, and loading a large model into it counts too."""
    return 10.0 + 0.25 * time_limit


class _Stalled(Exception):
    pass


class _Died(Exception):
    pass


WORKER_CODE = "from lightning_lazytrain.planner.solver_worker import serve; serve()"  # what the worker runs
# Run first: the worker imports from the caller's sys.path, not from ``python -c``'s (the working directory
# first, where another lightning_lazytrain could lie)
_PRELUDE = "import json, os, sys; sys.path[:] = json.loads(os.environ['LAZYTRAIN_SOLVER_SYS_PATH'])\n"


class _Worker:
    """One solver process: ``python -c`` running ``WORKER_CODE``, talking on pipes (module docstring)."""

    def __init__(self) -> None:
        env = dict(os.environ)
        env["LAZYTRAIN_SOLVER_SYS_PATH"] = json.dumps([p for p in sys.path if isinstance(p, str)])
        env["LAZYTRAIN_SOLVER_PARENT"] = str(os.getpid())
        self.owner = os.getpid()  # a fork of this process must not talk on these pipes
        # Note: [the worker's own thread] Linux's PR_SET_PDEATHSIG (_die_with_parent) fires when the *thread*
        # that started the worker ends: a planning thread's worker would be killed under a solve from another
        # thread (review 10). So a thread of its own starts it and lives as long as it does.
        started: list = []
        ready = threading.Event()

        def own() -> None:
            try:
                started.append(subprocess.Popen(
                    [sys.executable, "-c", _PRELUDE + WORKER_CODE],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0, close_fds=True))
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
                started.append(exc)
            ready.set()
            if isinstance(started[0], subprocess.Popen):
                started[0].wait()

        threading.Thread(target=own, name="lazytrain-solver-process", daemon=True).start()
        ready.wait()
        if not isinstance(started[0], subprocess.Popen):
            raise started[0]
        self.proc = started[0]
        self._poll = select.poll()  # not select(): a process may have more than 1024 files open (review 10)
        self._poll.register(self.proc.stdout.fileno(), select.POLLIN)

    def send(self, message: tuple) -> None:
        write_message(self.proc.stdin, message)

    def _read(self, n: int, deadline: float | None) -> bytes:
        fd, chunks = self.proc.stdout.fileno(), []
        while n:
            wait = None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if not self._poll.poll(wait):
                raise _Stalled
            chunk = os.read(fd, n)
            if not chunk:
                raise _Died
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def receive(self, deadline: float | None) -> tuple:
        (n,) = HEADER.unpack(self._read(HEADER.size, deadline))
        return pickle.loads(self._read(n, deadline))

    def close(self) -> None:
        """Close this end of the pipes (the process is left alone: after a fork it is the parent's)."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            return self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
            return None
        finally:
            self.close()


_lock = threading.Lock()
_worker: list[_Worker] = []  # the process's worker, when one is running


def _current() -> _Worker:
    if _worker and _worker[0].owner != os.getpid():
        _worker.pop().close()  # inherited by a fork: the parent's
    if _worker and _worker[0].proc.poll() is not None:
        _stop_current()  # gone: reap it, close its pipes
    if not _worker:
        _worker.append(_Worker())
    return _worker[0]


def _stop_current() -> int | None:
    return _worker.pop().stop() if _worker else None


def _after_fork_in_child() -> None:
    """A fork has one thread: a lock another thread held at the fork would stay held (review 10), and the
    parent's worker is not this process's."""
    global _lock
    _lock = threading.Lock()
    if _worker:
        _worker.pop().close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@atexit.register
def _shutdown() -> None:
    if _worker and _worker[0].owner == os.getpid():
        _stop_current()


class RemoteTraceback(Exception):
    """The traceback of an error raised in the solver process (the ``__cause__`` of the error raised here)."""

    def __str__(self) -> str:
        return f"raised in the planner's solver process:\n{self.args[0]}"


def _replay_record(fields: dict) -> None:
    """A log record of the worker, handled here as if it had been made here (its logger's level and handlers)."""
    record = logging.makeLogRecord(fields)
    logger = logging.getLogger(record.name)
    if logger.isEnabledFor(record.levelno):
        logger.handle(record)


def _levels() -> dict[str, int]:
    """This process's logger levels (``""``: the root's, then every logger's own, where set): the worker takes them,
    so that it makes the records this process would handle, and no more (HiGHS's log is captured only when wanted)."""
    levels = {"": logging.getLogger().level}
    for name, lg in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger) and lg.level:
            levels[name] = lg.level
    return levels


def _replay(caught: list[tuple[type[Warning], str]]) -> None:
    for category, text in caught:
        warnings.warn(text, category, stacklevel=3)


def _exchange(request: tuple) -> tuple[str, object, list]:
    """Send one solve and wait for its answer: ("done", result, warnings), ("error", exception, warnings),
    ("stalled", seconds allowed, []) or ("died", exit code, []). Anything else that stops the wait (Ctrl-C)
    stops the worker too: its late answer must not be read as the next solve's."""
    worker = _current()
    try:
        worker.send(request)
    except (BrokenPipeError, OSError):  # it died since the last solve: once more with a fresh one
        _stop_current()
        worker = _current()
        worker.send(request)
    deadline, allowed = None, 0.0
    try:
        while True:
            try:
                message = worker.receive(deadline)
            except _Stalled:
                _stop_current()
                return "stalled", allowed, []
            except (_Died, EOFError, pickle.UnpicklingError):
                return "died", _stop_current(), []
            kind = message[0]
            if kind == "log":
                _replay_record(message[1])
            elif kind == "run":
                limit = message[1]  # None: the run ended; inf: HiGHS runs unbounded, as it would here
                bounded = limit is not None and math.isfinite(limit)
                allowed = limit + grace_seconds(limit) if bounded else 0.0
                deadline = time.monotonic() + allowed if bounded else None
            elif kind == "done":
                return "done", message[1], message[2]
            else:
                exc = message[1]
                if exc is None:
                    exc = RuntimeError(f"the planner's solver process failed:\n{message[2]}")
                else:  # where it was raised (as concurrent.futures shows a worker's traceback)
                    exc.__cause__ = RemoteTraceback(message[2])
                return "error", exc, message[3]
    except BaseException:
        if _worker and _worker[0] is worker:
            _stop_current()
        raise


@dataclass(frozen=True)
class Stopped:
    """No answer: ``why`` each try ended (stopped past its deadline, or the worker died); ``seconds`` in all."""

    why: tuple[str, ...]
    seconds: float


def solve_guarded(wl: Workload, hw: Hardware, opt: MilpOptions, start: Schedule | None):
    """solve_here(wl, hw, opt, start) in the solver process: its SolveResult (or its error, raised here), or
    Stopped when HiGHS overran twice (with presolve, then without) or the worker died (module docstring)."""
    t0 = time.perf_counter()
    why: list[str] = []
    with _lock:
        for presolve in (True, False):
            kind, value, caught = _exchange(("solve", wl, hw, opt, start, presolve, _levels()))
            _replay(caught)
            if kind == "done":
                if not presolve:  # the time the stopped run took counts
                    value.solver["retried"] = why[0]
                    value.solve_seconds = time.perf_counter() - t0 - value.build_seconds
                return value
            if kind == "error":
                raise value
            why.append(f"HiGHS gave no answer within {value:.0f} s of a {opt.time_limit:g} s time limit"
                       if kind == "stalled" else f"the solver process died (exit code {value})")
            log.warning("%s%s", why[-1], "; solving again with HiGHS's presolve off" if presolve else "")
    return Stopped(tuple(why), time.perf_counter() - t0)
