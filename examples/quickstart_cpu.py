"""Quick start on a CPU: a tiny Llama-style model trained on the Python standard library's own source with
``Trainer(strategy="lazytrain")`` (layer streaming + a MILP plan; on a CPU the "device" is a slice of host RAM).

    python examples/quickstart_cpu.py              # 50 steps, about half a minute
    QUICKSTART_STEPS=5 python examples/quickstart_cpu.py
    QUICKSTART_STRATEGY=auto python examples/quickstart_cpu.py    # plain Lightning, for comparison
"""

import os

import lightning as L

import lightning_lazytrain.strategy  # noqa: F401  (registers strategy="lazytrain")
from lightning_lazytrain.data import StdlibTextDataModule
from lightning_lazytrain.lit_module import CausalLMModule

STEPS = int(os.environ.get("QUICKSTART_STEPS", "50"))
STRATEGY = os.environ.get("QUICKSTART_STRATEGY", "lazytrain")


def main() -> None:
    L.seed_everything(0)
    model = CausalLMModule(model_name="tiny", lr=3e-3, warmup_steps=min(10, STEPS))  # conf/model/tiny.yaml
    data = StdlibTextDataModule(seq_len=128, batch_size=8, max_bytes=1_000_000, val_windows=32)
    trainer = L.Trainer(strategy=STRATEGY, accelerator="cpu", devices=1, precision="32-true", max_steps=STEPS,
                        val_check_interval=STEPS, check_val_every_n_epoch=None, logger=False,
                        enable_checkpointing=False)
    trainer.fit(model, datamodule=data)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    print(f"quickstart: {STEPS} steps with strategy={STRATEGY!r}, held-out val loss {val:.3f} "
          f"(ln 256 = 5.545 before training)")


if __name__ == "__main__":
    main()
