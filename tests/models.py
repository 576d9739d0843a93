"""Models the tests share. Each is built right after ``torch.manual_seed``: a test gets the same
weights wherever it builds one. Where tests differ (sizes, activation, attention), the variant is an
argument, named."""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from torch import nn

LAYERS = 4


def tiny_llama_config(*, layers: int = LAYERS, eager: bool = True):
    """A 4-block Llama of hidden size 64 over 256 tokens; ``eager``: eager attention (the default
    attention otherwise, as ``transformers.LlamaConfig`` picks it)."""
    import transformers

    kw = {"attn_implementation": "eager"} if eager else {}
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)


def tiny_llama(seed: int = 0, *, layers: int = LAYERS, eager: bool = True) -> nn.Module:
    """``transformers.LlamaForCausalLM`` of ``tiny_llama_config``, built from a config (no download)."""
    import transformers

    cfg = tiny_llama_config(layers=layers, eager=eager)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def mlp_block(d: int, hidden: int, *, act: Callable[[], nn.Module], norm: bool = False, bias: bool = True,
              seed: int | None = None) -> nn.Sequential:
    """Linear(d, hidden) [-> LayerNorm(hidden)] -> act -> Linear(hidden, d); seeded first when ``seed``
    is given."""
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(d, hidden, bias=bias)]
    if norm:
        layers.append(nn.LayerNorm(hidden))
    layers += [act(), nn.Linear(hidden, d, bias=bias)]
    return nn.Sequential(*layers)


def mlp_stack(n: int, d: int, hidden: int, *, act: Callable[[], nn.Module], norm: bool = False, bias: bool = True,
              seed: int = 0) -> nn.Sequential:
    """``n`` ``mlp_block`` s in a Sequential (the optimizer tests' layer stacks)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[mlp_block(d, hidden, act=act, norm=norm, bias=bias) for _ in range(n)])


def layer_of(name: str) -> int:
    """The block a parameter of an ``mlp_stack`` belongs to (its name's first part)."""
    return int(name.split(".")[0])


class WideBlock(nn.Module):
    """x + Linear(2d, d)(tanh(LayerNorm(Linear(d, 2d)(x)))) (the clip tests' block)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.out(torch.tanh(self.norm(self.lin(x))))


class DropoutBlock(nn.Module):
    """x + dropout(tanh([BatchNorm](Linear(d, d)(x)))) (the conformance tests' block)."""

    def __init__(self, d, dropout, bn):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d) if bn else None
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.lin(x)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return x + self.drop(torch.tanh(h))


class StackNet(L.LightningModule):
    """Linear(6, d) -> ``layers`` blocks (``block()`` each, in ``self.layers``) -> a Linear(d, 1) head
    [and a Linear(d, 1) critic], built after ``torch.manual_seed(0)``; the loss is the head's output
    squared, averaged. Subclasses add the optimizer."""

    def __init__(self, block: Callable[[], nn.Module], d: int, *, layers: int = LAYERS, critic: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(6, d)
        self.layers = nn.ModuleList(block() for _ in range(layers))
        self.head = nn.Linear(d, 1)
        if critic:
            self.critic = nn.Linear(d, 1)

    def forward(self, x):
        h = self.emb(x)
        for b in self.layers:
            h = b(h)
        return h

    def training_step(self, batch, batch_idx):
        return self.head(self(batch)).square().mean()
