"""Several processes (gloo, Lightning's own launcher): 2 ranks x micro-batch b train bit for bit as
Lightning's DDP does, and as 1 rank x 2b under strategy='auto' (losses and final weights, to 1e-6),
for several plans, with accumulation and clipping; a rank that fails makes every rank exit with
the error, no hang."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

SCRIPT = Path(__file__).with_name("dist_train.py")


def mixed_plan(path: Path) -> str:
    """A plan file for dist_train's 4 blocks: boundary 1 in host memory, boundary 2 recomputed,
    layer 0's internals kept and parked in host memory from F2 to B3 (test_conformance's plan)."""
    from test_conformance import mixed_plan as write

    return write(path)
pytestmark = pytest.mark.slow


def _script():
    spec = importlib.util.spec_from_file_location("dist_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch(tmp_path: Path, timeout: float = 240, **opts) -> subprocess.CompletedProcess:
    opts = {"out": str(tmp_path), "devices": 2, **opts}
    return subprocess.run([sys.executable, str(SCRIPT), json.dumps(opts)], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path)


def outputs(path: Path, ranks: int = 2) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    return ([json.loads((path / f"losses_rank{r}.json").read_text()) for r in range(ranks)],
            torch.load(path / "weights.pt"))


@pytest.mark.parametrize("policy, accum, clip, optimizer, overlap", [
    ("milp", 1, None, "sgd", True),
    ("milp", 2, 0.5, "sgd", True),  # planned as replicate (the MILP's overlap is for grad_accum 1)
    ("recompute_all", 2, 0.5, "hybrid", True),
    ("megatrain", 2, 0.5, "sgd", False),  # every group averaged after the backward
    ("mixed", 2, 0.5, "sgd", True),  # a host home, a recomputed boundary, internals kept on the host
])
def test_two_ranks_train_as_ddp_and_as_one_rank_with_twice_the_batch(tmp_path, policy, accum, clip, optimizer,
                                                                     overlap):
    """The same training as Lightning's DDP, bit for bit; with ``overlap`` (distributed.py, Note:
    [overlapped all-reduce]) every group's all-reduce ran on the collective thread as soon as the
    group was finished (the blocks' during the backward), without, all of them after it; each rank's
    bytes per lane equal the simulator's per-rank prediction."""
    b, steps = 2, 3
    common = dict(batch=b, steps=steps, accum=accum, clip=clip, optimizer=optimizer,
                  same_init=False)  # ranks start differently: rank 0's weights are broadcast, as DDP does
    (tmp_path / "lazy").mkdir()
    (tmp_path / "ddp").mkdir()
    plan = mixed_plan(tmp_path / "plan.json") if policy == "mixed" else policy
    for run in (launch(tmp_path / "lazy", policy=plan, overlap=overlap, record_bytes=True, **common),
                launch(tmp_path / "ddp", strategy="auto", **common)):  # Lightning's DDP
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    losses, weights = outputs(tmp_path / "lazy")
    ddp_losses, ddp_weights = outputs(tmp_path / "ddp")
    layers = _script().LAYERS
    for r in range(2):
        rows = json.loads((tmp_path / "lazy" / f"bytes_rank{r}.json").read_text())
        assert [row["step"] for row in rows] == list(range(1, steps + 1))
        if policy != "recompute_all":  # the profiled step runs the provisional schedule (recompute_all on CPU)
            assert rows[-1]["policy"] == rows[1]["policy"] != rows[0]["policy"]
        for row in rows:
            assert sorted(row["overlapped"]) == (list(range(-1, layers)) if overlap else []), (r, row["step"])
            # Per optimizer step, each rank's bytes on h2d, d2h (executor) and collective (GradSync's
            # all-reduces, in the planner's unit: 2 (W-1)/W of each group's flat fp32 host gradient)
            # equal the simulator's per-rank prediction for the schedule that step ran (the provisional
            # one while profiling, then the plan), in replicate mode: multi.rank_workload(plan workload, 2)
            measured, predicted = row["measured"], row["predicted"]
            assert predicted["collective"] > 0
            for lane in ("h2d", "d2h", "collective", "nvme_read", "nvme_write"):
                assert measured.get(lane, 0.0) == predicted.get(lane, 0.0), (r, row["step"], lane)
    # the same training as DDP, bit for bit (fp32, deterministic CPU kernels; HybridAdamW's fused
    # clip is clip_grad_norm_ bit for bit, see optim/clip.py Note: [exact clip])
    assert losses == ddp_losses
    for name, value in ddp_weights.items():
        assert torch.equal(weights[name], value), name

    ref = _script().train({"devices": 1, "batch": 2 * b, "steps": steps, "accum": accum, "clip": clip,
                           "strategy": "auto", "optimizer": optimizer, "same_init": False, "union_of": 2})
    # ref's init is rank 0's; each of its micro-batches is the union of the two ranks' (same order)
    ours = [(x + y) / 2 for x, y in zip(*losses)]
    assert len(ours) == len(ref.losses) == steps * accum
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref.losses), rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():  # summation order differs: 1e-6 of each tensor's norm
        # (Adam divides rounding-level differences of tiny gradients by their own size: there
        # DDP is no closer to one rank than we are, and that is the bound)
        slack = (ddp_weights[name] - value).norm() if optimizer != "sgd" else 0.0
        assert (weights[name] - value).norm() <= 1e-6 * value.norm() + 1.01 * slack, name


