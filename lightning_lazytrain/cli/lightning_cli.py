"""``lazytrain-cli``: Lightning's own CLI (``LightningCLI``) over ``CausalLMModule`` and ``StdlibTextDataModule``.

    lazytrain-cli fit --trainer.strategy=lazytrain --trainer.accelerator=cpu --trainer.max_steps=300
    lazytrain-cli fit --trainer.strategy.class_path=lightning_lazytrain.strategy.LazyTrainStrategy \\
                      --trainer.strategy.init_args.policy=megatrain
    lazytrain-cli fit --model.model_name=tiny --model.model_overrides='{num_layers: 6}' --data.seq_len=256
    lazytrain-cli fit --print_config > run.yaml && lazytrain-cli fit --config run.yaml

``import lightning_lazytrain.strategy`` runs first, so the strategy names it registers (``lazytrain``,
``lazytrain_megatrain``) resolve in ``--trainer.strategy``. The model comes from ``--model.model_name``
(``conf/model/<name>.yaml`` or a path to a model YAML) with ``--model.model_overrides`` applied, or from
``--model.hf_config`` (a Hugging Face config dict; needs transformers). ``build_cli(args=[...])`` runs the CLI
in-process with the given arguments (tests use it) and returns the ``LightningCLI``; ``main`` (the console
script) returns the exit status 0.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

import lightning_lazytrain.strategy  # noqa: F401  (registers the lazytrain strategies by name)

from ..data import StdlibTextDataModule
from ..lit_module import CausalLMModule


def build_cli(args: Optional[Sequence[str]] = None, *, run: bool = True, **kwargs: Any) -> Any:
    """The ``LightningCLI`` over ``CausalLMModule`` and ``StdlibTextDataModule``, after it ran (Python use and
    tests). ``args``: argument list instead of ``sys.argv[1:]``; ``run=False``: parse and instantiate only (no
    subcommand); ``kwargs`` go to ``LightningCLI``."""
    from lightning.pytorch.cli import LightningCLI

    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return LightningCLI(CausalLMModule, StdlibTextDataModule, args=list(args) if args is not None else None,
                        run=run, **kwargs)


def main(args: Optional[Sequence[str]] = None) -> int:
    """Console script ``lazytrain-cli``: run the CLI and return the exit status (0; a bad argument exits 2 from
    the parser, an exception propagates). The CLI object itself is ``build_cli``'s."""
    build_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
