"""Review 23: data parallel beyond 2 ranks and across world sizes (CPU, gloo; tests/dist_review23.py is the
launched script, runs shared through tests/dist_runs.py).

PROBED. Model: review 6's tiny Llama (3 blocks, hidden 32, vocab 67) plus two non-block parameters, a scalar and a
2 x 3 matrix: with 3 ranks every sharded tensor splits unevenly (67 rows 23/23/21, 32 rows 11/11/10, the k/v
projections' 16 rows 6/6/4, the 2-row matrix 1/1/0, the scalar 1/0/0). ``policy="megatrain"``, ``replan=False``.
Reference: Lightning's DDP (``strategy="auto"``, CPU devices) on the same per-rank data, launched and resumed the
same way.

- 3 ranks, ``accumulate_grad_batches=2``, ``gradient_clip_val=0.5`` (norm; it engages: the norm is ~1.2), replicate
  and shard, SGD(momentum) / torch AdamW / HybridAdamW (fused clip);
- uneven data: 13 samples through Lightning's DistributedSampler (shuffled, padded to 15: batches 2, 2, 1 per rank);
  own data per rank of 6, 6, 5 samples with accumulation 2 (the epoch ends mid-accumulation, rank 2's last batch
  holds 1 sample) and a value clip (0.05: 330 of 27552 gradient elements cut); own data of 4, 4, 2 samples (rank 2
  has fewer batches);
- checkpoints saved by N ranks at the end of epoch 0 and resumed by M for epoch 1 (3 -> 2, 2 -> 3, 1 -> 3,
  3 -> 1; replicate and shard, sharded DCP directory): torch AdamW + a per-step LambdaLR (moments, step counts and
  the scheduler through the checkpoint); the sharded mode's ``checkpoint_format="full"`` 3 -> 2 and into
  ``strategy="auto"``; HybridAdamW 32-bit (shard 3 -> 2) and 8-bit states (replicate 3 -> 2; shard 3 -> 2);
- a checkpoint resumed in the other data-parallel mode: AdamW 32-bit with a world-size change (shard 3 ->
  replicate 2, replicate 2 -> shard 3); HybridAdamW 8-bit states at the same world size (2 -> 2, both ways);
- a 3-rank sharded-mode DCP directory read outside lazytrain (``load_sharded``) and by ``strategy="auto"``.

DEFECTS FOUND (numbered as found; all five fixed the same day, each test below failed before its fix):
1. [loud, misleading; FIXED during this review by a working-tree change to optim/checkpoint.py, Note: [states
   converted as they load], made at 12:52 by another session] test_sharded_hybrid_8bit_assignment_that_depends_on_
   the_world_size_resumes (now a passing test): ``data_parallel="shard"`` + ``HybridAdamW(eight_bit="all",
   min_8bit_numel=1024)`` compares the shard's numel with ``min_8bit_numel``, so which tensors are 8-bit depends on
   the world size (embed / lm_head 67 x 32: 736 < 1024 at 3 ranks -> 32-bit, 1088 at 2 ranks -> 8-bit); a 3-rank
   checkpoint (no 8-bit state, hence no per-process entry and no world-size check) resumed on 2 failed on every rank
   with "saved state of 'g0.p2' is 32-bit but this optimizer assigns it 8-bit: construct it with the eight_bit policy
   the checkpoint was made with" -- the same policy; the world size had changed. Now the moments are converted.
2. [loud, unclear] test_ranks_with_different_numbers_of_batches_are_refused_naming_it: own loaders
   (``use_distributed_sampler=False``) of 2, 2 and 1 batches on 3 ranks: rank 2 ends its fit as a success, ranks 0
   and 1 fail at step 2 with "the overlapped gradient all-reduce failed: RuntimeError: [.../gloo/transport/tcp/
   pair.cc:553] Connection closed by peer ... typically caused by a remote worker crashing"; in the sharded mode
   (probed by hand, timeout=40 s) all three ranks wait for the process group's timeout and fail with "Application
   timeout caused pair closure". No hang past the timeout, but nothing names the uneven batch counts or the fix
   (the DistributedSampler / the same number of batches per rank). DDP fails with the same bare gloo error.
   FIXED: every rank refuses before the first step, naming each rank's count (adapters/processes.py
   refuse_uneven_batches, from the strategy's on_train_start).
3. [doc; loud, unclear] test_readme_documents_how_to_read_a_sharded_checkpoint_outside_lazytrain: the default
   several-process checkpoint is a DCP directory at the ``.ckpt`` path; ``Trainer(strategy="auto").fit(ckpt_path=)``,
   ``LightningModule.load_from_checkpoint`` and ``torch.load`` fail on it with a bare "IsADirectoryError: [Errno 21]
   Is a directory", and the README names no way to read or convert it (``core.sharded_checkpoint.load_sharded``
   works, below; or resume on one lazytrain process, which writes one file); it says only that
   ``checkpoint_format="full"`` is what ``auto`` reads. FIXED: the README names ``load_sharded``.
4. [SILENT] test_sharded_8bit_checkpoint_resumed_in_replicate_mode_is_refused_or_keeps_the_ranks_equal: a
   ``data_parallel="shard"`` checkpoint of 2 ranks whose 8-bit HybridAdamW states include a parameter with fewer
   rows than ranks (a 1 x 300 "cls token": rank 1's shard is one padding row, the whole parameter's shape),
   resumed with ``data_parallel="replicate"`` on 2 ranks: no error; each rank loads its own shard's per-process
   state (``#rank<r>``) as the whole parameter's, so rank 1 starts from the padding row's state and the replicas
   silently diverge (after 2 steps rank 0's and rank 1's ``row`` differ by 4.9e-3 max abs; rank 0 equals the
   shard-mode resume to 8.6e-6). ``load_sharded`` checks only a per-process entry's world size, not that the
   resuming run is sharded (core/checkpoint_state.py passes ``shard=None`` in the replicate mode, and
   sharded_tensors._wanted then picks ``#rank<r>`` by the group rank). FIXED: refused by name on every rank.
5. [loud, unclear] test_8bit_checkpoint_resumed_in_the_other_mode_is_refused_naming_it: the same mode change where
   the shapes differ fails in the 8-bit state check with nothing about the mode change or a fix: shard -> replicate
   "ValueError: 8-bit state1 must be uint8 of shape (67, 32), got torch.uint8 (34, 32)"; replicate -> shard
   "ValueError: absmax1 must be float32 with 5 block scales, got torch.float32 x 9" (the whole tensor's 8-bit codes
   are cut into rows as if per element by ShardedParamStore.shard_optimizer_state, its block scales are not).
   FIXED: both directions refused naming data_parallel and the fix.

PASSING (each compares real numbers with the reference and fails if they move):
- 3 ranks, accumulation 2, norm clip, uneven shards: replicate and shard x SGD / AdamW / HybridAdamW equal DDP
  (SGD to 1e-6 replicate, measured 8e-8; 1e-5 shard, measured 7e-8; Adam to 1e-4, measured 1.4e-5 replicate,
  1.1e-5 shard), every rank's losses and final weights, the ranks' weights equal;
- the DistributedSampler over 13 samples (padding, shuffle, smaller last batch): replicate and shard equal DDP
  (AdamW, 1e-4); own data 6/6/5 with the epoch ending mid-accumulation and a value clip: DDP (1e-6 / 1e-5);
- checkpoints 3 -> 2, 2 -> 3, 1 -> 3, 3 -> 1, replicate and shard, AdamW + LambdaLR: the resumed run's losses,
  learning rates (exactly: 0.01 * 0.5**2, 0.01 * 0.5**3) and final weights equal DDP saved and resumed the same
  way (1e-4); sharded-mode ``full`` file 3 -> 2 (DDP, 1e-4) and resumed by ``strategy="auto"`` on one device (as
  DDP 3 -> 1, 1e-4); HybridAdamW 32-bit shard 3 -> 2 (1e-4); HybridAdamW 8-bit replicate 3 -> 2 (DDP, 1e-4);
  8-bit shard 3 -> 2 with 8-bit states saved: refused on both ranks before training, naming 3, 2 and the fix;
- ``load_sharded`` of the 3-rank sharded-mode directory: the model bit-equal to the run's final weights, DDP's
  checkpoint to 1e-4, the AdamW moments/steps keyed and shaped as DDP's (1e-4), the scheduler state and
  global_step equal, a strict ``load_state_dict`` into a fresh module;
- ranks with different numbers of batches: every rank ends (no hang), rank 2 with its result;
- (defect 1, fixed) the sharded 8-bit 3 -> 2 resume whose 8/32-bit assignment changes with the world size: trains,
  the ranks agree, near DDP's (losses 9.8e-5, weights 1.6e-2: another quantisation history);
- 32-bit AdamW checkpoints across a mode change and a world size change (shard 3 -> replicate 2, replicate 2 ->
  shard 3): as DDP 3 -> 2 / 2 -> 3 (1e-4).

NOTED, NOT A DEFECT: with 3 ranks the replicate mode is not bit-equal to DDP (the README claims bit-equality for 2
processes): after one SGD step 15 of 30 tensors differ by at most 3.7e-9 (the losses are equal). Dividing before the
sum, as DDP's reducer does (GradSync._average_group patched in the script, by hand), still left 19 tensors off by
~4e-9: it is the order of the ring all-reduce's sums over DDP's buckets vs lazytrain's per-group flat buffers (a sum
of 2 is commutative; of 3 it is not associative), so grad_sync.py's Note: [overlapped all-reduce] ("bit-identical
... to DDP") holds for 2 ranks only. Tested here to 1e-6.

Runtime: ~6 minutes on a busy 2-core machine (every test but the README one launches or shares 1-3 process runs,
so the module is marked slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_runs import runs_fixtures, uses_runs  # noqa: E402

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parent / "dist_review23.py"

dist_runs, runs = runs_fixtures(SCRIPT, __file__)


def result(path: Path, ranks: int) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    return ([json.loads((path / f"result_rank{r}.json").read_text()) for r in range(ranks)],
            [torch.load(path / f"weights_rank{r}.pt") for r in range(ranks)])


def errors(path: Path, ranks: int) -> list[str]:
    return [(path / f"error_rank{r}.txt").read_text() for r in range(ranks) if (path / f"error_rank{r}.txt").exists()]


def assert_no_error(path: Path, ranks: int) -> None:
    e = errors(path, ranks)
    assert not e, e[0][-3000:]


def assert_ranks_agree(path: Path, ranks: int) -> None:
    _, w = result(path, ranks)
    for r in range(1, ranks):
        bad = {k: (w[0][k] - w[r][k]).abs().max().item() for k in w[0] if not torch.equal(w[0][k], w[r][k])}
        assert not bad, ("ranks diverged", r, sorted(bad.items(), key=lambda kv: -kv[1])[:5])


def rel_diff(a: Path, b: Path, ranks: int) -> tuple[float, float]:
    """(max relative loss difference, max relative weight difference (norm)) over the ranks."""
    ra, wa = result(a, ranks)
    rb, wb = result(b, ranks)
    loss = max(abs(x - y) / abs(y) for r in range(ranks) for x, y in zip(ra[r]["losses"], rb[r]["losses"], strict=True))
    w = max(((wa[r][k] - v).norm() / (v.norm() + 1e-12)).item() for r in range(ranks) for k, v in wb[r].items())
    return loss, w


def assert_close(a: Path, b: Path, ranks: int, rel: float) -> None:
    ra, _ = result(a, ranks)
    rb, _ = result(b, ranks)
    for r in range(ranks):
        assert len(ra[r]["losses"]) == len(rb[r]["losses"]) > 0, (r, ra[r]["losses"], rb[r]["losses"])
        assert ra[r]["lrs"] == rb[r]["lrs"], (r, ra[r]["lrs"], rb[r]["lrs"])
    loss, w = rel_diff(a, b, ranks)
    assert loss <= rel and w <= rel, (loss, w)


def ddp(**o) -> dict:
    return dict(strategy="auto", **{k: v for k, v in o.items() if k not in ("data_parallel", "checkpoint_format")})


# ---- 3 ranks, accumulation 2, norm clip, uneven shards: DDP with 3 ranks -------------------------------
BASE3 = dict(devices=3, n=12, batch=2, accum=2, clip=0.5, extra_params=True)  # 6 batches a rank: 3 steps


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "hybrid"])
@pytest.mark.parametrize("data_parallel", ["replicate", "shard"])
@uses_runs(lambda data_parallel, optimizer: {
    "lazy": dict(data_parallel=data_parallel, optimizer=optimizer, catch=True, **BASE3),
    "ddp": ddp(optimizer=optimizer, **BASE3)})
def test_three_ranks_with_accumulation_clip_and_uneven_shards_is_ddp(runs, data_parallel, optimizer):
    """SGD: DDP to 1e-6 replicate (measured 8e-8: not bit-equal at 3 ranks, see the module docstring) / 1e-5 shard
    (measured 7e-8); AdamW and HybridAdamW: 1e-4 (measured 1.4e-5 replicate, 1.1e-5 shard: Adam divides the
    last-bit differences of the 3-rank sums by the gradients' own size). Losses and every rank's final weights; the
    three ranks end on the same weights."""
    assert_no_error(runs["lazy"], 3)
    assert_ranks_agree(runs["lazy"], 3)
    rel = (1e-6 if data_parallel == "replicate" else 1e-5) if optimizer == "sgd" else 1e-4
    assert_close(runs["lazy"], runs["ddp"], 3, rel)


# ---- uneven data: DistributedSampler over 13 samples, 3 ranks, drop_last=False ------------------------
UNEVEN = dict(devices=3, total=13, batch=2, clip=0.5, shuffle=True, optimizer="adamw")  # 5 a rank: 2, 2, 1


@pytest.mark.parametrize("data_parallel", ["replicate", "shard"])
@uses_runs(lambda data_parallel: {"lazy": dict(data_parallel=data_parallel, catch=True, **UNEVEN),
                                  "ddp": ddp(**UNEVEN)})
def test_three_ranks_uneven_dataset_through_the_distributed_sampler_is_ddp(runs, data_parallel):
    """Lightning's DistributedSampler pads 13 samples to 15 and shuffles with the same seed under both strategies;
    the last batch of each rank holds 1 sample (smaller than the profiled one)."""
    assert_no_error(runs["lazy"], 3)
    res, _ = result(runs["lazy"], 3)
    assert all(len(r["losses"]) == 3 for r in res), res
    assert_ranks_agree(runs["lazy"], 3)
    assert_close(runs["lazy"], runs["ddp"], 3, 1e-4)  # AdamW


# own data per rank (no sampler), 6, 6 and 5 samples, batch 2, accumulation 2: 3 batches a rank, so the epoch ends
# mid-accumulation (a last step of one micro-batch) and rank 2's last batch holds 1 sample; a value clip
ODD = dict(devices=3, n=[6, 6, 5], batch=2, accum=2, clip=0.05, clip_algorithm="value", extra_params=True)


@pytest.mark.parametrize("data_parallel", ["replicate", "shard"])
@uses_runs(lambda data_parallel: {"lazy": dict(data_parallel=data_parallel, catch=True, **ODD), "ddp": ddp(**ODD)})
def test_three_ranks_epoch_ending_mid_accumulation_with_a_smaller_last_batch_and_a_value_clip_is_ddp(runs, data_parallel):
    """SGD: DDP to 1e-6 (replicate) / 1e-5 (shard); the value clip cuts each rank's shard of the averaged gradient."""
    assert_no_error(runs["lazy"], 3)
    res, _ = result(runs["lazy"], 3)
    assert all(len(r["losses"]) == 3 for r in res), res
    assert_ranks_agree(runs["lazy"], 3)
    assert_close(runs["lazy"], runs["ddp"], 3, 1e-6 if data_parallel == "replicate" else 1e-5)


# ---- a checkpoint written with N ranks, resumed with M ----------------------------------------------
# 2 epochs of 2 steps (4 samples a rank, batch 2); the first run stops and saves at the end of epoch 0
CK = dict(n=4, batch=2, epochs=2, steps=4, clip=0.5, optimizer="adamw", sched=True, extra_params=True)


def ck_runs(a: int, b: int, **extra) -> dict[str, dict]:
    out = {}
    for name, kind in (("lazy", dict(extra)), ("ddp", ddp(**extra))):
        c = dict(CK, **kind)
        first = dict(c, devices=a, steps=2, save="epoch0.ckpt", save_every=2)
        out[f"{name}_first"] = first
        out[name] = dict(c, devices=b, resume={"run": first}, catch=True)
    return out


WORLDS = [(3, 2), (2, 3), (1, 3), (3, 1)]


@pytest.mark.parametrize("data_parallel", ["replicate", "shard"])
@pytest.mark.parametrize("a, b", WORLDS, ids=[f"{a}to{b}" for a, b in WORLDS])
@uses_runs(lambda a, b, data_parallel: ck_runs(a, b, data_parallel=data_parallel))
def test_adamw_and_scheduler_checkpoint_resumes_on_another_world_size_as_ddp(runs, a, b, data_parallel):
    """torch AdamW + a per-step LambdaLR, saved (sharded DCP directory) by ``a`` ranks at the end of epoch 0 and
    resumed by ``b`` ranks: every rank's epoch-1 losses, learning rates and final weights equal DDP's saved by ``a``
    and resumed by ``b`` (to 1e-4: AdamW divides rounding-level differences by their size)."""
    assert_no_error(runs["lazy"], b)
    assert_ranks_agree(runs["lazy"], b)
    res, _ = result(runs["lazy"], b)
    assert res[0]["lrs"] == [0.01 * 0.5 ** 2, 0.01 * 0.5 ** 3], res[0]["lrs"]  # the scheduler resumed at step 2
    assert_close(runs["lazy"], runs["ddp"], b, 1e-4)


@uses_runs(lambda: ck_runs(3, 2, data_parallel="shard", checkpoint_format="full"))
def test_sharded_mode_full_checkpoint_of_three_ranks_resumes_on_two_as_ddp(runs):
    """``checkpoint_format="full"`` in the sharded mode: rank 0 gathers every uneven shard into one file."""
    assert_no_error(runs["lazy"], 2)
    assert_close(runs["lazy"], runs["ddp"], 2, 1e-4)


@uses_runs(lambda: ck_runs(3, 2, data_parallel="shard", optimizer="hybrid"))
def test_sharded_hybrid_adamw_32bit_checkpoint_resumes_3_to_2_as_ddp(runs):
    """HybridAdamW (32-bit states, its fused clip) + the scheduler, sharded mode, 3 -> 2: each rank of 2 reads its
    rows of the 3 uneven row chunks of the moments; as DDP saved by 3 and resumed by 2 (to 1e-4)."""
    assert_no_error(runs["lazy"], 2)
    assert_ranks_agree(runs["lazy"], 2)
    assert_close(runs["lazy"], runs["ddp"], 2, 1e-4)


MODES = [(3, 2, "shard", "replicate"), (2, 3, "replicate", "shard")]


@pytest.mark.parametrize("a, b, saved, resumed", MODES, ids=[f"{a}{m}_to_{b}{n}" for a, b, m, n in MODES])
@uses_runs(lambda a, b, saved, resumed: {
    "lazy": dict(CK, devices=b, data_parallel=resumed, catch=True,
                 resume={"run": ck_runs(a, b, data_parallel=saved)["lazy_first"]}),
    "ddp": ck_runs(a, b)["ddp"]})
def test_checkpoint_resumes_in_the_other_data_parallel_mode_on_another_world_size_as_ddp(runs, a, b, saved, resumed):
    """A sharded-mode directory (row chunks) resumed in the replicate mode, and a replicate-mode directory
    (deduplicated whole tensors) resumed in the sharded mode, each on another number of processes: as DDP (1e-4)."""
    assert_no_error(runs["lazy"], b)
    assert_ranks_agree(runs["lazy"], b)
    assert_close(runs["lazy"], runs["ddp"], b, 1e-4)


def full_into_auto() -> dict[str, dict]:
    first = ck_runs(3, 2, data_parallel="shard", checkpoint_format="full")["lazy_first"]
    return {"auto": dict(CK, strategy="auto", devices=1, resume={"run": first}, catch=True),
            "ddp": ck_runs(3, 1)["ddp"]}


@uses_runs(full_into_auto)
def test_sharded_mode_full_checkpoint_of_three_ranks_resumes_under_auto(runs):
    """README: ``checkpoint_format="full"`` is readable by ``strategy="auto"``: the 3-rank sharded mode's file,
    resumed by ``strategy="auto"`` on one device, trains as DDP's 3-rank checkpoint resumed on one (to 1e-4)."""
    assert_no_error(runs["auto"], 1)
    assert_close(runs["auto"], runs["ddp"], 1, 1e-4)


H8 = dict(optimizer="hybrid8", sched=False)


@uses_runs(lambda: ck_runs(3, 2, data_parallel="replicate", **H8))
def test_replicate_hybrid_8bit_checkpoint_resumes_3_to_2_as_ddp(runs):
    """HybridAdamW 8-bit states in the replicate mode are whole on every rank: a 3-rank checkpoint resumes on 2
    as DDP's does (to 1e-4: 8-bit quantisation of rounding-level differences)."""
    assert_no_error(runs["lazy"], 2)
    assert_close(runs["lazy"], runs["ddp"], 2, 1e-4)


def lazy_only(runs: dict[str, dict]) -> dict[str, dict]:
    return {k: v for k, v in runs.items() if k.startswith("lazy")}


@uses_runs(lambda: lazy_only(ck_runs(3, 2, data_parallel="shard", **H8, min8=256)))
def test_sharded_hybrid_8bit_checkpoint_3_to_2_is_refused_naming_the_world_sizes_and_the_fix(runs):
    """Documented limit: 8-bit states are blockwise over each rank's shard; a resume on 2 of a 3-rank save (with
    8-bit states: ``min_8bit_numel=256``, every block weight's shard qualifies) is refused on every rank, before
    training, naming 3 and 2 and the fix."""
    e = errors(runs["lazy"], 2)
    assert len(e) == 2, e
    assert all("shard groups of 3 processes only, not 2" in x and "Fix:" in x for x in e), e[0]
    assert not (runs["lazy"] / "result_rank0.json").exists()


@uses_runs(lambda: {"lazy": ck_runs(3, 2, data_parallel="shard", **H8)["lazy"],
                    "ddp": ck_runs(3, 2, data_parallel="replicate", **H8)["ddp"]})
def test_sharded_hybrid_8bit_assignment_that_depends_on_the_world_size_resumes(runs):
    """``data_parallel="shard"`` + ``HybridAdamW(eight_bit="all", min_8bit_numel=1024)`` compares the *shard's*
    numel with ``min_8bit_numel``, so which tensors get 8-bit states depends on the world size (embed / lm_head
    67 x 32: 736 < 1024 at 3 ranks -> 32-bit, 1088 at 2 ranks -> 8-bit). A 3-rank checkpoint (no 8-bit state) resumed
    on 2 used to fail on every rank with "saved state of 'g0.p2' is 32-bit but this optimizer assigns it 8-bit:
    construct it with the eight_bit policy the checkpoint was made with" (the same policy; the world size changed).
    Since optim/checkpoint.py's Note: [states converted as they load] (a change made during this review) the saved
    32-bit moments are quantised as they load: the resume trains, the ranks agree, and the losses and weights stay
    near DDP's 3 -> 2 resume with whole-tensor 8-bit states (another quantisation history, and lr 1e-2 Adam steps are
    ~half a weight's size: measured 9.8e-5 losses, 1.6e-2 weights; held to 1e-3 / 5e-2)."""
    assert_no_error(runs["lazy"], 2)
    assert_ranks_agree(runs["lazy"], 2)
    ra, _ = result(runs["lazy"], 2)
    assert all(len(r["losses"]) == 2 for r in ra), ra
    loss, w = rel_diff(runs["lazy"], runs["ddp"], 2)
    assert loss <= 1e-3 and w <= 5e-2, (loss, w)


# ---- 8-bit states across a change of data-parallel mode at the same world size ----------------------------
M8 = dict(CK, devices=2, optimizer="hybrid8", sched=False, min8=256, row_param=True, extra_params=False)


def mode_change(saved: str, resumed: str, **extra) -> dict[str, dict]:
    first = dict(M8, data_parallel=saved, steps=2, save="epoch0.ckpt", save_every=2, **extra)
    return {"lazy": dict(M8, data_parallel=resumed, resume={"run": first}, catch=True, **extra)}


@uses_runs(lambda: mode_change("shard", "replicate", only_row_8bit=True))
def test_sharded_8bit_checkpoint_resumed_in_replicate_mode_is_refused_or_keeps_the_ranks_equal(runs):
    """Was DEFECT 4 (SILENT: each rank of the replicate resume read its own shard's 8-bit state as the whole
    parameter's; the replicas diverged, 4.9e-3 after 2 steps); now refused by name on every rank
    (core/sharded_checkpoint.py load_sharded: per-process states and a run that is not sharded)."""
    e = errors(runs["lazy"], 2)
    if e:
        assert all("data_parallel" in x for x in e), e
    else:
        assert_ranks_agree(runs["lazy"], 2)


@pytest.mark.parametrize("saved, resumed", [("shard", "replicate"), ("replicate", "shard")])
@uses_runs(lambda saved, resumed: mode_change(saved, resumed))
def test_8bit_checkpoint_resumed_in_the_other_mode_is_refused_naming_it(runs, saved, resumed):
    """Was DEFECT 5 (loud, unclear: "8-bit state1 must be uint8 of shape (67, 32) ..." / "absmax1 must be float32 with
    5 block scales ..."); now both directions name data_parallel and the fix (load_sharded; ShardedParamStore
    ._refuse_whole_8bit)."""
    e = errors(runs["lazy"], 2)
    assert len(e) == 2 and all("data_parallel" in x for x in e), e


# ---- ranks with different numbers of batches (use_distributed_sampler=False) ---------------------------
@pytest.fixture(scope="module")
def uneven_batches(tmp_path_factory) -> Path:
    """Launched on its own (a run meant to fail ends the processes of a shared batch): 3 ranks, own data of 4, 4
    and 2 samples, batch 2, replicate mode."""
    out = tmp_path_factory.mktemp("uneven_batches")
    opts = dict(devices=3, n=[4, 4, 2], batch=2, catch=True, timeout=60, out=str(out))
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), json.dumps([opts])], capture_output=True, text=True,
                              timeout=240, cwd=out)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: no end within {e.timeout} s")
    missing = [r for r in range(3) if not (out / f"done_rank{r}").exists()]
    assert not missing, (missing, proc.stdout[-2000:], proc.stderr[-4000:])
    return out