def test_a_hook_after_backward_sees_what_it_sees_under_ddp(tmp_path):
    """distributed.py, Note: [one sync per step]: an ``on_after_backward`` hook makes every micro-batch
    write its gradients back; with accumulation 2 the hook still sees each rank's own gradients after
    the first micro-batch and their average after the last, as under DDP (``no_sync``), and the run
    is DDP's bit for bit."""
    common = dict(batch=2, steps=2, accum=2, clip=0.5, same_init=False, grad_probe=True)
    (tmp_path / "lazy").mkdir()
    (tmp_path / "ddp").mkdir()
    for run in (launch(tmp_path / "lazy", policy="megatrain", **common),
                launch(tmp_path / "ddp", strategy="auto", **common)):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    probes = {k: [json.loads((tmp_path / k / f"probe_rank{r}.json").read_text())["rows"] for r in range(2)]
              for k in ("lazy", "ddp")}
    # the profiled micro-batch averaged nothing (held), yet the plan prices every group's all-reduce
    assert json.loads((tmp_path / "lazy" / "probe_rank0.json").read_text())["plan_allreduce_bytes"] > 0
    for r in range(2):
        assert len(probes["lazy"][r]) == 4
        torch.testing.assert_close(torch.tensor(probes["lazy"][r]), torch.tensor(probes["ddp"][r]),
                                   rtol=1e-6, atol=0.0)
    assert probes["ddp"][0][0] != probes["ddp"][1][0]  # first micro-batch: each rank's own
    assert probes["ddp"][0][1] == probes["ddp"][1][1]  # last: the average
    losses, weights = outputs(tmp_path / "lazy")
    ddp_losses, ddp_weights = outputs(tmp_path / "ddp")
    assert losses == ddp_losses
    for name, value in ddp_weights.items():
        assert torch.equal(weights[name], value), name


def test_gradient_hooks_and_edits_train_as_ddp_and_sharded_as_one_rank(tmp_path):
    """Parameter hooks and gradients edited before the step (dist_train's ``EditingNet``), with
    HybridAdamW's fused clip and accumulation: the replicate mode equals Lightning's DDP bit for bit
    (the post-accumulate hook sees each rank's own gradient, the average comes after it, the clip's
    norms are taken after the edits); the sharded mode equals one rank with twice the batch (its
    norms of edited gradients taken again over the ranks' shards)."""
    b, steps = 2, 3
    common = dict(batch=b, steps=steps, accum=2, clip=0.5, optimizer="hybrid", same_init=False, user_hooks=True)
    runs = {"lazy": dict(policy="megatrain"), "shard": dict(policy="recompute_all", data_parallel="shard"),
            "ddp": dict(strategy="auto")}
    for name, opts in runs.items():
        (tmp_path / name).mkdir()
        run = launch(tmp_path / name, **opts, **common)
        assert run.returncode == 0, name + run.stdout[-3000:] + run.stderr[-5000:]
    losses, weights = outputs(tmp_path / "lazy")
    ddp_losses, ddp_weights = outputs(tmp_path / "ddp")
    assert losses == ddp_losses
    for name, value in ddp_weights.items():
        assert torch.equal(weights[name], value), name
    shard_losses, shard_weights = outputs(tmp_path / "shard")
    ref = _script().train({"devices": 1, "batch": 2 * b, "steps": steps, "accum": 2, "clip": 0.5, "strategy": "auto",
                           "optimizer": "hybrid", "same_init": False, "union_of": 2, "user_hooks": True})
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*shard_losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():  # Adam: DDP's own distance from one rank is the bound
        slack = (ddp_weights[name] - value).norm()
        assert (shard_weights[name] - value).norm() <= 1e-6 * value.norm() + 1.01 * slack, name


