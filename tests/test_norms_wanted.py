"""The host lane takes gradient norms only when something uses them (engine/executor.py, Note: [norms
only when wanted]): no pass over the fp32 host gradients for a run without clip, skip or several
processes; the same training; the plan prices no norm pass then."""

from __future__ import annotations

import copy
import dataclasses

import lightning as L
import pytest
import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.param_store import ParamStore
from lightning_lazytrain.planner.placement import HOST_ONLY, Placement, priced_from_rates
from lightning_lazytrain.strategy import LazyTrainStrategy
from test_executor import SCHEDULES, SPEC, LlamaLM


def run_executor(take_norms: bool, monkeypatch, tmp_path):
    torch.manual_seed(0)
    model, tokens = LlamaLM(SPEC), torch.randint(0, SPEC.vocab, (4, 33))
    calls = []
    original = ParamStore.grad_norms
    monkeypatch.setattr(ParamStore, "grad_norms", lambda self, j: (calls.append(j), original(self, j))[1])
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES["recompute_all"], nvme_dir=tmp_path, compute_dtype=torch.bfloat16)
    ex.take_norms = take_norms
    try:
        for k in range(2):
            ex.begin_microbatch(first=k == 0, last=k == 1)
            m.loss(tokens[k::2]).backward()
            stats = ex.end_microbatch()
        ex.params.wait_host()
        grads = [p.grad.clone() for p in m.parameters()]
    finally:
        ex.close()
    return stats, grads, calls


def test_without_norms_the_host_lane_takes_none_and_the_gradients_are_the_same(monkeypatch, tmp_path):
    with_stats, with_grads, with_calls = run_executor(True, monkeypatch, tmp_path)
    without_stats, without_grads, without_calls = run_executor(False, monkeypatch, tmp_path)
    assert len(with_calls) == SPEC.num_layers + 1 and with_stats.grad_norms  # every group, once per step
    assert without_calls == [] and not without_stats.grad_norms and not without_stats.layer_sq_norms
    assert all(torch.equal(a, b) for a, b in zip(with_grads, without_grads))


def make_module(optimizer: str, **opt_kw):
    from lightning_lazytrain.lit_module import CausalLMModule
    from lightning_lazytrain.optim import HybridAdamW

    class Module(CausalLMModule):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.taken.append(self.trainer.strategy.executor.take_norms
                              if isinstance(self.trainer.strategy, LazyTrainStrategy) else None)

        def configure_optimizers(self):
            groups = self.param_groups()
            if optimizer == "hybrid":
                return HybridAdamW(groups, lr=1e-3, eight_bit="none", **opt_kw)
            return torch.optim.AdamW(groups, lr=1e-3)

    module = Module(model_name="tiny", optimizer="hybrid_adamw" if optimizer == "hybrid" else "adamw",
                    lr_schedule="constant", warmup_steps=0)
    module.taken = []
    return module


def fit(module, strategy, clip=None, steps=3):
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        gradient_clip_val=clip)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(steps)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("optimizer,opt_kw,clip,taken", [
    ("adamw", {}, None, False),  # torch's AdamW, no clip: nothing uses them
    ("adamw", {}, 0.5, False),  # torch clips with its own pass
    ("hybrid", {}, None, True),  # HybridAdamW's non-finite skip (fp32 gradients) takes the handed-over norms
    ("hybrid", {"skip_nonfinite": False}, None, False),
    ("hybrid", {"skip_nonfinite": False}, 0.5, True),  # the fused clip
])
def test_the_strategy_takes_norms_only_for_what_uses_them(optimizer, opt_kw, clip, taken):
    """And trains as strategy="auto" does (32-true: bit for bit)."""
    torch.manual_seed(0)
    module = make_module(optimizer, **opt_kw)
    ref = copy.deepcopy(module)
    got = fit(module, LazyTrainStrategy(policy="recompute_all"), clip)
    assert set(module.taken) == {taken}
    want = fit(ref, "auto", clip)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(got, want))


def test_the_plan_prices_no_norm_pass_without_norms():
    """Device widening: a step's only host work on a group's gradient is its norm (the copy lands in
    place); without norms that is nothing. Host widening: the widening add, less the norm's read."""
    from lightning_lazytrain.planner.model import ModelSpec, TrainSpec
    from lightning_lazytrain.planner.workload import Workload

    from planner_helpers import hardware

    hw = hardware(80e9).replace(host_bytes_per_s=10e9, host_norm_bytes_per_s=5e9)
    spec = ModelSpec(name="m", num_layers=4, hidden=256, intermediate=512, heads=4, kv_heads=4, head_dim=64, vocab=1000)
    wl = Workload.analytic(spec, TrainSpec(micro_batch_size=2, seq_len=64), hw)
    assert wl.compute_bytes == 2  # fp32 masters, bf16 copies: conversions to place
    both = Placement(cast_blocks=True, widen_blocks=True, cast_rest=True, widen_rest=True)
    on = priced_from_rates(wl, both, hw)
    off = priced_from_rates(dataclasses.replace(wl, host_norms=False), both, hw)
    assert all(layer.accum_seconds > 0 for layer in on.layers)
    assert all(layer.accum_seconds == pytest.approx(0.0, abs=1e-12) for layer in off.layers)
    host_on, host_off = priced_from_rates(wl, HOST_ONLY, hw), priced_from_rates(
        dataclasses.replace(wl, host_norms=False), HOST_ONLY, hw)
    for a, b, layer in zip(host_on.layers, host_off.layers, wl.layers):
        assert a.accum_seconds - b.accum_seconds == pytest.approx(layer.params * 4 / 5e9, rel=1e-9)
