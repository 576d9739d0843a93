"""Kept compute copies (engine/param_staging.py, Note: [kept compute copy]): 16-bit copies of fp32
masters cast once per micro-batch and reused by the micro-batch's later fetches (backward, re-runs),
bit-equal to a cast per fetch, with the host bytes the planner predicts."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from lightning_lazytrain.engine.copy_engine import LinkSpec
from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.param_store import REST
from lightning_lazytrain.planner.workload import param_store_host_bytes
from test_executor import SCHEDULES, SPEC, LlamaLM


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    return LlamaLM(SPEC), torch.randint(0, SPEC.vocab, (4, 33))


def train(model, tokens, name, keep, tmp_path, *, micro=2, steps=2, links=None):
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES[name], nvme_dir=tmp_path, compute_dtype=torch.bfloat16, keep_compute_copy=keep,
                  links=links)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, casts = [], []
    try:
        for _ in range(steps):
            for k in range(micro):
                ex.begin_microbatch(first=k == 0, last=k == micro - 1)
                loss = m.loss(tokens[k::micro])
                loss.backward()
                ex.end_microbatch()
                losses.append(loss.detach())
            casts.append(Counter(r.tag for r in ex.engine.records() if (r.tag or "").startswith("cast")))
            opt.step()
            opt.zero_grad()
        pinned = ex.params.host_pinned_bytes
        kept = ex.params.keeps_copies
    finally:
        ex.close()
    return m, losses, casts, pinned, kept


@pytest.mark.parametrize("name", ["megatrain_K2", "recompute_all", "cpu_homes", "kept_internals_resident",
                                  "partial_keep"])
def test_kept_copies_train_bit_equal_with_one_cast_per_group_and_microbatch(reference, tmp_path, name):
    model, tokens = reference
    want_model, want, want_casts, _, _ = train(model, tokens, name, False, tmp_path)
    # a slow emulated link: stages queue behind each other, so a re-cast that did not wait for the
    # last H2D reading the copy would corrupt the weights
    links = {"h2d": LinkSpec(2e8, 1e-4), "d2h": LinkSpec(2e8, 1e-4)}
    got_model, got, casts, _, kept = train(model, tokens, name, True, tmp_path, links=links)
    assert kept
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (n, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        assert torch.equal(p, q), n
    # per step: each group at most once per micro-batch (the non-block group once per step: it stays
    # bound), every block at least once per micro-batch but layer 0 (its slot lives on); a cast per
    # fetch casts more
    L = SPEC.num_layers
    for step in casts:
        assert step["cast:-1"] == 1 and step["cast:0"] in (1, 2)
        assert all(step[f"cast:{j}"] == 2 for j in range(1, L))
    assert all(sum(w.values()) > sum(c.values()) for w, c in zip(want_casts, casts))


def test_copies_follow_master_changes_between_microbatches(reference, tmp_path):
    """A master changed between micro-batches (the optimizer, user code) is re-cast: nothing stale."""
    model, tokens = reference
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES["recompute_all"], nvme_dir=tmp_path, compute_dtype=torch.bfloat16,
                  keep_compute_copy=True)
    try:
        ex.begin_microbatch()
        m.loss(tokens).backward()
        ex.end_microbatch()
        with torch.no_grad():
            for p in m.parameters():
                p.data.mul_(0.5)  # through .data: no version counter sees it
        ex.begin_microbatch()
        loss = m.loss(tokens)
        loss.backward()
        ex.end_microbatch()
    finally:
        ex.close()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    want_model = copy.deepcopy(ref)
    e2 = Executor(want_model, SCHEDULES["recompute_all"], nvme_dir=tmp_path, compute_dtype=torch.bfloat16)
    try:
        e2.begin_microbatch()
        want = want_model.loss(tokens)
        want.backward()
        e2.end_microbatch()
    finally:
        e2.close()
    assert torch.equal(loss, want)


def test_kept_copies_host_bytes_equal_the_planner_formula(reference):
    model, _ = reference
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES["recompute_all"], compute_dtype=torch.bfloat16, keep_compute_copy=True)
    try:
        store = ex.params
        blocks = [store.group_numel(j) for j in range(SPEC.num_layers)]
        want = param_store_host_bytes(blocks, store.group_numel(REST), master_bytes=4, compute_bytes=2, cast=True,
                                      block_slots=store.num_slots, copies=True)
        assert store.host_pinned_bytes == want
        # the copies replace the slots' cast buffers: no pinned memory for both
        assert [a["name"] for a in store.host_arenas()] == ["masters", "staging", "copies"]
        assert all(s.cast is None for s in store._slots)
        assert not ex.set_keep_compute_copy(False) and store.host_pinned_bytes == param_store_host_bytes(
            blocks, store.group_numel(REST), master_bytes=4, compute_bytes=2, cast=True, block_slots=store.num_slots)
        assert [a["name"] for a in store.host_arenas()] == ["masters", "staging", "cast"]
    finally:
        ex.close()


def test_no_copies_without_a_cast(reference):
    """fp32 compute copies (or 16-bit masters) need no cast: nothing is kept."""
    model, _ = reference
    ex = Executor(copy.deepcopy(model), SCHEDULES["recompute_all"], keep_compute_copy=True)
    try:
        assert not ex.params.keeps_copies
    finally:
        ex.close()


@pytest.mark.parametrize("keep", [True, False])
def test_a_profile_with_kept_copies_says_so(reference, tmp_path, keep):
    """The measured workload records kept copies (``Workload.kept_copies``: the plan then prices no cast
    for the H and B windows' fetches, as the engine runs them); before, the flag was set after a return
    and never reached the workload, so a plan priced re-casts the engine did not do."""
    from lightning_lazytrain.engine.profiler import measure_workload

    model, tokens = reference
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES["recompute_all"], nvme_dir=tmp_path, compute_dtype=torch.bfloat16,
                  keep_compute_copy=keep)
    try:
        wl = measure_workload(ex, lambda: m.loss(tokens).backward(), tokens=tokens.numel())
    finally:
        ex.close()
    assert wl.kept_copies is keep and wl.compute_bytes == 2
