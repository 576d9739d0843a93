"""Hugging Face causal LMs with the project's chunked linear + cross-entropy (models/hf_loss.py,
Note: [chunked loss for Hugging Face models]): the loss and every gradient as the module's own loss
gives them, within 1e-5 relative (fp32; the sums run in another order), with labels that ignore
positions, ``num_items_in_batch`` and ``shift_labels``; on every causal LM of the architecture
matrix, those whose head is not a plain linear layer refused by name; and through
``LazyTrainStrategy(chunked_loss=True)``: the same training as the module's own loss, without the
full logits in the head window."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_lazytrain.models.hf_loss import ChunkedLoss

pytest.importorskip("transformers")
from test_hf_matrix import ARCHS, BATCH, SEQ, VOCAB, build  # noqa: E402

CAUSAL_LMS = sorted(name for name, a in ARCHS.items() if a["model"].endswith("ForCausalLM"))
REFUSED = {"gemma2": "final_logit_softcapping", "cohere": "logit_scale", "phi": "bias", "gpt-j": "bias"}


def close(a, b, rtol=1e-5):
    return (a - b).abs().max() <= rtol * b.abs().max() + 1e-7


@pytest.mark.parametrize("name", CAUSAL_LMS)
def test_the_chunked_loss_is_the_modules_own(name):
    model, batch = build(name)
    model.eval()  # no dropout: both runs see the same network
    ids = batch["input_ids"]
    extra = {k: v for k, v in batch.items() if k not in ("input_ids", "labels")}
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt the loss ignores
    calls = [dict(extra, labels=labels), dict(extra, labels=labels, num_items_in_batch=torch.tensor(20))]
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            ChunkedLoss(model)
        return
    for kw in calls:
        want_model, got_model = copy.deepcopy(model), copy.deepcopy(model)
        want = want_model(input_ids=ids, **kw).loss
        want.backward()
        hooks = ChunkedLoss(got_model, chunk_tokens=7)
        out = got_model(input_ids=ids, **kw)
        got = out.loss
        got.backward()
        hooks.remove()
        assert out.logits.shape[1] == 1  # no full logits
        assert close(got, want), (kw.keys(), got.item(), want.item())
        for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
            if q.grad is None:
                assert p.grad is None, n
                continue
            assert close(p.grad, q.grad, rtol=1e-4), n
        # after remove(): the module's own loss again
        again = got_model(input_ids=ids, **kw)
        assert again.logits.shape[1] == SEQ


def test_shift_labels_are_taken_as_given():
    model, _ = build("llama")
    model.eval()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    shift = torch.roll(ids, -1, dims=1)
    shift[:, -1] = -100
    want = copy.deepcopy(model)(input_ids=ids, shift_labels=shift, labels=ids).loss
    hooks = ChunkedLoss(model, chunk_tokens=5)
    got = model(input_ids=ids, shift_labels=shift, labels=ids).loss
    hooks.remove()
    assert close(got, want)


def test_the_strategy_option_trains_as_the_modules_own_loss_without_the_full_logits():
    import lightning as L

    from lightning_lazytrain.strategy import LazyTrainStrategy

    transformers = pytest.importorskip("transformers")

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                           attn_implementation="eager")
            torch.manual_seed(0)
            self.model = transformers.LlamaForCausalLM(cfg)
            self.losses = []

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 512, (4, 32), generator=g) for _ in range(4)]
    plans = []

    class Seen(L.Callback):
        reads_gradients_only = True  # records, reads no weight (Note: [weights read after the step])

        def on_train_batch_end(self, trainer, *args):
            plans.append(getattr(trainer.strategy, "plan", None))

    def run(strategy):
        module = LM()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[Seen()])
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return module

    want = run("auto")
    own = run(LazyTrainStrategy(policy="recompute_all"))
    own_plan = plans[-1]
    got = run(LazyTrainStrategy(policy="recompute_all", chunked_loss=8))
    chunked_plan = plans[-1]
    assert own.losses == want.losses  # the module's own loss: exact
    assert torch.allclose(torch.tensor(got.losses), torch.tensor(want.losses), rtol=1e-5)
    for (n, p), q in zip(got.named_parameters(), want.parameters()):
        assert close(p, q, rtol=1e-4), n
    # the head window's working set no longer holds every position's logits (4 x 32 x 512 fp32)
    assert chunked_plan.result.workload.head_work_bytes < own_plan.result.workload.head_work_bytes - 4 * 32 * 512 * 4
    assert not got.model._forward_pre_hooks  # removed at teardown


@pytest.mark.parametrize("chunked", [False, True])
def test_every_window_of_a_hugging_face_model_stays_within_the_plan(tmp_path, chunked):
    """The live-bytes check of the engine's windows (tests/test_executor.py) on a Hugging Face causal
    LM: the non-block windows too (F0: the embedding, H: the final norm, the head and the loss, B0:
    the embedding's backward), with its own loss (all of the logits) and with the chunked one."""
    from lightning_lazytrain.engine.executor import Executor
    from lightning_lazytrain.engine.profiler import measure_workload
    from lightning_lazytrain.planner import recompute_all, simulate
    from lightning_lazytrain.planner.simulator import MEM_TOL
    from test_executor import big_host

    model, batch = build("llama")
    model.eval()
    hooks = ChunkedLoss(model, chunk_tokens=8) if chunked else None
    step = lambda m: m(**batch).loss.backward()  # noqa: E731
    ex = Executor(copy.deepcopy(model), recompute_all(4), nvme_dir=tmp_path)
    try:
        wl = measure_workload(ex, lambda: step(ex.module), tokens=batch["input_ids"].numel())
    finally:
        ex.close()
    sim = simulate(recompute_all(4), wl, big_host(wl))
    m = copy.deepcopy(model)
    ex = Executor(m, recompute_all(4), nvme_dir=tmp_path)
    ex.measure_memory = True
    try:
        for _ in range(2):
            ex.begin_microbatch()
            step(m)
            stats = ex.end_microbatch()
    finally:
        ex.close()
    if hooks is not None:
        hooks.remove()
    over = {w: b - sim.window_bytes[w] for w, b in stats.window_peak_bytes.items() if b > sim.window_bytes[w] + MEM_TOL}
    assert not over, f"windows over the plan (bytes): {over}"
    assert {"F0", "H", "B0"} <= set(stats.window_peak_bytes)
