"""The per-layer optimizer mode: under a pipelined step, ``Schedule.serial_layers``
are updated in T instead of in their F window. The MILP chooses them (``MilpOptions.serial_layers``),
the simulator times them, the engine runs them (the pipelined order puts them after layer 0 and T
waits for them), exactly."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import lightning.pytorch as L
import pytest
import torch

from lightning_lazytrain.planner import InvalidInput, keep_all, simulate, solve
from lightning_lazytrain.planner.milp import ScheduleModel
from lightning_lazytrain.planner.schedule import Op
from test_planner_optimizer_mode import small_instance


def test_windows_move_the_serial_layers_updates_into_t():
    s = dataclasses.replace(keep_all(4), serial_layers=(2,))
    w = {x.name: x for x in s.windows()}
    assert not any(op.lane == "cpu" for op in w["F1"].ops)  # layer 2 is not updated before its fetch
    assert any(op == Op("cpu", "optimizer", 3) for op in w["F2"].ops)  # layer 3 still is
    t_cpu = [op.index for op in w["T"].ops if op.lane == "cpu"]
    assert t_cpu == [-1, 0, 2]
    later = {x.name: x for x in s.windows(first_microbatch=False)}  # later micro-batches: no updates
    assert not any(op.lane == "cpu" for n, x in later.items() if n != "T" for op in x.ops)
    again = type(s).loads(s.dumps())
    assert again.serial_layers == (2,) and again.windows() == s.windows()
    assert s.in_mode("replicate").serial_layers == ()  # several ranks: not modelled there
    for bad in ((0,), (4,), (3, 2), (2, 2)):
        with pytest.raises(InvalidInput, match="serial_layers"):
            dataclasses.replace(keep_all(4), serial_layers=bad)
    with pytest.raises(InvalidInput, match="pipelined"):
        dataclasses.replace(keep_all(4), optimizer="serial", serial_layers=(1,))


def test_the_milp_finds_the_per_layer_mode_where_it_beats_both_pure_modes():
    """Small instance (4 layers, 4 micro-batches, slow link): pipelined 36.30 s, serial 37.19 s, and
    pipelined with layer 2 updated in T 35.94 s; the MILP returns that, its objective is the simulator's,
    and no set of serial layers is better with its other decisions."""
    wl, hw = small_instance(random.Random(1207), 4, slow=False)
    res = solve(wl, hw, mip_gap=1e-9, time_limit=30, serial_layers=True)
    assert res.status == "optimal"
    assert res.schedule.optimizer == "pipelined" and res.schedule.serial_layers == (2,)
    assert solve(wl, hw, mip_gap=1e-9, time_limit=30).schedule.serial_layers == ()  # off by default
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-6)  # + the tie-breaks
    pure = [solve(wl, hw, mip_gap=1e-9, time_limit=30, optimizer_mode=m, serial_layers=False)
            for m in ("serial", "pipelined")]
    best_pure = min(r.simulated.iteration_seconds for r in pure)
    assert all(r.schedule.serial_layers == () for r in pure)
    assert res.simulated.iteration_seconds < best_pure * (1 - 0.005)
    for k in range(wl.num_layers):
        for S in itertools.combinations(range(1, wl.num_layers), k):
            other = dataclasses.replace(res.schedule, serial_layers=S)
            assert res.simulated.iteration_seconds <= simulate(other, wl, hw).iteration_seconds + 1e-9


@pytest.mark.slow
def test_at_27b_with_a_3_gb_per_s_link_some_layers_go_to_t():
    """The audit's case: serial beat pipelined (59.90 vs 61.05 s); a pipelined step with some layers
    updated in T beats both. With the shipped H800 profile no layer moves."""
    from lightning_lazytrain.config import load_hardware, load_model
    from lightning_lazytrain.planner import TrainSpec, Workload

    hw = load_hardware("h800")
    wl = Workload.analytic(load_model("qwen3.6-27b"), TrainSpec(micro_batch_size=72, seq_len=1024), hw)
    slow = hw.replace(h2d_bytes_per_s=3e9, d2h_bytes_per_s=3e9)
    res = solve(wl, slow, serial_layers=True)
    serial = solve(wl, slow, optimizer_mode="serial")
    assert res.schedule.optimizer == "pipelined" and len(res.schedule.serial_layers) > 0
    assert res.simulated.iteration_seconds < serial.simulated.iteration_seconds * (1 - 0.003)
    # the objective is the simulated time plus its tie-breaks (ScheduleModel.EPS per move and per serial layer)
    s = res.schedule
    moves = (sum(h == "cpu" for h in s.homes) + 2 * sum(h == "nvme" for h in s.homes) + len(s.offloaded_internals)
             + len(s.serial_layers))
    assert res.objective - ScheduleModel.EPS * moves == pytest.approx(res.simulated.iteration_seconds, rel=1e-9)
    assert solve(wl, hw, serial_layers=True).schedule.serial_layers == ()


def test_the_strategy_updates_the_serial_layers_in_t_exactly(tmp_path):
    """A plan with layer 2 of 4 updated in T: the pipelined HybridAdamW step runs embed, head, layer
    0, layer 2, then 1 and 3; the executor waits for layer 2's update before F0; Lightning's training
    bit for bit (losses, clip norms, weights)."""
    from test_clip_exact import ACCUM, STEPS, fit

    from lightning_lazytrain.lit_module import CausalLMModule
    from lightning_lazytrain.strategy import LazyTrainStrategy

    plan = tmp_path / "plan.json"
    schedule = dataclasses.replace(keep_all(4), serial_layers=(2,), policy="test-serial-layers")
    plan.write_text(json.dumps({"schedule": schedule.to_json()}))

    def module():
        torch.manual_seed(0)
        return CausalLMModule(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)

    g = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(STEPS * ACCUM)]
    m_want, r_want, _ = fit("auto", module(), clip=0.05, batches=tokens)
    waits: list[int] = []
    orders: list = []

    class Spy(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def on_train_batch_end(self, trainer, *args):
            st = trainer.strategy
            ex = st.executor
            orders.append(st.core.pipelined_order(trainer.optimizers[0].optimizer
                                             if hasattr(trainer.optimizers[0], "optimizer") else trainer.optimizers[0]))
            if not getattr(ex.wait_updated, "spied", False) and ex.wait_updated is not None:
                inner = ex.wait_updated
                ex.wait_updated = lambda j: (waits.append(j), inner(j))[1]
                ex.wait_updated.spied = True

    strategy = LazyTrainStrategy(policy=str(plan))
    m_got, r_got, _ = fit(strategy, module(), clip=0.05, batches=tokens, extra_callbacks=[Spy()])
    assert orders and orders[-1] == ["embed", "head", 0, 2, 1, 3]
    assert waits[:4] == [-1, -2, 0, 2]  # T: the parts, layer 0, then the serial layer 2
    assert r_got.losses == r_want.losses and r_got.norms == r_want.norms
    for (k, a), b in zip(m_got.state_dict().items(), m_want.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.slow
def test_milp_window_times_equal_the_simulator_with_serial_layers(seed):
    """Seeded with every pipelined schedule of a 3-layer space and every set of serial layers, the
    model's iteration time (window variables at their tight lower bounds) is the simulator's."""
    import pyomo.environ as pyo

    from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
    from planner_helpers import milp_space

    wl, hw = small_instance(random.Random(1400 + seed), 3)
    model = ScheduleModel(wl, hw, MilpOptions(serial_layers=True))
    n = 0
    offered = sorted(model.y)  # the layers whose update can pay off in T (the model prunes the others)
    assert offered, "the instance offers no layer the per-layer mode"
    sets = [tuple(c) for k in range(len(offered) + 1) for c in itertools.combinations(offered, k)]
    for s in milp_space(3, nvme=False, pipelined=True):
        for S in sets:
            t = dataclasses.replace(s, serial_layers=S)
            model.seed_from(t)
            assert pyo.value(model.iteration_time()) == pytest.approx(
                simulate(t, wl, hw, check=False).iteration_seconds, rel=1e-9), t
            n += 1
    assert n > 40
