"""Review 6: data-parallel training with several processes (CPU, gloo, 2 ranks) against Lightning's DDP
(``strategy="auto"`` on 2 CPU devices) on the same per-rank data, in the cases tests/test_distributed.py
does not cover: validation between steps (also between the micro-batches of an accumulation), a last
batch smaller on one rank, an epoch that ends mid-accumulation, frozen parameters (optimizer given the
trainable ones only), HybridAdamW(updates_in_backward=True), a re-plan in the replicate mode, an NVMe
plan (spill files on every rank), hybrid sharding with shard_size=1, manual optimization in the
replicate mode, a sharded checkpoint of a run with frozen parameters resumed 2 -> 2 and 2 -> 1, and a
rank that fails in its backward or in validation (every rank must stop, bounded).

This file is also the training script: ``python test_review6_processes.py '<json list of options>'``
runs the runs one after another in the same processes (the first ``Trainer.fit`` launches rank 1,
as tests/dist_train.py does); runs are shared through tests/dist_runs.py. Each rank reads its own
data (``use_distributed_sampler=False``: rank r's samples are fixed), so both strategies see the same
batches on the same rank, whatever the sampler would do with uneven data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from dist_runs import run_each, runs_fixtures, uses_runs

SEQ = 16
LAYERS = 3
VOCAB = 67  # odd: the sharded embedding and head split 34/33 rows


def tiny_model(seed: int = 0):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def samples(rank: int, n: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + 17 + salt)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)


# ------------------------------------------------------------------------------------------------
# the training script (also imported by the tests for the one-process runs)
# ------------------------------------------------------------------------------------------------

def _module(opts: dict):
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            # rank 1 starts elsewhere: rank 0's weights are broadcast (as DDP does)
            self.model = tiny_model(5 if int(os.environ.get("LOCAL_RANK", 0)) == 1 else 0)
            self.automatic_optimization = not opts.get("manual", False)
            self.losses: list[float] = []
            self.val_losses: list[float] = []
            self.val_synced: list[float] = []
            self.nvme_bytes = 0.0
            if opts.get("extra_params"):  # non-block parameters of 0 dims and of 1 row (fewer rows than ranks)
                self.temp = torch.nn.Parameter(torch.tensor(1.0))
                self.shift = torch.nn.Parameter(torch.zeros(1, 3))
            for pattern in opts.get("freeze", []):
                for name, p in self.model.named_parameters():
                    if pattern in name:
                        p.requires_grad_(False)
            fail = opts.get("fail_hook")
            if fail is not None:
                def hook(g):
                    if self.global_rank == fail["rank"] and self.trainer.global_step == fail["step"]:
                        raise RuntimeError(f"injected backward failure on rank {self.global_rank}")
                    return g

                self.model.model.layers[1].mlp.down_proj.weight.register_hook(hook)

        # data: each rank its own samples (fixed), the same under both strategies
        def _rank_data(self, n_list, salt=0):
            return samples(self.global_rank, n_list[self.global_rank] if isinstance(n_list, list) else n_list, salt)

        def train_dataloader(self):
            if "union" in opts:  # one process: per step the concatenation of the ranks' batches
                w, b = opts["union"], opts["batch"] // opts["union"]
                per = [samples(r, opts["n"], 0) for r in range(w)]
                tokens = torch.cat([per[r][k * b:(k + 1) * b] for k in range(opts["n"] // b) for r in range(w)])
            else:
                tokens = self._rank_data(opts["n"])
            return torch.utils.data.DataLoader(tokens, batch_size=opts["batch"])

        def val_dataloader(self):
            return torch.utils.data.DataLoader(self._rank_data(4, salt=99), batch_size=2)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            if opts.get("extra_params"):
                loss = loss * self.temp + (self.shift * batch[:, :3].float().mean(0)).sum() * 1e-3
            self.losses.append(loss.item())
            if not self.automatic_optimization:
                opt, accum = self.optimizers(), opts.get("accum", 1)
                self.manual_backward(loss / accum)
                if (batch_idx + 1) % accum == 0:
                    if opts.get("clip"):
                        self.clip_gradients(opt, gradient_clip_val=opts["clip"], gradient_clip_algorithm="norm")
                    opt.step()
                    opt.zero_grad()
                return None
            return loss

        def validation_step(self, batch, batch_idx):
            if self.global_rank == opts.get("fail_val", -1):
                raise RuntimeError(f"injected validation failure on rank {self.global_rank}")
            loss = self.model(input_ids=batch, labels=batch).loss
            self.val_losses.append(loss.item())
            self.log("val_loss", loss, sync_dist=True)

        def on_validation_end(self):
            if "val_loss" in self.trainer.callback_metrics:
                self.val_synced.append(float(self.trainer.callback_metrics["val_loss"]))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            stats = getattr(self.trainer.strategy, "last_stats", None)
            if stats is not None:
                self.nvme_bytes += float(stats.lane_bytes.get("nvme_write", 0.0))

        def configure_optimizers(self):
            if self.global_rank == opts.get("fail_setup", -1):
                raise RuntimeError(f"injected setup failure on rank {self.global_rank}")
            params = [p for p in self.parameters() if p.requires_grad]
            kind = opts.get("optimizer", "sgd")
            if kind.startswith("hybrid"):
                from lightning_lazytrain.optim import HybridAdamW

                if kind == "hybrid_uib":
                    return HybridAdamW(params, lr=1e-3, updates_in_backward=True, max_grad_norm=None,
                                       skip_nonfinite=False)
                return HybridAdamW(params, lr=1e-3)
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    return Net()


def nvme_plan(path: Path) -> str:
    from lightning_lazytrain.planner import Schedule

    s = Schedule(num_layers=LAYERS, homes=("gpu", "nvme", "gpu", "gpu"), keep_internals=(False,) * LAYERS,
                 resident_weights=(False,) * LAYERS, offload_window=(None, 1, None, None),
                 reload_window=(None, 2, None, None))
    path.write_text(json.dumps({"schedule": s.to_json()}))
    return str(path)


def train(opts: dict):
    import lightning as L

    torch.set_num_threads(1)
    out = Path(opts["out"])
    devices = opts.get("devices", 2)
    if opts.get("strategy", "lazytrain") == "lazytrain":
        from lightning_lazytrain.strategy import LazyTrainStrategy

        policy = opts.get("policy", "megatrain")
        kw = {}
        if policy == "nvme":
            policy = nvme_plan(out / f"plan_{os.environ.get('LOCAL_RANK', '0')}.json")
            kw["nvme_dir"] = str(out / "spill")
            (out / "spill").mkdir(exist_ok=True)
        strategy = LazyTrainStrategy(policy=policy, timeout=timedelta(seconds=opts.get("timeout", 60)),
                                     overlap_grad_sync=opts.get("overlap", True),
                                     data_parallel=opts.get("data_parallel", "replicate"),
                                     shard_size=opts.get("shard_size"), replan=opts.get("replan", True),
                                     checkpoint_format=opts.get("checkpoint_format", "sharded"), **kw)
    else:
        strategy = "auto"
    module = _module(opts)
    callbacks = []
    if opts.get("save"):
        from lightning.pytorch.callbacks import ModelCheckpoint

        path = opts["save"]
        callbacks.append(ModelCheckpoint(dirpath=os.path.dirname(path), filename=os.path.basename(path)[:-5],
                                         every_n_train_steps=opts["save_every"], save_top_k=-1,
                                         enable_version_counter=False))
    val = opts.get("val_every")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=opts.get("steps", -1),
                        max_epochs=opts.get("epochs", 1), callbacks=callbacks,
                        accumulate_grad_batches=1 if opts.get("manual") else opts.get("accum", 1),
                        gradient_clip_val=None if opts.get("manual") else opts.get("clip"), logger=False,
                        gradient_clip_algorithm=opts.get("clip_algorithm", "norm"),
                        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=2 if val or opts.get("validate_after") else 0,
                        val_check_interval=val, check_val_every_n_epoch=1 if val else None, deterministic=True,
                        use_distributed_sampler=False)
    trainer.fit(module, ckpt_path=opts.get("resume"))
    if opts.get("validate_after"):  # evaluation after the fit, on the trained weights
        trainer.validate(module, verbose=False)
    module.replans = list(getattr(trainer.strategy, "replans", []) or [])
    return module


def run(opts: dict) -> None:
    module = train(opts)
    out = Path(opts["out"])
    rank = module.global_rank
    (out / f"result_rank{rank}.json").write_text(json.dumps({
        "losses": module.losses, "val_losses": module.val_losses, "val_synced": module.val_synced,
        "replans": [repr(r) for r in module.replans], "nvme_bytes": module.nvme_bytes}))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.model.state_dict().items()}, out / "weights.pt")
    (out / f"done_rank{rank}").write_text("")


def main() -> None:
    run_each("review6", run)  # tests/dist_runs.py, Note: [shared runs]


if __name__ == "__main__":
    main()
    sys.exit(0)

# ------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------

import pytest  # noqa: E402

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)


pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve()

dist_runs, runs = runs_fixtures(SCRIPT, __file__)


def result(path: Path, ranks: int = 2) -> tuple[list[dict], dict[str, torch.Tensor]]:
    return ([json.loads((path / f"result_rank{r}.json").read_text()) for r in range(ranks)],
            torch.load(path / "weights.pt"))


def assert_bitwise(a: Path, b: Path, *, val: bool = False) -> None:
    ra, wa = result(a)
    rb, wb = result(b)
    for r in range(2):
        assert ra[r]["losses"] == rb[r]["losses"], (r, ra[r]["losses"], rb[r]["losses"])
        if val:
            assert ra[r]["val_losses"] == rb[r]["val_losses"], r
            assert ra[r]["val_synced"] == rb[r]["val_synced"], r
    bad = [k for k in wb if not torch.equal(wa[k], wb[k])]
    assert not bad, (bad[:5], max((wa[k] - wb[k]).abs().max().item() for k in bad))


def assert_close(a: Path, b: Path, rel: float = 1e-5, *, val: bool = False) -> None:
    ra, wa = result(a)
    rb, wb = result(b)
    for r in range(2):
        torch.testing.assert_close(torch.tensor(ra[r]["losses"]), torch.tensor(rb[r]["losses"]), rtol=rel, atol=0.0)
        if val:
            torch.testing.assert_close(torch.tensor(ra[r]["val_losses"]), torch.tensor(rb[r]["val_losses"]),
                                       rtol=rel, atol=0.0)
    for k, v in wb.items():
        assert wa[k].shape == v.shape, k
        assert (wa[k] - v).norm() <= rel * v.norm() + 1e-7, (k, (wa[k] - v).norm().item(), v.norm().item())


def trio(**common) -> dict[str, dict]:
    return {"overlap": dict(overlap=True, **common), "serial": dict(overlap=False, **common),
            "shard": dict(data_parallel="shard", **common), "ddp": dict(strategy="auto", **common)}


# ---- validation between steps, and between the micro-batches of an accumulation ----------------
VAL = dict(n=16, batch=2, accum=2, clip=0.5, val_every=3, policy="megatrain")


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@uses_runs(lambda mode: {k: v for k, v in trio(**VAL).items() if k in (mode, "ddp")})
def test_validation_mid_accumulation_replicate_is_ddp_bit_for_bit(runs, mode):
    """val_check_interval=3 with accumulate_grad_batches=2: validation runs after batch 3 (between the
    two micro-batches of step 2) and after batch 6; training losses, validation losses (per rank and
    the synced logged value) and final weights equal DDP's bit for bit."""
    res, _ = result(runs[mode])
    assert len(res[0]["val_losses"]) == 4 and len(res[0]["losses"]) == 8
    assert_bitwise(runs[mode], runs["ddp"], val=True)


