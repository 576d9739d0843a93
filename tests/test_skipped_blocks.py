"""A training forward that skips a block (LayerDrop) is refused with a message that names the pattern and
the fix, not an internal staging error (found by a review: it failed with "layer 3 is not staged in slot 1")."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_lazytrain.strategy import LazyTrainStrategy


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class SkippingNet(L.LightningModule):
    """Four blocks; from batch ``skip_at`` on, block 1 is skipped (as LayerDrop would)."""

    def __init__(self, skip_at: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(16) for _ in range(4))
        self.head = nn.Linear(16, 1)
        self.skip_at = skip_at

    def forward(self, x: torch.Tensor, skip: bool = False) -> torch.Tensor:
        for i, block in enumerate(self.layers):
            if not (skip and i == 1):
                x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        return self(batch, skip=batch_idx >= self.skip_at).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_skipped_block_is_refused_with_the_pattern_and_the_fix():
    torch.manual_seed(0)
    data = [torch.randn(4, 16) for _ in range(4)]
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy="recompute_all"), accelerator="cpu", max_steps=4,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    with pytest.raises(RuntimeError, match=r"block 2 .* without \[1\] \(the model skips or reorders blocks.*Fix"):
        trainer.fit(SkippingNet(skip_at=2), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    assert trainer.strategy.core.executor is None  # torn down
