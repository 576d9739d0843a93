"""The sharded mode's layout (engine/shard_layout.py): per-parameter dim-0 shards, the all-gather's
copy-out and the reduce-scatter's copy-in, exact on one process and through gloo on two."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch

from lightning_lazytrain.engine.shard_layout import ALIGN, ShardLayout

# awkward on purpose: fewer rows than ranks, a 0-dim and a 1-D parameter, rows not divisible by world
SHAPES = [(5, 3), (7,), (), (1, 4), (12, 2, 3), (2,)]


def packed(shapes):
    """Param-major offsets as the ParamStore packs them (each parameter at a multiple of ALIGN)."""
    offsets, off = [], 0
    for shape in shapes:
        offsets.append(off)
        off = -(-(off + max(1, torch.Size(shape).numel())) // ALIGN) * ALIGN
    return offsets, off


def full_buffer(shapes, seed):
    offsets, n = packed(shapes)
    g = torch.Generator().manual_seed(seed)
    full = torch.zeros(n)
    for shape, off in zip(shapes, offsets):
        numel = max(1, torch.Size(shape).numel())
        full[off: off + numel] = torch.randn(numel, generator=g)
    return full, offsets


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_shards_cover_every_row_once_and_gather_back(world):
    full, offsets = full_buffer(SHAPES, 0)
    layout = ShardLayout(SHAPES, offsets, world)
    assert layout.shard_numel % ALIGN == 0
    shards = [layout.shard_of(full, r) for r in range(world)]
    for i, spec in enumerate(layout.specs):  # every row in exactly one rank's shard, with its values
        owned = [spec.owned_rows(r) for r in range(world)]
        assert sum(b - a for a, b in owned) == spec.rows
        assert all(owned[r][1] <= owned[r + 1][0] or owned[r + 1][0] == owned[r + 1][1] for r in range(world - 1))
        for r, (a, b) in enumerate(owned):
            view = layout.local_view(shards[r], i)
            assert view.shape[0] == spec.rows_per_rank
            rows = full[spec.full_offset: spec.full_offset + spec.rows * spec.row_numel].view(spec.rows, -1)
            assert torch.equal(view.reshape(spec.rows_per_rank, -1)[: b - a], rows[a:b])
            assert not view.reshape(spec.rows_per_rank, -1)[b - a:].any()  # padding rows are zero
    gathered = torch.cat(shards)
    out = torch.full_like(full, float("nan"))
    layout.gather_into(gathered, out)
    for shape, off in zip(SHAPES, offsets):
        numel = max(1, torch.Size(shape).numel())
        assert torch.equal(out[off: off + numel], full[off: off + numel])
    rank_major = torch.full((layout.gathered_numel,), float("nan"))
    layout.scatter_into(full, rank_major)
    assert torch.equal(rank_major, gathered)  # copy-in is the inverse of copy-out


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        weights, offsets = full_buffer(SHAPES, 0)  # the same weights on both ranks
        layout = ShardLayout(SHAPES, offsets, 2)
        gathered = torch.empty(layout.gathered_numel)
        dist.all_gather_into_tensor(gathered, layout.shard_of(weights, rank))
        assembled = torch.zeros_like(weights)
        layout.gather_into(gathered, assembled)
        grads, _ = full_buffer(SHAPES, 10 + rank)  # each rank's own gradients
        rank_major = torch.empty(layout.gathered_numel)
        layout.scatter_into(grads, rank_major)
        mine = torch.empty(layout.shard_numel)
        dist.reduce_scatter_tensor(mine, rank_major)
        torch.save({"assembled": assembled, "weights": weights, "mine": mine}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_all_gather_assembles_the_weights_and_reduce_scatter_sums_each_shard(tmp_path):
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(__file__))
    mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    total = full_buffer(SHAPES, 10)[0] + full_buffer(SHAPES, 11)[0]
    _, offsets = full_buffer(SHAPES, 0)
    layout = ShardLayout(SHAPES, offsets, 2)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["assembled"], got["weights"])
        # two ranks: a + b is the same sum in either order, so the shard equals the shard of the sum exactly
        assert torch.equal(got["mine"], layout.shard_of(total, rank))


@pytest.mark.parametrize("rows, saved_world, world", [(5, 2, 3), (7, 3, 2), (1, 2, 3), (4, 4, 1), (3, 2, 2), (0, 2, 2)])
def test_a_resuming_rank_reads_only_its_rows_of_a_row_chunked_state(rows, saved_world, world):
    """sharded_checkpoint: a state written as row chunks by ``saved_world`` ranks, read back for rank r
    of ``world`` (``own``), is exactly that rank's ``ShardLayout`` shard of the whole tensor (padding
    zero), from the chunks that overlap its rows only."""
    from lightning_lazytrain.core.sharded_checkpoint import (MARKER, _own_rows, _wanted, join_tensors, markers,
                                                        split_tensors)

    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    key = "optimizer_states/0/state/0/exp_avg"
    saved: dict[str, torch.Tensor] = {}
    for r in range(saved_world):
        saving = ShardLayout([full.shape], [0], saved_world)
        shard = saving.local_view(saving.shard_of(full.reshape(-1), r), 0)
        skeleton, tensors = split_tensors({"optimizer_states": [{"state": {0: {"exp_avg": shard}}}]},
                                          layout={key: ("rows", (rows, 3), saved_world, r)})
        saved.update(tensors)
    layout = ShardLayout([full.shape], [0], world)
    for r in range(world):
        own = {m[MARKER]: _own_rows(m, (r, world)) for m in markers(skeleton)}
        got = join_tensors(skeleton, saved, rank=r, own=own)["optimizer_states"][0]["state"][0]["exp_avg"]
        assert torch.equal(got, layout.local_view(layout.shard_of(full.reshape(-1), r), 0)), (r, got)
        if rows:
            assert len(_wanted(markers(skeleton)[0], r, own[key])) <= -(-saved_world // world) + 1
