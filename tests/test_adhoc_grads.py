"""Two backward calls in one Executor micro-batch (engine/adhoc_grads.py, Note: [ad-hoc gradients per backward
call]): the second forward is an ad-hoc pass; its gradients are added to the host gradient per backward call, in
call order, as plain autograd adds each call into ``.grad``. fp32, bit for bit against plain autograd, with the
planned pass's backward first or last, over micro-batches of a step (a nonzero gradient to add to)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_executor import SCHEDULES, SPEC, LlamaLM

from lightning_lazytrain.engine.executor import Executor


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return LlamaLM(SPEC), torch.randint(0, SPEC.vocab, (4, 33))


def grads_after(model, tokens, executor_schedule, order, tmp_path, micro=2):
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES[executor_schedule], nvme_dir=tmp_path) if executor_schedule else None
    try:
        for k in range(micro):
            if ex is not None:
                ex.begin_microbatch(first=k == 0, last=k == micro - 1)
            x = tokens[k::micro]
            planned, adhoc = m.loss(x), 0.5 * m.loss(x[:1])  # the second forward is an ad-hoc pass
            for loss in ((planned, adhoc) if order == "planned_first" else (adhoc, planned)):
                loss.backward()
            if ex is not None:
                ex.end_microbatch()
    finally:
        if ex is not None:
            ex.close()
    # after the step's last micro-batch (layer 0's gradients of the others leave in the next one's first window)
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize("order", ["planned_first", "adhoc_first"])
@pytest.mark.parametrize("schedule", ["megatrain_K2", "keep_all", "recompute_all", "cpu_homes"])
def test_two_backward_calls_in_a_micro_batch_add_like_plain_autograd(reference, tmp_path, schedule, order):
    model, tokens = reference
    want = grads_after(model, tokens, None, order, tmp_path)
    got = grads_after(model, tokens, schedule, order, tmp_path)
    bad = {n: (got[n] - want[n]).abs().max().item() for n in want if not torch.equal(got[n], want[n])}
    assert not bad, bad  # before the fix: 18 (planned first) or 36 (ad hoc first) tensors off by ~1e-8
