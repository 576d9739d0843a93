"""The executor against plain autograd, and against the simulator's byte and FLOP counts.

Equality is exact (``torch.equal``) in fp32 on CPU: every policy runs the same kernels on the
same inputs in the same order as plain autograd (a re-run forward is bit-identical on CPU), and
per-layer gradients are accumulated into the host fp32 ``.grad`` in the same order.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.profiler import measure_workload
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import Hardware, ModelSpec, Schedule, keep_all, megatrain, recompute_all, simulate, solve
from lightning_lazytrain.planner.simulator import MEM_TOL

SPEC = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16, vocab=256)
L = SPEC.num_layers


def custom(homes, keep=None, res=None, off=None, rel=None, ioff=(), irel=(), partial=()) -> Schedule:
    return Schedule(num_layers=L, homes=tuple(homes), keep_internals=tuple(keep or [False] * L),
                    resident_weights=tuple(res or [False] * L), offload_window=tuple(off or [None] * (L + 1)),
                    reload_window=tuple(rel or [None] * (L + 1)), internals_offload_window=tuple(ioff),
                    internals_reload_window=tuple(irel), partial_keep=tuple(partial), policy="custom")


SCHEDULES = {
    "keep_all": keep_all(L),
    "recompute_all": recompute_all(L),
    "megatrain_K1": megatrain(L, 1),
    "megatrain_K2": megatrain(L, 2),
    "megatrain_K4": megatrain(L, 4),
    "cpu_homes": custom(["gpu", "cpu", "recompute", "cpu", "gpu"], off=[None, 1, None, 3, None],
                        rel=[None, 3, None, 4, None]),
    "nvme_homes": custom(["gpu", "nvme", "nvme", "gpu", "gpu"], off=[None, 1, 2, None, None],
                         rel=[None, 2, 3, None, None]),
    "kept_internals_resident": custom(["gpu", "gpu", "recompute", "gpu", "gpu"], keep=[True, False, False, True],
                                      res=[False, False, True, True]),
    # Note: [offloaded internals]: layer 0's saved tensors leave in F1 and come back in B2, layer
    # 1's leave in F3 (next to boundary 3's offload) and come back in H; layer 2 keeps its own.
    "offloaded_internals": custom(["gpu", "gpu", "gpu", "cpu", "gpu"], keep=[True, True, True, False],
                                  off=[None, None, None, 3, None], rel=[None, None, None, 4, None],
                                  ioff=[1, 3, None, None], irel=[2, 4, None, None]),
    # Note: [partial keep]: layers 0 and 1 keep their matmul outputs (layer 1 is also re-run without
    # grad in B2's recompute block, for boundary 2), layer 2 re-runs locally, layer 3 keeps everything
    "partial_keep": custom(["gpu", "gpu", "recompute", "gpu", "gpu"], keep=[False, False, False, True],
                           partial=[True, True, False, False]),
}


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    model = LlamaLM(SPEC)
    tokens = torch.randint(0, SPEC.vocab, (2, 33))
    return model, tokens


def plain_grads(model, tokens, micro=1):
    ref = copy.deepcopy(model)
    losses = []
    for k in range(micro):
        loss = ref.loss(tokens[k::micro] if micro > 1 else tokens)
        loss.backward()
        losses.append(loss.detach())
    return losses, [p.grad for p in ref.parameters()]


def run(model, schedule, tokens, tmp_path, micro=1, **kw):
    m = copy.deepcopy(model)
    ex = Executor(m, schedule, nvme_dir=tmp_path, **kw)
    losses = []
    try:
        for k in range(micro):
            ex.begin_microbatch(first=k == 0, last=k == micro - 1)
            loss = m.loss(tokens[k::micro] if micro > 1 else tokens)
            loss.backward()
            stats = ex.end_microbatch()
            losses.append(loss.detach())
    finally:
        ex.close()
    return m, losses, stats


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_loss_and_every_gradient_equal_plain_autograd(reference, tmp_path, name):
    model, tokens = reference
    want_losses, want_grads = plain_grads(model, tokens)
    m, losses, _ = run(model, SCHEDULES[name], tokens, tmp_path)
    assert torch.equal(losses[0], want_losses[0])
    for (pname, p), g in zip(m.named_parameters(), want_grads):
        assert torch.equal(p.grad, g), pname


def test_gradient_accumulation_equals_plain(reference, tmp_path):
    model, tokens = reference
    want_losses, want_grads = plain_grads(model, tokens, micro=2)
    m, losses, _ = run(model, SCHEDULES["cpu_homes"], tokens, tmp_path, micro=2)
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    for (pname, p), g in zip(m.named_parameters(), want_grads):
        assert torch.equal(p.grad, g), pname


def test_training_steps_equal_plain_training(reference, tmp_path):
    model, tokens = reference
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES["megatrain_K2"], nvme_dir=tmp_path)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    try:
        for _ in range(3):
            loss_ref = ref.loss(tokens)
            loss_ref.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            ex.begin_microbatch()
            loss = m.loss(tokens)
            loss.backward()
            ex.end_microbatch()
            opt.step()
            opt.zero_grad()
            assert torch.equal(loss.detach(), loss_ref.detach())
        with torch.no_grad():  # evaluation streams through the slots
            assert torch.equal(m.loss(tokens), ref.loss(tokens))
    finally:
        ex.close()


def measured(model, tokens, tmp_path, device="cpu"):
    m = copy.deepcopy(model)
    tokens = tokens.to(device)
    ex = Executor(m, recompute_all(L), nvme_dir=tmp_path, device=device)
    try:
        return measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens.numel())
    finally:
        ex.close()


def big_host(wl) -> Hardware:
    return Hardware(name="cpu-test", gpu_memory_bytes=1e12, gpu_memory_cap_bytes=1e12, peak_tflops=1, efficiency=1,
                    h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
                    nvme_capacity_bytes=1e12, cpu_memory_bytes=1e12, cpu_adam_params_per_s=1e9,
                    cpu_adam8_params_per_s=1e9)


def milp_schedule(wl) -> Schedule:
    # a device budget between the smallest and the keep-all footprint forces a mixed plan
    hw = big_host(wl)
    lo = simulate(recompute_all(L), wl, hw).peak_gpu_bytes
    hi = simulate(keep_all(L), wl, hw).peak_gpu_bytes
    res = solve(wl, hw.replace(gpu_memory_cap_bytes=(lo + hi) / 2, gpu_memory_bytes=1e12))
    assert res.status == "optimal"
    return res.schedule


def test_milp_plan_runs_exactly(reference, tmp_path):
    model, tokens = reference
    wl = measured(model, tokens, tmp_path)
    schedule = milp_schedule(wl)
    want_losses, want_grads = plain_grads(model, tokens)
    m, losses, _ = run(model, schedule, tokens, tmp_path)
    assert torch.equal(losses[0], want_losses[0])
    assert all(torch.equal(p.grad, g) for p, g in zip(m.parameters(), want_grads))


@pytest.mark.parametrize("name", list(SCHEDULES) + ["milp"])
@pytest.mark.slow
def test_bytes_per_lane_recompute_and_peak_match_the_simulator(reference, tmp_path, name):
    model, tokens = reference
    wl = measured(model, tokens, tmp_path)
    schedule = milp_schedule(wl) if name == "milp" else SCHEDULES[name]
    sim = simulate(schedule, wl, big_host(wl))
    _, _, stats = run(model, schedule, tokens, tmp_path)
    for lane in ("h2d", "d2h", "nvme_read", "nvme_write"):
        assert stats.lane_bytes[lane] == pytest.approx(sim.lane_bytes.get(lane, 0.0), abs=0), lane
    assert stats.recomputed_forwards == sim.recomputed_forwards
    assert 0 < stats.peak_tracked_bytes <= sim.peak_gpu_bytes


def test_profile_measures_host_lane_work(reference, tmp_path):
    """The profile times the host lane: one cast per weight fetch (fp32 masters, bf16 compute
    copies) and one gradient accumulation per D2H, for every layer and the non-block group, so a
    measured plan counts the host work the engine does."""
    model, tokens = reference
    m = copy.deepcopy(model)
    ex = Executor(m, recompute_all(L), compute_dtype=torch.bfloat16, nvme_dir=tmp_path)
    try:
        wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens.numel())
    finally:
        ex.close()
    assert all(layer.cast_seconds > 0 and layer.accum_seconds > 0 for layer in wl.layers)
    assert wl.nonblock_cast_seconds > 0 and wl.nonblock_accum_seconds > 0
    assert all(layer.cast_seconds == 0 for layer in measured(model, tokens, tmp_path).layers)  # fp32: no cast


RESIDENT_LAYER0 = custom(["gpu"] * (L + 1), keep=[False, True, False, False], res=[True, False, False, True])


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("name", list(SCHEDULES) + ["milp", "resident_layer0"])
@pytest.mark.slow
def test_real_device_bytes_stay_within_the_plan(reference, tmp_path, name, micro):
    """Real device bytes (live_bytes: every allocation, not the executor's bookkeeping) stay within
    what the simulator predicts in every window, and the step's real peak is at least 0.8x the
    predicted one: a plan does not run out of memory at its cap, nor waste it. The recompute slot
    and resident layers' slots hold memory only in the windows the plan counts them; the second
    step finds what the first one left."""
    check_device_bytes_within_plan(*reference, tmp_path, name, micro)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("name", ["recompute_all", "megatrain_K2", "cpu_homes", "kept_internals_resident",
                                  "offloaded_internals", "milp"])
def test_real_cuda_bytes_stay_within_the_plan(reference, tmp_path, name, micro):
    """The same on a GPU: the CUDA allocator's own counters (``max_memory_allocated``, reset at each
    window mark) against the plan made from the workload profiled on that GPU, per window and for the
    step (>= 0.8x the predicted peak). The allocator rounds every tensor up to 512 bytes, which the
    profile measures too; 64 KiB of slack per window covers the rest."""
    check_device_bytes_within_plan(*reference, tmp_path, name, micro, device="cuda", tol=MEM_TOL + 65536)


@pytest.mark.parametrize("name", ["cpu_homes", "nvme_homes", "offloaded_internals"])
@pytest.mark.slow
def test_a_slow_offload_costs_time_not_memory(reference, tmp_path, name):
    """Delay injection: with a D2H lane far slower than compute, an offloaded boundary (or a layer's
    offloaded internals) still leaves the device at the end of its offload window (compute waits
    for the copy there), so every window stays within the plan; before, the source lived on until
    the copy finished."""
    slow = {"d2h": LinkSpec(bandwidth_bytes_per_s=2e6, latency_s=0.02)}
    check_device_bytes_within_plan(*reference, tmp_path, name, 2, links=slow)


def test_device_bytes_the_step_leaves_behind_are_in_every_window_of_the_plan(reference, tmp_path):
    """Note: [untracked device bytes]: a step that leaves device memory allocated that the executor
    does not track (as the CUDA allocator keeps cuBLAS's workspace after the first matmul, or a model
    its caches) makes the profile's ``device_overhead_bytes``: static, in every window's prediction."""
    model, tokens = reference
    m = copy.deepcopy(model)
    cache_bytes = 1 << 20

    def first_call_cache(module, args, output):  # a workspace made at the first call, kept
        if not hasattr(module, "workspace"):
            module.workspace = torch.zeros(cache_bytes // 4)
        return None

    m.norm.register_forward_hook(first_call_cache)
    ex = Executor(m, recompute_all(L), nvme_dir=tmp_path)
    try:  # warmup=0: the first step is the profile, as the strategy's
        wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens.numel(), warmup=0)
    finally:
        ex.close()
    assert cache_bytes <= wl.device_overhead_bytes <= cache_bytes + 4096
    plain = measured(model, tokens, tmp_path)
    assert plain.device_overhead_bytes < 4096
    s = recompute_all(L)
    with_cache, without = simulate(s, wl, big_host(wl)), simulate(s, plain, big_host(plain))
    assert all(with_cache.window_bytes[w] >= without.window_bytes[w] + cache_bytes - 4096 for w in without.window_bytes)


def check_device_bytes_within_plan(model, tokens, tmp_path, name, micro, *, device="cpu", tol=MEM_TOL, **kw):
    tokens = tokens.to(device)
    wl = measured(model, tokens[0::micro], tmp_path, device)  # one micro-batch's workload
    schedule = {"milp": lambda: milp_schedule(wl), "resident_layer0": lambda: RESIDENT_LAYER0}.get(
        name, lambda: SCHEDULES[name])()
    sim = simulate(schedule, wl, big_host(wl))
    m = copy.deepcopy(model)
    ex = Executor(m, schedule, nvme_dir=tmp_path, device=device, **kw)
    ex.measure_memory = True
    trace = None
    try:
        for step in range(2):
            def one_step():
                nonlocal stats
                for k in range(micro):
                    ex.begin_microbatch(first=k == 0, last=k == micro - 1)
                    m.loss(tokens[k::micro]).backward()
                    stats = ex.end_microbatch()

            stats = None
            if step == 1 and device == "cuda":  # what is alive at the peak, by site, for a failure's message
                from lightning_lazytrain.engine.alloc_trace import record_peak

                trace = record_peak(device, one_step, top=12)
            else:
                one_step()
    finally:
        ex.close()
    over = {w: b - sim.window_bytes[w] for w, b in stats.window_peak_bytes.items() if b > sim.window_bytes[w] + tol}
    assert not over, f"windows over the plan (bytes): {over}; alive at the step's traced peak: {trace}"
    assert set(stats.window_peak_bytes) == set(sim.window_bytes)
    assert 0.8 * sim.peak_gpu_bytes <= stats.real_peak_bytes <= sim.peak_gpu_bytes + tol


def block_forward_flops(model, tokens) -> int:
    from lightning_lazytrain.models.llama import rotary

    block = model.layers[0]
    x = model.embed_tokens(tokens[:, :-1]).detach()
    pe = rotary(x.shape[1], SPEC.head_dim, model.rope_theta, x.device, x.dtype)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        block(x, position_embeddings=pe)
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["keep_all", "recompute_all", "megatrain_K2", "megatrain_K4", "cpu_homes",
                                  "partial_keep"])
@pytest.mark.slow
def test_recomputed_flops_are_exactly_the_predicted_reruns(reference, tmp_path, name):
    model, tokens = reference
    with FlopCounterMode(display=False) as plain:
        copy.deepcopy(model).loss(tokens).backward()
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES[name], nvme_dir=tmp_path)
    try:
        ex.begin_microbatch()
        with FlopCounterMode(display=False) as ours:
            m.loss(tokens).backward()
        ex.end_microbatch()
    finally:
        ex.close()
    reruns = sum(simulate(SCHEDULES[name], measured(model, tokens, tmp_path), big_host(None))
                 .recomputed_forwards.values())
    extra = ours.get_total_flops() - plain.get_total_flops()
    assert extra == reruns * block_forward_flops(model, tokens)


def test_block_that_returns_a_tuple_and_takes_kwargs(tmp_path):
    torch.manual_seed(1)

    class TupleBlock(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, *, scale, mask=None):
            return torch.tanh(self.lin(x)) * scale + x, {"aux": 1}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.layers = torch.nn.ModuleList(TupleBlock() for _ in range(3))

        def forward(self, x):
            h = self.inp(x)
            for i, b in enumerate(self.layers):  # hidden state by position and by keyword
                h, aux = b(h, scale=torch.tensor(0.5), mask=None) if i % 2 else b(x=h, scale=torch.tensor(0.5))
                assert aux == {"aux": 1}
            return h.square().mean()

    net = Net()
    x = torch.randn(5, 4)
    ref = copy.deepcopy(net)
    ref(x).backward()
    ex = Executor(net, megatrain(3, 2), nvme_dir=tmp_path)
    try:
        ex.begin_microbatch()
        net(x).backward()
        ex.end_microbatch()
    finally:
        ex.close()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


HF_CONFIGS = {
    # GPT-2 passes its KV cache positionally and has dropout: re-runs must drop the cache and
    # replay the forward's random state
    "gpt2-dropout": dict(cls="GPT2Config", vocab_size=256, n_embd=64, n_layer=4, n_head=4, n_positions=64),
    "gpt-neox": dict(cls="GPTNeoXConfig", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64),
    "qwen2": dict(cls="Qwen2Config", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
@pytest.mark.parametrize("policy", ["megatrain_K2", "cpu_homes", "kept_internals_resident", "offloaded_internals",
                                    "partial_keep"])
@pytest.mark.slow
def test_hugging_face_models_equal_plain_autograd(tmp_path, name, policy):
    transformers = pytest.importorskip("transformers")
    spec = dict(HF_CONFIGS[name])
    cfg = getattr(transformers, spec.pop("cls"))(**spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    x = torch.randint(0, 256, (2, 16))
    ref = copy.deepcopy(model)
    torch.manual_seed(7)
    want = ref(input_ids=x, labels=x).loss
    want.backward()
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES[policy], nvme_dir=tmp_path)
    try:
        torch.manual_seed(7)
        ex.begin_microbatch()
        loss = m(input_ids=x, labels=x).loss
        loss.backward()
        ex.end_microbatch()
    finally:
        ex.close()
    assert torch.equal(loss, want)
    for (pname, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), pname


def test_profile_measures_transient_working_sets(reference, tmp_path):
    """Real device bytes per window (live_bytes on CPU): every layer's forward and backward and the
    loss head have a working set the plan must count; the head's holds at least the logits."""
    model, tokens = reference
    wl = measured(model, tokens, tmp_path)
    logits = tokens.numel() * SPEC.vocab * 4
    assert all(layer.fwd_work_bytes > 0 and layer.bwd_work_bytes > 0 for layer in wl.layers)
    assert wl.head_work_bytes >= logits
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES["recompute_all"], nvme_dir=tmp_path)
    ex.measure_memory = True
    try:
        ex.begin_microbatch()
        m.loss(tokens).backward()
        stats = ex.end_microbatch()
    finally:
        ex.close()
    assert stats.real_peak_bytes >= stats.peak_tracked_bytes  # bookkeeping never exceeds reality
    assert set(stats.window_peak_bytes) >= {"F0", "H", "B0"}


