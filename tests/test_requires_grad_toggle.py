"""``requires_grad`` set on a non-block weight through the module inside ``training_step`` (where the
module holds the bound stand-in, not the host master) reaches the master, as under strategy="auto"."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lazytrain.strategy import LazyTrainStrategy


def fit(strategy, steps: int = 4):
    from lightning_lazytrain.lit_module import CausalLMModule

    class Module(CausalLMModule):
        def training_step(self, batch, batch_idx):
            # the final norm trains on odd steps only, switched through the module before the forward
            self.model.norm.weight.requires_grad_(self.global_step % 2 == 1)
            return super().training_step(batch, batch_idx)

    torch.manual_seed(0)
    module = Module(model_name="tiny", optimizer="adamw", lr_schedule="constant", warmup_steps=0)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(steps)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, module.model.norm.weight.requires_grad


@pytest.mark.parametrize("policy", ["recompute_all", "keep_all"])
def test_requires_grad_set_through_the_module_in_the_step_reaches_the_master(policy):
    want, want_flag = fit("auto")
    got, got_flag = fit(LazyTrainStrategy(policy=policy))
    assert got_flag == want_flag
    differ = [n for n in want if not torch.equal(want[n], got[n])]
    assert not differ, differ