@uses_runs(lambda: {k: v for k, v in trio(**VAL).items() if k in ("shard", "ddp")})
def test_validation_mid_accumulation_shard_is_ddp_to_1e5(runs):
    assert_close(runs["shard"], runs["ddp"], val=True)


# ---- a last batch smaller on one rank -----------------------------------------------------------
UNEVEN = dict(n=[5, 6], batch=2, clip=0.5, policy="megatrain")


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@uses_runs(lambda mode: {k: v for k, v in trio(**UNEVEN).items() if k in (mode, "ddp")})
def test_last_batch_smaller_on_one_rank_replicate_is_ddp(runs, mode):
    """Rank 0's third batch has 1 sample, rank 1's has 2: DDP averages the ranks' mean gradients; so
    must the replicate mode, bit for bit."""
    assert_bitwise(runs[mode], runs["ddp"])


@uses_runs(lambda: {k: v for k, v in trio(**UNEVEN).items() if k in ("shard", "ddp")})
def test_last_batch_smaller_on_one_rank_shard_is_ddp(runs):
    assert_close(runs["shard"], runs["ddp"])


# ---- an epoch that ends mid-accumulation (Lightning steps on the partial accumulation) -----------
PARTIAL = dict(n=10, batch=2, accum=2, clip=0.5, epochs=2, policy="megatrain")


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@uses_runs(lambda mode: {k: v for k, v in trio(**PARTIAL).items() if k in (mode, "ddp")})
def test_epoch_ending_mid_accumulation_replicate_is_ddp(runs, mode):
    """5 batches per epoch, accumulation 2: steps after batches 2, 4 and 5 (a one-batch step), twice."""
    res, _ = result(runs[mode])
    assert len(res[0]["losses"]) == 10
    assert_bitwise(runs[mode], runs["ddp"])


