"""A Llama/Qwen-style decoder (pre-norm, GQA, RoPE, SwiGLU) built from a planner ``ModelSpec``.

The same block the planner's ``block_cost`` describes, so analytic and measured workloads can be
compared on CPU. Blocks are called like Hugging Face decoder layers: ``block(hidden,
position_embeddings=(cos, sin), attention_mask=None)`` and return the new hidden state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lazytrain.planner.model import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as in Llama; x: [B, S, h]
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotary(seq_len: int, head_dim: int, theta: float, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_dim
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, d
        self.input_layernorm = RMSNorm(h)
        self.q_proj = nn.Linear(h, spec.heads * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, spec.kv_heads * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(spec.heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h)
        self.gate_proj = nn.Linear(h, spec.intermediate, bias=False)
        self.up_proj = nn.Linear(h, spec.intermediate, bias=False)
        self.down_proj = nn.Linear(spec.intermediate, h, bias=False)

    def forward(self, hidden: torch.Tensor, *, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = hidden.shape
        x = self.input_layernorm(hidden)
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, d]
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None)
        hidden = hidden + self.o_proj(attn.transpose(1, 2).reshape(b, s, -1))
        x = self.post_attention_layernorm(hidden)
        return hidden + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLM(nn.Module):
    """``forward(tokens[B, S]) -> logits[B, S, V]``; ``loss(tokens)`` is next-token cross-entropy."""

    def __init__(self, spec: ModelSpec, rope_theta: float = 10000.0) -> None:
        super().__init__()
        spec.validate()
        self.spec = spec
        self.rope_theta = rope_theta
        self.embed_tokens = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleList(LlamaBlock(spec) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(tokens)
        pe = rotary(tokens.shape[1], self.spec.head_dim, self.rope_theta, hidden.device, hidden.dtype)
        for block in self.layers:
            hidden = block(hidden, position_embeddings=pe)
        return self.lm_head(self.norm(hidden))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
