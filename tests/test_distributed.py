"""Several processes (gloo, Lightning's own launcher): 2 ranks x micro-batch b train bit for bit as
Lightning's DDP does, and as 1 rank x 2b under strategy='auto' (losses and final weights, to 1e-6),
for several plans, with accumulation and clipping; a rank that fails makes every rank exit with
the error, no hang."""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_runs import Runs, runs_fixtures, uses_runs

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


@functools.cache
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


# The runs the tests assert on are shared: tests/dist_runs.py, Note: [shared runs]. Options of this
# module's own: policy "mixed" (``mixed_plan``'s file) and ``resume`` {"one_process": options}
# (dist_train.train in this process, saving its ``save``, once per session). The runs that are meant
# to fail, and the 4-process run, are launched on their own (``launch``).
_saved: dict[str, Path] = {}


def one_process_save(root: Path, opts: dict) -> Path:
    """dist_train.train(opts) in this process, once: the checkpoint it saved (under ``root``)."""
    key = json.dumps(opts, sort_keys=True)
    if key not in _saved or not _saved[key].exists():
        out = root / f"one{len(_saved)}"
        out.mkdir()
        _script().train({**opts, "save": str(out / opts["save"])})
        _saved[key] = out / opts["save"]
    return _saved[key]


def _resolve(runs: Runs, opts: dict, out: Path) -> dict:
    if opts.get("policy") == "mixed":
        opts["policy"] = mixed_plan(runs.root / "mixed_plan.json")
    dep = opts.get("resume")
    if isinstance(dep, dict):
        opts["resume"] = str(one_process_save(runs.root, dep["one_process"]))
    return opts


dist_runs, runs = runs_fixtures(SCRIPT, __file__, _resolve)


_references: dict[str, object] = {}


def reference(opts: dict):
    """dist_train.train(opts) in this process (one rank), once per configuration: the module it
    trained (tests read its losses and weights, never change them)."""
    key = json.dumps(opts, sort_keys=True)
    if key not in _references:
        _references[key] = _script().train(opts)
    return _references[key]


def two_rank_runs(policy, accum, clip, optimizer, overlap) -> dict[str, dict]:
    common = dict(batch=2, steps=3, accum=accum, clip=clip, optimizer=optimizer,
                  same_init=False)  # ranks start differently: rank 0's weights are broadcast, as DDP does
    return {"lazy": dict(policy=policy, overlap=overlap, record_bytes=True, **common),
            "ddp": dict(strategy="auto", **common)}  # Lightning's DDP