def test_a_second_pass_through_the_blocks_averages_after_the_backward(tmp_path):
    """Two forwards before one backward (every block runs an ad-hoc second pass, whose gradients
    reach the host after its planned ones): the overlapped all-reduce would miss them, so the ranks
    agree to average every group after the backward in such a step; the run still equals one rank
    with twice the batch (to 1e-6)."""
    b, steps = 2, 2
    run = launch(tmp_path, batch=b, steps=steps, policy="megatrain", two_forwards=True, record_bytes=True,
                 same_init=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    losses, weights = outputs(tmp_path)
    for r in range(2):
        rows = json.loads((tmp_path / f"bytes_rank{r}.json").read_text())
        assert [row["overlapped"] for row in rows] == [[]] * steps
    ref = _script().train({"devices": 1, "batch": 2 * b, "steps": steps, "strategy": "auto", "same_init": False,
                           "union_of": 2, "two_forwards": True})
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():
        assert (weights[name] - value).norm() <= 1e-6 * value.norm(), name


def test_a_failing_rank_stops_every_rank_with_its_error(tmp_path):
    run = launch(tmp_path, timeout=180, batch=2, steps=4, fail_rank=1, fail_step=2)
    assert run.returncode != 0
    assert "injected failure on rank 1 at batch 2" in run.stdout + run.stderr
    assert not (tmp_path / "weights.pt").exists()


def resume_three_ways(tmp_path: Path, **common) -> tuple[Path, list[list[float]], dict[str, torch.Tensor]]:
    """Two epochs of two steps on 2 ranks: uninterrupted, stopped after epoch 0 with a checkpoint, and
    resumed from it; asserts the resumed run is the uninterrupted one, bit for bit (losses and weights).
    Returns the checkpoint, the resumed run's losses per rank and the final weights."""
    for d in ("full", "first", "second"):
        (tmp_path / d).mkdir()
    ckpt = tmp_path / "epoch0.ckpt"
    for run in (launch(tmp_path / "full", steps=4, **common),
                launch(tmp_path / "first", steps=2, save=str(ckpt), **common),
                launch(tmp_path / "second", steps=4, resume=str(ckpt), **common)):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    full_losses, full = outputs(tmp_path / "full")
    first_losses, _ = outputs(tmp_path / "first")
    second_losses, resumed = outputs(tmp_path / "second")
    for r in range(2):
        assert first_losses[r] + second_losses[r] == full_losses[r]
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name
    return ckpt, second_losses, full


@pytest.mark.parametrize("fmt, optimizer", [("sharded", "sgd"), ("sharded", "hybrid8"), ("full", "sgd")])
def test_resume_is_bit_identical_and_a_checkpoint_moves_from_two_ranks_to_one(tmp_path, fmt, optimizer):
    """Two epochs of two steps: 2 ranks uninterrupted; 2 ranks stopped after epoch 0 and resumed from
    the checkpoint (bit-identical); and the same checkpoint resumed by 1 rank with twice the batch
    (the same training, to 1e-6). ``sharded``: a DCP directory, each rank writing a share (with
    ``hybrid8`` HybridAdamW's uint8 states, fp32 block scales and qmaps go through it); ``full``: one
    file from rank 0."""
    b = 2
    ckpt, second_losses, full = resume_three_ways(tmp_path, batch=b, epoch_steps=2, policy="milp", same_init=False,
                                                  checkpoint_format=fmt, optimizer=optimizer)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left
    if fmt == "sharded":  # both ranks wrote a share, neither all of it (DCP deduplicated the replicas)
        shares = {p.name: p.stat().st_size for p in ckpt.glob("*.distcp")}
        assert sorted(shares) == ["__0_0.distcp", "__1_0.distcp"], shares
        assert all(0.25 < n / sum(shares.values()) < 0.75 for n in shares.values()), shares
    else:
        assert ckpt.is_file()

    one = _script().train({"devices": 1, "batch": 2 * b, "steps": 4, "epoch_steps": 2, "strategy": "lazytrain",
                           "policy": "milp", "same_init": False, "union_of": 2, "epoch": 1, "resume": str(ckpt),
                           "optimizer": optimizer})
    ours = [(x + y) / 2 for x, y in zip(*second_losses)]
    torch.testing.assert_close(torch.tensor(one.losses), torch.tensor(ours), rtol=1e-6, atol=0.0)
    if optimizer == "sgd":  # Adam divides rounding-level gradient differences (the summation order of
        # one rank vs two) by their own size, and 8-bit states quantise them: its weights differ by a
        # few 1e-6 of their norm, as DDP's would (see the test above); the losses still agree to 1e-6
        for name, value in one.model.state_dict().items():
            assert (full[name] - value).norm() <= 1e-6 * value.norm(), name


def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    """1 -> 2: one rank with twice the batch trains epoch 0 and saves (one process: the single
    verified file); two ranks resume from it and train epoch 1 as two uninterrupted ranks do (to 1e-6)."""
    b = 2
    for d in ("one", "full", "second"):
        (tmp_path / d).mkdir()
    ckpt = tmp_path / "one" / "epoch0.ckpt"
    _script().train({"devices": 1, "batch": 2 * b, "steps": 2, "epoch_steps": 2, "strategy": "lazytrain",
                     "policy": "milp", "same_init": False, "union_of": 2, "epoch": 0, "save": str(ckpt)})
    assert ckpt.is_file()
    common = dict(batch=b, epoch_steps=2, policy="milp", same_init=False)
    for run in (launch(tmp_path / "full", steps=4, **common),
                launch(tmp_path / "second", steps=4, resume=str(ckpt), **common)):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    full_losses, full = outputs(tmp_path / "full")
    second_losses, resumed = outputs(tmp_path / "second")
    for r in range(2):
        torch.testing.assert_close(torch.tensor(second_losses[r]), torch.tensor(full_losses[r][2:]), rtol=1e-6, atol=0.0)
    for name, value in full.items():
        assert (resumed[name] - value).norm() <= 1e-6 * value.norm(), name


def test_a_writer_that_fails_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """A checkpoint saved every step to one path: the first save creates it, the second replaces it,
    at the third rank 1's DCP writer writes its file and then fails. Every rank stops with that
    error (no hang), and the path holds the second save, whole (its CRCs check), with no temporary
    directory or half checkpoint next to it."""
    from lightning_lazytrain.sharded_checkpoint import is_sharded_checkpoint, load_sharded

    ckpt = tmp_path / "ckpts" / "every.ckpt"
    run = launch(tmp_path, timeout=180, batch=2, steps=4, save=str(ckpt), save_every=1, fail_save_rank=1,
                 fail_save_at=3, same_init=False)
    assert run.returncode != 0
    assert "injected writer failure on rank 1 at save 3" in run.stdout + run.stderr
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["every.ckpt"]
    assert is_sharded_checkpoint(ckpt)
    state = load_sharded(ckpt)  # verified: every file's size and CRC
    assert state["global_step"] == 2
    assert len(state["optimizer_states"][0]["state"]) == len(state["state_dict"])  # SGD momentum per parameter
    assert not (tmp_path / "weights.pt").exists()
    # flipped bytes in a shard are refused before they could resume, naming the file
    from lightning_lazytrain.checkpoint_io import CorruptCheckpoint

    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="__1_0.distcp.*CRC"):
        load_sharded(ckpt)


