"""The engine's one worker primitive: a FIFO thread, the handle every job returns, one error rule.

Note: [one worker, one error rule]
    A ``Worker`` runs jobs on one daemon thread in submission order. Every FIFO thread of the
    engine is one: each lane of the copy engine that runs on the host (the CPU backend's h2d and
    d2h, both backends' nvme_read, nvme_write and host lanes: copy_engine.py), a sharded store's
    gloo reduce-scatters (shard_grads.py) and the several-process gradient all-reduces
    (core/grad_sync.GradSync). Every job returns a ``ThreadHandle``, the one completion signal
    (``wait``, ``done``, ``exception``, ``add_done_callback``).

    The error rule: a job that raises stops its worker. Every later job of that worker, already
    queued or submitted afterwards, fails at once with the same error, without running (a
    collective must not wait for ranks that gave up, a copy must not use what a failed one left
    half done), until the owner calls ``clear()`` where it reports the failure: the copy engine in
    ``synchronize`` (a step's start and end), ``GradSync`` when its drain has raised it, the
    reduce-scatter lane when it closes. The error reaches whoever waits: ``wait()`` raises
    ``CopyError`` (one sentence naming the lane and the bytes, ``CopyError.of``) from the
    original error, ``exception`` is the original. A job whose ``after=`` dependency failed fails
    with that failure (its sentence repeats the first failure's) without running, and does not
    stop its own worker: the failure belongs to the worker whose job raised.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["CopyError", "CopyHandle", "DoneHandle", "ThreadHandle", "Worker"]


class CopyError(RuntimeError):
    """A copy failed; raised from ``CopyHandle.wait()`` (the cause is chained). Made by ``of``: one
    readable sentence, never the repr of a repr."""

    @classmethod
    def of(cls, lane: str, nbytes: int, exc: BaseException) -> CopyError:
        """The error of a ``lane`` copy of ``nbytes`` that failed with ``exc``: the lane, the bytes and
        ``exc``'s message; a copy that waited for a failed one (``exc`` a ``CopyError``) repeats that
        one's message, which names the copy that failed first."""
        if isinstance(exc, CopyError):
            return cls(str(exc))
        text = str(exc)
        detail = text if isinstance(exc, OSError) and text else f"{type(exc).__name__}: {text}".rstrip(": ")
        return cls(f"{lane} copy of {nbytes} bytes failed: {detail}")


class CopyHandle(ABC):
    """A copy (or other job of the engine) in flight."""

    lane: str
    nbytes: int

    @abstractmethod
    def wait(self) -> None:
        """Block the calling thread until the copy has finished (raises CopyError on failure)."""

    @abstractmethod
    def done(self) -> bool:
        """True once the copy has finished (successfully or not); never blocks."""

    def sync_current_stream(self) -> None:
        """Make the current compute stream wait for this copy.

        On CPU there is no stream, so this is ``wait()``; the CUDA backend
        overrides it with a non-blocking ``stream.wait_event``.
        """
        self.wait()

    def release_device(self) -> None:
        """Drop this handle's references to device tensors. Only after ``sync_current_stream()``:
        compute then runs after the copy, so the caching allocator may hand the memory to compute
        at once (see copy_cuda's Note: [allocator ownership]). On CPU the finished copy holds none."""


class ThreadHandle(CopyHandle):
    """A job of a ``Worker`` (Note: [one worker, one error rule]): finished by its thread."""

    def __init__(self, lane: str, nbytes: int, keep: tuple[Any, ...] = ()) -> None:
        self.lane = lane
        self.nbytes = nbytes
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[ThreadHandle], None]] = []
        # References that must outlive the job (a copy's source and destination tensors).
        self._keep: tuple[Any, ...] | None = keep

    def _finish(self, exc: BaseException | None = None) -> None:
        with self._lock:
            self._exc = exc
            self._keep = None
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, fn: Callable[[ThreadHandle], None]) -> None:
        """Run ``fn(handle)`` when done: in the finishing thread, or now if already done."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    @property
    def exception(self) -> BaseException | None:
        """The error the job failed with (the original, not the ``CopyError`` ``wait`` raises)."""
        return self._exc

    def wait(self) -> None:
        self._event.wait()
        if self._exc is not None:
            raise CopyError.of(self.lane, self.nbytes, self._exc) from self._exc

    def done(self) -> bool:
        return self._event.is_set()


class DoneHandle(ThreadHandle):
    """An already finished no-op (e.g. 'compute is done' on CPU, a GPU-tier offload)."""

    def __init__(self, lane: str = "h2d", nbytes: int = 0) -> None:
        super().__init__(lane, nbytes)
        self._finish()


_Job = tuple[ThreadHandle, Callable[[], object], tuple[CopyHandle, ...]]


class Worker:
    """One daemon thread running jobs in submission order, with one error rule (Note: [one worker,
    one error rule])."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object], *, lane: str, nbytes: int = 0, after: Iterable[CopyHandle] = (),
               keep: tuple[Any, ...] = ()) -> ThreadHandle:
        """Run ``fn()`` after every earlier job and after ``after``; returns its handle (``lane`` and
        ``nbytes`` name the job in its error; ``keep``: references that must live until it is done)."""
        handle = ThreadHandle(lane, nbytes, keep)
        self._queue.put((handle, fn, tuple(after)))
        return handle

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the worker (None: it runs its jobs)."""
        return self._error

    def clear(self) -> BaseException | None:
        """Let later jobs run again; returns the error that had stopped the worker (or None)."""
        err, self._error = self._error, None
        return err

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued jobs (failing them at once if the worker is stopped) and end the thread;
        False if it is still running after ``timeout`` seconds (inside a job)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            handle, fn, after = job
            del job
            err: BaseException | None = self._error
            if err is None:
                try:
                    for dep in after:
                        dep.wait()
                except BaseException as dep_err:  # noqa: BLE001 - the dependency's failure, not this worker's
                    err = dep_err
                else:
                    try:
                        fn()
                    except BaseException as job_err:  # noqa: BLE001 - delivered to whoever waits
                        err = self._error = job_err
            # Note: [a job's references go before its handle finishes]: the job's function (its closure
            # holds the copy's tensors) goes here, before the handle wakes its waiter. A waiter that then
            # drops its own reference to a buffer frees it at once (a host arena's memory, which
            # host_pinned_bytes counts, goes with its last slice), not whenever this thread takes its
            # next job; an error's traceback keeps this frame, not the tensors.
            del fn, after
            handle._finish(err)
            del handle, err
