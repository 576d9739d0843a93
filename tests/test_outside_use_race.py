"""A block's master used outside its block (Note: [a master used outside its block], engine/outside_uses.py):
the hook that records autograd's gradient of that use reads ``.grad`` under the lock the host lane adopts
gradients under. Were the host lane to adopt between the hook's read and its record (adding the gradient into
the host view and setting ``.grad`` to the view), the record would name a gradient already counted, and
``reconcile_outside_grads`` would add it again: seen once in CI under load, review 7's cross-layer weight use
ended one update off (tests/test_review7_weight_reads.py::test_a_forward_using_a_later_blocks_weight_with_grad).
The interleaving is forced here."""

from __future__ import annotations

import threading
import time

import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec, keep_all

SPEC = ModelSpec(name="tiny", num_layers=2, hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8, vocab=64)


def test_an_adoption_between_the_hooks_read_and_its_record_counts_the_gradient_once():
    torch.manual_seed(0)
    model = LlamaLM(SPEC)
    ex = Executor(model, keep_all(SPEC.num_layers))
    store = ex.params
    info = store._group(1).params[0]
    p = info.param
    outside = torch.full_like(p, 0.25)
    p.grad = outside  # autograd's gradient of a use outside the block, not yet in the host view
    recorded = threading.Event()
    with store._outside_lock:  # the host lane holds the lock while it adopts
        hook = threading.Thread(target=lambda: (store._outside_use(info, p), recorded.set()))
        hook.start()
        time.sleep(0.2)
        assert not recorded.is_set()  # the hook waits before it reads .grad
        view = store._host_view(store._group(1).grad, info)
        view.zero_()
        cur = store._take_outside(info, view)  # the adoption, as _adopt_landed does it
        assert cur is outside
        view.add_(cur)
        p.grad = view
    hook.join(10)
    assert recorded.is_set()
    assert id(info) not in store._outside  # nothing left to add again
    store.reconcile_outside_grads()
    assert torch.equal(p.grad, torch.full_like(p, 0.25))
    ex.close()
