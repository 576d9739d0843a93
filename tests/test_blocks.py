"""Block discovery on Hugging Face models (tiny configs, no weights) and plain modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_lazytrain.blocks import BlockDiscoveryError, BlockStack, find_blocks


class _Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _MoEBlock(nn.Module):
    """A block holding many identical experts: the expert list must not win."""

    def __init__(self, d: int = 8, experts: int = 6) -> None:
        super().__init__()
        self.attn = nn.Linear(d, 4 * d)
        self.experts = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(experts))


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])  # heterogeneous sizes, same class
        self.stack = nn.ModuleList(_MoEBlock() for _ in range(3))
        self.out = nn.Linear(8, 10)


def _check(stack: BlockStack, root: nn.Module, path: str, n: int) -> None:
    assert stack.path == path
    assert len(stack) == n
    assert stack.blocks is root.get_submodule(path)
    assert getattr(stack.owner, stack.attr) is stack.blocks
    assert stack.block_path(0) == f"{path}.0"


# --------------------------------------------------------------------------- HF
def _tf():  # noqa: ANN202 - the transformers module
    return pytest.importorskip("transformers")


def _llama() -> nn.Module:
    cfg = _tf().LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return _tf().LlamaForCausalLM(cfg)


def _qwen2() -> nn.Module:
    cfg = _tf().Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    return _tf().Qwen2ForCausalLM(cfg)


def _gpt2() -> nn.Module:
    cfg = _tf().GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return _tf().GPT2LMHeadModel(cfg)


def _neox() -> nn.Module:
    cfg = _tf().GPTNeoXConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        bos_token_id=0, eos_token_id=0,
    )
    return _tf().GPTNeoXForCausalLM(cfg)


@pytest.mark.parametrize(
    ("factory", "path", "n"),
    [(_llama, "model.layers", 3), (_qwen2, "model.layers", 2), (_gpt2, "transformer.h", 2),
     (_neox, "gpt_neox.layers", 2)],
    ids=["llama", "qwen2", "gpt2", "gpt_neox"],
)
def test_hf_models(factory, path: str, n: int) -> None:
    model = factory()
    _check(find_blocks(model), model, path, n)


def test_wrapped_in_lightning_like_module() -> None:
    class Wrapper(nn.Module):  # what a LightningModule holding `self.model` looks like
        def __init__(self) -> None:
            super().__init__()
            self.model = _llama()

    w = Wrapper()
    stack = find_blocks(w)
    _check(stack, w, "model.model.layers", 3)
    assert stack.owner is w.model.model


def test_explicit_path_on_hf() -> None:
    model = _gpt2()
    _check(find_blocks(model, "transformer.h"), model, "transformer.h", 2)


# ------------------------------------------------------------------------ plain
def test_plain_module_fallback_prefers_biggest_homogeneous_list() -> None:
    m = _Plain()
    # `stack` (3 MoE blocks) beats both `heads` and the 6-long per-block expert lists.
    _check(find_blocks(m), m, "stack", 3)


def test_explicit_path_plain() -> None:
    m = _Plain()
    _check(find_blocks(m, "heads"), m, "heads", 2)
    _check(find_blocks(m, ".stack.0.experts"), m, "stack.0.experts", 6)


@pytest.mark.parametrize(
    ("path", "problem"),
    [("nope.layers", "does not exist"), ("embed", "not an nn.ModuleList"), ("", "empty")],
)
def test_explicit_path_errors(path: str, problem: str) -> None:
    with pytest.raises(BlockDiscoveryError, match=problem) as ei:
        find_blocks(_Plain(), path)
    assert "stack: len=3" in str(ei.value)
    assert "blocks=" in str(ei.value)


def test_explicit_empty_modulelist() -> None:
    m = _Plain()
    m.empty = nn.ModuleList()
    with pytest.raises(BlockDiscoveryError, match="empty nn.ModuleList"):
        find_blocks(m, "empty")


def test_no_blocks_error_lists_candidates() -> None:
    class NoStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # mixed classes
            self.b = nn.ModuleList([nn.Linear(2, 2)])  # too short for the fallback
            self.c = nn.Sequential(_Block(), _Block())  # not a ModuleList

    with pytest.raises(BlockDiscoveryError) as ei:
        find_blocks(NoStack())
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "a: len=2, children=[Linear, ReLU]" in msg
    assert "b: len=1, children=[Linear]" in msg
    assert 'blocks="model.layers"' in msg


def test_no_modulelist_at_all() -> None:
    with pytest.raises(BlockDiscoveryError, match="no nn.ModuleList at all"):
        find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def test_known_suffix_beats_bigger_generic_list() -> None:
    class Multi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision = nn.Module()
            self.vision.encoder = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))  # bigger
            self.model = nn.Module()
            self.model.layers = nn.ModuleList(_Block() for _ in range(2))

    m = Multi()
    _check(find_blocks(m), m, "model.layers", 2)
