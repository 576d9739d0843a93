"""Model and training shapes, and the analytic cost of one decoder block.

The default block is a pre-norm Llama/Qwen decoder layer: RMSNorm -> attention (GQA, RoPE, SDPA/flash)
-> residual -> RMSNorm -> SwiGLU MLP -> residual. ``ModelSpec``'s layout fields describe the other
layers the memory model knows (eager attention, Gemma2's norms, GPT-2's LayerNorm and plain MLP,
routed experts); ``hf.model_spec_from_hf`` fills them from a Hugging Face config. Bytes come from
``memory_model`` (the layer's ops replayed as PyTorch allocates and frees them). Costs ignore:
element-wise FLOPs (norms, RoPE, SiLU: <1% of the matmuls), kernel launch gaps, dropout (taken as
off), allocator fragmentation (absorbed by the hardware profile's memory cap and efficiency factor).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import InvalidInput
from .memory_model import layer_memory
from .units import DTYPE_BYTES

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")
NORMS = ("rms", "rms_fp32", "layer")
MLPS = ("gated", "plain")
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu", "gelu_new")


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
    # ---- layer layout: what the memory model replays (memory_model.py); defaults = HF Llama/Qwen ----
    attn_implementation: str = "sdpa"  # sdpa (flash kernels: q, k, v, out, fp32 row stats) | eager (S x S probs)
    norm: str = "rms"  # rms: HF Llama RMSNorm (fp32 statistics, scale in the compute dtype) |
    #                    rms_fp32: Gemma RMSNorm (x * (1 + w) in fp32) | layer: nn.LayerNorm (weight + bias)
    post_norms: bool = False  # Gemma2: a norm after attention and after the MLP too (4 per block)
    mlp: str = "gated"  # gated: down(act(gate(x)) * up(x)) | plain: fc2(act(fc1(x))) (GPT-2)
    activation: str = "silu"  # HF hidden_act: silu | gelu | gelu_pytorch_tanh | relu | gelu_new (Python tanh GELU)
    bias: bool = False  # every projection has a bias (GPT-2); qkv_bias alone is Qwen2's
    softmax_fp32: bool = True  # eager attention: softmax in fp32 (HF Llama family) or in the compute dtype (GPT-2)
    attn_softcap: bool = False  # Gemma2: tanh soft-capping of the attention logits (eager)
    num_experts: int = 0  # > 0: the MLP is a routed mixture of experts (grouped experts, top-k router)
    experts_per_token: int = 0  # top-k
    expert_intermediate: int = 0  # each expert's gated MLP width
    shared_expert_intermediate: int = 0  # > 0: Qwen2-MoE's always-on shared expert with a sigmoid gate
    router_weights_fp32: bool = False  # Mixtral: routing weights stay fp32 (weighted expert outputs in fp32)
    source: str = ""  # where the numbers came from

    def validate(self) -> ModelSpec:
        for key in ("num_layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInput(f"model.{key}", value, "must be an integer >= 1")
        if self.heads % self.kv_heads:
            raise InvalidInput("model.kv_heads", self.kv_heads, f"must divide heads={self.heads}")
        for key, allowed in (("attn_implementation", ATTN_IMPLEMENTATIONS), ("norm", NORMS), ("mlp", MLPS),
                             ("activation", ACTIVATIONS)):
            if getattr(self, key) not in allowed:
                raise InvalidInput(f"model.{key}", getattr(self, key), f"must be one of {', '.join(allowed)}")
        for key in ("num_experts", "experts_per_token", "expert_intermediate", "shared_expert_intermediate"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInput(f"model.{key}", value, "must be an integer >= 0")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise InvalidInput("model.experts_per_token", self.experts_per_token,
                                   f"must be in 1..num_experts={self.num_experts} for a mixture of experts")
            if self.expert_intermediate < 1:
                raise InvalidInput("model.expert_intermediate", self.expert_intermediate,
                                   "must be >= 1 for a mixture of experts")
            if self.mlp != "gated":
                raise InvalidInput("model.mlp", self.mlp, "experts are gated MLPs (mlp: gated)")
        elif self.experts_per_token or self.expert_intermediate or self.shared_expert_intermediate:
            raise InvalidInput("model.num_experts", 0, "experts_per_token, expert_intermediate and "
                               "shared_expert_intermediate need num_experts > 0")
        return self

    # ---- parameter counts -------------------------------------------------------------------
    @property
    def norm_params(self) -> int:
        """Parameters of one of the block's norms (weight, and bias for LayerNorm)."""
        return self.hidden * (2 if self.norm == "layer" else 1)

    @property
    def mlp_matmul_params(self) -> int:
        """Weights of the MLP's matrices one token is multiplied by (a routed MLP: the router, its top-k
        experts and the shared expert with its gate)."""
        h = self.hidden
        if self.num_experts:
            shared = 3 * h * self.shared_expert_intermediate + (h if self.shared_expert_intermediate else 0)
            return h * self.num_experts + self.experts_per_token * 3 * h * self.expert_intermediate + shared
        return (3 if self.mlp == "gated" else 2) * h * self.intermediate

    @property
    def block_params(self) -> int:
        """Parameters of one decoder block."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias or self.bias:
            attn += q + 2 * kv
        if self.bias:
            attn += h
        if self.qk_norm:
            attn += 2 * self.head_dim
        if self.num_experts:
            shared = 3 * h * self.shared_expert_intermediate + (h if self.shared_expert_intermediate else 0)
            mlp = h * self.num_experts + self.num_experts * 3 * h * self.expert_intermediate + shared
        else:
            mlp = self.mlp_matmul_params
            if self.bias:
                mlp += (2 if self.mlp == "gated" else 1) * self.intermediate + h
        norms = 4 if self.post_norms else 2
        return attn + mlp + norms * self.norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """Final norm + LM head (0 extra when tied to the embedding)."""
        return self.norm_params + (0 if self.tied_embeddings else self.vocab * self.hidden)

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
    partial_bytes: int = 0  # a partial keep: the matmul-class ops' outputs (memory_model.Tape.partial)
    elementwise_bytes: int = 0  # ... and what its elementwise recompute reads and writes
    partial_recompute_bytes: int = 0  # ... and the saved tensors that recompute re-materialises
    notes: dict = field(default_factory=dict)


def block_cost(model: ModelSpec, train: TrainSpec) -> BlockCost:
    """FLOPs and bytes of one decoder block for one micro-batch.

    FLOPs (N = batch * seq tokens): 2 * N per weight of every matrix a token is multiplied by
    (attention projections, the MLP's matrices or the router and top-k experts), plus QK^T and AV,
    halved for a causal mask under ``sdpa`` (flash kernels skip the upper triangle; eager computes
    the whole S x S). Backward is 2x the forward matmul FLOPs and 2.5x the attention FLOPs.

    Bytes: ``memory_model.layer_memory`` replays the layer's ops (norms with their fp32 copies, the
    attention implementation, the MLP layout, experts) as PyTorch allocates, saves and frees them:
    ``internal_bytes`` = boundary + every tensor autograd saves (with fp32 islands: RMSNorm's fp32
    input copy and row statistics, the softmax's log-sum-exp or eager's fp32 probabilities, the
    router's probabilities), ``fwd_work_bytes`` and ``bwd_work_bytes`` the transient peaks (see
    ``BlockCost``). ``notes["saved_by"]``: saved bytes per op that first keeps them.
    """
    e = DTYPE_BYTES[train.dtype]
    n = train.tokens
    b, s = train.micro_batch_size, train.seq_len
    h = model.hidden
    q, kv = model.heads * model.head_dim, model.kv_heads * model.head_dim
    matmul_params = h * q + 2 * h * kv + q * h + model.mlp_matmul_params
    causal = 0.5 if train.causal and model.attn_implementation == "sdpa" else 1.0
    attn = 4 * b * model.heads * s * s * model.head_dim * causal
    fwd = 2.0 * n * matmul_params + attn
    bwd = 2.0 * 2.0 * n * matmul_params + 2.5 * attn
    boundary = n * h * e
    mem = layer_memory(model, train)
    saved = boundary + mem.saved_bytes
    return BlockCost(params=model.block_params, fwd_flops=fwd, bwd_flops=bwd, boundary_bytes=boundary,
                     internal_bytes=int(round(saved)), fwd_work_bytes=int(round(mem.fwd_work_bytes)),
                     bwd_work_bytes=int(round(mem.bwd_work_bytes)), partial_bytes=int(round(mem.partial_bytes)),
                     elementwise_bytes=int(round(mem.elementwise_bytes)),
                     partial_recompute_bytes=int(round(mem.partial_recompute_bytes)), notes={"saved_by": mem.breakdown})
