"""The solver process's side (Note: [the solver's process] in solver_process.py): a loop answering solve
requests on stdin with length-prefixed pickles on a copy of stdout, run by ``solver_process.WORKER_CODE``."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import traceback
import warnings

from .solve import solve_here
from .solver_process import HEADER, write_message


class _Forward(logging.Handler):
    """Sends each record to the caller, formatted (its message and traceback as text), to be handled there."""

    def __init__(self, send) -> None:
        super().__init__()
        self.send = send
        self.formatter = logging.Formatter()

    def emit(self, record: logging.LogRecord) -> None:
        fields = dict(record.__dict__)
        fields["msg"], fields["args"] = record.getMessage(), None
        if record.exc_info:
            fields["exc_text"] = record.exc_text or self.formatter.formatException(record.exc_info)
        fields["exc_info"] = None
        try:
            self.send(("log", fields))
        except Exception:  # an extra field that does not pickle: the plain fields
            plain = {k: fields[k] for k in ("name", "levelno", "levelname", "msg", "pathname", "filename", "module",
                                            "lineno", "funcName", "created", "exc_text") if k in fields}
            try:
                self.send(("log", plain))
            except Exception:  # pragma: no cover - a record that cannot be sent is not worth a failed solve
                pass


def _portable(exc: BaseException) -> BaseException | None:
    """``exc`` if it survives a pickle round trip, else None (the traceback text says what it was)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return None


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when its parent dies (a hung HiGHS never reads the closed stdin)."""
    parent = int(os.environ.get("LAZYTRAIN_SOLVER_PARENT", os.getppid()))
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the closed stdin ends a worker that is not hung
        return
    if os.getppid() != parent:  # the parent died before the call
        os._exit(0)


def serve_with(handle) -> None:
    """The worker's loop: ``handle(request, send)`` for each request, until stdin closes."""
    import signal

    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the caller, which stops this process if it must
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # what HiGHS or Pyomo print goes to stderr, never into a message
    inp = sys.stdin.buffer

    def send(message: tuple) -> None:
        write_message(out, message)

    root = logging.getLogger()  # the records the caller's levels let through go back, to the caller's handlers
    root.handlers[:] = [_Forward(send)]
    while True:
        header = inp.read(HEADER.size)
        if len(header) < HEADER.size:
            return
        (n,) = HEADER.unpack(header)
        request = pickle.loads(inp.read(n))
        if len(request) > 6:  # the caller's levels (logging.NOTSET where it set none)
            for name, lg in list(logging.Logger.manager.loggerDict.items()):
                if isinstance(lg, logging.Logger) and name not in request[6]:
                    lg.setLevel(logging.NOTSET)
            for name, level in request[6].items():
                logging.getLogger(name or None).setLevel(level)
        for lg in list(logging.Logger.manager.loggerDict.values()):  # handlers that libraries added (Pyomo's
            if isinstance(lg, logging.Logger):                        # stdout one): the caller has its own
                lg.handlers.clear()
        handle(request, send)


def _solve_request(request: tuple, send) -> None:
    _, wl, hw, opt, start, presolve = request[:6]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = solve_here(wl, hw, opt, start, presolve=presolve, on_run=lambda limit: send(("run", limit)))
            reply = ("done", result, [(w.category, str(w.message)) for w in caught])
        except Exception as exc:
            reply = ("error", _portable(exc), traceback.format_exc(), [(w.category, str(w.message)) for w in caught])
    send(reply)


def serve() -> None:
    """The solver process's loop (WORKER_CODE)."""
    serve_with(_solve_request)
