"""assign_state_bits policies, state-byte accounting and optimizer construction checks."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from lightning_lazytrain.optim import (
    HybridAdamW,
    assign_state_bits,
    estimate_state_bytes,
    is_norm_name,
    param_state_bytes,
)

SHAPES: list[tuple[str, tuple[int, ...]]] = [
    ("embed.weight", (1000, 64)),  # 64,000
    ("layers.0.attn.qkv.weight", (192, 64)),  # 12,288
    ("layers.0.attn.qkv.bias", (192,)),
    ("layers.0.input_layernorm.weight", (64,)),
    ("layers.0.mlp.up.weight", (256, 64)),  # 16,384
    ("layers.0.mlp.down.weight", (64, 256)),  # 16,384
    ("layers.0.small.weight", (8, 8)),  # 64: below min_8bit_numel
    ("ln_f.weight", (64,)),
    ("final_norm.proj", (128, 64)),  # 2-d but a norm layer
]
TOTAL = sum(torch.Size(s).numel() for _, s in SHAPES)



def test_none_and_all() -> None:
    assert set(assign_state_bits(SHAPES, "none").values()) == {32}
    bits = assign_state_bits(SHAPES, "all")
    assert {n for n, b in bits.items() if b == 8} == {
        "embed.weight",
        "layers.0.attn.qkv.weight",
        "layers.0.mlp.up.weight",
        "layers.0.mlp.down.weight",
    }


def test_norm_names() -> None:
    for name in ["model.norm.weight", "h.3.ln_1.weight", "ln_f.bias", "layers.0.post_attention_layernorm.weight",
                 "bn1.weight", "encoder.layer_norm.weight", "RMSNorm.scale"]:
        assert is_norm_name(name), name
    for name in ["layers.0.mlp.up.weight", "embed.weight", "lm_head.weight", "linear.weight"]:
        assert not is_norm_name(name), name


def test_fraction_greedy_largest_first_never_above_target() -> None:
    # 20 % of TOTAL (~109k) = ~21.9k: embed (64k) does not fit, one 16,384 tensor does, then
    # nothing else fits (12,288 would exceed) -> exactly one tensor, the first by name among ties.
    bits = assign_state_bits(SHAPES, 0.2)
    eight = [n for n, b in bits.items() if b == 8]
    assert eight == ["layers.0.mlp.down.weight"]
    covered = sum(torch.Size(dict(SHAPES)[n]).numel() for n in eight)
    assert covered <= 0.2 * TOTAL
    # A larger fraction takes the embedding first.
    bits = assign_state_bits(SHAPES, 0.7)
    assert bits["embed.weight"] == 8
    assert sum(torch.Size(dict(SHAPES)[n]).numel() for n, b in bits.items() if b == 8) <= 0.7 * TOTAL
    # Deterministic under input reordering.
    assert assign_state_bits(list(reversed(SHAPES)), 0.2) == assign_state_bits(SHAPES, 0.2)


def test_fraction_too_small_selects_nothing_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    assert set(assign_state_bits(SHAPES, 0.01).values()) == {32}
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain.optim"):
        HybridAdamW(_named_model().named_parameters(), eight_bit=0.01)
    assert "selected no tensor" in caplog.text


def test_predicate_cannot_override_eligibility() -> None:
    bits = assign_state_bits(SHAPES, lambda name, shape: "mlp" in name or "norm" in name or "small" in name)
    assert {n for n, b in bits.items() if b == 8} == {"layers.0.mlp.up.weight", "layers.0.mlp.down.weight"}


@pytest.mark.parametrize("bad", ["half", 0.0, 1.5, True, 3])
def test_bad_policies(bad: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        assign_state_bits(SHAPES, bad)  # type: ignore[arg-type]


def test_duplicate_names_rejected() -> None:
    with pytest.raises(ValueError):
        assign_state_bits([("a", (64, 64)), ("a", (64, 64))], "all")


def test_estimate_pure_and_all_8bit_below_0_3x() -> None:
    est32 = estimate_state_bytes(SHAPES, "none")
    assert est32.total == sum(param_state_bytes(torch.Size(s).numel(), 32) for _, s in SHAPES)
    assert est32.bytes_per_param == pytest.approx(8.0, abs=0.01)
    # A big model: all-8bit states at most 0.3x of fp32 AdamW's.
    big = [(f"layers.{i}.w", (4096, 4096)) for i in range(4)] + [(f"layers.{i}.norm.weight", (4096,)) for i in range(4)]
    ratio = estimate_state_bytes(big, "all").total / estimate_state_bytes(big, "none").total
    assert ratio <= 0.3
    assert ratio == pytest.approx((2 + 8 / 256) / 8, rel=1e-3)
    # Meta tensors work too (no allocation).
    meta = [(n, torch.empty(s, device="meta")) for n, s in big]
    assert estimate_state_bytes(meta, "all").total == estimate_state_bytes(big, "all").total


def _named_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64), torch.nn.Linear(64, 8)
    )


@pytest.mark.parametrize("policy", ["none", "all", 0.5])
def test_estimate_equals_measured(policy: object) -> None:
    if policy != "none":
        pytest.importorskip("bitsandbytes")
    model = _named_model()
    named = list(model.named_parameters())
    opt = HybridAdamW(model.named_parameters(), eight_bit=policy)  # type: ignore[arg-type]
    measured = opt.state_bytes()
    estimated = estimate_state_bytes(named, policy)  # type: ignore[arg-type]
    assert opt.assignment == assign_state_bits(named, policy)  # type: ignore[arg-type]
    assert measured.total == estimated.total
    assert measured.per_param == estimated.per_param
    assert measured.qmap_bytes == estimated.qmap_bytes
    # And the tensors really are what the assignment says.
    for name, p in named:
        st = opt.state[p]
        if opt.assignment[name] == 8:
            assert st["state1"].dtype == torch.uint8 and st["absmax1"].numel() == -(-p.numel() // 256)
        else:
            assert st["exp_avg"].dtype == p.dtype


def test_assignment_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("bitsandbytes")
    with caplog.at_level(logging.INFO, logger="lightning_lazytrain.optim"):
        HybridAdamW(_named_model().named_parameters(), eight_bit="all")
    text = caplog.text
    assert "2/8 tensors 8-bit" in text and "B/param" in text


def test_block_size_must_be_256() -> None:
    with pytest.raises(ValueError, match="fixed block of 256"):
        HybridAdamW(_named_model().parameters(), eight_bit="all", block_size=2048)
    HybridAdamW(_named_model().parameters(), eight_bit="none", block_size=256)


def test_unnamed_params_get_names() -> None:
    opt = HybridAdamW(_named_model().parameters())
    assert list(opt.assignment) == [f"g0.p{i}" for i in range(8)]


@pytest.mark.slow
def test_works_without_bitsandbytes() -> None:
    """eight_bit='none' needs no bitsandbytes; asking for 8-bit then fails with a clear error."""
    code = (
        "import sys; sys.modules['bitsandbytes'] = None\n"
        "import torch\n"
        "from lightning_lazytrain.optim import HybridAdamW\n"
        "m = torch.nn.Linear(64, 64)\n"
        "opt = HybridAdamW(m.parameters(), eight_bit='none', max_grad_norm=1.0)\n"
        "m(torch.randn(2, 64)).sum().backward(); opt.step()\n"
        "try:\n"
        "    HybridAdamW(m.parameters(), eight_bit='all')\n"
        "except ImportError as e:\n"
        "    print('IMPORT-ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "IMPORT-ERROR 8-bit optimizer states need bitsandbytes" in out.stdout


def test_config_builds_and_estimates_the_same_bytes() -> None:
    from lightning_lazytrain.optim import HybridAdamWConfig

    cfg = HybridAdamWConfig(lr=3e-4, eight_bit="none", max_grad_norm=1.0, impl="foreach")
    model = _named_model()
    estimate = cfg.state_bytes([(n, torch.empty(p.shape, device="meta")) for n, p in model.named_parameters()])
    opt = cfg.build(model.named_parameters())
    assert opt.max_grad_norm == 1.0 and opt.impl == "foreach" and opt.param_groups[0]["lr"] == 3e-4
    assert opt.state_bytes().total == estimate.total
