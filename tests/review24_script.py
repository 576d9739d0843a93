"""Review 24 helper: one small Trainer fit described by a JSON config, run in this process (``fit``) or as a
child process that can be killed hard (``python tests/review24_script.py '<json>'``; ``os._exit`` at a
chosen moment: no ``finally``, no atexit, no Lightning teardown -- what SIGKILL leaves).

Config keys (all optional):
  strategy: "auto" or a dict of LazyTrainStrategy kwargs (``plan_schedule``: "all_nvme" / "recompute" writes a
            plan file of that schedule into ``plan_dir`` and passes it as ``policy``)
  steps, accumulate, precision, eight_bit, lr_schedule, clip, in_backward, val_every (val_check_interval in batches)
  ckpt: dict of ModelCheckpoint kwargs (dirpath, every_n_train_steps, save_last, save_top_k, ...)
  ckpt_path: passed to fit
  losses: a file each micro-batch's loss is appended to (one JSON line: [global_step, batch_idx, loss])
  params_out: a file the final parameters are saved to (torch.save of a list) after fit
  kill: {"where": "batch_end"|"validation"|"save"|"before_backward", "step": global step, "micro": batch_idx %
        accumulate (batch_end/before_backward), "nth": which torch.save call (save; 1-based),
        "how": "exit" (os._exit(77), the default) or "raise" (``Crash``: an in-process failure Lightning sees)}
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

KILLED = 77  # the exit status of a child killed by its own os._exit


def batches(n: int, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 33), generator=g) for _ in range(n)]


DATA = batches(64)


class Crash(RuntimeError):
    """Raised instead of os._exit where the kill asks for ``raise`` (an in-process crash, Lightning tears down)."""


def _die(how: str = "exit") -> None:
    if how == "raise":
        raise Crash("review24 crash")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(KILLED)


def make_module(cfg: dict):
    from lightning_lazytrain.lit_module import CausalLMModule

    acc = int(cfg.get("accumulate", 1))
    kill = cfg.get("kill") or {}

    class Module(CausalLMModule):
        def training_step(self, batch, batch_idx):
            # the batch is chosen by the global step (a resumed fit sees the batches the uninterrupted one saw)
            batch = DATA[self.trainer.global_step * acc + batch_idx % acc]
            return super().training_step(batch, batch_idx)

        def on_before_backward(self, loss):
            if kill.get("where") == "before_backward" and self.trainer.global_step == kill["step"] \
                    and self.trainer.fit_loop.epoch_loop.batch_idx % acc == kill.get("micro", 0):
                _die(kill.get("how", "exit"))

    torch.manual_seed(0)
    return Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule=cfg.get("lr_schedule", "cosine"),
                  warmup_steps=int(cfg.get("warmup", 0)), eight_bit=cfg.get("eight_bit", "none"),
                  updates_in_backward=bool(cfg.get("in_backward", False)))


class Record(L.Callback):
    reads_gradients_only = True  # records, reads no weight

    def __init__(self, path: str | None, acc: int):
        self.path, self.acc = path, acc
        self.losses: list[list] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        row = [trainer.global_step, batch_idx % self.acc, outputs["loss"].item()]
        self.losses.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")


class Kill(L.Callback):
    reads_gradients_only = True

    def __init__(self, kill: dict, acc: int):
        self.kill, self.acc = kill, acc

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        k = self.kill
        if k.get("where") == "batch_end" and trainer.global_step == k["step"] and batch_idx % self.acc == k.get("micro", 0):
            _die(k.get("how", "exit"))

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if self.kill.get("where") == "validation" and trainer.state.fn == "fit" and trainer.global_step == self.kill["step"]:
            _die(self.kill.get("how", "exit"))


def arm_save_kill(nth: int) -> None:
    """The ``nth`` torch.save writes the first half of the checkpoint's real bytes, then the process dies."""
    real = torch.save
    calls = {"n": 0}

    def save(obj, f, *a, **k):
        calls["n"] += 1
        if calls["n"] != nth or not hasattr(f, "write"):
            return real(obj, f, *a, **k)
        buf = io.BytesIO()
        real(obj, buf, *a, **k)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        _die()

    torch.save = save


def make_strategy(spec, plan_dir: str | None = None):
    if spec is None or spec == "auto":
        return "auto"
    from lightning_lazytrain.strategy import LazyTrainStrategy

    spec = dict(spec)
    which = spec.pop("plan_schedule", None)
    if which is not None:
        from test_review_replan_nvme import _schedule, all_nvme_schedule, write_plan

        schedule = {"all_nvme": all_nvme_schedule, "recompute": _schedule}[which]()
        spec["policy"] = write_plan(Path(plan_dir) / f"{which}.json", schedule)
    return LazyTrainStrategy(**spec)


def fit(cfg: dict):
    from lightning.pytorch.callbacks import ModelCheckpoint

    acc = int(cfg.get("accumulate", 1))
    steps = int(cfg.get("steps", 6))
    module = make_module(cfg)
    rec = Record(cfg.get("losses"), acc)
    cbs: list = [rec]
    if cfg.get("kill"):
        cbs.append(Kill(cfg["kill"], acc))
        if cfg["kill"].get("where") == "save":
            arm_save_kill(int(cfg["kill"]["nth"]))
    if cfg.get("ckpt"):
        cbs.append(ModelCheckpoint(**cfg["ckpt"]))
    val_every = cfg.get("val_every")
    trainer = L.Trainer(strategy=make_strategy(cfg.get("strategy"), cfg.get("plan_dir")), accelerator="cpu",
                        max_steps=steps, max_epochs=-1, accumulate_grad_batches=acc, logger=False,
                        enable_checkpointing=bool(cfg.get("ckpt")), callbacks=cbs, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=1 if val_every else 0, val_check_interval=val_every,
                        check_val_every_n_epoch=None if val_every else 1,
                        precision=cfg.get("precision", "32-true"), gradient_clip_val=cfg.get("clip"),
                        default_root_dir=cfg.get("root"))
    n = int(cfg.get("epoch_batches", steps * acc))
    loader = torch.utils.data.DataLoader(DATA[:n], batch_size=None)
    val = torch.utils.data.DataLoader(DATA[-1:], batch_size=None) if val_every else None
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val, ckpt_path=cfg.get("ckpt_path"))
    if cfg.get("params_out"):
        torch.save([p.detach().clone() for p in module.parameters()], cfg["params_out"])
    return rec.losses, module, trainer


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("REVIEW24_THREADS", torch.get_num_threads())))
    fit(json.loads(sys.argv[1]))
    print("finished", flush=True)
