"""The non-block group in parts (Note: [non-block parts] in planner/schedule_windows.py): T moves,
accumulates, updates and stages the embedding and the final norm + LM head as two parts, so part 0's
accumulation overlaps part 1's D2H and part 0's cast and fetch overlap part 1's update. Exact
(bit-equal to one part and to plain autograd), the bytes the simulator counts, and a shorter T."""

from __future__ import annotations

import copy
from dataclasses import replace

import lightning.pytorch as L
import pytest
import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.param_store import REST, ParamStore
from lightning_lazytrain.engine.profiler import measure_workload
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import (
    Hardware, ModelSpec, TrainSpec, Workload, keep_all, megatrain, recompute_all, simulate, solve,
)

SPEC = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16, vocab=256)
LAYERS = SPEC.num_layers


def parts_of(model: LlamaLM) -> list[list[torch.nn.Parameter]]:
    """The embedding, then the final norm and the head (the packing order of the non-block group)."""
    embed = list(model.embed_tokens.parameters())
    return [embed, [p for n, p in model.named_parameters() if "layers." not in n and not any(p is e for e in embed)]]


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return LlamaLM(SPEC), torch.randint(0, SPEC.vocab, (2, 33))


def test_parts_must_be_runs_of_the_packed_buffer(reference):
    model, _ = reference
    store = ParamStore(copy.deepcopy(model), compute_dtype=torch.bfloat16)
    try:
        m = store.module
        embed, head = parts_of(m)
        assert store.rest_parts == (store.group_numel(REST),)  # one part by default
        assert not store.set_rest_parts([embed])  # the norm and head are in no part
        assert not store.set_rest_parts([embed + head[-1:], head[:-1]])  # embedding + head: not one run
        assert not store.set_rest_parts([embed + head])  # one part
        assert store.rest_parts == (store.group_numel(REST),)
        assert store.set_rest_parts([embed, head])
        assert len(store.rest_parts) == 2 and sum(store.rest_parts) == store.group_numel(REST)
        assert store.rest_part_parameters(0) == embed
        with pytest.raises(ValueError, match="only REST has parts"):
            store.stage(0, 0, part=0)
    finally:
        store.close()


def test_staging_and_grads_in_parts_equal_one_part(reference):
    """Each part's cast + H2D lands its range; per-part D2H + accumulation gives the same host grads
    and the same clip norms (per parameter and the group's) bit for bit."""
    model, tokens = reference
    out = {}
    for parts in (False, True):
        m = copy.deepcopy(model)
        store = ParamStore(m, compute_dtype=torch.bfloat16)
        try:
            if parts:
                assert store.set_rest_parts(parts_of(m))
            for p in range(len(store.rest_parts)):
                store.stage(REST, part=p if parts else None)
            store._slot(REST, None).ready.wait()
            weights = store.slot_weights(REST).clone()
            for step in range(2):  # the second step accumulates on top of the first one's grads
                with store.bind(REST, grads=True):
                    h = m.embed_tokens(tokens)
                    loss = m.lm_head(m.norm(h)).float().square().mean() * (step + 1)
                    loss.backward()
                norms: dict = {}
                sq = store.write_back_grads(REST, param_norms=norms)
            out[parts] = (weights, [p.grad.clone() for p in store.group_parameters(REST)], sq,
                          [norms[p] for p in store.group_parameters(REST)])
        finally:
            store.close()
    (w1, g1, sq1, n1), (w2, g2, sq2, n2) = out[False], out[True]
    assert torch.equal(w1, w2)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert torch.equal(sq1, sq2) and all(torch.equal(a, b) for a, b in zip(n1, n2))


def run(model, schedule, tokens, tmp_path, micro=1, parts=True, profile=False):
    m = copy.deepcopy(model)
    ex = Executor(m, schedule, nvme_dir=tmp_path, compute_dtype=torch.float32)
    if parts:
        assert ex.set_rest_parts(parts_of(m))
    losses, wl = [], None
    try:
        if profile:
            wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens.numel())
            return m, losses, ex.stats, wl
        for k in range(micro):
            ex.begin_microbatch(first=k == 0, last=k == micro - 1)
            loss = m.loss(tokens[k::micro] if micro > 1 else tokens)
            loss.backward()
            stats = ex.end_microbatch()
            losses.append(loss.detach())
    finally:
        ex.close()
    return m, losses, stats, wl


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("schedule", [recompute_all(LAYERS), megatrain(LAYERS, 2), keep_all(LAYERS)], ids=["rc", "mt", "keep"])
def test_training_in_parts_equals_plain_autograd(reference, tmp_path, schedule, micro):
    model, tokens = reference
    ref = copy.deepcopy(model)
    want = []
    for k in range(micro):
        loss = ref.loss(tokens[k::micro] if micro > 1 else tokens)
        loss.backward()
        want.append(loss.detach())
    m, losses, stats, _ = run(model, schedule, tokens, tmp_path, micro=micro)
    assert all(torch.equal(a, b) for a, b in zip(losses, want))
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))
    # T ran the parts: a D2H, an accumulation, a cast-free (fp32) H2D per part, tagged -1 and -2
    got = {(s.lane, s.kind, s.index) for s in stats.segments}
    for idx in (-1, -2):
        assert {("d2h", "grads", idx), ("host", "accumulate", idx)} <= got, idx