@uses_runs(lambda: {k: v for k, v in trio(**PARTIAL).items() if k in ("shard", "ddp")})
def test_epoch_ending_mid_accumulation_shard_is_ddp(runs):
    assert_close(runs["shard"], runs["ddp"])


# ---- frozen parameters (LoRA-like: the optimizer gets the trainable ones only) ------------------
FROZEN = dict(n=8, batch=2, accum=2, clip=0.5, policy="megatrain",
              freeze=["embed_tokens", "layers.0.", "layers.1.self_attn", "norm.weight"])


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@uses_runs(lambda mode: {k: v for k, v in trio(**FROZEN).items() if k in (mode, "ddp")})
def test_frozen_parameters_replicate_is_ddp(runs, mode):
    _, w = result(runs[mode])
    _, w0 = result(runs["ddp"])
    init = tiny_model(0).state_dict()
    assert torch.equal(w["model.embed_tokens.weight"], init["model.embed_tokens.weight"])
    assert not torch.equal(w["model.layers.2.mlp.up_proj.weight"], init["model.layers.2.mlp.up_proj.weight"])
    assert_bitwise(runs[mode], runs["ddp"])


@uses_runs(lambda: {k: v for k, v in trio(**FROZEN).items() if k in ("shard", "ddp")})
def test_frozen_parameters_shard_is_ddp(runs):
    assert_close(runs["shard"], runs["ddp"])


