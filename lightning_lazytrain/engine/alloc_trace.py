"""What the CUDA allocator holds at a step's peak, by where it was allocated (a memory diagnosis for the
device kit and the GPU tests).

The second H200 run found the MILP plan of the throughput stage allocating 4.36 GB more than the executor
tracks (2.05 GB with every conversion on the host), and the per-window CUDA test over the plan by
0.08-0.64 MB where internals are offloaded; neither can be explained from the peaks alone. ``record_peak``
runs one step under the allocator's history recording (``torch.cuda.memory._record_memory_history``,
Python stacks), takes the trace (``torch.cuda.memory._snapshot()["device_traces"]``) and
``peak_allocations`` replays it: the allocations alive when the step's own allocations peaked, grouped by
the first frame of this project (or of the model) on their stack, largest first. Allocations made before
the recording began (the executor's static buffers, the model) are not in the trace: the report gives the
allocator's ``memory_allocated`` at the start beside the traced peak.

On the CPU the step runs and the figure is recorded as skipped (the history is CUDA's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

__all__ = ["peak_allocations", "record_peak", "site_of"]

# frames whose file path holds one of these are the code a reader wants to see (in this order of preference)
OURS = ("lightning_lazytrain/", "bench/device/", "tests/", "transformers/models/")


def site_of(frames: Sequence[dict], depth: int = 2) -> str:
    """The allocation's site: up to ``depth`` frames of this project (or the model) on its stack, innermost
    first, ``path:line(function)`` joined by ``" < "``; else the innermost frame."""
    picked = []
    for f in frames:
        name = str(f.get("filename", ""))
        for mark in OURS:
            i = name.find(mark)
            if i >= 0:
                picked.append(f"{name[i:]}:{f.get('line')}({f.get('name')})")
                break
        if len(picked) >= depth:
            break
    if picked:
        return " < ".join(picked)
    if frames:
        f = frames[0]
        return f"{f.get('filename')}:{f.get('line')}({f.get('name')})"
    return "(no stack)"


def peak_allocations(entries: Iterable[dict], top: int = 25) -> dict:
    """Replay an allocator trace (``alloc``, ``free_requested`` / ``free_completed`` entries with ``addr``,
    ``size`` and ``frames``): the largest total of the traced allocations alive at once, and what was
    alive then, grouped by ``site_of``. A free of an address never allocated in the trace (made before it)
    is ignored."""
    entries = list(entries)
    live: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, e in enumerate(entries):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            live[addr] = int(e.get("size", 0))
            total += live[addr]
            if total > peak:
                peak, peak_at = total, i
        elif action in ("free_requested", "free_completed") and addr in live:
            total -= live.pop(addr)
    alive: dict[int, dict] = {}
    for e in entries[:peak_at + 1]:
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            alive[addr] = e
        elif action in ("free_requested", "free_completed"):
            alive.pop(addr, None)
    sites: dict[str, list[int]] = {}
    for e in alive.values():
        s = sites.setdefault(site_of(e.get("frames") or []), [0, 0])
        s[0] += int(e.get("size", 0))
        s[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {"traced_peak_bytes": peak, "alive_at_peak": len(alive), "entries": len(entries),
            "sites": [{"site": k, "bytes": v[0], "count": v[1]} for k, v in ranked[:top]],
            "other_sites_bytes": sum(v[0] for _, v in ranked[top:])}


def record_peak(dev: str, step: Callable[[], Any], top: int = 25, max_entries: int = 500_000) -> dict:
    """Run ``step`` once under the allocator's history recording and report ``peak_allocations`` (CUDA);
    on the CPU run it and record why there is no figure."""
    if dev != "cuda":
        step()
        return {"status": "skipped", "reason": "CUDA only: the allocator history is CUDA's (the step ran)"}
    from lightning_lazytrain.engine.live_bytes import reset_cuda_peak

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    reset_cuda_peak(torch.device("cuda", torch.cuda.current_device()))  # the run's peak kept (live_bytes.py)
    try:  # an earlier recording's entries are not this step's
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python", clear_history=True)
    except TypeError:  # a torch without clear_history
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    traces = snap.get("device_traces") or [[]]
    out = peak_allocations(traces[torch.cuda.current_device()] if len(traces) > 1 else traces[0], top)
    out.update(status="measured", allocated_before_bytes=before, max_memory_allocated_bytes=torch.cuda.max_memory_allocated(),
               truncated=out["entries"] >= max_entries)
    return out
