"""A training script for the data-parallel tests (``tests/test_distributed.py``): run as
``python tests/dist_train.py '<json options>'`` (or a JSON list of options: the runs one after another in
the same processes, see ``main``); Lightning's launcher starts the other ranks by running this same
command. Each rank writes its per-step losses; rank 0 writes the final weights.

Options: out (directory), devices, batch, steps, accum, clip, policy, strategy ("lazytrain" or
"auto"), fail_rank / fail_step (raise there), optimizer ("sgd", "hybrid" or "hybrid8": HybridAdamW
with 8-bit states), epoch_steps (steps per epoch), save / resume (checkpoint paths; save_every:
steps between saves, default steps), checkpoint_format ("sharded" or "full"), fail_save_rank /
fail_save_at (that rank's DCP writer writes its files, then fails, at that save, 1-based),
record_bytes (each rank writes bytes_rank{r}.json: per step the executor's and GradSync's bytes per
lane and the simulator's per-rank prediction for the schedule that step ran, and the groups whose
all-reduce overlapped the backward), union_of / epoch (one process sees, per batch, the union of
what union_of ranks see in that epoch), overlap (LazyTrainStrategy's overlap_grad_sync, default
true), two_forwards (the loss is the mean of two forwards, the second on the reversed sequences:
every block runs twice before the backward), data_parallel ("replicate" or "shard": LazyTrainStrategy's),
shard_size (LazyTrainStrategy's: processes per shard group), manual (manual optimization: the
module accumulates ``accum`` batches itself with ``manual_backward``, clips with ``clip_gradients``
and steps; the Trainer gets neither accumulation nor a clip value), replan (LazyTrainStrategy's; each
rank writes replans_rank{r}.json when it re-planned), precision (the Trainer's), fp32_masters (LazyTrainStrategy's), grad_probe (each rank writes probe_rank{r}.json: per
backward, the gradient norms an ``on_after_backward`` hook saw, and the all-reduce bytes the plan priced), user_hooks
(``EditingNet``: parameter hooks and an ``on_after_backward`` that edit gradients). A resuming rank writes loaded_shapes_rank{r}.json:
the shapes of the model tensors its checkpoint load returned.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import lightning as L
import torch
from dist_runs import run_each
from models import tiny_llama

LAYERS = 4
SEQ = 32


class Net(L.LightningModule):
    def __init__(self, opts: dict):
        super().__init__()
        self.model = tiny_llama(0 if opts.get("same_init", True) else 1000 + int(os.environ.get("LOCAL_RANK", 0)),
                                layers=LAYERS)
        self.opts = opts
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        o = self.opts
        if self.global_rank == o.get("fail_rank", -1) and batch_idx == o.get("fail_step", -1):
            raise RuntimeError(f"injected failure on rank {self.global_rank} at batch {batch_idx}")
        loss = self.model(input_ids=batch, labels=batch).loss
        if o.get("two_forwards"):
            flipped = batch.flip(1)
            loss = (loss + self.model(input_ids=flipped, labels=flipped).loss) / 2
        self.losses.append(loss.item())
        if os.environ.get("DIST_DEBUG"):
            print("DEBUG", self.global_rank, batch_idx, batch[:, 0].tolist(), loss.item(), flush=True)
        return loss

    def on_load_checkpoint(self, checkpoint):  # what a resume read: whole tensors or this rank's rows
        self.loaded_shapes = {k: list(v.shape) for k, v in checkpoint["state_dict"].items()}

    def configure_optimizers(self):
        if self.opts.get("optimizer", "sgd") in ("hybrid", "hybrid8"):
            from lightning_lazytrain.optim import HybridAdamW

            if self.opts["optimizer"] == "hybrid8":
                return HybridAdamW(self.parameters(), lr=1e-3, eight_bit="all", min_8bit_numel=1024)
            return HybridAdamW(self.parameters(), lr=1e-3)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ManualNet(Net):
    """Manual optimization: ``accum`` batches per optimizer step, clipped with ``clip_gradients``."""

    def __init__(self, opts: dict):
        super().__init__(opts)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        o, opt = self.opts, self.optimizers()
        accum = o.get("accum", 1)
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.item())
        self.manual_backward(loss / accum)
        if (batch_idx + 1) % accum == 0:
            if o.get("clip"):
                self.clip_gradients(opt, gradient_clip_val=o["clip"], gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


class EditingNet(Net):
    """``user_hooks``: the user touches gradients as in the exactness conformance tests: a
    ``register_hook`` on a block weight (doubles its gradient), a ``register_post_accumulate_grad_hook``
    on the embedding (halves its accumulated ``.grad`` in place) and ``on_after_backward`` scaling
    another block weight's gradient by 3 (all linear, so a sharded run still equals one rank with
    twice the batch)."""

    def __init__(self, opts: dict):
        super().__init__(opts)
        layers = self.model.model.layers
        layers[1].mlp.down_proj.weight.register_hook(lambda g: g * 2.0)
        def halve(p):
            p.grad.mul_(0.5)

        self.model.model.embed_tokens.weight.register_post_accumulate_grad_hook(halve)

    def on_after_backward(self):
        self.model.model.layers[2].mlp.up_proj.weight.grad.mul_(3.0)


class RecordBytes(L.Callback):
    """Per optimizer step: the bytes per lane the rank moved (executor + GradSync) and what the
    simulator predicts for one rank of a ``replicate`` run with the schedule that step ran."""

    def __init__(self, accum: int):
        self.accum = accum
        self.rows: list[dict] = []
        self._schedule = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # the schedule of the batch whose stats are recorded: a step's (switched at a step's end) or,
        # with full micro-batches (the executor's step is the micro-batch, planned as one), the last one's
        self._schedule = trainer.strategy.executor.schedule

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % self.accum:
            return
        strategy = trainer.strategy
        sync = strategy.grad_sync
        self.rows.append({"step": trainer.global_step, "policy": self._schedule.policy,
                          "overlapped": list(sync.overlapped) if sync is not None else [],
                          "measured": {k: float(v) for k, v in strategy.last_stats.lane_bytes.items()},
                          "predicted": predicted_lane_bytes(strategy, self._schedule, trainer.world_size)})


class GradProbe(L.Callback):
    """After every backward (so under lazytrain every micro-batch's gradients reach the host): the
    norms of a block weight's and the head's gradients as the hook sees them."""

    def __init__(self):
        self.rows: list[list[float]] = []
        self.plan_allreduce_bytes = 0.0  # what the plan priced on the collective lane (lazytrain)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        plan = getattr(trainer.strategy, "plan", None)
        if plan is not None:
            wl = plan.result.workload
            self.plan_allreduce_bytes = sum(x.allreduce_bytes for x in wl.layers) + wl.nonblock_allreduce_bytes

    def on_after_backward(self, trainer, pl_module):
        model = pl_module.model
        self.rows.append([model.model.layers[1].mlp.down_proj.weight.grad.double().norm().item(),
                          model.lm_head.weight.grad.double().norm().item()])


def predicted_lane_bytes(strategy, schedule, world: int) -> dict[str, float]:
    """The simulator's bytes per lane for one rank: the plan's measured workload and hardware as a
    node of ``world`` ranks in replicate mode (``planner.multi``), ``schedule`` in that mode (shard
    mode: the plan's own per-rank workload, ``schedule`` in shard mode)."""
    from dataclasses import replace

    from lightning_lazytrain.planner import simulate
    from lightning_lazytrain.planner.multi import rank_hardware, rank_workload

    res = strategy.plan.result
    if strategy.data_parallel == "shard":  # the plan's workload is already the rank's (multi.measured_shard_workload)
        assert res.workload.data_parallel == "shard"
        return dict(simulate(replace(schedule, data_parallel="shard"), res.workload, res.hardware,
                             check=False).lane_bytes)
    hw = res.hardware.replace(gpus_per_node=world, intra_node_bytes_per_s=1e9, host_collective_bytes_per_s=1e9)
    wl = rank_workload(res.workload, hw, "replicate")
    sim = simulate(replace(schedule, data_parallel="replicate"), wl, rank_hardware(hw), check=False)
    return dict(sim.lane_bytes)


def inject_save_failure(rank: int, at: int) -> None:
    """This rank's DCP writer fails at its ``at``-th save, after writing its files (a half checkpoint
    on disk, as a writer that dies midway leaves)."""
    from torch.distributed.checkpoint import FileSystemWriter

    real = FileSystemWriter.write_data
    calls = [0]

    def write_data(self, plan, planner):
        fut = real(self, plan, planner)
        if int(os.environ.get("LOCAL_RANK", 0)) == rank:
            calls[0] += 1
            if calls[0] == at:
                fut.wait()
                raise OSError(f"injected writer failure on rank {rank} at save {at}")
        return fut

    FileSystemWriter.write_data = write_data


def data(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (n, SEQ), generator=g)


def train(opts: dict) -> Net:
    torch.set_num_threads(1)
    devices, batch = opts.get("devices", 2), opts["batch"]
    steps, accum = opts.get("steps", 3), opts.get("accum", 1)
    if opts.get("strategy", "lazytrain") == "lazytrain":
        from lightning_lazytrain.strategy import LazyTrainStrategy

        strategy = LazyTrainStrategy(policy=opts.get("policy", "milp"), timeout=timedelta(seconds=60),
                                     checkpoint_format=opts.get("checkpoint_format", "sharded"),
                                     overlap_grad_sync=opts.get("overlap", True),
                                     data_parallel=opts.get("data_parallel", "replicate"),
                                     shard_size=opts.get("shard_size"), replan=opts.get("replan", True),
                                     fp32_masters=opts.get("fp32_masters", False))
    else:
        strategy = "auto"
    manual = opts.get("manual", False)
    module = ManualNet(opts) if manual else EditingNet(opts) if opts.get("user_hooks") else Net(opts)
    per_epoch = opts.get("epoch_steps", steps)
    tokens = data((batch if "union_of" in opts else devices * batch) * per_epoch * accum)
    if "union_of" in opts:  # the samples W ranks see in one step, as one batch (Lightning's
        w = opts["union_of"]  # DistributedSampler shuffles the training set with seed 0 + epoch)
        gen = torch.Generator().manual_seed(opts.get("epoch", 0))
        perm = torch.randperm(len(tokens), generator=gen)
        per_rank, b = [perm[r::w] for r in range(w)], batch // w
        tokens = tokens[torch.cat([per_rank[r][k * b:(k + 1) * b] for k in range(len(tokens) // batch)
                                   for r in range(w)])]
    loader = torch.utils.data.DataLoader(tokens, batch_size=batch)
    callbacks: list = []
    if opts.get("save"):  # a checkpoint inside the run, at its last step (as ModelCheckpoint saves)
        from lightning.pytorch.callbacks import ModelCheckpoint

        path = opts["save"]
        callbacks.append(ModelCheckpoint(dirpath=os.path.dirname(path), filename=os.path.basename(path)[:-5],
                                         every_n_train_steps=opts.get("save_every", steps), save_top_k=-1,
                                         enable_version_counter=False))
    if "fail_save_rank" in opts:
        inject_save_failure(opts["fail_save_rank"], opts["fail_save_at"])
    if opts.get("record_bytes"):
        callbacks.append(RecordBytes(accum))
    if opts.get("grad_probe"):
        callbacks.append(GradProbe())
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, callbacks=callbacks,
                        accumulate_grad_batches=1 if manual else accum,
                        gradient_clip_val=None if manual else opts.get("clip"), logger=False,
                        enable_checkpointing=bool(callbacks), enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
                        precision=opts.get("precision", "32-true"))
    trainer.fit(module, train_dataloaders=loader, ckpt_path=opts.get("resume"))
    module.byte_rows = next((cb.rows for cb in callbacks if isinstance(cb, RecordBytes)), None)
    module.replans = list(getattr(trainer.strategy, "replans", []))
    probe = next((cb for cb in callbacks if isinstance(cb, GradProbe)), None)
    module.probe = probe.rows if probe is not None else None
    module.plan_allreduce_bytes = probe.plan_allreduce_bytes if probe is not None else 0.0
    return module


def main() -> None:
    run_each("dist_train", run)  # tests/dist_runs.py, Note: [shared runs]


def run(opts: dict) -> None:
    module = train(opts)
    out = opts["out"]
    rank = module.global_rank
    with open(os.path.join(out, f"losses_rank{rank}.json"), "w") as f:
        json.dump(module.losses, f)
    if getattr(module, "loaded_shapes", None) is not None:
        with open(os.path.join(out, f"loaded_shapes_rank{rank}.json"), "w") as f:
            json.dump(module.loaded_shapes, f)
    if module.replans:
        with open(os.path.join(out, f"replans_rank{rank}.json"), "w") as f:
            json.dump(module.replans, f)
    if module.probe is not None:
        with open(os.path.join(out, f"probe_rank{rank}.json"), "w") as f:
            json.dump({"rows": module.probe, "plan_allreduce_bytes": module.plan_allreduce_bytes}, f)
    if module.byte_rows is not None:
        with open(os.path.join(out, f"bytes_rank{rank}.json"), "w") as f:
            json.dump(module.byte_rows, f)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in module.model.state_dict().items()},
                   os.path.join(out, "weights.pt"))
    with open(os.path.join(out, f"done_rank{rank}"), "w"):
        pass


if __name__ == "__main__":
    main()