@pytest.mark.parametrize("name", ["megatrain_K2", "megatrain_K4", "recompute_all"])
@pytest.mark.slow
def test_a_rerun_starts_after_its_weights_arrive_on_a_slow_link(reference, tmp_path, name):
    """Delay injection: with an H2D link far slower than compute, every forward and every re-run of
    a recompute block starts on the timeline after the weight copy it binds has landed (the engine
    waits, as the planner's cast -> fetch -> re-run chain says), and the wait is a stall, not
    compute: the measured compute segment begins after the copy's end."""
    model, tokens = reference
    slow = {"h2d": LinkSpec(bandwidth_bytes_per_s=5e6, latency_s=0.01)}
    _, _, stats = run(model, SCHEDULES[name], tokens, tmp_path, links=slow)
    copies = [s for s in stats.segments if s.lane == "h2d" and s.kind == "weights"]
    reruns = [s for s in stats.segments if s.lane == "compute"
              and s.kind in ("forward", "recompute", "local_recompute")]
    assert any(s.kind == ("local_recompute" if name == "recompute_all" else "recompute") for s in reruns)
    for seg in reruns:
        landed = [c.end for c in copies if c.index == seg.index and c.end <= seg.start + 1e-4]
        assert landed, f"{seg.kind} of layer {seg.index} in {seg.window} started before its weights landed"