@pytest.mark.parametrize("policy, accum, clip, optimizer", [
    ("milp", 1, None, "sgd"),
    ("megatrain", 2, 0.5, "sgd"),
    ("recompute_all", 2, 0.5, "hybrid"),
    ("mixed", 2, 0.5, "sgd"),
])
def test_sharded_ranks_train_as_one_rank_with_twice_the_batch(tmp_path, policy, accum, clip, optimizer):
    """``data_parallel="shard"`` (engine/shard_store.py): each rank holds half of every block's host
    masters, gradients and optimizer state; the run equals one rank with twice the batch to 1e-6 (the
    reduce-scatter averages each micro-batch, DDP each step: the same sums in another order), and each
    rank's bytes per lane equal the simulator's."""
    b, steps = 2, 3
    common = dict(batch=b, steps=steps, accum=accum, clip=clip, optimizer=optimizer, same_init=False)
    (tmp_path / "shard").mkdir()
    plan = mixed_plan(tmp_path / "plan.json") if policy == "mixed" else policy
    run = launch(tmp_path / "shard", policy=plan, data_parallel="shard", record_bytes=True, **common)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    losses, weights = outputs(tmp_path / "shard")
    # per step, each rank's host-link bytes (its shards: every fetch, every gradient copy) and collective
    # bytes (all-gathers and reduce-scatters) equal the simulator's for the plan's per-rank workload
    # (multi.measured_shard_workload) and the step's schedule
    for r in range(2):
        rows = json.loads((tmp_path / "shard" / f"bytes_rank{r}.json").read_text())
        assert len(rows) == steps
        for row in rows:
            for lane in ("h2d", "d2h", "collective"):
                assert row["measured"].get(lane, 0.0) > 0, (r, row["step"], lane)
                assert row["measured"][lane] == pytest.approx(row["predicted"].get(lane, 0.0), rel=1e-9), \
                    (r, row["step"], lane, row)
    ddp_weights = None
    if optimizer != "sgd":  # Adam divides rounding-level differences of tiny gradients by their own
        (tmp_path / "ddp").mkdir()  # size: DDP's own distance from one rank is the bound there
        ddp = launch(tmp_path / "ddp", strategy="auto", **common)
        assert ddp.returncode == 0, ddp.stdout[-3000:] + ddp.stderr[-5000:]
        ddp_weights = outputs(tmp_path / "ddp")[1]
    ref = _script().train({"devices": 1, "batch": 2 * b, "steps": steps, "accum": accum, "clip": clip,
                           "strategy": "auto", "optimizer": optimizer, "same_init": False, "union_of": 2})
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():
        assert weights[name].shape == value.shape, name  # whole again after the run
        slack = (ddp_weights[name] - value).norm() if ddp_weights is not None else 0.0
        assert (weights[name] - value).norm() <= 1e-6 * value.norm() + 1.01 * slack, name


