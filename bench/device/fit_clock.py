"""The fit stage's timing and progress lines (``stage_fit.py``, both sides).

``say`` (wall clock and seconds since ``T0``, this process's start), the one-line error summaries
(``first_line``, ``is_oom``), the child's ``Clock`` of a run's steps (step seconds, optimizer seconds,
forward / backward phases, memory peaks, one step under ``torch.profiler``), the profiled step's GPU
busy and H2D / D2H copy figures (``parse_profile``, ``copy_lanes``), lazytrain's busy seconds and GB/s
per lane (``lane_figures``) and the main thread's cProfile lines (``profile_lines``).
"""

from __future__ import annotations

import datetime as dt
import re
import statistics
import time
from typing import Any, Callable

import torch

from kit import GB

T0 = time.perf_counter()


def say(msg: str) -> None:
    """A progress line: wall clock and seconds since this process started."""
    print(f"[{dt.datetime.now():%H:%M:%S} +{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def first_line(err: BaseException, n: int = 400) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    return text.splitlines()[0][:n] if text else type(err).__name__


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


class Clock:
    """Times one run's steps. Step k's timestamps come from the training loop: ``start(k)`` at the
    batch's start, ``before_optimizer()`` once its backward is done, ``end(k)`` at its end (each after a
    CUDA synchronise). Steps: ``lead`` (lazytrain: the profiled first step and the plan), ``warmup``,
    ``timed`` (each from its start to the next step's start), then one step under ``torch.profiler``.
    Memory peaks: reset at the first timed step's start, sampled at each timed step's end."""

    def __init__(self, dev: str, lead: int, warmup: int, timed: int) -> None:
        self.dev, self.cuda = dev, dev == "cuda"
        self.first_timed = lead + warmup
        self.profiled = self.first_timed + timed
        self.total = self.profiled + 1
        self.starts: dict[int, float] = {}
        self.ends: dict[int, float] = {}
        self.opt_starts: dict[int, float] = {}
        # the forward / backward split of each step (Note: [phase marks]): CUDA events on the compute stream
        # (no synchronise: the host runs ahead as in training), perf_counter on the CPU
        self.marks: dict[int, dict[str, Any]] = {}
        self.k = -1
        self.reset_peak: Callable[[], None] = (lambda: torch.cuda.reset_peak_memory_stats()) if self.cuda else (
            lambda: None)
        self.peak_allocated: Callable[[], int] = (lambda: torch.cuda.max_memory_allocated()) if self.cuda else (
            lambda: 0)
        self.allocated = 0
        self.reserved = 0
        self.hooks: dict[str, list[Callable[[], None]]] = {"first_timed": [], "last_timed": [], "profiled_start": [],
                                                            "done": []}
        self.prof: Any = None
        self.prof_t0 = 0.0
        self.gpu_busy: dict | None = None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _run(self, name: str) -> None:
        for fn in self.hooks[name]:
            fn()

    def _mark(self, name: str) -> None:
        """Note: [phase marks] A phase boundary of step ``k``: on CUDA an event on the current stream, which
        the GPU passes once the work queued before it is done -- the forward's end as the device ran it,
        its waits for host updates included -- without stopping the host; on the CPU the time now."""
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.setdefault(self.k, {})[name] = ev
        else:
            self.marks.setdefault(self.k, {})[name] = time.perf_counter()

    def _between(self, k: int, a: str, b: str) -> float | None:
        m = self.marks.get(k, {})
        if a not in m or b not in m:
            return None
        return m[a].elapsed_time(m[b]) / 1e3 if self.cuda else m[b] - m[a]

    def start(self, k: int) -> None:
        self.sync()
        self.k = k
        self.starts[k] = time.perf_counter()
        self._mark("start")
        if k == self.first_timed:
            self.reset_peak()
            self._run("first_timed")
        if k == self.profiled:
            self._run("profiled_start")
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU])
            self.prof.start()
            self.sync()
            self.prof_t0 = time.perf_counter()
        if k in (0, self.first_timed, self.profiled):
            say(f"step {k} of {self.total}: " + ("first" if k == 0 else "timed steps start" if k == self.first_timed
                                                 else "profiled step"))

    def before_backward(self) -> None:
        self._mark("backward")

    def before_optimizer(self) -> None:
        self.sync()
        self.opt_starts[self.k] = time.perf_counter()
        self._mark("optimizer")

    def end(self, k: int) -> None:
        self.sync()
        self.ends[k] = time.perf_counter()
        if self.first_timed <= k < self.profiled and self.cuda:
            self.allocated = max(self.allocated, int(self.peak_allocated()))
            self.reserved = max(self.reserved, int(torch.cuda.max_memory_reserved()))
        if k == self.profiled - 1:
            self._run("last_timed")
        if k == self.profiled and self.prof is not None:
            wall = self.ends[k] - self.prof_t0
            self.prof.stop()
            self.gpu_busy = parse_profile(self.prof, wall, self.cuda)
            self.prof = None
            self._run("done")

    def result(self, tokens_per_step: int) -> dict:
        timed = [self.starts[k + 1] - self.starts[k] for k in range(self.first_timed, self.profiled)
                 if k in self.starts and k + 1 in self.starts]
        first = [self.starts[k + 1] - self.starts[k] for k in range(0, self.first_timed)
                 if k in self.starts and k + 1 in self.starts]
        opt = [self.ends[k] - self.opt_starts[k] for k in range(self.first_timed, self.profiled)
               if k in self.ends and k in self.opt_starts]
        out: dict = {"steps_run": len(self.starts), "untimed_step_seconds": [round(s, 4) for s in first],
                     "step_seconds": [round(s, 4) for s in timed]}
        if timed:
            med = statistics.median(timed)
            out.update(median_step_seconds=med, tokens_per_s=tokens_per_step / med)
        if opt:
            out["optimizer_seconds"] = statistics.median(opt)
            out["optimizer_seconds_each"] = [round(s, 4) for s in opt]
        # Note: [phase marks]: the timed steps' forward (from the step's start: T's waits for the updated
        # non-block weights and block 0 included) and backward (to the optimizer step), medians
        phases = {}
        for name, (a, b) in {"forward": ("start", "backward"), "backward": ("backward", "optimizer")}.items():
            got = [x for k in range(self.first_timed, self.profiled) if (x := self._between(k, a, b)) is not None]
            if got:
                phases[name] = round(statistics.median(got), 4)
        if phases:
            out["phase_seconds"] = phases
        if self.cuda and timed:
            out["max_memory_allocated_gb"] = self.allocated / GB
            out["max_memory_reserved_gb"] = self.reserved / GB
        if self.gpu_busy is not None:
            out["gpu_busy"] = self.gpu_busy
            out["gpu_busy_fraction"] = self.gpu_busy.get("gpu_busy_fraction")
            if self.cuda and timed and self.gpu_busy.get("kernel_seconds"):
                out["gpu_busy_fraction_of_median_step"] = self.gpu_busy["kernel_seconds"] / statistics.median(timed)
        return out


