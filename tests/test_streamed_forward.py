"""A copy of a model whose blocks the executor streams is a plain, independent model
(engine/streamed_forward.py, Note: [a copy of a streamed block])."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.streamed_forward import StreamedForward
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec, keep_all

SPEC = ModelSpec(name="tiny", num_layers=3, hidden=32, intermediate=48, heads=4, kv_heads=2, head_dim=8, vocab=64)


def streamed():
    torch.manual_seed(0)
    model = LlamaLM(SPEC)
    ex = Executor(model, keep_all(SPEC.num_layers))
    return model, ex


def test_the_blocks_forward_is_the_executors_while_it_streams():
    model, ex = streamed()
    assert all(isinstance(vars(b)["forward"], StreamedForward) for b in model.layers)
    ex.close()
    assert all("forward" not in vars(b) for b in model.layers)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_computes_with_its_own_weights_and_outlives_the_executor(how):
    model, ex = streamed()
    tokens = torch.randint(0, SPEC.vocab, (2, 9))
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert all(not isinstance(vars(b).get("forward"), StreamedForward) for b in twin.layers)
    with torch.no_grad():
        for p in twin.layers.parameters():
            p.mul_(0.5)  # the copy's blocks now differ from the live model's
    plain = LlamaLM(SPEC)
    plain.load_state_dict(twin.state_dict())
    with torch.no_grad():
        want = plain.loss(tokens)
        got = twin.loss(tokens)
    ex.close()
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.equal(twin.loss(tokens), want)  # after the executor closed


def test_the_live_model_still_streams_after_a_copy():
    model, ex = streamed()
    copy.deepcopy(model)
    assert all(isinstance(vars(b)["forward"], StreamedForward) for b in model.layers)
    ex.close()