def test_sharded_16_bit_compute_moves_the_bytes_the_plan_predicts(tmp_path):
    """``bf16-true`` with ``fp32_masters`` in the sharded mode: bf16 shards cross the links and are
    all-gathered, the gradients are widened to fp32 before the reduce-scatter and land as fp32
    shards; each rank's bytes per lane equal the simulator's for the plan's workload (the landed
    gradients priced at 4 bytes: ``LayerWork.grad_widen``), and the run trains."""
    run = launch(tmp_path, batch=2, steps=3, accum=2, policy="milp", data_parallel="shard", record_bytes=True,
                 precision="bf16-true", fp32_masters=True, same_init=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    for r in range(2):
        rows = json.loads((tmp_path / f"bytes_rank{r}.json").read_text())
        assert len(rows) == 3
        for row in rows:
            for lane in ("h2d", "d2h", "collective"):
                assert row["measured"].get(lane, 0.0) > 0, (r, row["step"], lane)
                assert row["measured"][lane] == pytest.approx(row["predicted"].get(lane, 0.0), rel=1e-9), \
                    (r, row["step"], lane, row)
    losses = outputs(tmp_path)[0]
    assert all(torch.isfinite(torch.tensor(x)).all() for x in losses)


def test_sharded_ranks_train_manual_optimization_as_one_rank_with_twice_the_batch(tmp_path):
    """Manual optimization in the sharded mode: ``manual_backward`` of every batch (each a full
    micro-batch: its gradients reduce-scattered into the host shards), manual accumulation over two
    batches, ``clip_gradients`` (the norm summed over the shard group) and ``opt.step()`` on the
    shards: equal to one rank with twice the batch to 1e-6."""
    common = dict(batch=2, steps=3, accum=2, clip=0.5, optimizer="sgd", same_init=False, manual=True)
    run = launch(tmp_path, policy="megatrain", data_parallel="shard", **common)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    losses, weights = outputs(tmp_path)
    ref = _script().train({"devices": 1, "batch": 4, "steps": 3, "accum": 2, "clip": 0.5, "strategy": "auto",
                           "optimizer": "sgd", "same_init": False, "union_of": 2, "manual": True})
    assert len(ref.losses) == 6
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():
        assert (weights[name] - value).norm() <= 1e-6 * value.norm(), name


def test_sharded_ranks_replan_on_drift_together_and_stay_exact(tmp_path):
    """Drift re-planning in the sharded mode: rank 0 decides and re-plans for all (its collectives
    priced in line in the re-profiled step), both ranks record the same re-plan, every step's bytes
    per lane still equal the simulator's for the schedule it ran, and training equals one rank with
    twice the batch to 1e-6. (A threshold of ~0 makes the first planned steps' noise the drift.)"""
    steps = 6
    common = dict(batch=2, steps=steps, optimizer="sgd", same_init=False)
    run = launch(tmp_path, policy="milp", data_parallel="shard", record_bytes=True,
                 replan={"threshold": 1e-9, "patience": 1, "max_replans": 1, "min_gain": 0.0}, **common)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    replans = [json.loads((tmp_path / f"replans_rank{r}.json").read_text()) for r in range(2)]
    assert len(replans[0]) == 1 and replans[0] == replans[1], replans
    for r in range(2):
        for row in json.loads((tmp_path / f"bytes_rank{r}.json").read_text()):
            for lane in ("h2d", "d2h", "collective"):
                assert row["measured"][lane] == pytest.approx(row["predicted"].get(lane, 0.0), rel=1e-9), (r, row)
    losses, weights = outputs(tmp_path)
    ref = _script().train({"devices": 1, "batch": 4, "steps": steps, "strategy": "auto", "optimizer": "sgd",
                           "same_init": False, "union_of": 2})
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():
        assert (weights[name] - value).norm() <= 1e-6 * value.norm(), name


def test_sharded_ranks_refuse_8_bit_states_in_a_full_checkpoint_before_the_first_step(tmp_path):
    run = launch(tmp_path, batch=2, steps=2, data_parallel="shard", optimizer="hybrid8",
                 save=str(tmp_path / "last.ckpt"), checkpoint_format="full")
    assert run.returncode != 0
    assert "checkpoint_format='full') cannot write 8-bit optimizer states" in run.stderr + run.stdout
    assert not (tmp_path / "losses_rank0.json").exists()


@pytest.mark.parametrize("fmt, optimizer", [("sharded", "sgd"), ("sharded", "hybrid8"), ("full", "hybrid")])
def test_sharded_resume_is_bit_identical_and_moves_to_one_process(tmp_path, fmt, optimizer):
    """``data_parallel="shard"``, 2 ranks resume bit-identically. ``sharded`` (the default format): each
    rank writes only its rows of every sharded tensor (``<key>@<start>:<stop>``; 8-bit states per
    rank), nothing is gathered, and the directory joins them whole for one process; ``full``: rank 0
    writes one file with every tensor gathered whole. One process (replicate: whole host state)
    resumes either as the same training (to 1e-6), except 8-bit states, blockwise over a shard:
    refused on another number of processes, before the first step, with the fix."""
    import torch.distributed.checkpoint as dcp

    from lightning_lazytrain.sharded_checkpoint import load_sharded

    b = 2
    ckpt, second_losses, _ = resume_three_ways(tmp_path, batch=b, epoch_steps=2, policy="milp", same_init=False,
                                               optimizer=optimizer, data_parallel="shard", checkpoint_format=fmt)
    ref_shapes = {k: v.shape for k, v in _script().Net({}).state_dict().items()}
    if fmt == "full":
        assert ckpt.is_file()
        saved = torch.load(ckpt, weights_only=False)
    else:
        keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
        whole_blocks = [k for k in keys if k.startswith("state_dict/model.model.layers.") and "@" not in k]
        assert whole_blocks == [], whole_blocks[:3]  # every block weight in row chunks, none whole
        assert any(k.startswith("state_dict/model.lm_head.weight@") for k in keys)
        shares = [p.stat().st_size for p in ckpt.glob("*.distcp")]
        assert len(shares) == 2 and all(0.3 < n / sum(shares) < 0.7 for n in shares), shares
        if optimizer == "hybrid8":
            assert any("#rank1" in k for k in keys)  # a state with no whole form, per rank
            with pytest.raises(ValueError, match="resumes on shard groups of 2 processes only, not 1"):
                load_sharded(ckpt)
        else:
            saved = load_sharded(ckpt)
    if optimizer != "hybrid8":
        assert {k: v.shape for k, v in saved["state_dict"].items()} == ref_shapes  # whole tensors
    # the sharded resume read each rank's rows of the model (restored after setup, into the shards),
    # not the whole model on every process; a full file is read whole
    for r in range(2):
        loaded = json.loads((tmp_path / "second" / f"loaded_shapes_rank{r}.json").read_text())
        name = "model.model.layers.0.mlp.gate_proj.weight"
        rows = ref_shapes[name][0]
        assert loaded[name] == ([-(-rows // 2), *ref_shapes[name][1:]] if fmt == "sharded" else list(ref_shapes[name]))
    opts = {"devices": 1, "batch": 2 * b, "steps": 4, "epoch_steps": 2, "strategy": "lazytrain", "policy": "milp",
            "same_init": False, "union_of": 2, "epoch": 1, "resume": str(ckpt), "optimizer": optimizer}
    if optimizer == "hybrid8":
        with pytest.raises(ValueError, match="8-bit optimizer states are blockwise"):
            _script().train(opts)
    else:
        ours = [(x + y) / 2 for x, y in zip(*second_losses)]
        torch.testing.assert_close(torch.tensor(_script().train(opts).losses), torch.tensor(ours), rtol=1e-6, atol=0.0)


def test_hybrid_sharding_two_groups_of_two_train_as_one_rank_with_four_times_the_batch(tmp_path):
    """Note: [hybrid sharding]: 4 processes, ``shard_size=2`` (2 "nodes" of 2): each pair shards the
    host state, the pairs replicate it (each shard's gradient all-reduced across them). Against one
    process with the 4 ranks' batches: losses and final weights to 1e-6 (SGD, accumulation 2, clip);
    each rank's bytes per lane (fetches of its shard, all-gathers, reduce-scatters, the replica
    all-reduce) equal the simulator's for the plan's per-rank workload; the sharded checkpoint holds
    each chunk once (the replicas' equal keys deduplicated) and joins whole in one process, equal to
    the run's final weights."""
    import torch.distributed.checkpoint as dcp

    from lightning_lazytrain.sharded_checkpoint import load_sharded

    b, steps, accum = 1, 2, 2
    ckpt = tmp_path / "last.ckpt"
    run = launch(tmp_path, timeout=420, devices=4, shard_size=2, data_parallel="shard", batch=b, steps=steps,
                 accum=accum, clip=0.5, same_init=False, record_bytes=True, save=str(ckpt))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    losses, weights = outputs(tmp_path, ranks=4)
    ref = _script().train({"devices": 1, "batch": 4 * b, "steps": steps, "accum": accum, "clip": 0.5,
                           "strategy": "auto", "same_init": False, "union_of": 4})
    torch.testing.assert_close(torch.tensor([sum(x) / 4 for x in zip(*losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():
        assert (weights[name] - value).norm() <= 1e-6 * value.norm(), name
    for r in range(4):
        for row in json.loads((tmp_path / f"bytes_rank{r}.json").read_text()):
            for lane in ("h2d", "d2h", "collective"):
                assert row["measured"][lane] == pytest.approx(row["predicted"][lane], rel=1e-9), (r, lane, row)
    keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert not [k for k in keys if k.startswith("state_dict/model.model.layers.") and "@" not in k]
    assert {k for k in keys if k.startswith("state_dict/model.lm_head.weight")} == {
        "state_dict/model.lm_head.weight@0:128", "state_dict/model.lm_head.weight@128:256"}
    saved = load_sharded(ckpt)
    for name, value in weights.items():
        assert torch.equal(saved["state_dict"][f"model.{name}"], value), name