def parse_profile(prof: Any, wall: float, cuda: bool) -> dict:
    """GPU busy figures of a profiled step (``stage_throughput.gpu_busy_from_events``) plus the union of
    the H2D and D2H copies (the GPU's copy lanes)."""
    from stage_throughput import gpu_busy_from_events
    from torch.autograd import DeviceType

    device_types = {DeviceType.CUDA, getattr(DeviceType, "PrivateUse1", DeviceType.CUDA)}
    events = [(e.name, e.device_type in device_types, e.time_range.start, e.time_range.end) for e in prof.events()]
    out = gpu_busy_from_events(events, wall)
    out.update(copy_lanes(events), events=len(events))
    if not cuda:
        out.update(status="skipped", reason="CUDA only: the CPU rehearsal has no GPU kernels (the profiled step ran)",
                   gpu_busy_fraction=None)
    else:
        out["status"] = "measured"
    return out


def copy_lanes(events) -> dict:
    """Seconds the profiled step's H2D and D2H copies kept each direction busy (union of intervals)."""
    from stage_throughput import interval_union

    lanes: dict[str, list] = {"h2d": [], "d2h": []}
    for name, dev, a, b in events:
        low = name.lower()
        if dev and low.startswith("memcpy"):
            if "htod" in low:
                lanes["h2d"].append((a, b))
            elif "dtoh" in low:
                lanes["d2h"].append((a, b))
    return {f"{k}_copy_seconds": round(interval_union(v) / 1e6, 6) for k, v in lanes.items()}


def lane_figures(stats: Any, sim: Any) -> dict:
    """Busy seconds per lane of a measured step (``StepStats.segments``, summed as ``stage_throughput``)
    and as the plan predicted, and the achieved GB/s per lane (bytes / the lane's busy union)."""
    from stage_throughput import lane_rates

    out: dict = {}
    if stats is not None:
        busy: dict[str, float] = {}
        for seg in stats.segments:
            busy[seg.lane] = busy.get(seg.lane, 0.0) + seg.end - seg.start
        out["lane_busy_seconds"] = {k: round(v, 4) for k, v in sorted(busy.items())}
        out["lane_gb_per_s"] = lane_rates(stats.segments, dict(stats.lane_bytes))
        out["lane_bytes"] = {k: int(v) for k, v in stats.lane_bytes.items()}
    if sim is not None:
        pbusy: dict[str, float] = {}
        for seg in sim.timeline:
            pbusy[seg.lane] = pbusy.get(seg.lane, 0.0) + seg.end - seg.start
        out["predicted_lane_busy_seconds"] = {k: round(v, 4) for k, v in sorted(pbusy.items())}
        out["predicted_lane_gb_per_s"] = {k: v["gb_per_s"] for k, v in lane_rates(sim.timeline).items()}
        opt = [s for s in sim.timeline if s.kind == "optimizer"]
        out["predicted_optimizer_seconds"] = round(sum(s.end - s.start for s in opt), 4)
    return out


def profile_lines(prof: Any, top: int = 45) -> list[str]:
    """The main thread's cProfile of the timed steps: the ``top`` functions by cumulative seconds."""
    import io
    import pstats

    lines = []
    for key, n in (("cumulative", top), ("tottime", 15)):
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(n)
        text = re.sub(r"\S*/(site-packages|lightning_lazytrain)/", r"\1/", buf.getvalue())
        lines += [f"# by {key}"] + [line.rstrip()[:200] for line in text.splitlines() if line.strip()][:n + 12]
    return lines