@pytest.mark.parametrize("policy, accum, clip, optimizer, overlap", [
    ("milp", 1, None, "sgd", True),
    ("milp", 2, 0.5, "sgd", True),  # planned as replicate (the MILP's overlap is for grad_accum 1)
    ("recompute_all", 2, 0.5, "hybrid", True),
    ("megatrain", 2, 0.5, "sgd", False),  # every group averaged after the backward
    ("mixed", 2, 0.5, "sgd", True),  # a host home, a recomputed boundary, internals kept on the host
])
@uses_runs(two_rank_runs)
def test_two_ranks_train_as_ddp_and_as_one_rank_with_twice_the_batch(runs, policy, accum, clip, optimizer, overlap):
    """The same training as Lightning's DDP, bit for bit; with ``overlap`` (core/grad_sync.py, Note:
    [overlapped all-reduce]) every group's all-reduce ran on the collective thread as soon as the
    group was finished (the blocks' during the backward), without, all of them after it; each rank's
    bytes per lane equal the simulator's per-rank prediction."""
    b, steps = 2, 3
    losses, weights = outputs(runs["lazy"])
    ddp_losses, ddp_weights = outputs(runs["ddp"])
    layers = _script().LAYERS
    for r in range(2):
        rows = json.loads((runs["lazy"] / f"bytes_rank{r}.json").read_text())
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

    ref = reference({"devices": 1, "batch": 2 * b, "steps": steps, "accum": accum, "clip": clip,
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


def hook_runs() -> dict[str, dict]:
    common = dict(batch=2, steps=2, accum=2, clip=0.5, same_init=False, grad_probe=True)
    return {"lazy": dict(policy="megatrain", **common), "ddp": dict(strategy="auto", **common)}


@uses_runs(hook_runs)
def test_a_hook_after_backward_sees_what_it_sees_under_ddp(runs):
    """core/grad_sync.py, Note: [one sync per step]: an ``on_after_backward`` hook makes every micro-batch
    write its gradients back; with accumulation 2 the hook still sees each rank's own gradients after
    the first micro-batch and their average after the last, as under DDP (``no_sync``), and the run
    is DDP's bit for bit."""
    probes = {k: [json.loads((runs[k] / f"probe_rank{r}.json").read_text())["rows"] for r in range(2)]
              for k in ("lazy", "ddp")}
    # the profiled micro-batch averaged nothing (held), yet the plan prices every group's all-reduce
    assert json.loads((runs["lazy"] / "probe_rank0.json").read_text())["plan_allreduce_bytes"] > 0
    for r in range(2):
        assert len(probes["lazy"][r]) == 4
        torch.testing.assert_close(torch.tensor(probes["lazy"][r]), torch.tensor(probes["ddp"][r]),
                                   rtol=1e-6, atol=0.0)
    assert probes["ddp"][0][0] != probes["ddp"][1][0]  # first micro-batch: each rank's own
    assert probes["ddp"][0][1] == probes["ddp"][1][1]  # last: the average
    losses, weights = outputs(runs["lazy"])
    ddp_losses, ddp_weights = outputs(runs["ddp"])
    assert losses == ddp_losses
    for name, value in ddp_weights.items():
        assert torch.equal(weights[name], value), name


def editing_runs() -> dict[str, dict]:
    common = dict(batch=2, steps=3, accum=2, clip=0.5, optimizer="hybrid", same_init=False, user_hooks=True)
    return {"lazy": dict(policy="megatrain", **common),
            "shard": dict(policy="recompute_all", data_parallel="shard", **common),
            "ddp": dict(strategy="auto", **common)}


@uses_runs(editing_runs)
def test_gradient_hooks_and_edits_train_as_ddp_and_sharded_as_one_rank(runs):
    """Parameter hooks and gradients edited before the step (dist_train's ``EditingNet``), with
    HybridAdamW's fused clip and accumulation: the replicate mode equals Lightning's DDP bit for bit
    (the post-accumulate hook sees each rank's own gradient, the average comes after it, the clip's
    norms are taken after the edits); the sharded mode equals one rank with twice the batch (its
    norms of edited gradients taken again over the ranks' shards)."""
    b, steps = 2, 3
    losses, weights = outputs(runs["lazy"])
    ddp_losses, ddp_weights = outputs(runs["ddp"])
    assert losses == ddp_losses
    for name, value in ddp_weights.items():
        assert torch.equal(weights[name], value), name
    shard_losses, shard_weights = outputs(runs["shard"])
    ref = reference({"devices": 1, "batch": 2 * b, "steps": steps, "accum": 2, "clip": 0.5, "strategy": "auto",
                     "optimizer": "hybrid", "same_init": False, "union_of": 2, "user_hooks": True})
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*shard_losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():  # Adam: DDP's own distance from one rank is the bound
        slack = (ddp_weights[name] - value).norm()
        assert (shard_weights[name] - value).norm() <= 1e-6 * value.norm() + 1.01 * slack, name


@uses_runs(lambda: {"run": dict(batch=2, steps=2, policy="megatrain", two_forwards=True, record_bytes=True,
                                 same_init=False)})
def test_a_second_pass_through_the_blocks_averages_after_the_backward(runs):
    """Two forwards before one backward (every block runs an ad-hoc second pass, whose gradients
    reach the host after its planned ones): the overlapped all-reduce would miss them, so the ranks
    agree to average every group after the backward in such a step; the run still equals one rank
    with twice the batch (to 1e-6)."""
    b, steps = 2, 2
    losses, weights = outputs(runs["run"])
    for r in range(2):
        rows = json.loads((runs["run"] / f"bytes_rank{r}.json").read_text())
        assert [row["overlapped"] for row in rows] == [[]] * steps
    ref = reference({"devices": 1, "batch": 2 * b, "steps": steps, "strategy": "auto", "same_init": False,
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


def resume_runs(**common) -> dict[str, dict]:
    """Two epochs of two steps on 2 ranks: uninterrupted, stopped after epoch 0 with a checkpoint, and
    resumed from it (in fresh processes)."""
    first = dict(steps=2, save="epoch0.ckpt", **common)
    return {"full": dict(steps=4, **common), "first": first, "second": dict(steps=4, resume={"run": first}, **common)}


def resume_three_ways(runs: dict[str, Path]) -> tuple[Path, list[list[float]], dict[str, torch.Tensor]]:
    """``resume_runs``: asserts the resumed run is the uninterrupted one, bit for bit (losses and
    weights). Returns the checkpoint, the resumed run's losses per rank and the final weights."""
    ckpt = runs["first"] / "epoch0.ckpt"
    full_losses, full = outputs(runs["full"])
    first_losses, _ = outputs(runs["first"])
    second_losses, resumed = outputs(runs["second"])
    for r in range(2):
        assert first_losses[r] + second_losses[r] == full_losses[r]
    for name, value in full.items():
        assert torch.equal(resumed[name], value), name
    return ckpt, second_losses, full


@pytest.mark.parametrize("fmt, optimizer", [("sharded", "sgd"), ("sharded", "hybrid8"), ("full", "sgd")])
@uses_runs(lambda fmt, optimizer: resume_runs(batch=2, epoch_steps=2, policy="milp", same_init=False,
                                              checkpoint_format=fmt, optimizer=optimizer))
def test_resume_is_bit_identical_and_a_checkpoint_moves_from_two_ranks_to_one(runs, fmt, optimizer):
    """Two epochs of two steps: 2 ranks uninterrupted; 2 ranks stopped after epoch 0 and resumed from
    the checkpoint (bit-identical); and the same checkpoint resumed by 1 rank with twice the batch
    (the same training, to 1e-6). ``sharded``: a DCP directory, each rank writing a share (with
    ``hybrid8`` HybridAdamW's uint8 states, fp32 block scales and qmaps go through it); ``full``: one
    file from rank 0."""
    b = 2
    ckpt, second_losses, full = resume_three_ways(runs)
    assert [p.name for p in ckpt.parent.iterdir() if p.name.startswith(".")] == []  # no temporaries left
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


ONE_RANK_EPOCH0 = {"devices": 1, "batch": 4, "steps": 2, "epoch_steps": 2, "strategy": "lazytrain", "policy": "milp",
                  "same_init": False, "union_of": 2, "epoch": 0, "save": "epoch0.ckpt"}


def one_to_two_runs() -> dict[str, dict]:
    # (the format and optimizer are dist_train's defaults, named: the uninterrupted run is the resume test's)
    common = dict(batch=2, epoch_steps=2, policy="milp", same_init=False, checkpoint_format="sharded", optimizer="sgd")
    return {"full": dict(steps=4, **common), "second": dict(steps=4, resume={"one_process": ONE_RANK_EPOCH0}, **common)}


@uses_runs(one_to_two_runs)
def test_a_one_rank_checkpoint_resumes_on_two_ranks(runs, dist_runs):
    """1 -> 2: one rank with twice the batch trains epoch 0 and saves (one process: the single
    verified file); two ranks resume from it and train epoch 1 as two uninterrupted ranks do (to 1e-6)."""
    ckpt = one_process_save(dist_runs.root, ONE_RANK_EPOCH0)
    assert ckpt.is_file()
    full_losses, full = outputs(runs["full"])
    second_losses, resumed = outputs(runs["second"])
    for r in range(2):
        torch.testing.assert_close(torch.tensor(second_losses[r]), torch.tensor(full_losses[r][2:]), rtol=1e-6, atol=0.0)
    for name, value in full.items():
        assert (resumed[name] - value).norm() <= 1e-6 * value.norm(), name


def test_a_writer_that_fails_mid_save_leaves_the_previous_checkpoint(tmp_path):
    """A checkpoint saved every step to one path: the first save creates it, the second replaces it,
    at the third rank 1's DCP writer writes its file and then fails. Every rank stops with that
    error (no hang), and the path holds the second save, whole (its CRCs check), with no temporary
    directory or half checkpoint next to it."""
    from lightning_lazytrain.core.sharded_checkpoint import is_sharded_checkpoint, load_sharded

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
    from lightning_lazytrain.adapters.checkpoint_io import CorruptCheckpoint

    shard = ckpt / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="__1_0.distcp.*CRC"):
        load_sharded(ckpt)


def shard_runs(policy, accum, clip, optimizer) -> dict[str, dict]:
    common = dict(batch=2, steps=3, accum=accum, clip=clip, optimizer=optimizer, same_init=False)
    runs = {"shard": dict(policy=policy, data_parallel="shard", record_bytes=True, **common)}
    if optimizer != "sgd":  # Adam divides rounding-level differences of tiny gradients by their own
        runs["ddp"] = dict(strategy="auto", **common)  # size: DDP's own distance from one rank is the bound there
    return runs


@pytest.mark.parametrize("policy, accum, clip, optimizer", [
    ("milp", 1, None, "sgd"),
    ("megatrain", 2, 0.5, "sgd"),
    ("recompute_all", 2, 0.5, "hybrid"),
    ("mixed", 2, 0.5, "sgd"),
])
@uses_runs(shard_runs)
def test_sharded_ranks_train_as_one_rank_with_twice_the_batch(runs, policy, accum, clip, optimizer):
    """``data_parallel="shard"`` (engine/shard_store.py): each rank holds half of every block's host
    masters, gradients and optimizer state; the run equals one rank with twice the batch to 1e-6 (the
    reduce-scatter averages each micro-batch, DDP each step: the same sums in another order), and each
    rank's bytes per lane equal the simulator's."""
    b, steps = 2, 3
    losses, weights = outputs(runs["shard"])
    # per step, each rank's host-link bytes (its shards: every fetch, every gradient copy) and collective
    # bytes (all-gathers and reduce-scatters) equal the simulator's for the plan's per-rank workload
    # (multi.measured_shard_workload) and the step's schedule
    for r in range(2):
        rows = json.loads((runs["shard"] / f"bytes_rank{r}.json").read_text())
        assert len(rows) == steps
        for row in rows:
            for lane in ("h2d", "d2h", "collective"):
                assert row["measured"].get(lane, 0.0) > 0, (r, row["step"], lane)
                assert row["measured"][lane] == pytest.approx(row["predicted"].get(lane, 0.0), rel=1e-9), \
                    (r, row["step"], lane, row)
    ddp_weights = outputs(runs["ddp"])[1] if optimizer != "sgd" else None
    ref = reference({"devices": 1, "batch": 2 * b, "steps": steps, "accum": accum, "clip": clip,
                     "strategy": "auto", "optimizer": optimizer, "same_init": False, "union_of": 2})
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():
        assert weights[name].shape == value.shape, name  # whole again after the run
        slack = (ddp_weights[name] - value).norm() if ddp_weights is not None else 0.0
        assert (weights[name] - value).norm() <= 1e-6 * value.norm() + 1.01 * slack, name


@uses_runs(lambda: {"run": dict(batch=2, steps=3, accum=2, policy="milp", data_parallel="shard", record_bytes=True,
                                 precision="bf16-true", fp32_masters=True, same_init=False)})
def test_sharded_16_bit_compute_moves_the_bytes_the_plan_predicts(runs):
    """``bf16-true`` with ``fp32_masters`` in the sharded mode: bf16 shards cross the links and are
    all-gathered, the gradients are widened to fp32 before the reduce-scatter and land as fp32
    shards; each rank's bytes per lane equal the simulator's for the plan's workload (the landed
    gradients priced at 4 bytes: ``LayerWork.grad_widen``), and the run trains."""
    for r in range(2):
        rows = json.loads((runs["run"] / f"bytes_rank{r}.json").read_text())
        assert len(rows) == 3
        for row in rows:
            for lane in ("h2d", "d2h", "collective"):
                assert row["measured"].get(lane, 0.0) > 0, (r, row["step"], lane)
                assert row["measured"][lane] == pytest.approx(row["predicted"].get(lane, 0.0), rel=1e-9), \
                    (r, row["step"], lane, row)
    losses = outputs(runs["run"])[0]
    assert all(torch.isfinite(torch.tensor(x)).all() for x in losses)


@uses_runs(lambda: {"run": dict(policy="megatrain", data_parallel="shard", batch=2, steps=3, accum=2, clip=0.5,
                                 optimizer="sgd", same_init=False, manual=True)})
def test_sharded_ranks_train_manual_optimization_as_one_rank_with_twice_the_batch(runs):
    """Manual optimization in the sharded mode: ``manual_backward`` of every batch (each a full
    micro-batch: its gradients reduce-scattered into the host shards), manual accumulation over two
    batches, ``clip_gradients`` (the norm summed over the shard group) and ``opt.step()`` on the
    shards: equal to one rank with twice the batch to 1e-6."""
    losses, weights = outputs(runs["run"])
    ref = reference({"devices": 1, "batch": 4, "steps": 3, "accum": 2, "clip": 0.5, "strategy": "auto",
                     "optimizer": "sgd", "same_init": False, "union_of": 2, "manual": True})
    assert len(ref.losses) == 6
    torch.testing.assert_close(torch.tensor([(x + y) / 2 for x, y in zip(*losses)]), torch.tensor(ref.losses),
                               rtol=1e-6, atol=0.0)
    for name, value in ref.model.state_dict().items():
        assert (weights[name] - value).norm() <= 1e-6 * value.norm(), name


@uses_runs(lambda: {"run": dict(policy="milp", data_parallel="shard", record_bytes=True, batch=2, steps=6,
                                 optimizer="sgd", same_init=False,
                                 replan={"threshold": 1e-9, "patience": 1, "max_replans": 1, "min_gain": 0.0})})
def test_sharded_ranks_replan_on_drift_together_and_stay_exact(runs):
    """Drift re-planning in the sharded mode: rank 0 decides and re-plans for all (its collectives
    priced in line in the re-profiled step), both ranks record the same re-plan, every step's bytes
    per lane still equal the simulator's for the schedule it ran, and training equals one rank with
    twice the batch to 1e-6. (A threshold of ~0 makes the first planned steps' noise the drift.)"""
    steps = 6
    replans = [json.loads((runs["run"] / f"replans_rank{r}.json").read_text()) for r in range(2)]
    assert len(replans[0]) == 1 and replans[0] == replans[1], replans
    for r in range(2):
        for row in json.loads((runs["run"] / f"bytes_rank{r}.json").read_text()):
            for lane in ("h2d", "d2h", "collective"):
                assert row["measured"][lane] == pytest.approx(row["predicted"].get(lane, 0.0), rel=1e-9), (r, row)
    losses, weights = outputs(runs["run"])
    ref = reference({"devices": 1, "batch": 4, "steps": steps, "strategy": "auto", "optimizer": "sgd",
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
@uses_runs(lambda fmt, optimizer: resume_runs(batch=2, epoch_steps=2, policy="milp", same_init=False, optimizer=optimizer,
                                              data_parallel="shard", checkpoint_format=fmt))
def test_sharded_resume_is_bit_identical_and_moves_to_one_process(runs, fmt, optimizer):
    """``data_parallel="shard"``, 2 ranks resume bit-identically. ``sharded`` (the default format): each
    rank writes only its rows of every sharded tensor (``<key>@<start>:<stop>``; 8-bit states per
    rank), nothing is gathered, and the directory joins them whole for one process; ``full``: rank 0
    writes one file with every tensor gathered whole. One process (replicate: whole host state)
    resumes either as the same training (to 1e-6), except 8-bit states, blockwise over a shard:
    refused on another number of processes, before the first step, with the fix."""
    import torch.distributed.checkpoint as dcp

    from lightning_lazytrain.core.sharded_checkpoint import load_sharded

    b = 2
    ckpt, second_losses, _ = resume_three_ways(runs)
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
        loaded = json.loads((runs["second"] / f"loaded_shapes_rank{r}.json").read_text())
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

    from lightning_lazytrain.core.sharded_checkpoint import load_sharded

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