# ---- HybridAdamW(updates_in_backward=True) ------------------------------------------------------
UIB = dict(n=8, batch=2, accum=2, optimizer="hybrid_uib", policy="megatrain")


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@uses_runs(lambda mode: {k: v for k, v in trio(**UIB).items() if k in (mode, "ddp")})
def test_updates_in_backward_replicate_is_ddp(runs, mode):
    """Blocks updated during the backward must wait for their group's average: DDP's result bit for bit."""
    assert_bitwise(runs[mode], runs["ddp"])


@uses_runs(lambda: {k: v for k, v in trio(**UIB).items() if k in ("shard", "ddp")})
def test_updates_in_backward_shard_is_ddp(runs):
    assert_close(runs["shard"], runs["ddp"], rel=1e-4)  # Adam: rounding-level gradient differences grow


# ---- a re-plan mid-run in the replicate mode ----------------------------------------------------
REPLAN = dict(n=12, batch=2, policy="milp", replan={"threshold": 1e-9, "patience": 1, "max_replans": 1,
                                                    "min_gain": 0.0})


@uses_runs(lambda: {"overlap": dict(overlap=True, **REPLAN), "ddp": dict(strategy="auto", **REPLAN)})
def test_replicate_replan_happens_on_both_ranks_and_stays_ddp(runs):
    res, _ = result(runs["overlap"])
    assert len(res[0]["replans"]) == 1 and res[0]["replans"] == res[1]["replans"], res[0]["replans"]
    assert_bitwise(runs["overlap"], runs["ddp"])


# ---- an NVMe plan with two processes: spill files on every rank, gone after the fit -------------
NVME = dict(n=8, batch=2, accum=2, clip=0.5, policy="nvme")


@uses_runs(lambda: {"overlap": dict(overlap=True, **NVME), "ddp": dict(strategy="auto", **NVME)})
def test_nvme_plan_two_ranks_is_ddp_and_spill_dirs_go(runs):
    res, _ = result(runs["overlap"])
    assert all(r["nvme_bytes"] > 0 for r in res), [r["nvme_bytes"] for r in res]
    assert sorted(p.name for p in (runs["overlap"] / "spill").iterdir()) == []
    assert_bitwise(runs["overlap"], runs["ddp"])


