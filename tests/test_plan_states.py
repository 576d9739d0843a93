"""The 8-bit slice is chosen by the plan, not defaulted (optim/plan_states.py, Note: [planned 8-bit
slice]): ``HybridAdamW(eight_bit="plan")`` gets 32-bit states when the host holds them, the smallest
8-bit slice that fits when it does not, plain 32-bit states without a plan; the plan prices the
optimizer as its states are (an 8-bit slice a user asked for costs its measured rate)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lazytrain.config import load_hardware
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.optim.plan_states import planned_fraction
from lightning_lazytrain.planner.workload import STATE_BYTES_8, STATE_BYTES_32
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_clip_exact import Net, fit

pytest.importorskip("bitsandbytes")


class Seen(L.Callback):
    """What the plan had (the strategy drops it at teardown)."""
    reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

    def __init__(self):
        self.plan = None

    def on_train_batch_end(self, trainer, *args):
        self.plan = self.plan or getattr(trainer.strategy, "plan", None)


def run(strategy, eight_bit, clip=None):
    seen = Seen()
    model, rec, trainer = fit(strategy, Net(d=64, eight_bit=eight_bit, min_8bit_numel=256), clip=clip,
                              extra_callbacks=[seen])
    return model, rec, trainer.optimizers[0], seen.plan


def test_the_planned_fraction_is_the_smallest_that_fits():
    n, largest = 1_000_000, 10_000
    assert planned_fraction(100.0, 200.0, n, largest) == 0.0
    short = 0.25 * n * (STATE_BYTES_32 - STATE_BYTES_8)  # a quarter of the parameters' saving
    assert planned_fraction(1e9 + short, 1e9, n, largest) == pytest.approx(0.25 + largest / n)
    assert planned_fraction(1e12, 1e9, n, largest) == 1.0


def test_without_a_plan_the_states_are_32_bit_at_the_first_step():
    """Under strategy='auto' nothing plans: HybridAdamW(eight_bit='plan') is plain 32-bit AdamW."""
    got = run("auto", "plan")
    want = run("auto", "none")
    assert set(got[2].assignment.values()) == {32}
    assert got[1].losses == want[1].losses
    assert all(torch.equal(a, b) for a, b in zip(got[0].state_dict().values(), want[0].state_dict().values()))


def test_a_host_that_holds_32_bit_states_gets_no_8_bit_slice():
    got = run(LazyTrainStrategy(policy="milp", hardware="cpu"), "plan", clip=0.05)
    want = run(LazyTrainStrategy(policy="milp", hardware="cpu"), "none", clip=0.05)
    assert got[3].state_fraction == 0.0 and set(got[2].assignment.values()) == {32}
    assert got[1].losses == want[1].losses
    assert all(torch.equal(a, b) for a, b in zip(got[0].state_dict().values(), want[0].state_dict().values()))


def test_a_short_host_gets_the_smallest_8_bit_slice_that_fits_and_it_is_priced():
    roomy = run(LazyTrainStrategy(policy="milp", hardware="cpu"), "plan")[3]
    need = roomy.result.workload.host_static_bytes  # with 32-bit states for every parameter
    states = sum(p.numel() for p in Net(d=64).parameters()) * STATE_BYTES_32
    hw = load_hardware("cpu").replace(cpu_memory_bytes=need - 0.3 * states)
    model, rec, opt, plan = run(LazyTrainStrategy(policy="milp", hardware=hw), "plan")
    eight = sum(p.numel() for p in model.parameters() if opt.bits_of(p) == 8) / sum(
        p.numel() for p in model.parameters())
    assert 0.3 < plan.state_fraction < 1.0 and 0.3 <= eight <= plan.state_fraction
    wl = plan.result.workload
    assert wl.host_static_bytes <= hw.cpu_memory_bytes  # the real states' bytes fit
    assert sum(layer.opt_seconds for layer in wl.layers) > sum(layer.opt_seconds for layer in roomy.result.workload.layers)
    assert all(torch.isfinite(torch.tensor(rec.losses)))


def test_a_slice_the_user_chose_is_kept_and_priced_at_the_8_bit_rate():
    plain = run(LazyTrainStrategy(policy="milp", hardware="cpu"), "none")[3].result.workload
    eight = run(LazyTrainStrategy(policy="milp", hardware="cpu"), "all")[3]
    assert eight.state_fraction is None  # nothing was pending
    wl = eight.result.workload
    assert sum(x.opt_seconds for x in wl.layers) > 2 * sum(x.opt_seconds for x in plain.layers)
    assert wl.host_static_bytes < plain.host_static_bytes


def test_a_resume_takes_the_bits_the_checkpoint_holds():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(16, 32)) for _ in range(2)]
    saved = HybridAdamW(params, eight_bit=lambda name, shape: name.endswith("p0"), min_8bit_numel=256)
    for p in params:
        p.grad = torch.randn(16, 32)
    saved.step()
    pending = HybridAdamW(params, eight_bit="plan", min_8bit_numel=256)
    assert pending.bits_pending and not pending.state
    pending.load_state_dict(saved.state_dict())
    assert pending.assignment == saved.assignment == {"g0.p0": 8, "g0.p1": 32}