def test_profile_reports_the_parts_and_the_bytes_match_the_simulator(reference, tmp_path):
    model, tokens = reference
    _, _, _, wl = run(model, recompute_all(LAYERS), tokens, tmp_path, profile=True)
    store_parts = wl.nonblock_parts
    assert len(store_parts) == 2 and sum(store_parts) == wl.nonblock_params
    big = Hardware(name="big", gpu_memory_bytes=1e12, gpu_memory_cap_bytes=1e12, peak_tflops=1.0, efficiency=1.0,
                   h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, nvme_read_bytes_per_s=1e9,
                   nvme_write_bytes_per_s=1e9, nvme_capacity_bytes=1e12, cpu_memory_bytes=1e12,
                   cpu_adam_params_per_s=1e9, cpu_adam8_params_per_s=1e9).validate()
    for schedule in (recompute_all(LAYERS), megatrain(LAYERS, 2)):
        sim = simulate(schedule, wl, big)
        _, _, stats, _ = run(model, schedule, tokens, tmp_path)
        for lane in ("h2d", "d2h"):
            assert stats.lane_bytes[lane] == sim.lane_bytes.get(lane, 0.0), lane
        t = [s for s in sim.timeline if s.window == "T"]
        assert {s.index for s in t if s.kind == "grads"} == {0, -1, -2}


def h800_27b() -> tuple[Workload, Hardware]:
    from lightning_lazytrain.config import load_hardware, load_model

    hw, model = load_hardware("h800"), load_model("qwen3.6-27b")
    return Workload.analytic(model, TrainSpec(micro_batch_size=72, seq_len=1024), hw), hw


@pytest.mark.slow
def test_two_parts_shorten_t_and_the_milp_times_it_as_the_simulator():
    wl, hw = h800_27b()
    assert len(wl.nonblock_parts) == 2  # untied: the embedding, then the final norm and the head
    one = replace(wl, nonblock_parts=())
    for mode, gain in (("pipelined", 0.4), ("serial", 0.15)):  # serial: the blocks' updates follow
        s = replace(keep_all(wl.num_layers), optimizer=mode)
        t2 = simulate(s, wl, hw, check=False).window_seconds["T"]
        t1 = simulate(s, one, hw, check=False).window_seconds["T"]
        # the accumulation of part 0 under part 1's D2H, part 0's cast + fetch under part 1's update
        assert t2 < t1 - gain, (mode, t1, t2)
    res = solve(wl, hw)
    assert res.objective == pytest.approx(res.simulated.iteration_seconds, rel=1e-3)
    tied = replace(wl, nonblock_parts=())  # a tied model: one part, the one-group T
    assert solve(tied, hw).simulated.window_seconds["T"] > res.simulated.window_seconds["T"]


@pytest.mark.parametrize("clip", [0.05, None])
@pytest.mark.slow
def test_the_strategy_runs_causal_lm_module_in_two_parts_exactly(clip):
    """CausalLMModule's HybridAdamW layers ``embed`` and ``head`` become the two parts; the pipelined
    step stages the embedding once its update is done, while the head's still runs; the training is
    Lightning's bit for bit (losses, clip norms, final weights), and the plan's T has both parts."""
    from test_clip_exact import ACCUM, STEPS, fit

    from lightning_lazytrain.lit_module import CausalLMModule
    from lightning_lazytrain.strategy import LazyTrainStrategy

    def module():
        torch.manual_seed(0)
        return CausalLMModule(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)

    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 256, (2, 17), generator=g) for _ in range(STEPS * ACCUM)]
    m_want, r_want, _ = fit("auto", module(), clip=clip, batches=tokens)
    strategy = LazyTrainStrategy(policy="milp")
    seen: list = []
    waits: list[int] = []
    plans: list = []

    class Parts(L.Callback):
        reads_gradients_only = True  # reads the executor's parts, no weight: the step may stay pipelined

        def on_train_batch_end(self, trainer, *args):
            ex = trainer.strategy.executor
            seen.append([len(p) for p in ex.rest_parts])
            plans.append(trainer.strategy.plan)
            if ex.wait_updated is not None and not getattr(ex.wait_updated, "spied", False):
                inner = ex.wait_updated
                ex.wait_updated = lambda j: (waits.append(j), inner(j))[1]
                ex.wait_updated.spied = True

    m_got, r_got, _ = fit(strategy, module(), clip=clip, batches=tokens, extra_callbacks=[Parts()])
    assert seen and all(s == [1, 2] for s in seen)  # embed | final norm + lm_head
    assert waits[:3] == [-1, -2, 0]  # each part staged once its own update is done, then layer 0
    plan = plans[-1]
    wl = plan.result.workload
    assert len(wl.nonblock_parts) == 2 and sum(wl.nonblock_parts) == wl.nonblock_params
    assert plan.schedule.optimizer == "pipelined"
    t_ops = plan.result.to_json()["schedule"]["windows"][-1]["ops"]
    assert {op[2] for op in t_ops if op[1] == "grads"} == {0, -1, -2}
    assert r_got.losses == r_want.losses and r_got.norms == r_want.norms
    for (k, a), b in zip(m_got.state_dict().items(), m_want.state_dict().values()):
        assert torch.equal(a, b), k