def test_partial_keep_refuses_a_block_that_changes_a_matmul_output_in_place(tmp_path):
    """Note: [partial keep]: a block that changes a matmul output in place (as Falcon divides its QK^T
    product) cannot re-run exactly from the kept output: the executor refuses it in the forward of the
    first step (before any optimizer step), and a profile gives the layer no partial bytes, so a plan
    from it never partially keeps the layer. The unchanged block (no in-place op) is exact."""
    from lightning_lazytrain.engine.block_io import UnsupportedBlockPattern

    class Block(torch.nn.Module):
        def __init__(self, inplace):
            super().__init__()
            self.lin, self.inplace = torch.nn.Linear(8, 8), inplace

        def forward(self, x):
            y = self.lin(x)
            y = y.mul_(0.5) if self.inplace else y * 0.5
            return torch.tanh(y) + x

    class Net(torch.nn.Module):
        def __init__(self, inplace):
            super().__init__()
            self.layers = torch.nn.ModuleList(Block(inplace) for _ in range(2))

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x.square().mean()

    x = torch.randn(5, 8, requires_grad=True)
    partial = Schedule(num_layers=2, homes=("gpu",) * 3, keep_internals=(False, False),
                       resident_weights=(False, False), offload_window=(None,) * 3, reload_window=(None,) * 3,
                       partial_keep=(True, True))
    for inplace in (False, True):
        torch.manual_seed(0)
        net = Net(inplace)
        ref = copy.deepcopy(net)
        ref(x).backward()
        ex = Executor(net, recompute_all(2), nvme_dir=tmp_path)
        try:
            wl = measure_workload(ex, lambda: net(x).backward(), tokens=5)
        finally:
            ex.close()
        assert all((layer.partial_bytes > 0) != inplace for layer in wl.layers)
        for p in net.parameters():
            p.grad = None
        ex = Executor(net, partial, nvme_dir=tmp_path)
        try:
            ex.begin_microbatch()
            if inplace:
                with pytest.raises(UnsupportedBlockPattern, match="in place"):
                    net(x)
                ex.abort_microbatch()
                continue
            net(x).backward()
            ex.end_microbatch()
        finally:
            ex.close()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters()))


@pytest.mark.parametrize("name", ["megatrain_K2", "kept_internals_resident"])
def test_a_frozen_embedding_still_trains_every_block(reference, tmp_path, name):
    """The block node's grad anchor (engine/block_fn.py, Note: [the block node]): the first block's
    input does not require grad when the embedding is frozen, yet every block's weights get theirs."""
    model, tokens = reference
    frozen = copy.deepcopy(model)
    frozen.embed_tokens.weight.requires_grad_(False)
    want_losses, want_grads = plain_grads(frozen, tokens)
    m, losses, _ = run(frozen, SCHEDULES[name], tokens, tmp_path)
    assert torch.equal(losses[0], want_losses[0])
    for (pname, p), g in zip(m.named_parameters(), want_grads):
        assert (p.grad is None) == (g is None), pname
        assert g is None or torch.equal(p.grad, g), pname
    assert sum(p.grad is not None for p in m.parameters()) == sum(p.requires_grad for p in m.parameters())
