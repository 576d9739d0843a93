"""A Llama/Qwen-style decoder (pre-norm, GQA, RoPE, SwiGLU) built from a planner ``ModelSpec``.

The same block the planner's ``block_cost`` describes, so analytic and measured workloads can be
compared on CPU. Blocks are called like Hugging Face decoder layers: ``block(hidden,
position_embeddings=(cos, sin), attention_mask=None)`` and return the new hidden state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_lazytrain.models.loss import chunked_lm_loss
from lightning_lazytrain.planner.model import ModelSpec

# scaled_dot_product_attention(enable_gqa=...) exists from torch 2.5 on
_SDPA_GQA = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


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
        # Attention and MLP run in their own functions, as in Hugging Face's layers, so that their
        # temporaries (q, k, v; the norms' outputs) are freed when each returns: the planner's memory
        # model (planner/memory_model.py) replays exactly this order.
        hidden = hidden + self._attention(self.input_layernorm(hidden), position_embeddings, attention_mask)
        return hidden + self._mlp(self.post_attention_layernorm(hidden))

    def _attention(self, x: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                   attention_mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [B, H, S, d]
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        gqa = {}
        if self.heads != self.kv_heads:
            if _SDPA_GQA and (q.dtype != torch.float32 or q.device.type != "cuda"):
                # the kernel reads the shared k/v heads (flash kernels; CPU): no expanded copies saved
                gqa = {"enable_gqa": True}
            else:  # fp32 on CUDA has no flash kernel and the memory-efficient one needs expanded heads
                rep = self.heads // self.kv_heads
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None,
                                              **gqa)
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, -1))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLM(nn.Module):
    """``forward(tokens[B, S]) -> logits[B, S, V]``; ``loss(tokens)`` is next-token cross-entropy (chunked)."""

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

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens[B, S] -> `` the final norm's output ``[B, S, h]`` (what the LM head multiplies)."""
        hidden = self.embed_tokens(tokens)
        pe = rotary(tokens.shape[1], self.spec.head_dim, self.rope_theta, hidden.device, hidden.dtype)
        for block in self.layers:
            hidden = block(hidden, position_embeddings=pe)
        return self.norm(hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden_states(tokens))

    def loss(self, tokens: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens[B, S + 1]``, through the LM head ``chunk_tokens``
        tokens at a time (``models/loss.py``; the planner's ``TrainSpec.loss_chunk_tokens``): the full
        logits of a micro-batch are never held."""
        return chunked_lm_loss(self.hidden_states(tokens[:, :-1]), self.lm_head.weight, tokens[:, 1:], chunk_tokens)
