"""Blocks no gradient reaches (Note: [blocks no gradient reaches] in engine/block_calls.py).

A frozen first part of the stack below a frozen embedding gets no backward under plain autograd. Here such
blocks run their planned forward and no backward, no re-run and no gradient copy; the profile measures no
backward for them (so the plan prices none) and is complete (a plan is made from it); training equals
``strategy="auto"`` bit for bit.
"""

from __future__ import annotations

import lightning
import pytest
from test_review2_finetune import LAYERS, PartNet, fit, fit_like_auto, lazy

from lightning_lazytrain.strategy import LazyTrainStrategy


class Segments(lightning.Callback):
    """Per step: the compute segments' (kind, block) pairs and the gradient D2H bytes per block."""

    reads_gradients_only = True

    def __init__(self) -> None:
        self.compute: list[set[tuple[str, int]]] = []
        self.grad_bytes: list[dict[int, float]] = []

    def on_before_optimizer_step(self, trainer, *args):  # the step's stats are complete
        stats = trainer.strategy.executor.stats
        self.compute.append({(s.kind, s.index) for s in stats.segments if s.lane == "compute"})
        grads: dict[int, float] = {}
        for s in stats.segments:
            if s.lane == "d2h" and s.kind == "grads":
                grads[s.index] = grads.get(s.index, 0.0) + s.bytes
        self.grad_bytes.append(grads)


@pytest.mark.parametrize("kind", ["serial", "pipelined"])
@pytest.mark.parametrize("frozen", [1, 2, LAYERS])
def test_a_frozen_prefix_runs_no_backward_and_matches_auto(kind, frozen):
    seg = Segments()
    fit_like_auto(lazy(kind), lambda: PartNet(frozen, True, "hybrid"), extra=lambda: [], steps=3, accum=2)
    fit(lazy(kind), PartNet(frozen, True, "hybrid"), steps=3, accum=2, callbacks=[seg])
    for step in seg.compute:
        ran = {j for k, j in step if k in ("backward", "local_recompute", "recompute")}
        assert ran == set(range(frozen, LAYERS)), (frozen, sorted(step))
        assert {j for k, j in step if k == "forward"} == set(range(LAYERS))
    for step in seg.grad_bytes:
        assert all(step.get(j, 0) == 0 for j in range(frozen)), step
        assert all(step.get(j, 0) > 0 for j in range(frozen, LAYERS)), step


class PlanOf(lightning.Callback):
    reads_gradients_only = True

    def on_train_batch_end(self, trainer, *args):
        self.plan = trainer.strategy.core.plan


def test_the_plan_prices_no_backward_for_frozen_blocks():
    """policy='milp': the first step is the profile and a plan is made from it (no block counted as
    unreached); its workload has no backward seconds and no gradient bytes for the frozen blocks."""
    seen = PlanOf()
    _, _, trainer = fit(LazyTrainStrategy(), PartNet(2, True, "hybrid"), steps=2, callbacks=[seen])
    assert seen.plan is not None and trainer.strategy.replans == []  # planned from the first step
    layers = seen.plan.result.workload.layers
    assert [x.bwd_seconds for x in layers[:2]] == [0.0, 0.0]
    assert all(x.bwd_seconds > 0 for x in layers[2:])
    assert all(x.grad_bytes == 0 for x in layers[:2]) and all(x.grad_bytes > 0 for x in layers[2:])


def test_a_block_whose_input_requires_grad_still_runs_its_backward():
    """The embedding trains: every block's input requires grad, so every block runs its backward (the
    frozen ones for their input gradients), as under autograd."""
    seg = Segments()
    fit_like_auto(lazy("serial"), lambda: PartNet(2, False, "hybrid"), steps=2)
    fit(lazy("serial"), PartNet(2, False, "hybrid"), steps=2, callbacks=[seg])
    for step in seg.compute:
        assert {j for k, j in step if k == "backward"} == set(range(LAYERS))


class HeldFrozen(PartNet):
    """A frozen prefix whose weights an optimizer holds anyway (AdamW over ``self.parameters()``): they may be
    toggled back (``toggle_optimizer``), so their blocks keep their backward."""

    def configure_optimizers(self):
        import torch

        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def test_frozen_weights_an_optimizer_holds_keep_their_blocks_backward():
    seg = Segments()
    fit_like_auto(lazy("serial"), lambda: HeldFrozen(2, True), steps=2)
    fit(lazy("serial"), HeldFrozen(2, True), steps=2, callbacks=[seg])
    for step in seg.compute:
        assert {j for k, j in step if k == "backward"} == set(range(LAYERS))


class Internals(lightning.Callback):
    reads_gradients_only = True

    def on_before_optimizer_step(self, trainer, *args):
        self.internal = dict(trainer.strategy.executor.stats.internal_bytes)


def test_a_frozen_block_keeps_no_internals_under_keep_all():
    """keep_all keeps every block's internals for its backward; a block no gradient reaches has none to
    keep (its forward builds no graph)."""
    seen = Internals()
    fit_like_auto(lazy("pipelined"), lambda: PartNet(2, True, "hybrid"), steps=2)
    fit(lazy("pipelined"), PartNet(2, True, "hybrid"), steps=2, callbacks=[seen])
    assert set(seen.internal) == {2, 3}, seen.internal


class Fetches(lightning.Callback):
    reads_gradients_only = True

    def on_before_optimizer_step(self, trainer, *args):
        self.fetches: dict[int, int] = {}
        for s in trainer.strategy.executor.stats.segments:
            if s.lane == "h2d" and s.kind == "weights":
                self.fetches[s.index] = self.fetches.get(s.index, 0) + 1


@pytest.mark.parametrize("frozen", [2, LAYERS])
def test_a_frozen_block_is_not_fetched_again_for_the_backward(frozen):
    """recompute_all, one micro-batch: a trained block's weights cross twice a step (its forward, then its
    backward; the top block keeps its slot), a frozen block's once, except block 0's (its slot serves the
    next micro-batch's forward). Bit-equal to auto."""
    seen = Fetches()
    fit_like_auto(lazy("serial"), lambda: PartNet(frozen, True, "hybrid"), steps=2)
    fit(lazy("serial"), PartNet(frozen, True, "hybrid"), steps=2, callbacks=[seen])
    assert all(seen.fetches[u] == 1 for u in range(1, frozen) if u < LAYERS - 1), seen.fetches
    assert all(seen.fetches[u] == 2 for u in range(max(frozen, 1), LAYERS - 1)), seen.fetches
