"""A ``ModelSpec`` from a Hugging Face config (a ``transformers.PretrainedConfig`` or its ``to_dict()``).

No torch and no transformers import: the config is read attribute by attribute. Families the memory
model describes (``memory_model.layer_tape``): the Llama layout (llama, mistral, qwen2, qwen3,
and their relatives with the same decoder layer), Gemma2 (Gemma RMSNorm, four norms, soft-capped
eager attention), GPT-2 (LayerNorm, fused biased q/k/v, plain GELU MLP) and the routed
mixtures of experts of Qwen2-MoE, Qwen3-MoE and Mixtral (every layer sparse). Anything else raises
``InvalidInput`` rather than being approximated.
"""

from __future__ import annotations

from typing import Any

from .errors import InvalidInput
from .model import ModelSpec

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("qwen2_moe", "qwen3_moe", "mixtral")
FAMILIES = LLAMA_LIKE + MOE + ("gemma2", "gpt2")


def _get(cfg: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        value = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
        if value is not None:
            return value
    return default


def model_spec_from_hf(config: Any, *, name: str | None = None, attn_implementation: str | None = None) -> ModelSpec:
    """The planner's description of a Hugging Face decoder-only model.

    ``attn_implementation``: what the model runs (default: the config's ``_attn_implementation``,
    else ``sdpa``; Gemma2 with soft-capping runs ``eager``, as transformers requires)."""
    mt = _get(config, "model_type")
    if mt not in FAMILIES:
        raise InvalidInput("hf_config.model_type", mt, f"the memory model describes {', '.join(FAMILIES)}")
    gpt2 = mt == "gpt2"
    hidden = int(_get(config, "hidden_size", "n_embd"))
    heads = int(_get(config, "num_attention_heads", "n_head"))
    kv_heads = int(_get(config, "num_key_value_heads", default=heads))
    head_dim = int(_get(config, "head_dim", default=hidden // heads))
    intermediate = int(_get(config, "intermediate_size", "n_inner", default=4 * hidden))
    impl = attn_implementation or _get(config, "_attn_implementation", "attn_implementation", default="sdpa")
    if impl == "flash_attention_2":
        impl = "sdpa"  # same saved tensors as SDPA's flash kernel
    softcap = mt == "gemma2" and _get(config, "attn_logit_softcapping") is not None
    fields: dict[str, Any] = dict(
        name=name or f"hf-{mt}", num_layers=int(_get(config, "num_hidden_layers", "n_layer")), hidden=hidden,
        intermediate=intermediate, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        vocab=int(_get(config, "vocab_size")), tied_embeddings=bool(_get(config, "tie_word_embeddings", default=True)),
        qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(_get(config, "attention_bias", default=False)),
        qk_norm=mt in ("qwen3", "qwen3_moe"), attn_implementation=impl,
        norm="layer" if gpt2 else "rms_fp32" if mt == "gemma2" else "rms", post_norms=mt == "gemma2",
        mlp="plain" if gpt2 else "gated",
        activation=_get(config, "activation_function", "hidden_activation", "hidden_act", default="silu"),
        bias=gpt2, softmax_fp32=not gpt2, attn_softcap=softcap, source=f"Hugging Face config ({mt})")
    if mt in MOE:
        if mt == "mixtral":
            experts, width = _get(config, "num_local_experts"), intermediate
        else:
            experts, width = _get(config, "num_experts"), _get(config, "moe_intermediate_size")
            step = _get(config, "decoder_sparse_step", default=1)
            if step != 1 or _get(config, "mlp_only_layers", default=[]):
                raise InvalidInput("hf_config.decoder_sparse_step", step,
                                   "every layer must be sparse (one block type per model)")
        fields.update(num_experts=int(experts), experts_per_token=int(_get(config, "num_experts_per_tok")),
                      expert_intermediate=int(width),
                      shared_expert_intermediate=int(_get(config, "shared_expert_intermediate_size", default=0)),
                      router_weights_fp32=mt == "mixtral")
    return ModelSpec(**fields).validate()