# ---- hybrid sharding, one process per shard group (2 replicas of 1) -----------------------------
HYB = dict(n=8, batch=2, accum=2, clip=0.5, policy="megatrain")


@uses_runs(lambda: {"hyb": dict(data_parallel="shard", shard_size=1, **HYB), "ddp": dict(strategy="auto", **HYB)})
def test_shard_size_one_is_ddp(runs):
    assert_close(runs["hyb"], runs["ddp"])


# ---- manual optimization in the replicate mode --------------------------------------------------
MANUAL = dict(n=8, batch=2, accum=2, clip=0.5, manual=True, policy="megatrain")


@uses_runs(lambda: {"rep": dict(**MANUAL), "ddp": dict(strategy="auto", **MANUAL)})
def test_manual_optimization_replicate_is_ddp(runs):
    # DDP averages the accumulated .grad at each manual_backward: the same sums in another order
    assert_close(runs["rep"], runs["ddp"], rel=1e-6)


# ---- a sharded checkpoint of a run with frozen parameters: 2 -> 2 and 2 -> 1 ---------------------
CK = dict(n=4, batch=2, epochs=2, steps=4, policy="megatrain", freeze=["layers.0.", "embed_tokens"])


def ck_runs(dp: str, optimizer: str) -> dict[str, dict]:
    c = dict(CK, data_parallel=dp, optimizer=optimizer)
    first = dict(save="epoch0.ckpt", save_every=2, **{**c, "steps": 2})
    return {"full": c, "first": first, "second": dict(resume={"run": first}, **c)}


@pytest.mark.parametrize("dp, optimizer", [("replicate", "sgd"), ("shard", "sgd"), ("shard", "hybrid")])
@uses_runs(ck_runs)
def test_checkpoint_with_frozen_parameters_resumes_2_to_2_and_2_to_1(runs, dp, optimizer, tmp_path):
    full, wf = result(runs["full"])
    first, _ = result(runs["first"])
    second, ws = result(runs["second"])
    for r in range(2):
        assert first[r]["losses"] + second[r]["losses"] == full[r]["losses"], r
    for k, v in wf.items():
        assert torch.equal(ws[k], v), k
    # 2 -> 1: one process with both ranks' batches resumes the same checkpoint (to 1e-6)
    ckpt = runs["first"] / "epoch0.ckpt"
    os.chdir(tmp_path)
    one = train({**CK, "out": str(tmp_path), "devices": 1, "batch": 4, "union": 2, "resume": str(ckpt),
                 "optimizer": optimizer})
    ours = [(x + y) / 2 for x, y in zip(second[0]["losses"], second[1]["losses"])]
    torch.testing.assert_close(torch.tensor(one.losses), torch.tensor(ours), rtol=1e-6, atol=0.0)
    rel = 1e-6 if optimizer == "sgd" else 1e-4  # Adam: rounding-level gradient differences grow
    for k, v in one.model.state_dict().items():
        assert (wf[k] - v).norm() <= rel * v.norm() + 1e-8, k


# ---- gradient_clip_algorithm="value" across ranks -------------------------------------------------
VCLIP = dict(n=8, batch=2, accum=2, clip=0.02, clip_algorithm="value", policy="megatrain")


@pytest.mark.parametrize("mode", ["overlap", "serial"])
@uses_runs(lambda mode: {k: v for k, v in trio(**VCLIP).items() if k in (mode, "ddp")})
def test_value_clipping_replicate_is_ddp(runs, mode):
    assert_bitwise(runs[mode], runs["ddp"])


@uses_runs(lambda: {k: v for k, v in trio(**VCLIP).items() if k in ("shard", "ddp")})
def test_value_clipping_shard_is_ddp(runs):
    assert_close(runs["shard"], runs["ddp"])


# ---- non-block parameters of 0 dims and of 1 row (fewer rows than ranks) -------------------------
EXTRA = dict(n=8, batch=2, accum=2, clip=0.5, extra_params=True, policy="megatrain")


@uses_runs(lambda: {k: v for k, v in trio(**EXTRA).items() if k in ("overlap", "ddp")})
def test_scalar_and_one_row_parameters_replicate_is_ddp(runs):
    assert_bitwise(runs["overlap"], runs["ddp"])