def test_ranks_with_different_numbers_of_batches_are_refused_naming_it(uneven_batches):
    """Rank 2 has 1 batch, ranks 0 and 1 have 2 (own data, no DistributedSampler; DDP fails the same way). Was
    DEFECT 2 (loud, unclear: ranks 0 and 1 failed at step 2 with gloo's "Connection closed by peer" while rank 2
    reported success; the sharded mode waited out the process group's timeout). Now every rank refuses before the
    first step, naming each rank's count and the fix (adapters/processes.py refuse_uneven_batches); no hang."""
    e = errors(uneven_batches, 3)
    assert len(e) == 3 and all("different numbers of batches" in x and "rank 2: 1" in x for x in e), e


# ---- a 3-rank sharded checkpoint read outside lazytrain -----------------------------------------------
@uses_runs(lambda: {"lazy_first": ck_runs(3, 2, data_parallel="shard")["lazy_first"],
                    "ddp_first": ck_runs(3, 2, data_parallel="shard")["ddp_first"]})
def test_three_rank_sharded_checkpoint_reads_whole_and_loads_into_auto(runs):
    """``load_sharded`` (one process, no process group) joins the three uneven row chunks of every tensor: the
    model equals the run's final weights bit for bit (the save was its last step) and DDP's checkpoint to 1e-4;
    the AdamW moments and step counts equal DDP's, keyed the same; the scheduler state is DDP's; the state dict
    loads strictly into a fresh module (what ``strategy="auto"`` does with it)."""
    from lightning_lazytrain.core.sharded_checkpoint import load_sharded

    ckpt = runs["lazy_first"] / "epoch0.ckpt"
    assert ckpt.is_dir()
    got = load_sharded(ckpt)
    want = torch.load(runs["ddp_first"] / "epoch0.ckpt", weights_only=False)
    _, final = result(runs["lazy_first"], 3)
    assert set(got["state_dict"]) == set(want["state_dict"]) == set(final[0])
    for k, v in got["state_dict"].items():
        assert torch.equal(v, final[0][k]), k
        assert (v - want["state_dict"][k]).norm() <= 1e-4 * want["state_dict"][k].norm() + 1e-7, k
    so, wo = got["optimizer_states"][0], want["optimizer_states"][0]
    assert set(so["state"]) == set(wo["state"]) and so["param_groups"] == wo["param_groups"]
    for i, st in wo["state"].items():
        for name, v in st.items():
            g = so["state"][i][name]
            assert g.shape == v.shape, (i, name, g.shape, v.shape)
            assert (g - v).norm() <= 1e-4 * v.norm() + 1e-9, (i, name)
    assert got["lr_schedulers"] == want["lr_schedulers"]
    assert got["global_step"] == want["global_step"] == 2
    sys.path.insert(0, str(SCRIPT.parent))
    import dist_review23

    module = dist_review23._module(dict(CK))
    module.load_state_dict(got["state_dict"], strict=True)


def test_readme_documents_how_to_read_a_sharded_checkpoint_outside_lazytrain():
    """Was DEFECT 3 (doc: a bare IsADirectoryError, no way named); the README names load_sharded."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "load_sharded" in readme or "lazytrain-convert" in readme
