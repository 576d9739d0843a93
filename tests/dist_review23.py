"""Review 23's training script (tests/test_review23_world_sizes.py): ``python tests/dist_review23.py '<json list>'``
runs the runs one after another in the same processes (tests/dist_runs.py, Note: [shared runs]).

Options: out, devices, n (samples per rank, or a list: rank r's; own data per rank, ``use_distributed_sampler=False``),
total (instead: one global dataset of ``total`` samples through Lightning's DistributedSampler), shuffle, batch, accum,
clip, clip_algorithm ("norm" or "value"), steps, epochs, optimizer ("sgd", "adamw": torch AdamW, "hybrid": HybridAdamW
32-bit, "hybrid8": HybridAdamW 8-bit states), min8 (hybrid8's min_8bit_numel, default 1024), only_row_8bit (hybrid8:
8-bit states for 1-row matrices only), sched (a LambdaLR halving the LR every optimizer step), data_parallel,
checkpoint_format, policy, strategy ("lazytrain" / "auto"), timeout, extra_params (non-block parameters of 0 dims and of
2 rows: fewer rows than 3 ranks), row_param (a 1 x 300 non-block parameter), save / save_every / resume, catch (an
error is written per rank instead of raised). Each rank writes result_rank{r}.json (losses, lrs) and weights_rank{r}.pt
(the final module state dict).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository (lightning_lazytrain)
from dist_runs import run_each  # noqa: E402
from test_review6_processes import samples, tiny_model  # noqa: E402


def _module(opts: dict):
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            # the other ranks start elsewhere: rank 0's weights are broadcast (as DDP does)
            self.model = tiny_model(int(os.environ.get("LOCAL_RANK", 0)) * 5)
            if opts.get("extra_params"):
                self.temp = torch.nn.Parameter(torch.tensor(1.0))
                self.shift = torch.nn.Parameter(torch.zeros(2, 3))
            if opts.get("row_param"):  # one row of 300 (a cls token's shape): fewer rows than ranks, 8-bit eligible
                self.row = torch.nn.Parameter(torch.full((1, 300), 0.1))
            self.losses: list[float] = []
            self.lrs: list[float] = []

        def train_dataloader(self):
            if "total" in opts:
                tokens = samples(0, opts["total"], salt=3)
                return torch.utils.data.DataLoader(tokens, batch_size=opts["batch"], drop_last=False,
                                                   shuffle=opts.get("shuffle", False))
            n = opts["n"][self.global_rank] if isinstance(opts["n"], list) else opts["n"]
            return torch.utils.data.DataLoader(samples(self.global_rank, n), batch_size=opts["batch"])

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            if opts.get("extra_params"):
                loss = loss * self.temp + (self.shift * batch[:, :3].float().mean(0)).sum() * 1e-3
            if opts.get("row_param"):
                loss = loss + (self.row * batch[:, :1].float().mean()).square().mean() * 1e-3
            self.losses.append(loss.item())
            self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))
            return loss

        def configure_optimizers(self):
            params = [p for p in self.parameters() if p.requires_grad]
            kind = opts.get("optimizer", "sgd")
            if kind == "hybrid":
                from lightning_lazytrain.optim import HybridAdamW

                opt = HybridAdamW(params, lr=1e-2)
            elif kind == "hybrid8":
                from lightning_lazytrain.optim import HybridAdamW

                policy = (lambda name, shape: len(shape) == 2 and shape[0] == 1) if opts.get("only_row_8bit") else "all"
                opt = HybridAdamW(params, lr=1e-2, eight_bit=policy, min_8bit_numel=opts.get("min8", 1024))
            elif kind == "adamw":
                opt = torch.optim.AdamW(params, lr=1e-2)
            else:
                opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
            if not opts.get("sched"):
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)  # halves every optimizer step
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


def train(opts: dict):
    import lightning as L

    torch.set_num_threads(1)
    if opts.get("strategy", "lazytrain") == "lazytrain":
        from lightning_lazytrain.strategy import LazyTrainStrategy

        strategy = LazyTrainStrategy(policy=opts.get("policy", "megatrain"),
                                     timeout=timedelta(seconds=opts.get("timeout", 60)),
                                     data_parallel=opts.get("data_parallel", "replicate"), replan=False,
                                     checkpoint_format=opts.get("checkpoint_format", "sharded"))
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
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=opts.get("devices", 2),
                        max_steps=opts.get("steps", -1), max_epochs=opts.get("epochs", 1), callbacks=callbacks,
                        accumulate_grad_batches=opts.get("accum", 1), gradient_clip_val=opts.get("clip"),
                        gradient_clip_algorithm=opts.get("clip_algorithm", "norm"), logger=False, enable_checkpointing=bool(callbacks),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, deterministic=True, use_distributed_sampler="total" in opts)
    trainer.fit(module, ckpt_path=opts.get("resume"))
    return module


def run(opts: dict) -> None:
    out = Path(opts["out"])
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if opts.get("catch"):
        try:
            module = train(opts)
        except Exception as e:  # noqa: BLE001
            (out / f"error_rank{rank}.txt").write_text(f"{type(e).__name__}: {e}")
            (out / f"done_rank{rank}").write_text("")
            return
    else:
        module = train(opts)
    rank = module.global_rank
    (out / f"result_rank{rank}.json").write_text(json.dumps({"losses": module.losses, "lrs": module.lrs}))
    torch.save({k: v.detach().float().clone() for k, v in module.state_dict().items()}, out / f"weights_rank{rank}.pt")
    (out / f"done_rank{rank}").write_text("")


def main() -> None:
    run_each("review23", run)


if __name__ == "__main__":
    main()
    sys.exit(0)
