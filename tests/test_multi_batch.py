"""The batch search per rank on several GPUs (Note: [the batch search on several GPUs], planner/multi_batch.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("pyomo")
pytest.importorskip("highspy")

from lightning_lazytrain.config import load_hardware, load_model  # noqa: E402
from lightning_lazytrain.planner import InfeasibleBudget, MilpOptions, TrainSpec, plan_cluster, search_batch  # noqa: E402
from lightning_lazytrain.planner.multi_batch import rank_fits, search_cluster_batch  # noqa: E402

FAST = MilpOptions(time_limit=10)


def train(b: int, seq: int = 1024) -> TrainSpec:
    return TrainSpec(micro_batch_size=b, seq_len=seq)


@pytest.mark.parametrize("mode", ["shard", "replicate"])
def test_the_largest_batch_per_rank_plans_and_the_next_does_not_fit(mode):
    model, hw = load_model("qwen2.5-7b"), load_hardware("rtx3090x8")
    found = search_cluster_batch(model, train(1), hw, mode, options=FAST, candidates=[1, 2])
    top = found.largest_feasible
    assert top >= 2 and [r["micro_batch_size"] for r in found.table] == [1, 2]
    assert found.best_throughput in (1, 2)
    c = plan_cluster(model, train(top), hw, mode, options=FAST)  # the largest one plans
    assert c.sim.peak_gpu_bytes <= c.hardware.gpu_memory_cap_bytes + 1024
    assert not rank_fits(model, train(top + 1), hw, mode)


def test_a_rank_holds_a_larger_batch_in_shard_than_the_single_gpu_search_on_its_share():
    """The single-GPU workload on one rank's hardware (the old search) finds no batch for 27B on h800x8 (the
    whole host state on 1/8 of the host); the rank's sharded problem does."""
    from lightning_lazytrain.planner import largest_batch, rank_hardware

    model, hw = load_model("qwen3.6-27b"), load_hardware("h800x8")
    assert largest_batch(model, train(1), rank_hardware(hw)) == 0
    assert rank_fits(model, train(8), hw, "shard")


def test_candidates_all_above_the_largest_name_it():
    model, hw = load_model("qwen2.5-7b"), load_hardware("rtx3090")
    with pytest.raises(InfeasibleBudget, match="the largest that fits"):
        search_batch(model, train(1), hw, options=FAST, candidates=[4096])
    with pytest.raises(InfeasibleBudget, match="the largest that fits"):
        search_cluster_batch(model, train(1), load_hardware("rtx3090x8"), "shard", options=FAST, candidates=[4096])


def test_a_host_cap_per_node_lowers_the_largest_batch():
    model, hw = load_model("qwen2.5-7b"), load_hardware("rtx3090x8")
    free = search_cluster_batch(model, train(1), hw, "shard", options=FAST, candidates=[1])
    c = plan_cluster(model, train(1), hw, "shard", options=FAST)
    capped = search_cluster_batch(model, train(1), hw, "shard", options=FAST, candidates=[1],
                                  host_bytes_per_node=c.host_bytes_per_node * 1.02)
    assert 1 <= capped.largest_feasible <= free.largest_feasible
    # below the ranks' host state: planned as if it fit and flagged, plan_cluster's rule (the row says over cap)
    short = c.workload.host_static_bytes * hw.gpus_per_node * 0.9
    below = search_cluster_batch(model, train(1), hw, "shard", options=FAST, candidates=[1], host_bytes_per_node=short)
    assert not plan_cluster(model, train(below.best_throughput), hw, "shard", options=FAST,
                            host_bytes_per_node=short).host_fits
