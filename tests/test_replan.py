"""Online re-planning: the drift monitor, link rates from a step's copies, and a run whose emulated
link slows down mid-run — the strategy re-profiles one step, re-plans from what it measured, and
trains exactly as strategy='auto' through it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_lazytrain.core.replan import DriftMonitor, ReplanOptions, measured_link_rates
from models import tiny_llama

transformers = pytest.importorskip("transformers")


def test_stable_ratios_never_trigger_and_a_lasting_move_does_once_per_baseline():
    m = DriftMonitor(ReplanOptions(threshold=0.25, patience=3))
    assert all(m.observe(0.8 + 0.05 * (i % 2), 1.0) is None for i in range(12))  # baseline ~0.8, noise 6%
    assert m.observe(1.6, 1.0) is None  # one slow step in three: the median holds
    assert m.observe(1.7, 1.0) is None  # two: the median moved, but only just now
    assert m.observe(1.6, 1.0) is None  # (a streak of 2)
    reason = m.observe(1.6, 1.0)  # moved at 3 steps in a row: a lasting move
    assert reason is not None and reason.startswith("drift: ") and "0.80 to 1.60" in reason and "+100%" in reason
    assert "stayed there for 3 steps" in reason
    assert m.baseline is None and m.level == 1  # a new baseline follows the re-plan, and a higher bar
    assert all(m.observe(1.6, 1.0) is None for _ in range(12))


def test_a_short_burst_of_slow_steps_is_not_drift():
    m = DriftMonitor(ReplanOptions())  # threshold 25%, patience 5
    # the burst that made the main job re-plan (and keep its schedule) with a median of 3 steps
    ratios = [0.65] * 10 + [0.70, 1.33, 1.08, 1.57, 0.97, 0.75, 0.70, 0.76, 0.75, 0.68] + [0.66] * 20
    assert all(m.observe(r, 1.0) is None for r in ratios)


def noisy_ratios(n: int, seed: int, *, change_at: int | None = None, factor: float = 2.0) -> list[float]:
    """measured/predicted per step on a busy machine: ~6% jitter around 0.65 and, on 3% of the steps,
    the start of a burst of 2-6 steps 1.4-2.5x slower (other processes); from ``change_at`` on, a
    real change: every step ``factor`` slower."""
    import random

    rng = random.Random(seed)
    out, burst, amp = [], 0, 1.0
    for i in range(n):
        r = 0.65 * rng.lognormvariate(0.0, 0.06)
        if burst == 0 and rng.random() < 0.03:
            burst, amp = rng.randint(2, 6), rng.uniform(1.4, 2.5)
        if burst:
            r, burst = r * amp, burst - 1
        out.append(r * (factor if change_at is not None and i >= change_at else 1.0))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_noise_fires_at_most_twice_and_a_real_change_still_fires(seed):
    # (with a median of 3 steps, +-25% and no back-off, these sequences fired 5 times each: the cap)
    quiet = DriftMonitor(ReplanOptions())
    fired = [i for i, r in enumerate(noisy_ratios(600, seed)) if quiet.observe(r, 1.0) is not None]
    assert len(fired) <= 2, fired
    m = DriftMonitor(ReplanOptions())
    fired = [i for i, r in enumerate(noisy_ratios(600, seed, change_at=300)) if m.observe(r, 1.0) is not None]
    late = [i for i in fired if i >= 300]
    assert late and late[0] < 340, fired  # the lasting 2x slowdown is seen, even behind a raised bar


def test_each_kept_replan_raises_the_bar_and_a_switch_lowers_it():
    o = ReplanOptions(threshold=0.25, patience=2, backoff=1.0)
    m = DriftMonitor(o)
    assert (m.window, m.factor) == (2, pytest.approx(1.25))

    def drift_to(level_ratio: float, steps: int) -> list[int]:
        return [i for i in range(steps) if m.observe(level_ratio, 1.0) is not None]

    drift_to(1.0, 2)  # baseline 1.0
    assert drift_to(1.4, 4) == [2]  # +40% > +25% for 2 steps (after the window filled)
    assert (m.level, m.window, m.factor) == (1, 4, pytest.approx(1.25 ** 2))  # kept (presumed): higher bar
    drift_to(1.4, 4)  # new baseline 1.4
    assert drift_to(1.4 * 1.4, 12) == []  # +40% no longer counts (the bar is +56%)
    drift_to(1.4 * 1.4, 0)
    m.reset()
    drift_to(2.0, 4)  # baseline 2.0
    assert drift_to(2.0 * 1.7, 12) == [6]  # +70% does: a window of 4, then 4 steps in a row
    assert m.level == 2
    m.replanned(switched=True)  # the re-plan switched: the change was real, back to the first bar
    assert (m.level, m.window, m.factor, m.baseline) == (0, 2, pytest.approx(1.25), None)
    m.replanned(switched=False)  # a kept schedule leaves the level (raised when it fired) as it is
    assert m.level == 0


def test_no_backoff_keeps_the_bar_and_a_speedup_counts_too():
    m = DriftMonitor(ReplanOptions(threshold=0.25, patience=1, backoff=0))
    m.observe(1.0, 1.0)
    assert m.observe(0.79, 1.0) is not None  # 1/1.25 = 0.8: a 21% faster step is a move
    m.observe(0.79, 1.0)
    assert (m.level, m.factor) == (1, pytest.approx(1.25)) and m.observe(0.6, 1.0) is not None


def test_a_profile_unlike_the_steps_after_it_is_re_profiled_once():
    # the profiled step ran during a burst of load: predicted 0.55 s, the steps take 0.05 s
    m = DriftMonitor(ReplanOptions())
    assert all(m.observe(0.05, 0.55) is None for _ in range(4))
    reason = m.observe(0.05, 0.55)  # the first baseline (5 steps) is 0.09: beyond 3x
    assert reason is not None and reason.startswith("profile check: the 5 steps after the plan ran 11.0x faster")
    assert "than the profiled step predicted (measured/predicted 0.09, beyond 3x either way)" in reason
    assert (m.replans, m.level, m.baseline, m.profile_checked) == (1, 0, None, True)  # no back-off: not drift
    # the re-profile's prediction holds: quiet
    assert all(m.observe(0.05, 0.07) is None for _ in range(30))
    # once per run: a later baseline far from 1 (a systematic ratio) does not re-profile again
    m.reset()
    assert all(m.observe(0.05, 0.5) is None for _ in range(10))
    # a profile that is too fast; and the check off
    fast = DriftMonitor(ReplanOptions(patience=1))
    assert "4.0x slower" in (fast.observe(4.0, 1.0) or "")
    off = DriftMonitor(ReplanOptions(patience=1, profile_check=0))
    assert all(off.observe(0.05, 0.55) is None for _ in range(5))


def test_max_replans_caps_and_disabled_never_triggers():
    m = DriftMonitor(ReplanOptions(patience=1, max_replans=1, backoff=0))
    m.observe(1.0, 1.0)
    assert m.observe(2.0, 1.0) is not None
    m.observe(2.0, 1.0)
    assert m.observe(4.0, 1.0) is None  # the cap
    off = DriftMonitor(ReplanOptions.parse(False))
    assert all(off.observe(t, 1.0) is None for t in (1.0, 1.0, 1.0, 9.0, 9.0, 9.0))


@pytest.mark.parametrize("value, pattern", [
    ({"threshold": 0}, r"replan threshold=0: must be > 0"),
    ({"patience": 0}, r"replan patience=0"),
    ({"min_gain": 1.5}, r"replan min_gain=1.5"),
    ({"treshold": 0.2}, r"unknown option\(s\) \['treshold'\]"),
    ({"backoff": -1}, r"replan backoff=-1: must be a number in \[0, 10\]"),
    ({"profile_check": 0.5}, r"replan profile_check=0.5: must be a factor > 1"),
    ("yes", r"replan='yes': use True, False or a dict"),
])
def test_bad_options_name_the_problem(value, pattern):
    with pytest.raises(ValueError, match=pattern):
        ReplanOptions.parse(value)


def test_link_rates_are_bytes_over_busy_time():
    seg = lambda lane, n, a, b: SimpleNamespace(lane=lane, bytes=n, start=a, end=b)  # noqa: E731
    rates = measured_link_rates([seg("h2d", 1e6, 0, 0.5), seg("h2d", 1e6, 1, 1.5), seg("d2h", 4e6, 0, 2),
                                 seg("compute", 0, 0, 3), seg("d2h", 1000, 0, 1e-6)])
    assert rates == {"h2d": 2e6, "d2h": 4001000 / (2 + 1e-6)}


class SlowsDown(L.Callback):
    """Makes the emulated host<->device link `factor` times slower from step `at` on."""
    reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

    def __init__(self, at: int, factor: float):
        self.at, self.factor = at, factor
        self.before: float | None = None  # the prediction when the link slowed
        self.ratios: list[float] = []  # measured / predicted step seconds, per step
        self.predicted: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.strategy.metrics  # (logged after this callback)
        if "lazytrain/step_seconds" in m:
            self.ratios.append(m["lazytrain/step_seconds"] / m["lazytrain/predicted_step_seconds"])
            self.predicted.append(m["lazytrain/predicted_step_seconds"])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ex = getattr(trainer.strategy, "executor", None)
        if ex is None or trainer.global_step != self.at:
            return
        self.before = trainer.strategy.core.predicted_seconds()
        from lightning_lazytrain.engine.copy_engine import LinkSpec

        for lane in ("h2d", "d2h"):
            worker = ex.engine._workers[lane]
            worker.link = LinkSpec(worker.link.bandwidth_bytes_per_s / self.factor, worker.link.latency_s)


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama(0, eager=False)  # (the default attention)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def fit(strategy, steps: int, callbacks=()) -> Net:
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 32), generator=g) for _ in range(steps)]
    module = Net()
    L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              num_sanity_val_steps=0, callbacks=list(callbacks)).fit(
        module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return module


@pytest.mark.slow
def test_a_slower_link_mid_run_triggers_one_replan_and_training_stays_exact():
    from lightning_lazytrain.strategy import LazyTrainStrategy

    steps = 10
    # (the profile check off: a burst of load on this shared machine right after the plan would spend a
    # re-profile of its own; test_a_slow_profile_is_re_profiled_and_its_prediction_corrected covers it)
    strategy = LazyTrainStrategy(emulate_link_gb_per_s=0.2, replan={"threshold": 0.5, "patience": 2,
                                                                     "profile_check": 0})
    slow = SlowsDown(at=3, factor=40)
    ours = fit(strategy, steps, [slow])
    assert len(strategy.replans) == 1, strategy.replans
    r = strategy.replans[0]
    assert "moved from" in r["reason"] and r["step"] >= 5
    # the re-solve was warm-started (from the current plan when it still beat the baselines)
    assert r["warm_start"] is not None
    # the re-profile measured the slower link (40x): the schedule it had is now predicted far slower (x2 at least:
    # the step's compute share does not slow, and on a loaded machine it is larger -- 2.7x was seen under load)
    assert r["current_predicted_s"] > 2 * slow.before
    # after the switch the run is predicted by the new plan, and the prediction tracks it again:
    # a loose bound, as this is a timing on a shared 2-core machine (bench_replan.py measures it;
    # with the stale prediction the ratio would be ~ new/old prediction times this)
    assert slow.predicted[-1] == pytest.approx(r["new_predicted_s"] if r["switched"] else r["current_predicted_s"])
    assert sorted(slow.ratios[-3:])[1] < 3.0, (slow.ratios, r)
    ref = fit("auto", steps)
    assert ours.losses == ref.losses  # exact through the re-profile and the switch


class SlowProfile(L.Callback):
    """Every block's forward sleeps ``seconds`` during the first (profiled) step only: a burst of load
    while the profile is taken. Records the prediction of every step."""
    reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.active = False
        self.predicted: list[float] = []

    def on_train_start(self, trainer, pl_module):
        def sleep(module, args, output):
            if self.active:
                time.sleep(self.seconds)

        for layer in pl_module.model.model.layers:
            layer.register_forward_hook(sleep)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.active = trainer.global_step == 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.strategy.metrics
        if "lazytrain/predicted_step_seconds" in m:
            self.predicted.append(m["lazytrain/predicted_step_seconds"])


@pytest.mark.slow
def test_a_slow_profile_is_re_profiled_and_its_prediction_corrected():
    from lightning_lazytrain.strategy import LazyTrainStrategy

    # the drift bar wide (2x either way): the profile check is what this is about; with the default +25% a
    # loaded machine re-planned a second time for drift (.ci/run on 2026-12-05: 0.31 -> 0.40 s, +29%)
    strategy = LazyTrainStrategy(replan={"patience": 2, "threshold": 1.0})
    slow = SlowProfile(0.2)
    fit(strategy, 10, [slow])
    assert len(strategy.replans) == 1, strategy.replans  # once, at the first baseline; then quiet
    r = strategy.replans[0]
    assert "faster than the profiled step predicted" in r["reason"] and r["step"] == 3, r
    # the re-profiled step predicts the schedule it runs far faster (the sleeps in the profile made the
    # first plan's prediction several times the steps'); the run is measured against that from then on
    first = slow.predicted[0]
    # (alone ~0.23x the first; under the suite's load the re-profiled step is slower too: 0.52x seen in .ci/run
    # on 2026-12-05, so a loose bar)
    assert r["current_predicted_s"] < 0.75 * first, (slow.predicted, r)
    assert slow.predicted[-1] == pytest.approx(r["new_predicted_s"] if r["switched"] else r["current_predicted_s"])


def test_warm_up_steps_run_before_the_profiled_one_and_training_stays_exact():
    """Note: [profile warm-up] (core/replan.py): ``profile_warmup`` steps run on the provisional schedule
    before the profiled step (default 1 on CUDA, 0 on the CPU); the plan exists from the step after the
    profiled one, and the losses are auto's."""
    from lightning_lazytrain.strategy import LazyTrainStrategy
    from test_conformance import Net, fit

    class PlanSeen(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def __init__(self):
            self.planned = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.planned.append(trainer.strategy.core.plan is not None)

    _, want = fit("auto", Net(), steps=5)
    for warmup, first_planned in ((None, 1), (0, 1), (2, 3)):
        seen = PlanSeen()
        strategy = LazyTrainStrategy(policy="milp", replan={"profile_warmup": warmup})
        _, got = fit(strategy, Net(), steps=5, callbacks_extra=[seen])
        assert got == want
        assert seen.planned == [False] * first_planned + [True] * (5 - first_planned), (warmup, seen.planned)
    with pytest.raises(ValueError, match="profile_warmup"):
        LazyTrainStrategy(replan={"profile_warmup": -1})
