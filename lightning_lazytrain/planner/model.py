"""Model and training shapes, and the analytic cost of one decoder block.

The block is a pre-norm Llama/Qwen decoder layer: RMSNorm -> attention (GQA, RoPE, SDPA/flash)
-> residual -> RMSNorm -> SwiGLU MLP -> residual. Costs ignore: element-wise FLOPs (norms,
RoPE, SiLU: <1% of the matmuls), kernel launch gaps, and allocator fragmentation (absorbed by the
hardware profile's memory cap and efficiency factor).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import InvalidInput

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2.x has q/k/v biases
    qk_norm: bool = False  # Qwen3.x normalises q and k per head
    source: str = ""  # where the numbers came from

    def validate(self) -> ModelSpec:
        for key in ("num_layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"model.{key}", value, "must be an integer >= 1")
        if self.heads % self.kv_heads:
            raise InvalidInput("model.kv_heads", self.kv_heads, f"must divide heads={self.heads}")
        return self

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def block_params(self) -> int:
        """Parameters of one decoder block."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * self.intermediate
        return attn + mlp + 2 * h  # + two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Final norm + LM head (0 extra when tied to the embedding)."""
        return self.hidden + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def total_params(self) -> int:
        return self.num_layers * self.block_params + self.embedding_params + self.head_params

    def replace(self, **changes: object) -> ModelSpec:
        data = asdict(self)
        data.update(changes)
        return ModelSpec(**data).validate()


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    micro_batch_size: int
    seq_len: int
    grad_accum: int = 1
    dtype: str = "bf16"  # compute dtype of streamed weights and activations
    grad_dtype: str = "bf16"  # dtype of gradients sent device -> host
    eight_bit_fraction: float = 0.0  # fraction of block parameters with 8-bit optimizer states
    loss_chunk_tokens: int = 4096  # chunked cross-entropy: logits live for this many tokens at once
    causal: bool = True

    def validate(self) -> TrainSpec:
        for key in ("micro_batch_size", "seq_len", "grad_accum", "loss_chunk_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"train.{key}", value, "must be an integer >= 1")
        for key in ("dtype", "grad_dtype"):
            if getattr(self, key) not in DTYPE_BYTES:
                raise InvalidInput(f"train.{key}", getattr(self, key), f"must be one of {sorted(DTYPE_BYTES)}")
        if not 0.0 <= self.eight_bit_fraction <= 1.0:
            raise InvalidInput("train.eight_bit_fraction", self.eight_bit_fraction, "must be in [0, 1]")
        return self

    @property
    def tokens(self) -> int:
        """Tokens in one micro-batch."""
        return self.micro_batch_size * self.seq_len

    def replace(self, **changes: object) -> TrainSpec:
        data = asdict(self)
        data.update(changes)
        return TrainSpec(**data).validate()


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockCost:
    """Analytic per-block figures for one micro-batch (FLOPs and bytes)."""

    params: int
    fwd_flops: float
    bwd_flops: float  # backward only (input and weight grads), no recompute
    boundary_bytes: int  # the block's input/output hidden state
    internal_bytes: int  # everything autograd saves for backward, *including* the input boundary
    fwd_work_bytes: int  # transient peak of a forward without grad, beyond input and output
    bwd_work_bytes: int  # transient peak of a backward, beyond the saved internals
    notes: dict = field(default_factory=dict)


def block_cost(model: ModelSpec, train: TrainSpec) -> BlockCost:
    """FLOPs and bytes of one decoder block for one micro-batch.

    Shapes (N = batch * seq tokens, e = bytes of the compute dtype):
      boundary            [N, h]
      saved for backward  x, norm1(x), q, k, v, attn_out, x2, norm2(x2)   -> N*(4h + 2q + 2kv)
                          gate, up, silu(gate), silu(gate)*up             -> 4*N*f
                          (+ fp32 softmax log-sum-exp [B, heads, S] and norm rstd [N] x2)
    Attention FLOPs count QK^T and AV, halved for a causal mask (flash attention skips the upper
    triangle). Backward is 2x the forward matmul FLOPs and 2.5x the attention FLOPs.
    """
    e = DTYPE_BYTES[train.dtype]
    n = train.tokens
    b, s = train.micro_batch_size, train.seq_len
    h, f = model.hidden, model.intermediate
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    matmul_params = h * q + 2 * h * kv + q * h + 3 * h * f
    attn = 4 * b * model.heads * s * s * model.head_dim * (0.5 if train.causal else 1.0)
    fwd = 2.0 * n * matmul_params + attn
    bwd = 2.0 * 2.0 * n * matmul_params + 2.5 * attn
    boundary = n * h * e
    saved = n * e * (4 * h + 2 * q + 2 * kv + 4 * f) + 4 * (b * model.heads * s + 2 * n)
    fwd_work = 3 * n * f * e + n * (q + 2 * kv) * e  # gate, up, act live together; or q, k, v
    bwd_work = 3 * n * f * e + 2 * boundary  # activation grads of the MLP + grad in / grad out
    return BlockCost(params=model.block_params, fwd_flops=fwd, bwd_flops=bwd, boundary_bytes=boundary,
                     internal_bytes=saved, fwd_work_bytes=fwd_work, bwd_work_bytes=bwd_work)
