"""Early non-block parts (Note: [early non-block parts] in engine/early_parts.py): cases where the part's
gradient is not what the device buffer holds when the part is complete by its watch. Each fit with
HybridAdamW(updates_in_backward=True) must equal the same fit with updates_in_backward=False bit for bit
(as it did before the early parts: the head went with T). Since 4eb7206 an early part collects its own
gradients (create_graph), and a LightningModule that overrides ``backward`` keeps the updates for the step."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_lazytrain.strategy import LazyTrainStrategy
from test_updates_in_backward import CountingHybridAdamW, plan_in_backward


class _Losses(L.Callback):
    reads_gradients_only = True

    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.values.append(outputs["loss"].item())


def _fit(updates_in_backward: bool, *, create_graph: bool = False, toggle_norm: bool = False, steps: int = 4):
    from lightning_lazytrain.lit_module import CausalLMModule

    class Module(CausalLMModule):
        def configure_optimizers(self):
            self.__dict__["_norm_master"] = self.model.norm.weight  # the host master (a plain reference)
            return CountingHybridAdamW(self.param_groups(), lr=self.lr, betas=self.betas, eps=self.eps,
                                       weight_decay=self.weight_decay, eight_bit="none", skip_nonfinite=False,
                                       updates_in_backward=updates_in_backward)

        def training_step(self, batch, batch_idx):
            if toggle_norm:  # the final norm trains on odd steps only, decided in the step before the forward
                self._norm_master.requires_grad_(self.global_step % 2 == 1)
            return super().training_step(batch, batch_idx)

        if create_graph:
            def backward(self, loss, *args, **kwargs):
                loss.backward(create_graph=True)

    torch.manual_seed(0)
    module = Module(model_name="tiny", optimizer="hybrid_adamw", lr_schedule="constant", warmup_steps=0)
    losses = _Losses()
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy=plan_in_backward()), accelerator="cpu", max_steps=steps,
                        logger=False, enable_checkpointing=False, callbacks=[losses], enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(steps)]
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return losses.values, {n: p.detach().clone() for n, p in module.named_parameters()}, trainer.optimizers[0]


@pytest.mark.parametrize("case", ["create_graph", "requires_grad_set_after_begin"])
def test_an_early_part_writes_back_the_gradient_the_serial_step_sees(case):
    """create_graph=True: AccumulateGrad replaces the wrapper's .grad (old + new) instead of adding into the
    slot's grad buffer; only part 0's send collects such grads (``_collect_grads``), so a part p >= 1 sent
    early copies the stale (zero) buffer and T skips it: the head and final norm train on zero gradients.
    requires_grad set on a master after the micro-batch began (the bind follows it, ``follow_requires_grad``):
    EarlyParts built its watch at begin_microbatch without that parameter, so the part is sent before its
    gradient arrives, and the arrival is ignored (not even flagged late): the final norm never trains."""
    kw = {"create_graph": True} if case == "create_graph" else {"toggle_norm": True}
    want, want_params, _ = _fit(False, **kw)
    got, got_params, opt = _fit(True, **kw)
    if case == "create_graph":  # an overridden backward keeps the updates for the step (it may run several passes)
        assert opt.in_backward == []
    else:
        assert "head" in opt.in_backward  # the early path ran
    differ = [n for n in want_params if not torch.equal(want_params[n], got_params[n])]
    assert not differ and got == want, differ[-2:]
