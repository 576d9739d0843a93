"""Block discovery on Hugging Face models (tiny configs, no weights) and plain modules; a stack held
in an nn.Sequential (whole, or a run of blocks between an embedding and a head) trains as under
``strategy="auto"``."""

from __future__ import annotations

from collections import OrderedDict

import lightning as L
import pytest
import torch
from test_conformance import (  # the conformance tests' helpers
    LAYERS,
    STEPS,
    Block,
    assert_same_model,
    fit,
)
from torch import nn

from lightning_lazytrain.engine.blocks import BlockDiscoveryError, BlockStack, find_blocks
from lightning_lazytrain.strategy import LazyTrainStrategy


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
def _tf():
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
    [("nope.layers", "does not exist"), ("embed", "not an nn.ModuleList or nn.Sequential"), ("", "empty")],
)
def test_explicit_path_errors(path: str, problem: str) -> None:
    with pytest.raises(BlockDiscoveryError, match=problem) as ei:
        find_blocks(_Plain(), path)
    assert "stack: nn.ModuleList, len=3, children=[3x_MoEBlock]" in str(ei.value)
    assert "blocks=" in str(ei.value)


def test_explicit_empty_modulelist() -> None:
    m = _Plain()
    m.empty = nn.ModuleList()
    with pytest.raises(BlockDiscoveryError, match="empty nn.ModuleList"):
        find_blocks(m, "empty")
    m.empty_seq = nn.Sequential()
    with pytest.raises(BlockDiscoveryError, match="empty nn.Sequential"):
        find_blocks(m, "empty_seq")


def test_no_blocks_error_lists_candidates() -> None:
    class NoStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])  # mixed classes
            self.b = nn.ModuleList([nn.Linear(2, 2)])  # too short for the fallback
            self.c = nn.Sequential(_Block(), nn.ReLU(), _Block(), nn.ReLU())  # mixed, no run of 2
            self.d = nn.Sequential(nn.Linear(2, 2))  # too short

    with pytest.raises(BlockDiscoveryError) as ei:
        find_blocks(NoStack())
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "nn.ModuleList / nn.Sequential candidates in NoStack" in msg
    assert "a: nn.ModuleList, len=2, children=[Linear, ReLU]" in msg
    assert "b: nn.ModuleList, len=1, children=[Linear]" in msg
    assert "c: nn.Sequential, len=4, children=[_Block, ReLU, _Block, ReLU]" in msg  # in order
    assert "d: nn.Sequential, len=1, children=[Linear]" in msg
    assert "no nn.Sequential with >= 2 consecutive children of one class" in msg
    assert 'blocks="model.layers"' in msg and 'blocks="net[1:5]"' in msg


def test_no_container_at_all() -> None:
    with pytest.raises(BlockDiscoveryError, match="no nn.ModuleList or nn.Sequential at all"):
        find_blocks(nn.Linear(2, 2))


def test_the_root_is_never_the_stack() -> None:
    with pytest.raises(BlockDiscoveryError, match=r"<root>: nn.Sequential, len=3, children=\[Linear, 2x_Block\]"):
        find_blocks(nn.Sequential(nn.Linear(8, 8), _Block(), _Block()))


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


# ------------------------------------------------------------------- nn.Sequential stacks
class _SeqPlain(nn.Module):
    """The stack as ``nn.Sequential(*[Block() for _ in range(n)])`` (timm's ViT writes it so)."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.Linear(8, 3)])  # a smaller homogeneous list
        self.blocks = nn.Sequential(*[_MoEBlock() for _ in range(n)])
        self.out = nn.Linear(8, 10)


class _SeqMixed(nn.Module):
    """The blocks inside one Sequential with the embedding, the final norm and the head."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(10, 8), *[_Block() for _ in range(n)], nn.LayerNorm(8),
                                 nn.Linear(8, 10))


def _check_run(stack: BlockStack, root: nn.Module, container: str, start: int, n: int) -> None:
    seq = root.get_submodule(container)
    assert stack.path == f"{container}[{start}:{start + n}]"
    assert stack.container_path == container and stack.container is seq
    assert getattr(stack.owner, stack.attr) is seq
    assert len(stack) == n and stack.start == start
    assert [stack[i] for i in range(n)] == list(seq)[start:start + n] == list(stack)
    names = dict(root.named_parameters())
    for i in range(n):  # the parameter names of block i (lit_module._layer_of relies on them)
        assert stack.block_path(i) == f"{container}.{start + i}"
        for pname, p in stack[i].named_parameters():
            assert names[f"{stack.block_path(i)}.{pname}"] is p


def test_sequential_of_identical_blocks_is_the_stack() -> None:
    m = _SeqPlain()
    stack = find_blocks(m)
    _check(stack, m, "blocks", 4)  # not `heads`, and not the 6-long expert lists inside each block
    assert stack.start == 0 and stack.container is m.blocks and stack.block_path(3) == "blocks.3"
    _check(find_blocks(m, "blocks"), m, "blocks", 4)
    _check(find_blocks(m, "blocks[:]"), m, "blocks", 4)  # a slice of all of it is the Sequential itself


def test_named_sequential_children_keep_their_names() -> None:
    class TorchvisionLike(nn.Module):  # torchvision's ViT: nn.Sequential(OrderedDict(encoder_layer_0=...))
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Module()
            self.encoder.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", _Block()) for i in range(3)))

    m = TorchvisionLike()
    stack = find_blocks(m)
    paths = [stack.block_path(i) for i in range(3)]
    assert stack.path == "encoder.layers" and len(stack) == 3
    assert paths == [f"encoder.layers.encoder_layer_{i}" for i in range(3)]
    assert all(n in dict(m.named_parameters()) for n in (f"{p}.lin.weight" for p in paths))


