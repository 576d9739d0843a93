"""Several GPUs and nodes in the planner: the per-rank problem, the collective lane, the
modes (shard, replicate, replicate_overlap, fsdp), the MILP's algebra against the simulator."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from lightning_lazytrain.config import load_hardware
from lightning_lazytrain.planner import (
    Hardware, InvalidInput, ModelSpec, Schedule, TrainSpec, Workload, megatrain, recompute_all, simulate, solve,
)
from lightning_lazytrain.planner.milp import MilpOptions, ScheduleModel
from lightning_lazytrain.planner.multi import MODES, plan_cluster, rank_hardware, rank_workload
from planner_helpers import milp_space
from test_planner_host_lane import random_instance

TINY = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16, vocab=256)
SMALL = ModelSpec(name="small", num_layers=6, hidden=512, intermediate=1408, heads=8, kv_heads=2, head_dim=64,
                  vocab=4096)
TRAIN = TrainSpec(micro_batch_size=4, seq_len=256)


def node(n: int = 8, nodes: int = 1, **changes) -> Hardware:
    hw = load_hardware("h800x8x2" if nodes > 1 else "h800x8")
    return hw.replace(gpus_per_node=n, nodes=nodes, **changes)


# ---- profiles and inputs -------------------------------------------------------------------------
def test_profiles_carry_the_interconnect():
    h8, h16, r8 = load_hardware("h800x8"), load_hardware("h800x8x2"), load_hardware("rtx3090x8")
    assert (h8.world_size, h16.world_size, r8.world_size) == (8, 16, 8)
    assert h8.intra_node_bytes_per_s > r8.intra_node_bytes_per_s > 0
    assert h16.inter_node_bytes_per_s > 0 and h8.inter_node_bytes_per_s == 0
    single = load_hardware("h800")
    assert single.world_size == 1 and single.host_link_share == 1.0
    # the single-GPU fields are the H800 profile's
    assert (h8.h2d_bytes_per_s, h8.cpu_memory_bytes, h8.efficiency) == (single.h2d_bytes_per_s,
                                                                         single.cpu_memory_bytes, single.efficiency)


@pytest.mark.parametrize("changes, key", [
    (dict(gpus_per_node=0), "gpus_per_node"),
    (dict(gpus_per_node=2.5), "gpus_per_node"),
    (dict(nodes=0), "nodes"),
    (dict(gpus_per_node=4, intra_node_bytes_per_s=0.0), "intra_node_bytes_per_s"),
    (dict(nodes=2, inter_node_bytes_per_s=0.0), "inter_node_bytes_per_s"),
    (dict(inter_node_bytes_per_s=-1.0), "inter_node_bytes_per_s"),
    (dict(host_link_share=0.0), "host_link_share"),
    (dict(host_link_share=1.5), "host_link_share"),
    (dict(host_collective_bytes_per_s=float("nan")), "host_collective_bytes_per_s"),
])
def test_bad_interconnect_inputs_name_the_field(changes, key):
    with pytest.raises(InvalidInput, match=key) as err:
        load_hardware("h800").replace(**{"intra_node_bytes_per_s": 1e11, **changes})
    assert err.value.key == f"hardware.{key}"


def test_bad_modes_and_missing_host_collective_bandwidth():
    wl = Workload.analytic(TINY, TRAIN, node())
    with pytest.raises(InvalidInput, match="mode"):
        rank_workload(wl, node(), "zero3")
    with pytest.raises(InvalidInput, match="host_collective_bytes_per_s"):
        rank_workload(wl, node(host_collective_bytes_per_s=0.0), "replicate")
    with pytest.raises(InvalidInput, match="data_parallel"):
        replace(wl, data_parallel="ring").validate()
    with pytest.raises(InvalidInput, match="data_parallel"):
        replace(recompute_all(4), data_parallel="ring")


# ---- world size 1 is the single-GPU problem --------------------------------------------------------
@pytest.mark.parametrize("mode", ["shard", "replicate", "replicate_overlap"])
def test_world_size_one_reproduces_the_single_gpu_plan_exactly(mode):
    single_hw = load_hardware("h800")
    one = node(1)
    wl = Workload.analytic(SMALL, TRAIN, single_hw)
    assert rank_workload(wl, one, mode) is wl and rank_hardware(one) is one
    res = plan_cluster(SMALL, TRAIN, one, mode)
    ref = solve(wl, single_hw)
    assert res.schedule == ref.schedule
    assert res.sim.iteration_seconds == ref.simulated.iteration_seconds
    assert res.tokens_per_second == ref.simulated.tokens_per_second
    assert res.host_bytes_per_node == ref.simulated.peak_cpu_bytes
    assert "collective" not in res.sim.lane_bytes


# ---- per-rank lane bytes are the design's ---------------------------------------------------------
def _expected_weight_passes(s: Schedule, wl: Workload) -> dict[int, int]:
    """Weight fetches per layer in one iteration (grad_accum 1): forward, backward (unless resident),
    one per recompute-block re-run."""
    L = wl.num_layers
    n = {j: 2 - int(s.resident_weights[j]) for j in range(L)}
    for a, e in s.recompute_blocks:
        for j in range(a, e - 1):
            n[j] += 1
    return n


@pytest.mark.parametrize("n, nodes", [(2, 1), (8, 1), (8, 2)])
def test_shard_lane_bytes_per_rank(n, nodes):
    hw = node(n, nodes)
    wl1 = Workload.analytic(SMALL, TRAIN, hw)
    wl = rank_workload(wl1, hw, "shard")
    for s in (recompute_all(wl.num_layers), megatrain(wl.num_layers, 3)):
        s = replace(s, data_parallel="shard")
        sim = simulate(s, wl, rank_hardware(hw), check=False)
        passes = _expected_weight_passes(s, wl)
        block = [layer.param_bytes for layer in wl1.layers]
        # gradients are averaged in the masters' fp32 (the engine widens the bf16 ones first)
        grads = [4 * layer.params for layer in wl1.layers]
        assert 4 * wl1.layers[1].params == 2 * wl1.layers[1].grad_bytes  # (bf16 gradients here)
        fetched = sum(passes[j] * block[j] for j in passes) + wl1.nonblock_param_bytes
        # the host link: 1/n of every fetched block, 1/n of every (fp32) gradient
        assert sim.lane_bytes["h2d"] == pytest.approx(fetched / n, rel=1e-12)
        assert sim.lane_bytes["d2h"] == pytest.approx((sum(grads) + 4 * wl1.nonblock_params) / n, rel=1e-12)
        # all-gather: (n-1)/n of each fetched block; reduce-scatter: (n-1)/n of each block's gradients,
        # plus the cross-node all-reduce of the shard, 2 (M-1)/M of 1/n
        gather = (n - 1) / n * fetched
        reduce = (sum(grads) + 4 * wl1.nonblock_params) * ((n - 1) / n + 2 * (nodes - 1) / nodes / n)
        assert sim.lane_bytes["collective"] == pytest.approx(gather + reduce, rel=1e-12)
    # host state per rank: 1/n of the single GPU's; the host optimizer per rank: 1/n of the work at 1/n of
    # the node's rate (the same seconds); the host lane likewise
    assert wl.host_static_bytes == pytest.approx(wl1.host_static_bytes / n)
    assert wl.layers[1].opt_seconds == pytest.approx(wl1.layers[1].opt_seconds)
    assert wl.layers[1].cast_seconds == pytest.approx(wl1.layers[1].cast_seconds)
    assert wl.layers[1].gather_seconds == pytest.approx((n - 1) / n * block[1] / hw.intra_node_bytes_per_s)


def test_replicate_lane_bytes_and_host_memory():
    n = 4
    hw = node(n)
    wl1 = Workload.analytic(SMALL, TRAIN, hw)
    for mode in ("replicate", "replicate_overlap"):
        wl = rank_workload(wl1, hw, mode)
        s = replace(recompute_all(wl.num_layers), data_parallel=wl.data_parallel)
        sim = simulate(s, wl, rank_hardware(hw))
        ref = simulate(recompute_all(wl.num_layers), wl1, hw)
        assert sim.lane_bytes["h2d"] == pytest.approx(ref.lane_bytes["h2d"])  # full blocks over each link
        params = wl1.total_params
        assert sim.lane_bytes["collective"] == pytest.approx(2 * (n - 1) / n * 4 * params, rel=1e-9)
        # every rank holds a full host copy, and its optimizer shares the host with n - 1 others
        assert wl.host_static_bytes == wl1.host_static_bytes
        assert wl.layers[0].opt_seconds == pytest.approx(n * wl1.layers[0].opt_seconds)
    # the serial all-reduce is all in T, before any update
    s = replace(recompute_all(4), data_parallel="replicate", optimizer="serial")
    T = s.windows()[-1]
    kinds = [(op.lane, op.kind) for op in T.ops]
    assert kinds.count(("collective", "allreduce")) == 5
    assert max(i for i, k in enumerate(kinds) if k[1] == "allreduce") < kinds.index(("cpu", "optimizer"))
    # the overlapped one runs in the B windows of the last micro-batch only
    s = replace(s, data_parallel="replicate_overlap")
    first, last = s.windows(last_microbatch=False), s.windows()
    assert not any(op.kind == "allreduce" for w in first for op in w.ops)
    assert sum(op.kind == "allreduce" for w in last for op in w.ops) == 5


def test_shard_windows_gather_before_use_and_reduce_before_the_d2h():
    s = replace(megatrain(4, 2), data_parallel="shard")
    for w in s.windows():
        for pos, op in enumerate(w.ops):
            if op.lane == "h2d" and op.kind in ("weights", "recompute_weights"):
                nxt = w.ops[pos + 1]
                assert (nxt.lane, nxt.kind, nxt.index, nxt.after) == ("collective", "gather", op.index, pos)
            if op.kind == "grads":
                assert w.ops[op.after].kind == "reduce" and w.ops[op.after].index == op.index
            if op.kind == "recompute" or (op.kind in ("backward", "local_recompute") and op.after >= 0):
                assert w.ops[op.after].kind == "gather"
    # JSON round trip keeps the mode; a single-GPU schedule's JSON is unchanged (no key)
    assert Schedule.loads(s.dumps()) == s
    assert "data_parallel" not in recompute_all(4).to_json()
    with pytest.raises(Exception, match="data_parallel"):
        simulate(recompute_all(4), rank_workload(Workload.analytic(TINY, TRAIN, node(2)), node(2), "shard"),
                 rank_hardware(node(2)))


# ---- the MILP's algebra is the simulator's timing rule, with collectives ---------------------------------
def _multi_instance(seed: int, mode: str):
    rng = random.Random(seed)
    wl, hw, nvme = random_instance(rng, 3)
    if mode == "replicate_overlap":
        wl = replace(wl, grad_accum=1)
    bw = hw.h2d_bytes_per_s
    big = hw.replace(gpus_per_node=4, nodes=2, intra_node_bytes_per_s=bw * rng.uniform(0.5, 4.0),
                     inter_node_bytes_per_s=bw * rng.uniform(0.5, 4.0), host_collective_bytes_per_s=bw * 2,
                     host_link_share=rng.uniform(0.3, 1.0), cpu_memory_bytes=hw.cpu_memory_bytes * 4)
    return rank_workload(wl, big, mode), rank_hardware(big), nvme


@pytest.mark.parametrize("mode", ["shard", "fsdp", "replicate", "replicate_overlap"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.slow
def test_milp_window_times_match_the_simulator_on_every_schedule_with_collectives(mode, seed):
    import pyomo.environ as pyo

    wl, hw, nvme = _multi_instance(seed, mode)
    model = ScheduleModel(wl, hw, MilpOptions())
    n = 0
    for s in milp_space(wl.num_layers, nvme=nvme, pipelined=None):
        s = replace(s, data_parallel=wl.data_parallel)
        model.seed_from(s)
        sim = simulate(s, wl, hw, check=False)
        assert pyo.value(model.iteration_time()) == pytest.approx(sim.iteration_seconds, rel=1e-9), s
        n += 1
    assert n > 20


@pytest.mark.parametrize("mode", ["shard", "replicate", "replicate_overlap"])
def test_milp_objective_equals_the_simulator_on_multi_gpu_instances(mode):
    for seed in range(3):
        wl, hw, _ = _multi_instance(10 + seed, mode)
        res = solve(wl, hw, time_limit=30)
        sim = simulate(res.schedule, wl, hw)
        assert res.schedule.data_parallel == wl.data_parallel
        if res.objective is not None:
            assert res.objective == pytest.approx(sim.iteration_seconds, rel=1e-2)


def test_overlap_with_accumulation_is_refused_by_the_milp_with_a_reason():
    wl, hw, _ = _multi_instance(0, "replicate")
    wl = rank_workload(replace(wl, data_parallel="none", ranks=1, ranks_per_node=1), node(2), "replicate_overlap")
    with pytest.raises(InvalidInput, match="grad_accum"):
        ScheduleModel(replace(wl, grad_accum=2), rank_hardware(node(2)), MilpOptions())


# ---- the modes, end to end ------------------------------------------------------------------------------
def test_modes_on_a_small_model():
    one = plan_cluster(SMALL, TRAIN, node(1), "shard")
    res = {mode: plan_cluster(SMALL, TRAIN, node(4), mode) for mode in MODES}
    for mode, r in res.items():
        assert r.world_size == 4 and r.sim.iteration_seconds > 0, mode
    # sharding keeps one host copy per node; replication n
    assert res["shard"].host_bytes_per_node < 1.1 * one.host_bytes_per_node
    assert res["replicate"].host_bytes_per_node > 3.5 * one.host_bytes_per_node
    assert res["replicate_overlap"].sim.iteration_seconds <= res["replicate"].sim.iteration_seconds + 1e-9
    assert res["fsdp"].schedule.optimizer == "serial" and res["fsdp"].status == "policy"


def test_a_running_jobs_rank_workload_prices_the_measured_all_reduce():
    """``measured_rank_workload``: a rank's measured workload keeps its measured host times (they
    were taken with every rank working) and gets each group's host all-reduce at the measured
    bandwidth; the MILP plans it in that mode, and its plan equals the simulator."""
    from lightning_lazytrain.planner.multi import host_allreduce_bytes, measured_rank_workload

    wl, hw, _ = _multi_instance(3, "replicate_overlap")  # grad_accum 1 (the MILP's overlap)
    wl = replace(wl, data_parallel="none", ranks=1, ranks_per_node=1)
    for mode in ("replicate", "replicate_overlap"):
        rank = measured_rank_workload(wl, 4, 4, 2e9, mode)
        assert rank.data_parallel == mode and rank.ranks == 4
        for mine, theirs in zip(rank.layers, wl.layers):
            assert mine.allreduce_bytes == host_allreduce_bytes(theirs.params * 4, 4)
            assert mine.allreduce_seconds == pytest.approx(mine.allreduce_bytes / 2e9)
            assert (mine.opt_seconds, mine.cast_seconds, mine.accum_seconds) == (
                theirs.opt_seconds, theirs.cast_seconds, theirs.accum_seconds)
        res = solve(rank, hw, time_limit=30)
        assert res.schedule.data_parallel == mode
        sim = simulate(res.schedule, rank, hw)
        assert sim.lane_bytes["collective"] == pytest.approx(
            sum(x.allreduce_bytes for x in rank.layers) + rank.nonblock_allreduce_bytes)
        if res.objective is not None:
            assert res.objective == pytest.approx(sim.iteration_seconds, rel=1e-2)
        # a policy's schedule for that rank: the same decisions in the job's mode
        assert simulate(megatrain(wl.num_layers, 2).in_mode(mode), rank, hw).iteration_seconds > 0
    assert measured_rank_workload(wl, 1, 1, 2e9) is wl
    with pytest.raises(InvalidInput):
        measured_rank_workload(wl, 2, 2, 2e9, "shard")


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.slow
def test_widened_shard_gradients_are_priced_alike_by_the_milp_and_the_simulator(seed):
    """A sharded run with 16-bit compute lands its gradients widened to the masters' dtype
    (``measured_shard_workload(reduce_element_bytes=4)`` of a 2-byte measured workload: ``grad_widen``
    2): each gradient copy moves twice the bytes of a 2-byte landing, in the simulator and in the
    MILP's window times on every schedule."""
    import pyomo.environ as pyo

    from lightning_lazytrain.planner.multi import measured_shard_workload

    rng = random.Random(seed)
    wl, hw, nvme = random_instance(rng, 3)
    wl = replace(wl, nonblock_parts=())
    shard = [-(-layer.params // 2) for layer in wl.layers]
    args = (wl, 2, 2, shard, -(-wl.nonblock_params // 2), hw.h2d_bytes_per_s)
    narrow = measured_shard_workload(*args, gather_element_bytes=2, reduce_element_bytes=2)
    wide = measured_shard_workload(*args, gather_element_bytes=2, reduce_element_bytes=4)
    assert {layer.grad_widen for layer in wide.layers} == {2.0} and wide.nonblock_grad_widen == 2.0
    plain = replace(recompute_all(3), data_parallel="shard")  # nothing else crosses d2h
    assert simulate(plain, wide, hw, check=False).lane_bytes["d2h"] == pytest.approx(
        2 * simulate(plain, narrow, hw, check=False).lane_bytes["d2h"], rel=1e-12)
    model = ScheduleModel(wide, hw, MilpOptions())
    n = 0
    for s in milp_space(wide.num_layers, nvme=nvme, pipelined=None):
        s = replace(s, data_parallel="shard")
        model.seed_from(s)
        sim = simulate(s, wide, hw, check=False)
        assert pyo.value(model.iteration_time()) == pytest.approx(sim.iteration_seconds, rel=1e-9), s
        n += 1
    assert n > 10


def test_a_running_jobs_16_bit_host_gradients_are_all_reduced_at_their_size():
    """``measured_rank_workload(grad_element_bytes=2)`` (16-bit masters): each group's all-reduce
    moves half the bytes of fp32 host gradients."""
    from lightning_lazytrain.planner.multi import host_allreduce_bytes, measured_rank_workload

    wl, _, _ = _multi_instance(0, "replicate")
    wl = replace(wl, data_parallel="none", ranks=1, ranks_per_node=1)
    half = measured_rank_workload(wl, 4, 4, 2e9, grad_element_bytes=2)
    for mine, theirs in zip(half.layers, wl.layers):
        assert mine.allreduce_bytes == host_allreduce_bytes(theirs.params * 2, 4)
    assert half.nonblock_allreduce_bytes == host_allreduce_bytes(wl.nonblock_params * 2, 4)


def test_a_running_jobs_host_gradients_are_all_reduced_as_the_store_holds_them():
    """``grad_elements``: a fine-tune's host gradients end at each group's last trainable parameter (param_store's
    Note: [host gradients for what trains]), so each group's all-reduce moves those elements, not the group's."""
    from lightning_lazytrain.planner.errors import InvalidInput
    from lightning_lazytrain.planner.multi import host_allreduce_bytes, measured_rank_workload

    wl, _, _ = _multi_instance(0, "replicate")
    wl = replace(wl, data_parallel="none", ranks=1, ranks_per_node=1)
    counts = [layer.params // (3 + j) for j, layer in enumerate(wl.layers)]
    lora = measured_rank_workload(wl, 4, 4, 2e9, grad_elements=counts, nonblock_grad_elements=64)
    full = measured_rank_workload(wl, 4, 4, 2e9)
    for mine, n, whole in zip(lora.layers, counts, full.layers):
        assert mine.allreduce_bytes == host_allreduce_bytes(n * 4, 4) < whole.allreduce_bytes
        assert mine.allreduce_seconds < whole.allreduce_seconds
    assert lora.nonblock_allreduce_bytes == host_allreduce_bytes(64 * 4, 4)
    with pytest.raises(InvalidInput, match="grad_elements"):
        measured_rank_workload(wl, 4, 4, 2e9, grad_elements=counts[:-1])
