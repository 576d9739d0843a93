"""A Hugging Face ``LlamaForCausalLM`` (built from a small ``LlamaConfig``: random weights, nothing downloaded)
trained on the Python standard library's source with ``Trainer(strategy="lazytrain")``.

Needs the optional extra: ``pip install 'lightning-lazytrain[hf]'`` (transformers).

    python examples/hf_causal_lm.py                      # 30 steps on the CPU
    HF_EXAMPLE_STEPS=3 python examples/hf_causal_lm.py
    python examples/hf_causal_lm.py --accelerator gpu --precision bf16-mixed --layers 8 --hidden 512

The strategy finds the block stack at ``model.model.layers`` (the LightningModule holds the HF model as
``self.model``), profiles the first batch, plans and streams the decoder layers.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
from transformers import LlamaConfig, LlamaForCausalLM

import lightning_lazytrain.strategy  # noqa: F401  (registers strategy="lazytrain")
from lightning_lazytrain.data import VOCAB_SIZE, StdlibTextDataModule
from lightning_lazytrain.lit_module import CausalLMModule


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=int(os.environ.get("HF_EXAMPLE_STEPS", "30")))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--strategy", default=os.environ.get("HF_EXAMPLE_STRATEGY", "lazytrain"))
    return p.parse_args()


def main() -> None:
    args = parse_args()
    L.seed_everything(0)
    heads = max(1, args.hidden // 16)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), max_position_embeddings=args.seq_len,
                         tie_word_embeddings=False)
    module = CausalLMModule(model=LlamaForCausalLM(config), lr=3e-3, warmup_steps=min(10, args.steps))
    # the same thing from a plain dict, as the CLI takes it:
    #   CausalLMModule(hf_config={"model_type": "llama", "hidden_size": 64, ...})
    data = StdlibTextDataModule(seq_len=args.seq_len, batch_size=args.batch_size, max_bytes=1_000_000, val_windows=32)
    trainer = L.Trainer(strategy=args.strategy, accelerator=args.accelerator, devices=1, precision=args.precision,
                        max_steps=args.steps, val_check_interval=args.steps, check_val_every_n_epoch=None,
                        logger=False, enable_checkpointing=False)
    trainer.fit(module, datamodule=data)
    val = trainer.validate(module, datamodule=data, verbose=False)[0]["val_loss"]
    print(f"hf_causal_lm: LlamaForCausalLM ({module.num_parameters / 1e6:.2f}M params), {args.steps} steps with "
          f"strategy={args.strategy!r}, held-out val loss {val:.3f}")


if __name__ == "__main__":
    main()