def test_run_of_blocks_inside_a_mixed_sequential_is_the_stack() -> None:
    m = _SeqMixed()
    _check_run(find_blocks(m), m, "net", 1, 4)
    _check_run(find_blocks(m, "net"), m, "net", 1, 4)  # an explicit mixed Sequential: its run
    _check_run(find_blocks(m, "net[1:5]"), m, "net", 1, 4)  # the found path is accepted back
    _check_run(find_blocks(m, " net[2:-2] "), m, "net", 2, 3)  # any slice, Python's bounds
    whole = find_blocks(m, "net[0:7]")  # exactly what is named, whatever the classes
    _check(whole, m, "net", 7)


def test_the_largest_run_wins_and_leaf_runs_rank_last() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), *[_Block() for _ in range(3)],
                                     nn.ReLU(), *[_MoEBlock() for _ in range(2)], nn.Linear(8, 2))

    m = Two()
    _check_run(find_blocks(m), m, "net", 6, 2)  # 2 MoE blocks hold more parameters than 3 _Blocks

    class BigHead(nn.Module):  # a stack of small blocks and a head of two Linears holding far more
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(_Block() for _ in range(2))
            self.head = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 1000))

    m = BigHead()
    _check(find_blocks(m), m, "layers", 2)
    only_leaves = nn.Module()  # with nothing else, a Sequential of plain layers is the stack
    only_leaves.mlp = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    _check(find_blocks(only_leaves), only_leaves, "mlp", 3)


def test_a_sequential_stack_beats_the_lists_inside_its_blocks_and_a_smaller_list() -> None:
    m = _SeqPlain(n=2)
    m.extra = nn.ModuleList(_Block() for _ in range(5))  # longer, fewer parameters
    _check(find_blocks(m), m, "blocks", 2)


def test_known_suffix_may_be_a_sequential() -> None:
    class Multi(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision = nn.Module()
            self.vision.encoder = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))  # bigger
            self.model = nn.Module()
            self.model.layers = nn.Sequential(nn.Embedding(4, 8), _Block(), _Block())

    m = Multi()
    _check_run(find_blocks(m), m, "model.layers", 1, 2)


@pytest.mark.parametrize(
    ("path", "problem"),
    [("mlp", r"mixed classes \(Linear, ReLU, Linear, ReLU\) without a run of >= 2.*blocks='mlp\[0:4\]'"),
     ("mlp[3:1]", "selects no child of 'mlp'"), ("mlp[::2]", "not a dotted path"), ("[1:2]", "names no module"),
     ("blocks[5:]", "selects no child")],
)
def test_explicit_sequential_errors(path: str, problem: str) -> None:
    m = _SeqPlain(n=2)
    m.mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
    with pytest.raises(BlockDiscoveryError, match=problem) as ei:
        find_blocks(m, path)
    assert "mlp: nn.Sequential, len=4, children=[Linear, ReLU, Linear, ReLU]" in str(ei.value)
    assert "blocks: nn.Sequential, len=2, children=[2x_MoEBlock]" in str(ei.value)


# ------------------------------------------------- Lightning: a Sequential stack trains as under auto
def _seq_net(mixed: bool) -> L.LightningModule:
    class SeqNet(L.LightningModule):
        """conformance's Net with its stack in an nn.Sequential: the stack alone
        (``self.layers = nn.Sequential(*blocks)``) or between the input layer and the head
        (``self.net = nn.Sequential(emb, *blocks, norm, head)``)."""

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            d = 16
            emb, head = nn.Linear(6, d), nn.Linear(d, 1)
            blocks = [Block(d, 0.1, False) for _ in range(LAYERS)]  # dropout: replayed RNG
            if mixed:
                self.net = nn.Sequential(emb, *blocks, nn.LayerNorm(d), head)
            else:
                self.emb, self.layers, self.head = emb, nn.Sequential(*blocks), head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) if mixed else self.head(self.layers(self.emb(x)))

        def training_step(self, batch, batch_idx):
            loss = self(batch).square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return SeqNet()


@pytest.mark.parametrize("mixed", [False, True], ids=["sequential", "emb_blocks_head"])
@pytest.mark.parametrize("policy", ["milp", "recompute_all", "megatrain"])
def test_sequential_stack_trains_as_auto(policy: str, mixed: bool) -> None:
    class Streamed(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def __init__(self) -> None:
            self.paths: list[tuple[str, int]] = []

        def on_train_batch_end(self, trainer, *args) -> None:
            stack = trainer.strategy.executor.stack
            assert all("forward" in vars(b) for b in stack)  # the executor's forward, called by the Sequential
            self.paths.append((stack.path, len(stack)))

    ref, want = fit("auto", _seq_net(mixed))
    seen = Streamed()
    got_model, got = fit(LazyTrainStrategy(policy=policy), _seq_net(mixed), callbacks_extra=[seen])
    path = f"net[1:{1 + LAYERS}]" if mixed else "layers"
    assert seen.paths == [(path, LAYERS)] * STEPS  # the Sequential's blocks were streamed
    assert len(want) == STEPS and got == want  # per-step losses, bit-equal
    assert_same_model(got_model, ref)  # final state_dict, torch.equal
