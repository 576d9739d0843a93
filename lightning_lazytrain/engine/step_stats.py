"""``StepStats``: what one optimizer step of the executor did -- bytes per lane, re-runs, norms, the
measured timeline and real device bytes -- read by the strategies (their ``lazytrain/*`` metrics),
the profiler (the plan's workload) and the tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["StepStats"]


@dataclass
class StepStats:
    """What one optimizer step did (filled by the executor, read by tests and loggers)."""

    lane_bytes: dict[str, int] = field(default_factory=dict)
    # an evaluation ran between this step's micro-batches (its copies are not counted, nor its time in
    # step_seconds; the allocator's peak would include it: no memory watch from this step)
    evaluated_mid_step: bool = False
    # a profiled step's non-block parts (p >= 1) whose gradients were complete while a block's backward
    # was still to come: those the updates in the backward can hand over early (Note: [early non-block
    # parts] in early_parts.py), what the plan prices there
    early_complete_parts: set[int] = field(default_factory=set)
    recomputed_forwards: dict[int, int] = field(default_factory=dict)  # layer -> re-runs (block + local)
    peak_tracked_bytes: int = 0
    layer_sq_norms: dict[int, torch.Tensor] = field(default_factory=dict)  # REST = -1 included
    # per layer (REST included), each parameter with a grad and that grad's norm as clip_grad_norm_
    # takes it (ParamStore.grad_norms): what exact fused clipping is fed with
    grad_norms: dict[int, dict[nn.Parameter, torch.Tensor]] = field(default_factory=dict)
    segments: list = field(default_factory=list)  # measured timeline (planner Segments)
    boundary_bytes: dict[int, int] = field(default_factory=dict)  # boundary -> bytes (L: the last output)
    internal_bytes: dict[int, int] = field(default_factory=dict)  # layer -> saved bytes incl. its input
    max_memory_allocated: int | None = None  # CUDA: torch.cuda.max_memory_allocated over the step
    max_memory_reserved: int | None = None  # CUDA: torch.cuda.max_memory_reserved over the step (what OOMs)
    # With ``Executor.measure_memory`` (always while profiling): real device bytes, not bookkeeping
    # (``live_bytes``): per window, the transient working set (its real growth beyond what the
    # executor tracks); over the step, the real peak.
    window_work: dict[str, int] = field(default_factory=dict)
    window_peak_bytes: dict[str, int] = field(default_factory=dict)
    real_peak_bytes: int = 0
    # Device bytes of the tensors the block calls receive besides the hidden state (rotary tables,
    # masks, encoder states; each storage once), kept for the re-runs until the block's backward.
    call_bytes: int = 0
    # Note: [partial keep] (engine/partial_keep.py): per partially keeping layer, the matmul outputs it
    # stored; per locally re-run layer of a profiled step, what a partial keep would store, re-materialise
    # and spend on its elementwise ops (the profile's measurement)
    partial_bytes: dict[int, int] = field(default_factory=dict)
    partial_recompute_bytes: dict[int, int] = field(default_factory=dict)
    partial_seconds: dict[int, float] = field(default_factory=dict)
    # Note: [unreached blocks] (backward_windows.py): blocks whose planned forward ran with grad but got no
    # gradient (its output detached or dropped): their backward windows moved data, computed nothing.
    # Such a step is not a profile (its backward times are missing).
    unreached: set[int] = field(default_factory=set)
    # Note: [blocks no gradient reaches] (block_calls.py): blocks that ran their planned forward without the
    # node, in every micro-batch of the step: no backward, no re-run, no second fetch (the profile's
    # ``Workload.no_backward``, Note: [layers without a backward] in planner/workload.py)
    no_backward: set[int] = field(default_factory=set)
    # groups whose host gradients changed after their last accumulation of the step (an ad-hoc pass's
    # gradients flushed late, the user's post-accumulate-grad hooks): what was handed over as final for
    # them was not (core/optimizer_steps.py, Note: [updates in the backward pass])
    late_groups: set[int] = field(default_factory=set)
    # Note: [untracked device bytes] With memory measured: the real device bytes still allocated when
    # the step ends that the executor does not track (CUDA: everything the allocator holds, e.g. the
    # cuBLAS workspaces of the first matmul on a stream, module buffers, caches a model builds, the
    # batch; CPU: what ops allocated during the step and kept). They live through every window of the
    # next steps: the profile makes them the plan's ``device_overhead_bytes``.
    untracked_bytes: int = 0
    # the seconds the launching thread was blocked on a pipelined optimizer update before staging a layer
    # (core/optimizer_steps.py, Note: [pipelined step]): host blocking, not device idle time (on CUDA
    # the kernels already queued may keep the GPU busy meanwhile)
    optimizer_wait_seconds: float = 0.0

    def metrics(self, seconds: float, predicted_seconds: float) -> dict[str, float]:
        """The ``lazytrain/*`` figures of a step that took ``seconds`` (what the Trainer's strategy
        logs and the Fabric strategy exposes as ``metrics``)."""
        compute = sum(s.end - s.start for s in self.segments if s.lane == "compute")
        out = {
            "lazytrain/step_seconds": seconds,
            "lazytrain/predicted_step_seconds": predicted_seconds,
            "lazytrain/stall_seconds": max(0.0, seconds - compute),
            "lazytrain/peak_tracked_gb": self.peak_tracked_bytes / 1e9,
            "lazytrain/optimizer_wait_seconds": self.optimizer_wait_seconds,
        }
        for lane, nbytes in self.lane_bytes.items():
            out[f"lazytrain/{lane}_gb"] = nbytes / 1e9
        if self.max_memory_allocated is not None:
            out["lazytrain/max_memory_allocated_gb"] = self.max_memory_allocated / 1e9
        return out
