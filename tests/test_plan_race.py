"""The plan checked by measurement (Note: [the plan checked by measurement] in core/plan_race.py).

After a plan takes effect the run times it against the baselines it was compared with and keeps the schedule
whose median step was fastest. Here the race's decisions are driven by a callback that makes one schedule
measurably slower (a sleep at the end of its steps), and training through the race's switches equals
``strategy="auto"`` bit for bit.
"""

from __future__ import annotations

import time

import lightning
import pytest
from test_review2_finetune import PartNet, fit, fit_like_auto

from lightning_lazytrain.core.plan_race import PlanRace, RaceEntry
from lightning_lazytrain.core.replan import ReplanOptions
from lightning_lazytrain.strategy import LazyTrainStrategy

RACE = {"race": True, "race_margin": 10.0, "patience": 3}  # 3 timed steps each: a median one hiccup cannot move


def entries(n: int = 2) -> list[RaceEntry]:
    return [RaceEntry("plan" if k == 0 else f"c{k}", f"schedule{k}", 1.0 + k) for k in range(n)]


def run(race: PlanRace, periods: list[float], start: float = 100.0) -> list[str | None]:
    """Feed step periods; each step's switch (the entry's name) or None."""
    now = start
    race.step_ended(now)  # the step that adopted the plan
    out = []
    for p in periods:
        now += p
        e = race.step_ended(now)
        out.append(None if e is None else e.name)
    return out


def test_the_race_times_the_plan_then_each_challenger_and_keeps_the_fastest():
    race = PlanRace(entries(3), steps=2, min_gain=0.05)
    # plan: 1 uncounted + 2 counted (1.0, 1.2); c1: 1 + 2 (0.5, 0.7); c2: 1 + 2 (0.9, 0.9): c1 wins
    got = run(race, [9.0, 1.0, 1.2, 9.0, 0.5, 0.7, 9.0, 0.9, 0.9])
    assert got == [None, None, "c1", None, None, "c2", None, None, "c1"]
    assert race.done and race.winner.name == "c1"
    assert race.entries[0].times == pytest.approx([1.0, 1.2]) and race.entries[1].times == pytest.approx([0.5, 0.7])
    assert len(got) == PlanRace.length(2, 2)
    assert race.step_ended(1e6) is None  # decided: nothing more
    rec = race.record()
    assert rec["kept"] == "c1" and rec["entries"][1]["median_s"] == pytest.approx(0.6)


def test_a_challenger_must_beat_the_plan_by_min_gain():
    race = PlanRace(entries(2), steps=3, min_gain=0.05)
    got = run(race, [5, 1.0, 1.0, 1.0, 5, 0.97, 0.97, 0.97])  # 3% faster: not enough
    assert got[-1] == "plan" and race.winner.name == "plan"
    race = PlanRace(entries(2), steps=3, min_gain=0.05)
    got = run(race, [5, 1.0, 1.0, 1.0, 5, 0.9, 0.9, 0.9])
    assert got[-1] is None and race.winner.name == "c1"  # already on it: no switch


def test_a_step_with_an_evaluation_is_not_counted_and_abandon_goes_back_to_the_plan():
    race = PlanRace(entries(2), steps=2, min_gain=0.0)
    race.step_ended(0.0)
    race.step_ended(1.0)  # uncounted
    race.taint()
    race.step_ended(10.0)  # an evaluation ran: not counted
    assert race.entries[0].times == []
    race.step_ended(11.0)
    race.step_ended(12.0)
    assert race.entries[0].times == [1.0, 1.0] and race.current == 1
    back = race.abandon()
    assert back is race.entries[0] and race.done and race.winner is race.entries[0]
    assert race.abandon() is None


def test_options_are_checked():
    with pytest.raises(ValueError, match="race_margin"):
        ReplanOptions(race_margin=-1)
    with pytest.raises(ValueError, match="race_candidates"):
        ReplanOptions(race_candidates=0)
    with pytest.raises(ValueError, match="race="):
        ReplanOptions(race="yes")
    assert ReplanOptions().races("cuda") and not ReplanOptions().races("cpu")
    assert ReplanOptions(race=True).races("cpu") and not ReplanOptions(race=False).races("cuda")


class SlowOn(lightning.Callback):
    """Sleep ``seconds`` at the end of each training step run by a schedule whose policy is (``plan``) or is
    not (else) the MILP's; records the policy of every step."""

    def __init__(self, plan: bool, seconds: float = 0.15) -> None:
        self.plan, self.seconds, self.policies = plan, seconds, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        ex = getattr(trainer.strategy, "executor", None)  # auto's: none
        if ex is None:
            return
        policy = ex.schedule.policy
        self.policies.append(policy)
        if (policy == "milp") == self.plan:
            time.sleep(self.seconds)


@pytest.mark.parametrize("slow_plan", [True, False], ids=["plan-slower", "plan-faster"])
def test_a_lightning_run_keeps_the_schedule_that_measured_fastest(slow_plan):
    slow = SlowOn(plan=slow_plan)
    _, _, trainer = fit(LazyTrainStrategy(replan=RACE), PartNet(0, False), steps=12, callbacks=[slow])
    races = trainer.strategy.races
    assert len(races) == 1, races
    race = races[0]
    challenger = race["entries"][1]["name"]
    assert race["kept"] == (challenger if slow_plan else "plan"), race
    assert (slow.policies[-1] == "milp") == (not slow_plan), slow.policies  # the run went on with the winner
    assert any(p != "milp" for p in slow.policies)  # the challenger ran


@pytest.mark.parametrize("accum", [1, 2])
def test_training_through_the_race_matches_auto(accum):
    """Schedule switches at step boundaries (plan -> challenger -> winner) keep training bit for bit."""
    got, _, _ = fit_like_auto(LazyTrainStrategy(replan=RACE), lambda: PartNet(0, False),
                              extra=lambda: [SlowOn(plan=True, seconds=0.05)], steps=10, accum=accum)
    races = got[2].strategy.races
    assert len(races) == 1 and races[0]["kept"] != "plan", races  # plan -> challenger, kept


def test_no_race_on_the_cpu_by_default_nor_for_a_named_policy():
    _, _, trainer = fit(LazyTrainStrategy(), PartNet(), steps=6)
    assert trainer.strategy.races == []
    _, _, trainer = fit(LazyTrainStrategy(policy="megatrain", replan=RACE), PartNet(), steps=6)
    assert trainer.strategy.races == []
