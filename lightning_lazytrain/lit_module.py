"""``CausalLMModule``: a LightningModule for next-token language modelling.

The model is, in order of precedence:

* ``model=`` a ready ``nn.Module`` (Python use: e.g. a Hugging Face ``LlamaForCausalLM(config)``);
* ``hf_config=`` a dict for ``transformers.AutoConfig.for_model(**hf_config)`` (must hold ``model_type``)
  or a ``PretrainedConfig``; built with ``AutoModelForCausalLM.from_config`` (random weights, nothing
  downloaded; transformers is an optional extra and imported only here);
* ``model_name=`` a planner model YAML (``conf/model/<name>.yaml`` or a path to a ``.yaml`` file), with
  ``model_overrides`` applied field by field (or, with ``model_name=None``, ``model_overrides`` holding the
  whole ``ModelSpec``), built as our ``LlamaLM`` (``models/llama.py``).

Batches are ``[B, S + 1]`` token tensors (``StdlibTextDataModule``): inputs ``x[:, :-1]``, targets
``x[:, 1:]``, fp32 cross-entropy. Logged: ``train_loss`` (each step, progress bar), ``val_loss``,
``test_loss`` (per epoch). ``predict_step`` returns per-sample mean NLL and the greedy next-token guesses.

Optimizer: ``adamw`` (``torch.optim.AdamW``) or ``hybrid_adamw`` (``lightning_lazytrain.optim.HybridAdamW``,
one param-group per transformer block so the layer-pipelined step can run block by block; 8-bit states
per ``eight_bit``, the gradient clip fused in when ``max_grad_norm`` is set). Weight decay applies to
matrices only (not norms, biases). ``lr_schedule="cosine"``: linear warmup over ``warmup_steps`` then
cosine decay to ``min_lr_ratio * lr`` at the trainer's last step; ``"constant"``: warmup then flat.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from omegaconf import OmegaConf
from torch import nn

from .models.llama import LlamaLM
from .planner import ModelSpec

__all__ = ["CausalLMModule", "load_model_spec", "OPTIMIZERS", "LR_SCHEDULES"]

OPTIMIZERS = ("adamw", "hybrid_adamw")
LR_SCHEDULES = ("constant", "cosine")


def load_model_spec(model_name: str, overrides: Optional[Dict[str, Any]] = None) -> ModelSpec:
    """A planner ``ModelSpec`` from ``conf/model/<model_name>.yaml`` (or the YAML file ``model_name``), with
    ``overrides`` (field -> value) applied."""
    from .config import CONF_DIR, to_model  # hydra/omegaconf only; no torch

    path = Path(model_name)
    if path.suffix in (".yaml", ".yml") and not path.is_file():
        raise ValueError(f"model file {model_name!r} not found (or give the name of a model in {CONF_DIR / 'model'})")
    if not path.is_file():
        path = CONF_DIR / "model" / f"{model_name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
            raise ValueError(f"unknown model {model_name!r}: no {path} (known: {', '.join(known)}; "
                             f"or give a path to a model .yaml)")
    cfg = OmegaConf.load(path)
    if overrides:
        _refuse_unknown_fields(overrides, extra=cfg.keys())
        cfg = OmegaConf.merge(cfg, OmegaConf.create(dict(overrides)))
    return to_model(cfg)


def _spec_from_fields(fields: Dict[str, Any]) -> ModelSpec:
    from .config import to_model

    _refuse_unknown_fields(fields)
    return to_model(dict(fields))


def _refuse_unknown_fields(fields: Dict[str, Any], extra: Any = ()) -> None:
    """A model override the spec does not know (``num_layerz``) would be dropped without a word: name it."""
    import dataclasses
    import difflib

    known = [f.name for f in dataclasses.fields(ModelSpec)]
    for key in fields:
        if key not in known and key not in extra:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"model_overrides: unknown model field {key!r}{hint}; a model takes {', '.join(known)}")


def _build_hf(hf_config: Any) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("hf_config needs the optional 'transformers' package "
                          "(pip install 'lightning-lazytrain[hf]')") from err
    if isinstance(hf_config, dict):
        kwargs = dict(hf_config)
        model_type = kwargs.pop("model_type", None)
        if not model_type:
            raise ValueError("hf_config needs a 'model_type' (e.g. 'llama')")
        config = AutoConfig.for_model(model_type, **kwargs)
    else:
        config = hf_config
    return AutoModelForCausalLM.from_config(config)


class CausalLMModule(LightningModule):
    """Next-token LM training around ``LlamaLM`` (from a planner ``ModelSpec``) or a Hugging Face causal LM.

    Args:
        model_name: ``conf/model/<name>.yaml`` (or a ``.yaml`` path) describing a Llama-style ``ModelSpec``.
        model_overrides: ``ModelSpec`` fields to change, e.g. ``{"num_layers": 2, "hidden": 128}``; with
            ``model_name=None``, every field of the spec (``name``, ``num_layers``, ``hidden``, ...).
        hf_config: build a Hugging Face causal LM from this config instead (dict with ``model_type``).
        model: use this module instead (takes ``input_ids``, returns logits or an output with ``.logits``).
        optimizer: ``adamw`` or ``hybrid_adamw``.
        lr, weight_decay, betas, eps: optimizer hyper-parameters.
        lr_schedule: ``constant`` or ``cosine`` (both with linear warmup over ``warmup_steps``).
        warmup_steps: linear warmup steps.
        min_lr_ratio: the cosine schedule ends at ``min_lr_ratio * lr``.
        eight_bit: ``hybrid_adamw`` only: "plan" (default: under ``strategy="lazytrain"`` the plan gives
            the smallest 8-bit slice that fits host memory, none when 32-bit states fit; otherwise
            32-bit states), "none", "all" or the fraction of parameters with 8-bit states.
        max_grad_norm: ``hybrid_adamw`` only: clip the global gradient norm inside the optimizer.
        updates_in_backward: ``hybrid_adamw`` only: update each block as soon as its gradient is complete,
            during the backward, under ``strategy="lazytrain"`` (Note: [updates in backward] in
            optim/backward_updates.py): no clip, no non-finite skip (as torch's AdamW).
        loss_chunk_tokens: the ``LlamaLM`` training loss goes through the LM head this many tokens at a time
            (``models/loss.py``; the planner's ``train.loss_chunk_tokens``); other models compute full logits.
    """

    def __init__(
        self,
        model_name: Optional[str] = "tiny",
        model_overrides: Optional[Dict[str, Any]] = None,
        hf_config: Optional[Dict[str, Any]] = None,
        model: Any = None,  # an nn.Module (Python use); typed Any so LightningCLI does not list every Module
        optimizer: str = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: Tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        lr_schedule: str = "cosine",
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        eight_bit: Any = "plan",
        max_grad_norm: Optional[float] = None,
        loss_chunk_tokens: int = 4096,
        updates_in_backward: bool = False,
    ) -> None:
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"need warmup_steps >= 0 and 0 <= min_lr_ratio <= 1, got {warmup_steps}, {min_lr_ratio}")
        _check_optimizer_args(optimizer, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, eight_bit=eight_bit,
                              max_grad_norm=max_grad_norm)
        hf_hparam = hf_config if isinstance(hf_config, dict) or hf_config is None else hf_config.to_dict()
        self.save_hyperparameters({"model_name": model_name, "model_overrides": model_overrides,
                                   "hf_config": hf_hparam, "optimizer": optimizer, "lr": lr,
                                   "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps,
                                   "lr_schedule": lr_schedule, "warmup_steps": warmup_steps,
                                   "min_lr_ratio": min_lr_ratio, "eight_bit": eight_bit,
                                   "max_grad_norm": max_grad_norm, "loss_chunk_tokens": loss_chunk_tokens,
                                   "updates_in_backward": updates_in_backward})
        #: the planner's view of the model (None for Hugging Face / custom modules)
        self.model_spec: Optional[ModelSpec] = None
        if model is not None:
            if not isinstance(model, nn.Module):
                raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
            self.model = model
            self.model_kind = "custom"
        elif hf_config is not None:
            self.model = _build_hf(hf_config)
            self.model_kind = "hf"
        else:
            if model_name is None and not model_overrides:
                raise ValueError("give one of model_name, model_overrides (all ModelSpec fields), hf_config or model")
            self.model_spec = (load_model_spec(model_name, model_overrides) if model_name is not None
                               else _spec_from_fields(model_overrides))
            self.model = LlamaLM(self.model_spec)
            self.model_kind = "llama"
        self.optimizer_name = optimizer
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, (float(betas[0]), float(betas[1])), eps
        self.lr_schedule, self.warmup_steps, self.min_lr_ratio = lr_schedule, warmup_steps, min_lr_ratio
        self.eight_bit, self.max_grad_norm = eight_bit, max_grad_norm
        self.updates_in_backward = updates_in_backward
        if loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {loss_chunk_tokens}")
        self.loss_chunk_tokens = int(loss_chunk_tokens)

    # ---- model -------------------------------------------------------------------------------------
    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens[B, S] -> logits[B, S, V]``."""
        if self.model_kind == "llama":
            return self.model(tokens)
        out = self.model(input_ids=tokens, use_cache=False) if self.model_kind == "hf" else self.model(tokens)
        return out.logits if hasattr(out, "logits") else out

    @staticmethod
    def _split(batch: Any) -> torch.Tensor:
        if isinstance(batch, dict):
            batch = batch["input_ids"]
        elif isinstance(batch, (list, tuple)):
            batch = batch[0]
        if batch.dim() != 2 or batch.shape[1] < 2:
            raise ValueError(f"expected a [batch, seq_len + 1] token tensor, got shape {tuple(batch.shape)}")
        return batch

    def _strategy_chunks_the_loss(self) -> bool:
        """The Trainer's strategy computes a Hugging Face model's loss chunked (``LazyTrainStrategy(chunked_loss=...)``)."""
        trainer = self._trainer
        return trainer is not None and bool(getattr(trainer.strategy, "chunked_loss", False))

    def _nll(self, batch: Any, reduction: str = "mean") -> torch.Tensor:
        tokens = self._split(batch)
        if self.model_kind == "llama" and reduction == "mean":
            return self.model.loss(tokens, chunk_tokens=self.loss_chunk_tokens)  # chunked through the head
        if self.model_kind == "hf" and reduction == "mean" and self._strategy_chunks_the_loss():
            # the strategy's chunked loss replaces the model's own (models/hf_loss.py), which needs labels: the
            # targets given as they are (shift_labels), the same as the cross-entropy below
            inputs = tokens[:, :-1]
            return self.model(input_ids=inputs, labels=inputs, shift_labels=tokens[:, 1:], use_cache=False).loss
        logits = self(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1),
                               reduction=reduction)
        return loss if reduction == "mean" else loss.view(tokens.shape[0], -1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._nll(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True,
                 batch_size=self._split(batch).shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._nll(batch)
        self.log("val_loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=self._split(batch).shape[0])
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._nll(batch)
        self.log("test_loss", loss, on_step=False, on_epoch=True, batch_size=self._split(batch).shape[0])
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Dict[str, torch.Tensor]:
        tokens = self._split(batch)
        logits = self(tokens[:, :-1]).float()
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none")
        return {"nll": nll.view(tokens.shape[0], -1).mean(dim=1), "next_token": logits.argmax(dim=-1)}

    # ---- optimizer ---------------------------------------------------------------------------------
    @staticmethod
    def _decays(name: str, p: torch.Tensor) -> bool:
        return p.ndim >= 2 and "norm" not in name.lower()

    def _layer_of(self) -> Dict[str, Any]:
        """Parameter name -> block index (for params inside the block stack); outside it, ``"embed"``
        for the embeddings' and ``"head"`` for the rest (final norm, LM head): two layers, so the
        strategy moves, updates and stages them as two parts that overlap in the step's tail (Note:
        [non-block parts] in planner/schedule_windows.py)."""
        from .engine.blocks import BlockDiscoveryError, find_blocks

        embeddings = {id(p) for m in self.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
        out: Dict[str, Any] = {n: "embed" if id(p) in embeddings else "head" for n, p in self.named_parameters()}
        try:
            stack = find_blocks(self)
        except BlockDiscoveryError:
            return {n: "rest" for n in out}
        for i, block in enumerate(stack):
            prefix = stack.block_path(i)
            for n, _ in block.named_parameters():
                out[f"{prefix}.{n}"] = i
        return out

    def param_groups(self) -> list:
        """AdamW: two groups (decay / no decay) of named params. HybridAdamW: those split per block
        (``layer`` = block index; ``"embed"`` for the embeddings, ``"head"`` for the final norm and head)."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            groups = [{"params": [p for n, p in named if self._decays(n, p)], "weight_decay": self.weight_decay},
                      {"params": [p for n, p in named if not self._decays(n, p)], "weight_decay": 0.0}]
            return [g for g in groups if g["params"]]
        layer_of = self._layer_of()
        by_key: Dict[tuple, list] = {}
        for n, p in named:
            by_key.setdefault((layer_of.get(n, "rest"), self._decays(n, p)), []).append((n, p))
        rank = {"embed": 0, "head": 1, "rest": 2}  # the non-block layers first, then the blocks in order
        order = sorted(by_key, key=lambda k: (isinstance(k[0], int), k[0] if isinstance(k[0], int) else rank[k[0]],
                                              not k[1]))
        return [{"params": by_key[k], "layer": k[0], "weight_decay": self.weight_decay if k[1] else 0.0}
                for k in order]

    def _total_steps(self) -> int:
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return 0
        try:
            total = trainer.estimated_stepping_batches
        except Exception:  # noqa: BLE001 - no dataloader attached yet
            return 0
        return int(total) if math.isfinite(total) else 0

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` at optimizer step ``step`` (0-based)."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.lr_schedule == "constant" or total_steps <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def configure_optimizers(self) -> Any:
        groups = self.param_groups()
        if self.optimizer_name == "hybrid_adamw":
            try:
                from .optim import HybridAdamW
            except ImportError as err:  # pragma: no cover - the optim package ships with this one
                raise ImportError(f"optimizer='hybrid_adamw' needs lightning_lazytrain.optim: {err}") from err
            opt: torch.optim.Optimizer = HybridAdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps,
                                                     weight_decay=self.weight_decay, eight_bit=self.eight_bit,
                                                     max_grad_norm=self.max_grad_norm,
                                                     **({"updates_in_backward": True, "skip_nonfinite": False}
                                                        if self.updates_in_backward else {}))
        else:
            opt = torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps,
                                    weight_decay=self.weight_decay)
        if self.lr_schedule == "constant" and not self.warmup_steps:
            return opt
        total = self._total_steps()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: self.lr_factor(step, total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": 1}}


def _check_optimizer_args(optimizer: str, *, lr: float, weight_decay: float, betas: Any, eps: float, eight_bit: Any,
                          max_grad_norm: Optional[float]) -> None:
    """The optimizer's arguments, checked when the module is made (not first in ``configure_optimizers``, inside
    ``fit``): each error names the argument as written (``lr=-1``) and what it takes."""
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if not float(value) >= 0:
            raise ValueError(f"{name}={value}: must be a number >= 0")
    b = list(betas)
    if len(b) != 2 or not all(0.0 <= float(x) < 1.0 for x in b):
        raise ValueError(f"betas={b}: must be two numbers in [0, 1), e.g. [0.9, 0.95]")
    if max_grad_norm is not None and not float(max_grad_norm) > 0:
        raise ValueError(f"max_grad_norm={max_grad_norm}: must be a number > 0, or null (no clip)")
    if optimizer == "hybrid_adamw" and not callable(eight_bit):
        fraction = isinstance(eight_bit, (int, float)) and not isinstance(eight_bit, bool) and 0 < eight_bit <= 1
        if not (fraction or eight_bit in ("plan", "none", "all")):
            raise ValueError(f"eight_bit={eight_bit!r}: use 'plan' (the plan picks the 8-bit slice), 'none', 'all' or "
                             "a fraction in (0, 1] of the parameters with 8-bit states")