@uses_runs(lambda: {k: v for k, v in trio(**EXTRA).items() if k in ("shard", "ddp")})
def test_scalar_and_one_row_parameters_shard_is_ddp(runs):
    assert_close(runs["shard"], runs["ddp"])


# ---- trainer.validate after the fit --------------------------------------------------------------
AFTER = dict(n=8, batch=2, steps=2, validate_after=True, policy="megatrain")


@uses_runs(lambda: {k: v for k, v in trio(**AFTER).items() if k in ("overlap", "shard", "ddp")})
def test_validate_after_fit_is_ddp(runs):
    res, _ = result(runs["overlap"])
    assert len(res[0]["val_losses"]) == 2 and len(res[0]["losses"]) == 2 and len(res[0]["val_synced"]) == 1
    assert_bitwise(runs["overlap"], runs["ddp"], val=True)
    assert_close(runs["shard"], runs["ddp"], val=True)


# ---- a re-plan with accumulation ---------------------------------------------------------------
@uses_runs(lambda: {"overlap": dict(overlap=True, accum=2, clip=0.5, **{**REPLAN, "n": 16}),
                    "ddp": dict(strategy="auto", accum=2, clip=0.5, **{**REPLAN, "n": 16})})
def test_replicate_replan_with_accumulation_stays_ddp(runs):
    res, _ = result(runs["overlap"])
    assert res[0]["replans"] == res[1]["replans"], res
    assert_bitwise(runs["overlap"], runs["ddp"])


# ---- a rank that fails: every rank stops, bounded ------------------------------------------------
def launch(tmp_path: Path, limit: float, **opts) -> tuple[subprocess.CompletedProcess | None, float, str]:
    opts = {"out": str(tmp_path), "devices": 2, **opts}
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, str(SCRIPT), json.dumps([opts])], capture_output=True, text=True,
                           timeout=limit, cwd=tmp_path)
        return p, time.monotonic() - t0, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, time.monotonic() - t0, text


def _no_live_rank(tmp_path: Path) -> bool:
    """No process of ours still runs the script in tmp_path (a rank left hanging)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return not [line for line in out.splitlines() if str(tmp_path) in line and SCRIPT.name in line]


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_a_rank_failing_in_its_backward_stops_every_rank(tmp_path, fail_rank):
    """The failure is raised by a gradient hook in the middle of step 1's backward (the collective
    thread of the other rank has all-reduces in flight). Every rank stops with the error within the
    strategy's timeout (20 s) plus start-up; no rank is left running; spill directories are gone or
    removable as stale (no live owner)."""
    from lightning_lazytrain.engine.nvme import remove_stale_spill_dirs

    proc, took, text = launch(tmp_path, 150, n=8, batch=2, policy="nvme", timeout=20,
                              fail_hook={"rank": fail_rank, "step": 1})
    try:
        assert proc is not None, f"hung: killed after {took:.0f} s\n{text[-3000:]}"
        assert proc.returncode != 0
        assert f"injected backward failure on rank {fail_rank}" in text
        time.sleep(1)
        assert _no_live_rank(tmp_path)
        remove_stale_spill_dirs(tmp_path / "spill")
        assert [p.name for p in (tmp_path / "spill").iterdir()] == []
    finally:
        if not _no_live_rank(tmp_path):
            out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                if str(tmp_path) in line and SCRIPT.name in line:
                    os.kill(int(line.split()[0]), 9)


@pytest.mark.parametrize("where", ["validation", "setup"])
def test_a_rank_failing_in_validation_or_setup_stops_every_rank(tmp_path, where):
    """Rank 1 raises in validation_step (after a step) or in configure_optimizers (before the plan's
    broadcast: rank 0 waits for its profile)."""
    extra = dict(val_every=2, fail_val=1) if where == "validation" else dict(fail_setup=1)
    proc, took, text = launch(tmp_path, 150, n=8, batch=2, policy="milp", timeout=20, **extra)
    try:
        assert proc is not None, f"hung: killed after {took:.0f} s\n{text[-3000:]}"
        assert proc.returncode != 0
        assert f"injected {where} failure on rank 1" in text
        time.sleep(1)
        assert _no_live_rank(tmp_path)
    finally:
        if not _no_live_rank(tmp_path):
            out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            for line in out.splitlines():
                if str(tmp_path) in line and SCRIPT.name in line:
                    os.kill(int(line.split()[0]), 9)
