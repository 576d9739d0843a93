"""Note: [the tracker's own time] (engine/live_bytes.py): a profiled step on the CPU measures its device bytes with a
dispatch mode that slows every op; its trace takes that time out of the compute it times, so the plan prices
the compute a step without the tracker runs. Speed itself is measured by ``bench/bench_profile_overhead.py``;
these tests check the accounting."""

from __future__ import annotations

import threading

import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.live_bytes import LiveBytes, dispatch_cost
from lightning_lazytrain.engine.trace import StepTrace
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec
from lightning_lazytrain.planner.policies import keep_all


class Clock:
    """A stamp the test sets, and a tracker's running total the test sets."""

    def __init__(self) -> None:
        self.now = 0.0
        self.tracker = 0.0

    def stamp(self) -> float:
        return self.now


def test_a_compute_segment_and_a_window_span_leave_out_the_tracker_time_inside_them() -> None:
    c = Clock()
    tr = StepTrace(stamp=c.stamp, t0=0.0, overhead=lambda: c.tracker)
    tr.window("H")
    c.now, c.tracker = 1.0, 0.25  # tracker time before the segment: not the segment's
    with tr.timed("F0", "forward", 0):
        c.now, c.tracker = 3.0, 0.75  # 2 s on the clock, 0.5 s of it the tracker's
    with tr.timed("F1", "forward", 1):
        c.now, c.tracker = 4.0, 1.75  # more tracker time than the clock saw (an over-estimate): a floor
    tr.window("B1")
    c.now, c.tracker = 5.0, 2.0
    tr.window("H")  # a later mark of H does not move the span's start
    first, second = tr.compute
    assert (first.start, first.end) == (1.0, 2.5)
    assert abs((second.end - second.start) - 0.1) < 1e-12  # never below a tenth of the clock's
    assert tr.span("H", "B1") == (4.0 - 0.0) - (1.75 - 0.0)
    assert tr.span("H", "B7") == 0.0  # a window never marked
    assert tr.windows == [("H", 0.0), ("B1", 4.0), ("H", 5.0)]  # the marks themselves stay on the clock


def test_without_a_tracker_the_trace_is_the_clock() -> None:
    c = Clock()
    tr = StepTrace(stamp=c.stamp, t0=0.0)
    tr.window("H")
    with tr.timed("F0", "forward", 0):
        c.now = 2.0
    tr.window("B0")
    assert [(s.start, s.end) for s in tr.compute] == [(0.0, 2.0)]
    assert tr.span("H", "B0") == 2.0


def test_the_tracker_counts_its_own_time_for_its_thread_only() -> None:
    assert dispatch_cost() >= 0.0
    a = torch.ones(64)
    with LiveBytes() as lb:
        assert lb.overhead_s == 0.0
        for _ in range(20):
            a = a + 1  # each op allocates: bookkeeping, a finalizer when the old tensor goes
        mine = lb.overhead_s
        assert mine >= 20 * dispatch_cost() and mine > 0
        other = threading.Thread(target=lambda: [torch.ones(64) + 1 for _ in range(50)])
        other.start()
        other.join()  # another thread's ops do not pass through this thread's mode
        assert lb.overhead_s == mine
        assert lb.current > 0


def test_a_profiled_cpu_step_hands_the_plan_its_compute_without_the_tracker() -> None:
    torch.manual_seed(0)
    spec = ModelSpec(name="t", num_layers=2, hidden=32, intermediate=64, heads=2, kv_heads=2, head_dim=16, vocab=64)
    model = LlamaLM(spec)
    tokens = torch.randint(0, 64, (2, 16))
    ex = Executor(model, keep_all(2))
    assert ex.tracker_time_out is False  # off by default
    ex.tracker_time_out = True
    try:
        ex.profiling = True
        ex.begin_microbatch(first=True, last=True)
        model.loss(tokens).backward()
        stats = ex.end_microbatch()
        ex.profiling = False
        tr = ex.trace
        assert stats is not None
        raw = [tr.resolve(b) - tr.resolve(a) for _, _, _, a, b, _ in tr._compute]
        inside = [ov for *_, ov in tr._compute]
        net = [s.end - s.start for s in tr.compute]
        assert len(raw) == len(net) >= 4  # two forwards, two backwards
        assert all(o > 0 for o in inside)  # the tracker ran inside every timed block
        for r, o, n in zip(raw, inside, net):
            assert abs(n - max(r - o, 0.1 * r)) < 1e-12
        compute = [s for s in stats.segments if s.lane == "compute"]
        assert sum(s.end - s.start for s in compute) < sum(raw)
        # a step that measures nothing has no tracker: its segments are the clock's
        model.zero_grad(set_to_none=True)
        ex.begin_microbatch(first=True, last=True)
        model.loss(tokens).backward()
        ex.end_microbatch()
        assert all(ov == 0.0 for *_, ov in ex.trace._compute)
    finally:
        ex.close()
