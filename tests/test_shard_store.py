"""The sharded data-parallel mode in the engine (engine/shard_store.py): two gloo processes,
each holding half of every block's host masters, train as one process with twice the batch."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec, keep_all, megatrain, recompute_all

SPEC = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16, vocab=256)
STEPS = 2
SCHEDULES = {"recompute_all": recompute_all(4), "keep_all": keep_all(4), "megatrain": megatrain(4, 2)}
# keep_all, then a schedule with two resident layers (more slots: the executor rebuilds its store)
RESIDENT = dataclasses.replace(keep_all(4), resident_weights=(True, False, False, True))


def data() -> torch.Tensor:
    return torch.randint(0, SPEC.vocab, (4, 33), generator=torch.Generator().manual_seed(3))


def model() -> LlamaLM:
    torch.manual_seed(0)
    return LlamaLM(SPEC)


def train(m: LlamaLM, tokens: torch.Tensor, schedule, shard: bool, world: int = 1,
          switch_to=None, overlap: bool = True) -> tuple[list[float], dict, dict]:
    """``STEPS`` SGD steps through the executor (with ``shard``, every group sharded over the
    ``world`` ranks, the non-block one included); ``switch_to``: the schedule after the first step (a new
    ParamStore when its slots differ: the sharded one gathers the module whole and re-shards it).
    Returns losses, the final (full) weights and host bytes moved."""

    ex = Executor(m, schedule, shard_group="world" if shard else None)
    if shard:
        ex.params.overlap = overlap  # Note: [overlapped all-gather]
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)  # after the store: block params are shards
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    losses = []
    try:
        for _ in range(STEPS):
            ex.begin_microbatch()
            loss = m.loss(tokens)
            loss.backward()
            stats = ex.end_microbatch()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if switch_to is not None and len(losses) == 1:
                before = ex.params
                ex.set_schedule(switch_to)
                assert ex.params is not before  # rebuilt
        lane = dict(stats.lane_bytes)
        lane["collective"] = sum(getattr(ex.params, "collective_bytes", {}).values())
    finally:
        ex.close()  # a sharded store gives every parameter its full value back
    return losses, {"state": {k: v.clone() for k, v in m.state_dict().items()}, "shapes": shapes}, lane


def bf16_grads(m: LlamaLM, tokens: torch.Tensor, shard: bool, keep: bool = False) -> dict[str, torch.Tensor]:
    """One micro-batch with bf16 compute copies: the host (fp32) gradient of every parameter
    (``keep``: the shards' copies kept, param_staging's Note: [kept compute copy])."""
    ex = Executor(m, recompute_all(4), compute_dtype=torch.bfloat16, shard_group="world" if shard else None,
                  keep_compute_copy=keep)
    try:
        ex.begin_microbatch()
        m.loss(tokens).backward()
        ex.end_microbatch()
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    finally:
        ex.close()  # gathers weights and grads whole again; the copies above are this rank's shards


def tied_checkpoint(rank: int, out: str) -> dict[str, torch.Tensor]:
    """A model whose embedding and head are one parameter, sharded, one SGD step, then saved as the
    strategy saves a sharded checkpoint (each rank its rows, ``checkpoint_layout``); returns the
    whole weights the store gives back at close."""
    from lightning_lazytrain.core.sharded_checkpoint import save_sharded

    torch.manual_seed(0)
    m = LlamaLM(dataclasses.replace(SPEC, tied_embeddings=True))
    ex = Executor(m, recompute_all(4), shard_group="world")
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    try:
        ex.begin_microbatch()
        m.loss(data()[2 * rank: 2 * rank + 2]).backward()
        ex.end_microbatch()
        opt.step()
        checkpoint = {"state_dict": m.state_dict(), "optimizer_states": [opt.state_dict()]}
        save_sharded(checkpoint, f"{out}/tied.ckpt", layout=ex.params.checkpoint_layout(checkpoint, m, [opt]))
    finally:
        ex.close()
    return {k: v.clone() for k, v in m.state_dict().items()}


RS_DELAY = 0.25  # seconds each reduce-scatter is held back in the overlap scenarios


def reduce_scatter_held_back(overlap: bool, fail: bool = False) -> dict:
    """One micro-batch whose every reduce-scatter first sleeps ``RS_DELAY`` (``fail``: raises instead):
    the seconds the launching thread spent in ``send_grads``, how many it made, and the error if any
    (Note: [overlapped reduce-scatter])."""
    import time

    import torch.distributed as dist

    real = dist.reduce_scatter_tensor

    def held_back(*args, **kwargs):
        if fail:
            raise RuntimeError("injected reduce-scatter failure")
        time.sleep(RS_DELAY)
        return real(*args, **kwargs)

    m = model()
    ex = Executor(m, recompute_all(4), shard_group="world")
    ex.params.overlap = overlap
    store_send, spent = ex.params.send_grads, []

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return store_send(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - t0)

    ex.params.send_grads = timed
    dist.reduce_scatter_tensor = held_back
    error = None
    try:
        ex.begin_microbatch()
        m.loss(data()[:2]).backward()
        ex.end_microbatch()
    except Exception as err:  # noqa: BLE001 - reported to the test
        error = f"{type(err).__name__}: {err}"
    finally:
        dist.reduce_scatter_tensor = real
    if error is None:
        ex.close()
    else:
        dist.barrier()  # both ranks failed alike; nothing more to gather
    return {"seconds": sum(spent), "calls": len(spent), "error": error}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        results = {}
        for name, schedule in SCHEDULES.items():
            tokens = data()[2 * rank: 2 * rank + 2]
            results[name] = train(model(), tokens, schedule, shard=True, world=2)
        results["bf16_grads"] = bf16_grads(model(), data()[2 * rank: 2 * rank + 2], shard=True)
        results["bf16_grads_kept"] = bf16_grads(model(), data()[2 * rank: 2 * rank + 2], shard=True, keep=True)
        results["in_line"] = train(model(), data()[2 * rank: 2 * rank + 2], SCHEDULES["recompute_all"], shard=True,
                                   world=2, overlap=False)
        results["rebuild"] = train(model(), data()[2 * rank: 2 * rank + 2], keep_all(4), shard=True, world=2,
                                   switch_to=RESIDENT)
        results["tied_checkpoint"] = tied_checkpoint(rank, out)
        results["held_back"] = {o: reduce_scatter_held_back(o) for o in (True, False)}
        results["rs_failed"] = reduce_scatter_held_back(True, fail=True)
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("shard")
    mp.start_processes(_worker, args=(_free_port(), str(out)), nprocs=2, start_method="spawn", join=True)
    results = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    results[0]["tied_path"] = out / "tied.ckpt"
    return results


@pytest.mark.slow
def test_a_tied_parameter_is_saved_under_each_name_as_rows(two_ranks):
    """Each name of a tied parameter is written as row chunks (the state dict has both names, the
    module's parameters list it once): the joined checkpoint holds the whole tensor under both."""
    import torch.distributed.checkpoint as dcp

    from lightning_lazytrain.core.sharded_checkpoint import load_sharded

    path = two_ranks[0]["tied_path"]
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name in ("state_dict/embed_tokens.weight", "state_dict/lm_head.weight"):
        assert name not in keys and f"{name}@0:128" in keys and f"{name}@128:256" in keys, sorted(keys)[:6]
    saved = load_sharded(path)
    whole = two_ranks[0]["tied_checkpoint"]
    for k, v in whole.items():
        assert torch.equal(saved["state_dict"][k], v), k
    shapes = {tuple(v.shape) for v in whole.values()}
    for state in saved["optimizer_states"][0]["state"].values():  # SGD's momentum, joined whole
        assert tuple(state["momentum_buffer"].shape) in shapes


@pytest.mark.slow
def test_the_overlapped_all_gather_is_bit_identical_to_the_in_line_one(two_ranks):
    """Note: [overlapped all-gather]: the async all-gather finished at bind fills the slots as the
    in-line one does (the profiled step runs in line): the same losses and weights, bit for bit."""
    for r in range(2):
        (overlapped, w_over, bytes_over), (in_line, w_line, bytes_line) = two_ranks[r]["recompute_all"], \
            two_ranks[r]["in_line"]
        assert overlapped == in_line
        assert all(torch.equal(v, w_line["state"][k]) for k, v in w_over["state"].items())
        assert bytes_over == bytes_line


@pytest.mark.slow
def test_the_launching_thread_does_not_wait_for_the_reduce_scatters(two_ranks):
    """Note: [overlapped reduce-scatter]: with every reduce-scatter held back RS_DELAY, the backward's
    send_grads calls return at once (the collectives run on the store's gradient lane); in line (a
    profiled step) each waits for its collective."""
    for r in range(2):
        over, line = two_ranks[r]["held_back"][True], two_ranks[r]["held_back"][False]
        assert over["error"] is None and line["error"] is None
        assert over["calls"] == line["calls"] == 5  # four blocks and the non-block group
        assert line["seconds"] >= 5 * RS_DELAY
        assert over["seconds"] < RS_DELAY, over


@pytest.mark.slow
def test_a_failed_reduce_scatter_fails_the_step_with_its_cause(two_ranks):
    """An error in an overlapped collective reaches the launching thread when the step ends (no hang,
    no silent zero gradient), naming its cause."""
    for r in range(2):
        error = two_ranks[r]["rs_failed"]["error"]
        assert error is not None and "injected reduce-scatter failure" in error, error


@pytest.mark.parametrize("name", [*SCHEDULES, "rebuild"])
@pytest.mark.slow
def test_two_sharded_ranks_train_as_one_process_with_twice_the_batch(two_ranks, name):
    ref = model()
    tokens = data()
    want_losses = []
    opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for _ in range(STEPS):
        loss = ref.loss(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(loss.item())
    want = ref.state_dict()
    for r in range(2):
        losses, weights, _ = two_ranks[r][name]
        # the ranks' shard shapes were halves of the block parameters while training
        assert any(shape[0] < want[n].shape[0] for n, shape in weights["shapes"].items() if "layers." in n)
        for k, v in weights["state"].items():
            assert v.shape == want[k].shape, k
            torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-6, msg=k)
    for step in range(STEPS):  # the two halves' mean losses average to the whole batch's
        mean = (two_ranks[0][name][0][step] + two_ranks[1][name][0][step]) / 2
        assert mean == pytest.approx(want_losses[step], rel=1e-6)


@pytest.mark.slow
def test_each_rank_moves_half_of_the_block_weights_over_its_link(two_ranks):
    """The H2D of a sharded rank is the non-block weights plus half of every block fetch (its
    shard), against one process moving whole blocks; the other half arrives by the all-gather."""
    for name, schedule in SCHEDULES.items():
        m = model()
        _, _, lane_full = train(m, data()[:2], schedule, shard=False)
        for r in range(2):
            lane = two_ranks[r][name][2]
            assert lane["h2d"] < 0.75 * lane_full["h2d"], (name, lane, lane_full)
            assert lane["d2h"] < 0.75 * lane_full["d2h"], (name, lane, lane_full)
            assert lane["collective"] > 0


@pytest.mark.slow
def test_sharded_16_bit_gradients_are_averaged_in_fp32(two_ranks):
    """With bf16 compute copies each rank's device gradients are bf16; the sharded mode widens them
    before the reduce-scatter, so a block's host shard gradient is exactly the fp32 average of the two
    ranks' widened gradients, as the replicate mode (and DDP, in fp32) computes it."""
    from lightning_lazytrain.engine.shard_layout import ShardLayout

    per_rank = [bf16_grads(model(), data()[2 * r: 2 * r + 2], shard=False) for r in range(2)]
    for r in range(2):
        got = two_ranks[r]["bf16_grads"]
        for name, g in got.items():
            if "layers." not in name:
                continue
            full = (per_rank[0][name] + per_rank[1][name]) / 2
            layout = ShardLayout([full.shape], [0], 2)
            spec = layout.specs[0]
            start, stop = spec.owned_rows(r)
            want = full.reshape(spec.rows, -1)[start:stop]
            assert g.dtype == torch.float32
            assert torch.equal(g.reshape(spec.rows_per_rank, -1)[: stop - start], want), name
            assert torch.equal(two_ranks[r]["bf16_grads_kept"][name], g), name  # the shards' kept copies
