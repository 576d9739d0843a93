"""Review 15: where the dtype conversions run (planner/placement.py, Note: [conversion placement]; engine/copy_engine.py,
Note: [conversion on the device]; engine/grad_writeback.py, Note: [direct landing]), probed as a user would hit it.

Contract: with fp32 masters and bf16 compute copies every placement (``conversions="host" | "device" | "plan"``, or
``Executor.set_placement(cast_on_device=..., widen_on_device=...)`` per group) trains BIT-IDENTICAL to the host
placement -- ``torch.equal`` on the losses, every ``.grad`` wherever the user can see it (after each backward, before
the step, kept by reference), final weights and optimizer states -- and the fp32-masters path trains exactly as plain
PyTorch with fp32 masters and a bf16 model copy (tests/test_fp32_masters.py's construction). Direct landing (a step's
first gradient copy landing in the host gradient itself) is exact too, also in fp32 compute (Trainer 32-true, Fabric
32-true / bf16-mixed) where it runs without any placement. Probes showing a defect are strict xfails whose reason
starts "OPEN".

DEFECTS FOUND
- test_the_train_app_takes_strategy_conversions: ``lazytrain-train`` exposes strategy.fp32_masters and
  strategy.keep_compute_copy but not strategy.conversions (Hydra: "Could not override 'strategy.conversions'"): an app
  user cannot force the host or the device (cli/train_config.py StrategyConfig, cli/train.py build_strategy).
- test_engine_two_backwards_in_one_microbatch_equal_master_training_per_call (engine API only, every placement and
  the host alike): two forward + backward pairs inside one Executor micro-batch summed their bf16 gradients in bf16
  for the non-block group and blocks 0, 1 but apart for blocks 2, 3 (up to 4.9e-4 off either plain reference); in
  fp32 the same was ~1e-8 off plain autograd. The Trainer (a full micro-batch per backward) was exact.
Both FIXED the same day (each test failed before): the app's ``strategy.conversions`` (cli/train_config.py); each
backward call's ad-hoc gradients apart (engine/adhoc_grads.py, Note: [ad-hoc gradients per backward call]).

PASSING (regression tests). Engine (Executor, bf16 compute, LlamaLM of test_executor.SPEC), against plain fp32-master
training or the host placement: host / cast / widen / both / mixed / non-block-only placements; "both" on keep_all,
megatrain_K1, cpu_homes, nvme_homes, offloaded_internals, partial_keep, kept_internals_resident; zero_grad to zeros;
accumulated (not full) micro-batches; .grad kept by reference across set_to_none (also through a conversion buffer
in many chunks on slow links); LoRA-style / frozen block / frozen embedding; a tied embedding-head; clip by norm and
value; placements changed between steps and between full micro-batches (inside an accumulated step: refused by name);
schedule switches that rebuild the store; an ad-hoc second forward in the same backward; two backwards per micro-batch
(placement against host); some .grad dropped by the user; post-accumulate hooks (recording, scaling in place) and a
doubling tensor hook; kept compute copies beside device casts; weights edited in place between steps; kept .grad
zeroed then dropped. Trainer (bf16-true, fp32_masters): device and plan against host with serial / pipelined
HybridAdamW, torch AdamW, updates in the backward, accumulation 1-3, norm / value clip, every .grad after each
backward and before each step, optimizer states; device against plain master training; zero_grad to zeros; frozen
parts; a weight tied across blocks; .grad kept by reference; manual optimization (two optimizers, clip_gradients,
manual accumulation, two manual_backward per step); conversions="device" without fp32 masters is inert (32-true and
bf16-true as auto); checkpoints saved under one placement resumed under another (sharded, full); a forced re-plan
switching schedule (NVMe, resident weights) and one moving the conversions device <-> host mid-run (also between the
micro-batches of an accumulated step); weights thawed / frozen mid-run; keep_compute_copy True / False; an emulated
slow link; weights the gradient reaches in some micro-batches only (also 32-true against auto); gradients discarded
mid-accumulation (also 32-true against auto); .grad replaced / scaled by user code; validation between steps, test
and predict after the fit; the plan's header naming the placement; a bad conversions value named. Fabric:
no_backward_sync accumulation with alternating set_to_none, a weight used in one micro-batch, the clip norm and kept
.grad tensors, against auto (32-true on three schedules, bf16-mixed).

Not covered: several processes (data parallel, the gradient all-reduce over directly landed gradients, sharded
groups), a real GPU (CUDA streams, pinned memory), Hugging Face models, 8-bit optimizer states beside the placement.
"""

from __future__ import annotations

import copy
import dataclasses

import lightning as L
import pytest
import torch
from test_executor import SCHEDULES, SPEC
from test_fp32_masters import fold_into_masters
from test_review_clip_manual import MasterNet as HMasterNet
from test_review_clip_manual import Net as HNet  # HybridAdamW per block, or torch AdamW
from test_review_clip_manual import data as hdata
from test_review_clip_manual import fit as hfit
from test_review_clip_manual import pipelined, serial
from test_updates_in_backward import plan_file

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.param_store import REST
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import recompute_all
from lightning_lazytrain.strategy import LazyTrainStrategy

NL = SPEC.num_layers
BLOCKS = tuple(range(NL))
ALL = BLOCKS + (REST,)
PLACEMENTS = {
    "host": {},
    "cast": {"cast_on_device": ALL},
    "widen": {"widen_on_device": ALL},
    "both": {"cast_on_device": ALL, "widen_on_device": ALL},
    "mixed": {"cast_on_device": (0, 2, REST), "widen_on_device": (1, 3)},
    "rest_only": {"cast_on_device": (REST,), "widen_on_device": (REST,)},
}


# =====================================================================================================================
# the engine: Executor(compute_dtype=bf16) against plain fp32-master training
# =====================================================================================================================
def make_model(tied=False, seed=0):
    torch.manual_seed(seed)
    return LlamaLM(dataclasses.replace(SPEC, tied_embeddings=tied))


def frozen(name, freeze):
    """``freeze``: name prefixes, or "lora" (the blocks' base weights and the embedding frozen: only o_proj and
    down_proj train in the blocks, the final norm and the head outside them)."""
    if freeze == "lora":
        return name.startswith("embed_tokens") or (name.startswith("layers.") and not
                                                   any(k in name for k in ("o_proj", "down_proj")))
    return any(name.startswith(f) for f in freeze)


def tokens_for(steps, micro, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, SPEC.vocab, (2, 17), generator=g) for _ in range(steps * micro)]


def snap_grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def opt_state(opt):
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            out.append({k: (v.clone() if torch.is_tensor(v) else v) for k, v in sorted(st.items())})
    return out


def same_list(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return False
        if x is not None and not (x.dtype == y.dtype and torch.equal(x, y)):
            return False
    return True


def same_states(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.keys() != y.keys():
            return False
        for k in x:
            if torch.is_tensor(x[k]):
                if not torch.equal(x[k], y[k]):
                    return False
            elif x[k] != y[k]:
                return False
    return True


def engine_train(model, batches, schedule, placement, tmp_path, *, micro=1, steps=2, to_none=True, freeze=(),
                 clip=None, keep_refs=False, placements_by_step=None, schedule_by_step=None, adhoc=False,
                 set_grad_none=(), opt_fn=None, full=True, keep=False, hooks=None, between=None,
                 placements_by_micro=None, links=None):
    """Train ``model`` (a copy) with the executor in bf16 compute over fp32 masters. ``full``: every micro-batch a
    full one (first=last=True: the Trainer's fp32-masters path). Records the loss, every ``.grad`` after each
    backward (and, with ``keep_refs``, the ``.grad`` tensors kept by reference from the previous step, read after the
    next step's backward), final weights and optimizer states."""
    m = copy.deepcopy(model)
    for name, p in m.named_parameters():
        if frozen(name, freeze):
            p.requires_grad_(False)
    ex = Executor(m, SCHEDULES[schedule], nvme_dir=tmp_path, compute_dtype=torch.bfloat16, keep_compute_copy=keep,
                  links=links)
    rec = {"loss": [], "grads": [], "kept": [], "norms": [], "hooked": [], "between": []}
    handles = hooks(m, rec["hooked"]) if hooks is not None else []
    params = [p for p in m.parameters() if p.requires_grad]
    opt = (opt_fn or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)))(params)
    kept = None
    try:
        ex.set_placement(**placement)
        for s in range(steps):
            if placements_by_step and s in placements_by_step:
                ex.set_placement(**placements_by_step[s])
            if schedule_by_step and s in schedule_by_step:
                ex.set_schedule(SCHEDULES[schedule_by_step[s]])
            for k in range(micro):
                if placements_by_micro and (s, k) in placements_by_micro:
                    ex.set_placement(**placements_by_micro[(s, k)])
                ex.begin_microbatch(first=full or k == 0, last=full or k == micro - 1)
                x = batches[s * micro + k]
                loss = m.loss(x)
                if adhoc == "two_backwards":  # a second forward and backward in the same micro-batch
                    loss.backward()
                    loss = 0.5 * m.loss(x[:1])
                elif adhoc:  # a second forward of the same batch half, outside the plan (ad hoc)
                    loss = loss + 0.5 * m.loss(x[:1])
                loss.backward()
                ex.end_microbatch()
                rec["loss"].append(loss.detach().clone())
                rec["grads"].append(snap_grads(m))
                if kept is not None and k == 0:
                    rec["kept"].append([None if g is None else g.clone() for g in kept])
            for name in set_grad_none:  # user code drops some .grad before the step
                dict(m.named_parameters())[name].grad = None
            if clip == "norm":
                rec["norms"].append(torch.nn.utils.clip_grad_norm_(params, 0.05))
            elif clip == "value":
                torch.nn.utils.clip_grad_value_(params, 1e-3)
            if keep_refs:
                kept = [p.grad for p in m.parameters()]
                rec["kept_values"] = [None if g is None else g.clone() for g in kept]
            opt.step()
            opt.zero_grad(set_to_none=to_none)
            if between is not None:
                rec["between"].append(between(m))
        rec["direct"] = ex.params.direct_landings
    finally:
        for h in handles:
            h.remove()
        ex.close()
    rec["weights"] = [p.detach().clone() for p in m.parameters()]
    rec["state"] = opt_state(opt)
    return rec


def master_train(model, batches, *, micro=1, steps=2, to_none=True, freeze=(), clip=None, adhoc=False,
                 set_grad_none=(), opt_fn=None):
    """Plain PyTorch: a bf16 model copy, fp32 masters; each micro-batch's bf16 gradients added into the masters'."""
    ref = copy.deepcopy(model)
    for name, p in ref.named_parameters():
        if frozen(name, freeze):
            p.requires_grad_(False)
    low = copy.deepcopy(ref).to(torch.bfloat16)
    pairs = list(zip(low.parameters(), ref.parameters()))
    names = [name for name, _ in ref.named_parameters()]
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = (opt_fn or (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)))(params)
    rec = {"loss": [], "grads": [], "norms": []}
    for s in range(steps):
        for k in range(micro):
            x = batches[s * micro + k]
            loss = low.loss(x)
            if adhoc == "two_backwards":  # summed in the bf16 .grad, then added into the masters
                loss.backward()
                loss = 0.5 * low.loss(x[:1])
            elif adhoc == "two_backwards_apart":  # each backward call's block gradients added into the masters in
                loss.backward()  # turn; the non-block group's summed in bf16 (on the device, as a bf16 .grad)
                fold_into_masters([pq for pq, name in zip(pairs, names) if name.startswith("layers.")])
                loss = 0.5 * low.loss(x[:1])
            elif adhoc:
                loss = loss + 0.5 * low.loss(x[:1])
            loss.backward()
            fold_into_masters(pairs)
            rec["loss"].append(loss.detach().clone())
            rec["grads"].append(snap_grads(ref))
        for name in set_grad_none:
            dict(ref.named_parameters())[name].grad = None
        if clip == "norm":
            rec["norms"].append(torch.nn.utils.clip_grad_norm_(params, 0.05))
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(params, 1e-3)
        opt.step()
        opt.zero_grad(set_to_none=to_none)
        with torch.no_grad():
            for lp, mp in pairs:
                lp.copy_(mp)
    rec["weights"] = [p.detach().clone() for p in ref.parameters()]
    rec["state"] = opt_state(opt)
    return rec


def assert_same_run(got, want, *, grads=True):
    assert len(got["loss"]) == len(want["loss"])
    bad_loss = [i for i, (a, b) in enumerate(zip(got["loss"], want["loss"])) if not torch.equal(a, b)]
    assert not bad_loss, f"losses differ at {bad_loss}"
    if grads:
        for i, (a, b) in enumerate(zip(got["grads"], want["grads"])):
            assert same_list(a, b), f"grads after backward {i} differ"
    for a, b in zip(got.get("norms", []), want.get("norms", [])):
        assert torch.equal(a, b), "clip norms differ"
    assert same_list(got["weights"], want["weights"]), "final weights differ"
    assert same_states(got["state"], want["state"]), "optimizer states differ"


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def host_runs():
    return {}



_MASTER: dict = {}


def master(model, *, key=(), **kw):
    """master_train(model, tokens_for(steps, micro), **kw), cached per configuration (module's model only)."""
    k = (id(model), tuple(sorted((a, str(b)) for a, b in kw.items())))
    if k not in _MASTER:
        _MASTER[k] = master_train(model, tokens_for(kw.get("steps", 2), kw.get("micro", 1)), **kw)
    return _MASTER[k]


def engine(model, schedule, placement, tmp_path, **kw):
    return engine_train(model, tokens_for(kw.get("steps", 2), kw.get("micro", 1)), schedule,
                        PLACEMENTS.get(placement, placement) if isinstance(placement, str) else placement,
                        tmp_path, **kw)


# ---- (1) every placement, several schedules: plain fp32-master training, every .grad after every backward ---------
@pytest.mark.parametrize("placement", ["host", "cast", "widen", "both", "mixed", "rest_only"])
def test_engine_placements_equal_master_training(model, tmp_path, placement):
    want = master(model, micro=2)
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2)
    assert_same_run(got, want)


@pytest.mark.parametrize("schedule", ["keep_all", "megatrain_K1", "cpu_homes", "nvme_homes", "offloaded_internals",
                                      "partial_keep", "kept_internals_resident"])
def test_engine_device_conversions_on_every_schedule(model, tmp_path, schedule):
    want = master(model, micro=2)
    got = engine(model, schedule, "both", tmp_path, micro=2)
    assert_same_run(got, want)
    assert got["direct"] > 0  # the first copy of a step's groups landed directly


# ---- (2) zero_grad(set_to_none=False): no direct landing, still exact ----------------------------------------------
@pytest.mark.parametrize("placement", ["widen", "both", "mixed"])
def test_engine_zero_grad_to_zeros(model, tmp_path, placement):
    want = master(model, micro=2, to_none=False)
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, to_none=False)
    assert_same_run(got, want)


# ---- (3) accumulated (not full) micro-batches: placement against the host placement --------------------------------
@pytest.mark.parametrize("placement", ["widen", "both", "mixed", "rest_only"])
@pytest.mark.parametrize("to_none", [True, False])
def test_engine_accumulated_microbatches_equal_host(model, tmp_path, placement, to_none):
    host = engine(model, "cpu_homes", "host", tmp_path, micro=3, full=False, to_none=to_none)
    got = engine(model, "cpu_homes", placement, tmp_path, micro=3, full=False, to_none=to_none)
    assert_same_run(got, host)


# ---- (4) .grad kept by reference across zero_grad(set_to_none=True) ----------------------------------------------
@pytest.mark.parametrize("placement", ["host", "widen", "both"])
def test_engine_grads_kept_by_reference_keep_their_values(model, tmp_path, placement):
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, steps=3, keep_refs=True)
    want = master(model, micro=2, steps=3)
    assert_same_run(got, want)
    # kept after step s (read after step s+1's first backward): still step s's values
    assert len(got["kept"]) == 2
    for kept, step_grads in zip(got["kept"], [want["grads"][1], want["grads"][3]]):
        assert same_list(kept, step_grads)


# ---- (5) frozen parts: LoRA-style, a frozen block, a frozen embedding -----------------------------------------------
@pytest.mark.parametrize("freeze", ["lora", ("layers.1.",), ("embed_tokens", "layers.0.", "layers.3.")])
@pytest.mark.parametrize("placement", ["widen", "both", "mixed"])
def test_engine_frozen_parts(model, tmp_path, placement, freeze):
    want = master(model, micro=2, freeze=freeze)
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, freeze=freeze)
    assert_same_run(got, want)


# ---- (6) a weight tied between the embedding and the head (the non-block group) --------------------------------
@pytest.mark.parametrize("placement", ["host", "both", "rest_only", "mixed"])
def test_engine_tied_embedding_and_head(tmp_path, placement):
    tied = make_model(tied=True)
    want = master_train(tied, tokens_for(2, 2), micro=2)
    got = engine(tied, "megatrain_K2", placement, tmp_path, micro=2)
    assert_same_run(got, want)


# ---- (7) clipping by norm and by value ---------------------------------------------------------------------------
@pytest.mark.parametrize("clip", ["norm", "value"])
@pytest.mark.parametrize("placement", ["widen", "both"])
def test_engine_clipping(model, tmp_path, placement, clip):
    want = master(model, micro=2, clip=clip)
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, clip=clip)
    assert_same_run(got, want)


# ---- (8) a placement changed mid-run (between steps, and between the micro-batches of a step) -------------------
@pytest.mark.parametrize("change", [{1: PLACEMENTS["both"]}, {1: {}, 2: PLACEMENTS["mixed"]},
                                    {1: PLACEMENTS["widen"], 2: PLACEMENTS["cast"]}])
@pytest.mark.parametrize("to_none", [True, False])
def test_engine_placement_changed_between_steps(model, tmp_path, change, to_none):
    want = master(model, micro=2, steps=3, to_none=to_none)
    got = engine(model, "megatrain_K2", "both" if 1 in change and change[1] == {} else "host", tmp_path, micro=2,
                 steps=3, to_none=to_none, placements_by_step=change)
    assert_same_run(got, want)


# ---- (9) a schedule switch (the store rebuilt for resident weights) keeping the placement ------------------------
@pytest.mark.parametrize("to_none", [True, False])
@pytest.mark.parametrize("switch", [("megatrain_K2", "kept_internals_resident"), ("kept_internals_resident", "nvme_homes")])
def test_engine_schedule_switch_keeps_the_placement(model, tmp_path, switch, to_none):
    want = master(model, micro=2, steps=3, to_none=to_none)
    got = engine(model, switch[0], "both", tmp_path, micro=2, steps=3, to_none=to_none,
                 schedule_by_step={2: switch[1]})
    assert_same_run(got, want)


# ---- (10) an extra forward outside the plan (ad hoc) in the same backward ---------------------------------------
@pytest.mark.parametrize("placement", ["host", "widen", "both", "mixed"])
@pytest.mark.parametrize("schedule", ["megatrain_K2", "keep_all"])
def test_engine_adhoc_second_forward(model, tmp_path, placement, schedule):
    want = master(model, micro=2, adhoc=True)
    got = engine(model, schedule, placement, tmp_path, micro=2, adhoc=True)
    assert_same_run(got, want)


@pytest.mark.parametrize("placement", ["host", "widen", "both"])
def test_engine_two_backwards_in_one_microbatch(model, tmp_path, placement):
    """Two forward + backward pairs inside one micro-batch: against the host placement (and plain training:
    autograd sums the two backwards' bf16 gradients in bf16 before they join the masters)."""
    host = engine(model, "megatrain_K2", "host", tmp_path, micro=2, adhoc="two_backwards")
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, adhoc="two_backwards")
    assert_same_run(got, host)


@pytest.mark.parametrize("schedule", ["keep_all", "megatrain_K2", "recompute_all", "cpu_homes"])
@pytest.mark.parametrize("placement", ["host", "both"])
def test_engine_two_backwards_in_one_microbatch_equal_master_training_per_call(model, tmp_path, placement, schedule):
    """Each backward call's bf16 block gradients join the fp32 masters in turn (Note: [ad-hoc gradients per backward
    call] in engine/adhoc_grads.py), as the Trainer does (test_trainer_two_backwards_per_step_equal_master_training),
    on every block alike; the non-block group's, on the device, sum in bf16 over the micro-batch (as a bf16 model's
    .grad) and join the masters at its end (Note: [ad-hoc gradients per backward call]). Before the fix the non-block group and blocks 0, 1 summed the two calls in bf16 and blocks 2, 3
    did not (up to 4.9e-4 apart); in fp32 it was 1e-8 off plain autograd (tests/test_adhoc_grads.py)."""
    want = master(model, micro=2, adhoc="two_backwards_apart")
    got = engine(model, schedule, placement, tmp_path, micro=2, adhoc="two_backwards")
    assert_same_run(got, want)


# ---- (11) user code drops some .grad before the step (the others zeroed in place) ------------------------------
@pytest.mark.parametrize("placement", ["widen", "both"])
def test_engine_some_grads_dropped_by_the_user(model, tmp_path, placement):
    names = ("layers.1.q_proj.weight", "lm_head.weight")
    want = master(model, micro=2, steps=3, to_none=False, set_grad_none=names)
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, steps=3, to_none=False, set_grad_none=names)
    assert_same_run(got, want)


# =====================================================================================================================
# the Trainer: LazyTrainStrategy(fp32_masters=True, conversions=...) under precision="bf16-true"
# =====================================================================================================================

TL = 4  # the Trainer nets' blocks


class Seen(L.Callback):
    """Every ``.grad`` after each backward and before each optimizer step, and the placement in force."""
    reads_gradients_only = True

    def __init__(self):
        self.after, self.before, self.placements = [], [], []

    def on_after_backward(self, trainer, module):
        self.after.append([None if p.grad is None else p.grad.clone() for p in module.parameters()])

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.before.append([None if p.grad is None else p.grad.clone() for p in module.parameters()])

    def on_train_batch_end(self, trainer, *args):
        core = getattr(trainer.strategy, "core", None)
        if core is not None and core.executor is not None:
            self.placements.append(core.executor.params.placement)


class Placed(L.Callback):
    """The placement in force after each batch (no gradient-reading hook)."""
    reads_gradients_only = True

    def __init__(self):
        self.placements = []

    def on_train_batch_end(self, trainer, *args):
        self.placements.append(trainer.strategy.core.executor.params.placement)


def plan_of(name):
    if name == "pipelined":
        return pipelined()
    if name == "serial":
        return serial()
    if name == "in_backward":
        return plan_file(dataclasses.replace(recompute_all(TL), updates_in_backward=True, policy="review15-ib"))
    return name


def tfit(conversions, module, *, plan="serial", seen=True, callbacks=(), **kw):
    """A bf16-true fp32-masters fit under ``conversions``; returns (losses, state, trainer, Seen)."""
    s = Seen()
    strategy = LazyTrainStrategy(policy=plan_of(plan), fp32_masters=True, conversions=conversions)
    losses, state, trainer = hfit(strategy, module, precision="bf16-true",
                                  callbacks=[s, *callbacks] if seen else list(callbacks), **kw)
    return losses, state, trainer, s if seen else None


def opt_states(trainer):
    out = []
    for opt in trainer.optimizers:
        inner = getattr(opt, "optimizer", opt)
        sd = inner.state_dict()["state"]
        out.append({k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in st.items()} for k, st in sd.items()})
    return out


def assert_same_fit(got, want, *, grads=True):
    (lg, sg, tg, seen_g), (lw, sw, tw, seen_w) = got, want
    assert lg == lw, "losses differ"
    bad = [k for k in sw if not torch.equal(sg[k], sw[k])]
    assert not bad, f"weights differ: {bad}"
    for a, b in zip(opt_states(tg), opt_states(tw)):
        assert a.keys() == b.keys()
        for k in a:
            assert same_states([a[k]], [b[k]]), f"optimizer state {k} differs"
    if grads and seen_g is not None and seen_w is not None:
        assert len(seen_g.after) == len(seen_w.after) and len(seen_g.before) == len(seen_w.before)
        for i, (a, b) in enumerate(zip(seen_g.after, seen_w.after)):
            assert same_list(a, b), f".grad after backward {i} differs"
        for i, (a, b) in enumerate(zip(seen_g.before, seen_w.before)):
            assert same_list(a, b), f".grad before optimizer step {i} differs"


def on_device(seen):
    """The strategy's placement put every block's conversions on the device in some step."""
    return any(len(p["cast_on_device"]) >= TL and len(p["widen_on_device"]) >= TL for p in seen.placements)


# ---- (12) Trainer: device / plan against host, serial and pipelined HybridAdamW, torch AdamW, accumulation, clip --
@pytest.mark.parametrize("conversions", ["device", "plan"])
@pytest.mark.parametrize("plan,opt,accum,algo", [
    ("serial", "hybrid", 1, "norm"), ("pipelined", "hybrid", 2, "norm"), ("pipelined", "hybrid", 2, "value"),
    ("serial", "adamw", 3, "norm"), ("serial", "adamw", 2, None), ("in_backward", "hybrid", 1, None)])
def test_trainer_conversions_equal_host(conversions, plan, opt, accum, algo):
    kw = {"steps": 3, "accum": accum, "plan": plan}
    if algo is not None:
        kw.update(gradient_clip_val=0.05 if algo == "norm" else 0.002, gradient_clip_algorithm=algo)
    opt_kw = {"updates_in_backward": True, "skip_nonfinite": False} if plan == "in_backward" else {}
    if plan == "in_backward":  # no gradient-reading hook: the updates do run in the backward
        kw["callbacks"] = [Placed()]
        kw["seen"] = False
    got = tfit(conversions, HNet(opt, **opt_kw), **kw)
    want = tfit("host", HNet(opt, **opt_kw), **{**kw, "callbacks": []})
    assert_same_fit(got, want)
    if conversions == "device":
        placed = kw["callbacks"][0] if plan == "in_backward" else got[3]
        assert on_device(placed), placed.placements


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_trainer_device_conversions_equal_master_training(plan):
    """Plain PyTorch fp32 masters + bf16 model (test_review_clip_manual.MasterNet, HybridAdamW) under auto."""
    kw = {"accum": 2, "gradient_clip_val": 0.05, "steps": 3}
    losses, state, _, seen = tfit("device", HNet(), plan=plan, **kw)
    ref = HMasterNet()
    want_losses, _, _ = hfit("auto", ref, precision="bf16-true", **kw)
    assert losses == want_losses
    masters = {n: m for (n, _), (_, m) in zip(ref.named_parameters(), ref.pairs)}
    for name, value in state.items():
        assert value.dtype == torch.float32 and torch.equal(value, masters[name]), name
    assert on_device(seen)


# ---- (13) zero_grad(set_to_none=False) in the Trainer (no direct landing) ---------------------------------------
class ZerosNet(HNet):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)


@pytest.mark.parametrize("plan,accum", [("serial", 2), ("pipelined", 1)])
def test_trainer_zero_grad_to_zeros(plan, accum):
    kw = {"steps": 3, "accum": accum, "plan": plan, "gradient_clip_val": 0.05}
    got = tfit("device", ZerosNet(), **kw)
    assert_same_fit(got, tfit("host", ZerosNet(), **kw))
    assert on_device(got[3])


# ---- (14) LoRA-style partial fine-tuning: frozen base weights, a frozen block, a frozen non-block part -----------
class FrozenNet(HNet):
    def __init__(self, which="lora", opt="adamw"):
        super().__init__(opt)
        for name, p in self.named_parameters():
            if (which == "lora" and (name.startswith("emb") or (name.startswith("layers.") and ".out." not in name))) \
                    or (which == "block" and name.startswith("layers.2.")) or (which == "head" and name.startswith("head")):
                p.requires_grad_(False)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("which", ["lora", "block", "head"])
def test_trainer_frozen_parts(which):
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}
    got = tfit("device", FrozenNet(which), **kw)
    assert_same_fit(got, tfit("host", FrozenNet(which), **kw))


# ---- (15) a weight tied across blocks (joins the non-block group) ---------------------------------------------
@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("all_blocks", [False, True])
def test_trainer_weight_tied_across_blocks(plan, all_blocks):
    from test_shared_modules import TiedNet

    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05, "plan": plan}
    got = tfit("device", TiedNet(all_blocks), **kw)
    assert_same_fit(got, tfit("host", TiedNet(all_blocks), **kw))


# ---- (16) .grad kept by reference in a callback across steps ---------------------------------------------------
class KeepGrads(L.Callback):
    """Keeps each step's ``.grad`` tensors (by reference) and their values at on_before_optimizer_step; checks them
    after the next step's backward."""
    reads_gradients_only = True

    def __init__(self):
        self.kept, self.broken = [], []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.kept.append([(p.grad, p.grad.clone()) for p in module.parameters() if p.grad is not None])

    def on_after_backward(self, trainer, module):
        for step in self.kept:
            for g, v in step:
                if not torch.equal(g, v):
                    self.broken.append(len(self.kept))


@pytest.mark.parametrize("conversions", ["host", "device"])
def test_trainer_grads_kept_by_reference(conversions):
    keep = KeepGrads()
    tfit(conversions, HNet("adamw"), callbacks=[keep], steps=4, accum=2)
    assert keep.broken == []
    assert len(keep.kept) == 4


# ---- (17) manual optimization (two optimizers, toggle, clip_gradients, a closure) ------------------------------
@pytest.mark.parametrize("plan", ["serial", "pipelined"])
@pytest.mark.parametrize("accum", [False, True])
def test_trainer_manual_optimization(plan, accum):
    from test_review_clip_manual import ManualNet

    kw = {"steps": 6, "batches": hdata(8), "plan": plan}
    got = tfit("device", ManualNet(clip="all", accum=accum), **kw)
    assert_same_fit(got, tfit("host", ManualNet(clip="all", accum=accum), **kw))
    assert on_device(got[3])


# ---- (18) nothing to convert: conversions="device" is inert ---------------------------------------------------
@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_trainer_device_conversions_without_fp32_masters(precision):
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05, "precision": precision}
    got = hfit(LazyTrainStrategy(policy=serial(), conversions="device"), HNet(), **kw)
    want = hfit("auto", HNet(), **kw)
    from test_review_clip_manual import assert_same

    assert_same(got, want)


# ---- (19) checkpoint save with one conversions setting, resume with another ------------------------------------
def ckpt_fit(conversions, module, *, steps, root, ckpt_path=None, save=None, plan="pipelined", fmt="sharded"):
    torch.manual_seed(11)
    strategy = LazyTrainStrategy(policy=plan_of(plan), fp32_masters=True, conversions=conversions,
                                 checkpoint_format=fmt)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=steps, logger=False, precision="bf16-true",
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=str(root),
                        gradient_clip_val=0.05)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(hdata(2), batch_size=None), ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.clone() for k, v in module.state_dict().items()}, opt_states(trainer)


@pytest.mark.parametrize("first,second", [("device", "host"), ("host", "device"), ("device", "device")])
@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_checkpoint_resume_with_another_placement(tmp_path, first, second, fmt):
    """2 steps, save, resume to 4 (an epoch is 2 batches); the reference is the same save + resume on the host
    (a resume does not replay the uninterrupted run's data order here, whatever the placement)."""
    def resumed(a, b, name):
        path = str(tmp_path / f"{name}.ckpt")
        ckpt_fit(a, HNet(), steps=2, root=tmp_path / f"{name}1", save=path, fmt=fmt)
        return ckpt_fit(b, HNet(), steps=4, root=tmp_path / f"{name}2", ckpt_path=path, fmt=fmt)

    (got_state, got_opt), (want_state, want_opt) = resumed(first, second, "got"), resumed("host", "host", "want")
    bad = [k for k in want_state if not torch.equal(got_state[k], want_state[k])]
    assert not bad, bad
    for a, b in zip(got_opt, want_opt):
        assert a.keys() == b.keys() and all(same_states([a[k]], [b[k]]) for k in a)


# ---- (20) a re-plan switching schedule mid-run with the conversions on the device ------------------------------
@pytest.fixture
def switch_to(monkeypatch):
    from test_review_replan_nvme import switch_to as fixture

    return fixture.__wrapped__(monkeypatch)


class ForceReplan(L.Callback):
    reads_gradients_only = True

    def __init__(self, at):
        self.at = at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step * 0 + batch_idx == self.at:
            trainer.strategy.core.planner.replan_reason = "drift: forced by review 15"


@pytest.mark.parametrize("at", [2, 3])  # an accumulated step's first / second micro-batch
@pytest.mark.parametrize("target", ["nvme", "resident"])
def test_replan_switch_with_conversions_on_the_device(tmp_path, switch_to, at, target):
    from test_review_replan_nvme import nvme_schedule, write_plan

    sched = nvme_schedule() if target == "nvme" else dataclasses.replace(
        recompute_all(TL), resident_weights=(True, False, True, False), policy="review15-resident")
    seen = switch_to(write_plan(tmp_path / "b.json", sched))
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}
    strategy = LazyTrainStrategy(policy=serial(), fp32_masters=True, conversions="device",
                                 nvme_dir=str(tmp_path / "spill"))
    s = Seen()
    losses, state, trainer = hfit(strategy, HNet(), precision="bf16-true", callbacks=[s, ForceReplan(at)], **kw)
    got = (losses, state, trainer, s)
    assert seen and strategy.replans and strategy.replans[0]["switched"], strategy.replans
    assert on_device(s) and len(s.placements[-1]["widen_on_device"]) >= TL, s.placements
    assert_same_fit(got, tfit("host", HNet(), **kw))


# ---- (21) the engine: user hooks on the weights, kept compute copies, weights edited between steps, evaluation ----
def post_accumulate_recorder(model, out):
    """A post-accumulate-grad hook on a block weight and on the head: records ``.grad`` when it fires."""
    ps = [model.layers[1].q_proj.weight, model.lm_head.weight, model.norm.weight]
    return [p.register_post_accumulate_grad_hook(lambda p, i=i: out.append((i, p.grad.clone()))) for i, p in
            enumerate(ps)]


def doubling_tensor_hook(model, out):
    """A tensor hook doubling a block weight's and the embedding's gradient (as a gradient-scaling user would)."""
    return [p.register_hook(lambda g: g * 2) for p in (model.layers[2].down_proj.weight, model.embed_tokens.weight)]


def post_accumulate_scaler(model, out):
    """A post-accumulate-grad hook scaling ``.grad`` in place (as a per-parameter gradient scaler would)."""
    ps = [model.layers[3].o_proj.weight, model.lm_head.weight]
    def scale(p):
        p.grad.mul_(0.5)

    return [p.register_post_accumulate_grad_hook(scale) for p in ps]


@pytest.mark.parametrize("hook", [post_accumulate_recorder, doubling_tensor_hook, post_accumulate_scaler])
@pytest.mark.parametrize("placement", ["widen", "both", "mixed"])
def test_engine_user_grad_hooks(model, tmp_path, placement, hook):
    host = engine(model, "megatrain_K2", "host", tmp_path, micro=2, steps=2, hooks=hook)
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, steps=2, hooks=hook)
    assert_same_run(got, host)
    assert len(got["hooked"]) == len(host["hooked"])
    for (i, a), (j, b) in zip(got["hooked"], host["hooked"]):
        assert i == j and torch.equal(a, b)


@pytest.mark.parametrize("placement", ["cast", "mixed", "rest_only"])
def test_engine_kept_compute_copies_beside_device_casts(model, tmp_path, placement):
    want = master(model, micro=2)
    got = engine(model, "cpu_homes", placement, tmp_path, micro=2, keep=True)
    assert_same_run(got, want)


def clamp_and_evaluate(m):
    """Between steps: weights edited in place (a clamp, as a weight constraint; the head scaled)."""
    with torch.no_grad():
        m.layers[0].q_proj.weight.clamp_(-0.03, 0.03)
        m.lm_head.weight.mul_(0.99)
        return m.layers[0].q_proj.weight.clone()


@pytest.mark.parametrize("placement", ["host", "cast", "mixed"])
@pytest.mark.parametrize("keep", [False, True])
def test_engine_weights_edited_and_evaluated_between_steps(model, tmp_path, placement, keep):
    host = engine(model, "megatrain_K2", "host", tmp_path, micro=2, steps=3, between=clamp_and_evaluate)
    got = engine(model, "megatrain_K2", placement, tmp_path, micro=2, steps=3, keep=keep, between=clamp_and_evaluate)
    assert_same_run(got, host)
    assert all(torch.equal(a, b) for a, b in zip(got["between"], host["between"]))


@pytest.mark.parametrize("change", [{(0, 1): PLACEMENTS["both"]}, {(0, 1): PLACEMENTS["widen"], (1, 1): {}},
                                    {(1, 0): PLACEMENTS["rest_only"], (1, 2): PLACEMENTS["mixed"]}])
def test_engine_placement_changed_between_full_microbatches(model, tmp_path, change):
    host = engine(model, "cpu_homes", "host", tmp_path, micro=3)
    got = engine(model, "cpu_homes", "host", tmp_path, micro=3, placements_by_micro=change)
    assert_same_run(got, host)


def test_engine_placement_change_inside_an_accumulated_step_is_refused(model, tmp_path):
    """Not full micro-batches: the non-block group stays bound (accumulating on the device) between them; a
    placement change there is refused by name, not applied half-way."""
    with pytest.raises(RuntimeError, match="set_placement"):
        engine(model, "cpu_homes", "host", tmp_path, micro=3, full=False,
               placements_by_micro={(0, 1): PLACEMENTS["both"]})


# ---- (22) a weight the gradient reaches only in some micro-batches / steps --------------------------------------
class GatedBlock(torch.nn.Module):
    """WideBlock with a gate used only when the batch's first value is positive (a conditional branch / an
    adapter switched per batch): its weights get no gradient (``.grad`` None under autograd) in other batches."""

    def __init__(self, d=16):
        super().__init__()
        self.lin = torch.nn.Linear(d, 2 * d)
        self.out = torch.nn.Linear(2 * d, d)
        self.gate = torch.nn.Linear(d, d)

    on = True  # set per batch by GatedNet (a class attribute: the same for every block)

    def forward(self, x):
        h = x + self.out(torch.tanh(self.lin(x)))
        if GatedBlock.on:
            h = h + self.gate(x)
        return h


class GatedNet(HNet):
    def __init__(self, opt="adamw"):
        super().__init__(opt)
        torch.manual_seed(1)
        self.layers = torch.nn.ModuleList(GatedBlock() for _ in range(TL))
        self.side = torch.nn.Linear(16, 1)  # a non-block weight used in odd batches only

    def training_step(self, batch, batch_idx):
        GatedBlock.on = batch_idx % 4 in (0, 3)  # on in batches 0, 3, 4, 7 ... (within and across steps)
        h = self(batch)  # (the flag stays until the next batch: the plan's re-runs in the backward see it too)
        loss = self.head(h).square().mean()
        if batch_idx % 2 == 1:
            loss = loss + self.side(h).square().mean()
        self.log("loss", loss)
        return loss


def gated_data(n):
    return hdata(n)


def gate_seen(seen):
    """Whether layers.1.gate.weight had a .grad after each backward (it must vary)."""
    i = [n for n, _ in GatedNet().named_parameters()].index("layers.1.gate.weight")
    return [g[i] is not None for g in seen.after]


@pytest.mark.parametrize("opt,accum", [("adamw", 1), ("adamw", 2), ("hybrid", 2), ("hybrid", 1)])
def test_trainer_weights_the_gradient_reaches_sometimes(opt, accum):
    kw = {"steps": 4, "accum": accum, "batches": gated_data(4 * accum), "plan": "pipelined" if opt == "hybrid" else "serial"}
    got = tfit("device", GatedNet(opt), **kw)
    assert_same_fit(got, tfit("host", GatedNet(opt), **kw))
    assert on_device(got[3])
    assert len(set(gate_seen(got[3]))) == 2, gate_seen(got[3])


@pytest.mark.parametrize("opt,accum", [("adamw", 1), ("adamw", 2), ("hybrid", 2)])
def test_fp32_direct_landing_with_weights_the_gradient_reaches_sometimes(opt, accum):
    """32-true: the gradient copies land directly (no placement needed); against auto."""
    from test_review_clip_manual import assert_same

    kw = {"steps": 4, "accum": accum, "batches": gated_data(4 * accum)}
    plan = pipelined() if opt == "hybrid" else serial()
    s = Seen()
    got = hfit(LazyTrainStrategy(policy=plan), GatedNet(opt), callbacks=[s], **kw)
    s_auto = Seen()
    want = hfit("auto", GatedNet(opt), callbacks=[s_auto], **kw)
    assert_same(got, want)
    for i, (a, b) in enumerate(zip(s.after, s_auto.after)):
        assert same_list(a, b), f".grad after backward {i}"
    assert len(set(gate_seen(s))) == 2


# ---- (23) a micro-batch's gradients discarded mid-accumulation (zero_grad(set_to_none=True) in a hook) -------------
class DiscardNet(HNet):
    """Drops the gradients of every third batch (a loss spike guard) right after its backward."""

    def on_after_backward(self):
        if self.trainer.global_step * 0 + getattr(self, "_n", 0) % 3 == 1:
            self.zero_grad(set_to_none=True)
        self._n = getattr(self, "_n", 0) + 1


@pytest.mark.parametrize("accum", [2, 3])
def test_trainer_gradients_discarded_mid_accumulation(accum):
    kw = {"steps": 3, "accum": accum, "gradient_clip_val": 0.05, "plan": "pipelined"}
    got = tfit("device", DiscardNet(), **kw)
    assert_same_fit(got, tfit("host", DiscardNet(), **kw))


@pytest.mark.parametrize("accum", [2, 3])
def test_fp32_gradients_discarded_mid_accumulation_as_auto(accum):
    from test_review_clip_manual import assert_same

    kw = {"steps": 3, "accum": accum, "gradient_clip_val": 0.05}
    assert_same(hfit(LazyTrainStrategy(policy=pipelined()), DiscardNet(), **kw), hfit("auto", DiscardNet(), **kw))


# ---- (24) validation between steps (weights fetched for evaluation, cast on the device) -----------------------
class ValNet(HNet):
    def __init__(self):
        super().__init__("adamw")
        self.val = []

    def validation_step(self, batch, batch_idx):
        loss = self.head(self(batch)).square().mean()
        self.val.append(loss.detach().clone())
        return loss


def test_trainer_validation_between_steps():
    def go(conversions):
        m = ValNet()
        strategy = LazyTrainStrategy(policy=serial(), fp32_masters=True, conversions=conversions)
        torch.manual_seed(11)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", max_steps=4, logger=False, precision="bf16-true",
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, val_check_interval=1, limit_val_batches=2,
                            accumulate_grad_batches=1)
        trainer.fit(m, train_dataloaders=torch.utils.data.DataLoader(hdata(4), batch_size=None),
                    val_dataloaders=torch.utils.data.DataLoader(hdata(2, seed=7), batch_size=None))
        return m

    got, want = go("device"), go("host")
    assert len(got.val) == len(want.val) >= 6
    assert all(torch.equal(a, b) for a, b in zip(got.val, want.val))
    for (n, p), q in zip(got.named_parameters(), want.parameters()):
        assert torch.equal(p, q), n


# ---- (25) a re-plan that moves the conversions (device -> host, host -> device) mid-run ----------------------------
@pytest.fixture
def placements_in_turn(monkeypatch):
    """``placements_in_turn(modes)``: the n-th plan places the conversions as ``modes[n]`` (the last one after)."""
    from lightning_lazytrain.planner import plan as plan_mod

    original = plan_mod.place_conversions
    calls: list[str] = []

    def choose(modes):
        def place(wl, hw, mode, schedules):  # the mode of the plans since the last CountPlans mark
            m = modes[min(len(calls_per_plan), len(modes) - 1)]
            calls.append(m)
            return original(wl, hw, m, schedules)

        calls_per_plan: list[int] = []
        monkeypatch.setattr(plan_mod, "place_conversions", place)
        return calls, calls_per_plan

    return choose


class CountPlans(L.Callback):
    reads_gradients_only = True

    def __init__(self, per_plan, at):
        self.per_plan, self.at = per_plan, at

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.at:
            self.per_plan.append(1)  # the plans after this one use the next mode
            trainer.strategy.core.planner.replan_reason = "drift: forced by review 15"


@pytest.mark.parametrize("modes", [("device", "host"), ("host", "device")])
@pytest.mark.parametrize("at,accum", [(3, 2), (2, 2), (2, 1)])
def test_replan_moves_the_conversions(switch_to, placements_in_turn, tmp_path, modes, at, accum):
    from test_review_replan_nvme import write_plan

    switch_to(write_plan(tmp_path / "b.json", dataclasses.replace(recompute_all(TL), optimizer="pipelined",
                                                                  policy="review15-switch")))
    calls, per_plan = placements_in_turn(modes)
    kw = {"steps": 4, "accum": accum, "gradient_clip_val": 0.05}
    strategy = LazyTrainStrategy(policy="milp", fp32_masters=True, conversions="plan")
    s = Seen()
    losses, state, trainer = hfit(strategy, HNet(), precision="bf16-true", callbacks=[s, CountPlans(per_plan, at)],
                                  **kw)
    widen = [len(p["widen_on_device"]) for p in s.placements]
    assert modes[0] in calls and modes[1] in calls, calls
    assert (max(widen) >= TL) and (min(widen[1:]) == 0), widen  # both placements were in force
    assert_same_fit((losses, state, trainer, s), tfit("host", HNet(), plan="milp", **kw))


# ---- (26) weights thawed / frozen mid-run under device conversions ----------------------------------------------
class Thaw(L.Callback):
    reads_gradients_only = True

    def __init__(self, at, freeze=False):
        self.at, self.freeze = at, freeze

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.at:
            if self.freeze:
                module.layers[1].requires_grad_(False)
                module.emb.requires_grad_(False)
            else:
                ps = [p for p in module.parameters() if not p.requires_grad]
                for p in ps:
                    p.requires_grad_(True)
                trainer.optimizers[0].add_param_group({"params": ps, "lr": 5e-3})


@pytest.mark.parametrize("freeze", [False, True])
def test_trainer_thaw_or_freeze_mid_run(freeze):
    kw = {"steps": 4, "accum": 2, "gradient_clip_val": 0.05}

    def net():
        return FrozenNet("lora") if not freeze else HNet("adamw")

    got = tfit("device", net(), callbacks=[Thaw(4, freeze)], **kw)
    assert_same_fit(got, tfit("host", net(), callbacks=[Thaw(4, freeze)], **kw))
    assert on_device(got[3])


# ---- (27) explicit keep_compute_copy beside device conversions; updates in the backward with accumulation -------
@pytest.mark.parametrize("keep", [True, False])
def test_trainer_keep_compute_copy_with_device_conversions(keep):
    kw = {"steps": 3, "accum": 2, "gradient_clip_val": 0.05}

    def go(conversions):
        s = Seen()
        strategy = LazyTrainStrategy(policy=pipelined(), fp32_masters=True, conversions=conversions,
                                     keep_compute_copy=keep)
        return (*hfit(strategy, HNet(), precision="bf16-true", callbacks=[s], **kw), s)

    got = go("device")
    assert_same_fit(got, go("host"))
    assert on_device(got[3])


class SideNet(HNet):
    """A larger non-block group in several modules (its parts may be written back early)."""

    def __init__(self, **kw):
        super().__init__("hybrid", **kw)
        torch.manual_seed(3)
        self.pre = torch.nn.Linear(16, 16)
        self.side = torch.nn.Linear(16, 1)

    def forward(self, x):
        return super().forward(x)

    def training_step(self, batch, batch_idx):
        h = self(batch)
        loss = self.head(self.pre(h)).square().mean() + self.side(h).square().mean()
        self.log("loss", loss)
        return loss


@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_updates_in_backward_with_device_conversions(accum):
    opt_kw = {"updates_in_backward": True, "skip_nonfinite": False}
    kw = {"steps": 3, "accum": accum, "plan": "in_backward", "seen": False}
    p = Placed()
    got = tfit("device", SideNet(**opt_kw), callbacks=[p], **kw)
    assert_same_fit(got, tfit("host", SideNet(**opt_kw), **kw))
    assert on_device(p)


# ---- (28) user code edits / replaces .grad between the backwards of a step, zeroes to zeros afterwards ------------
class GradEditNet(HNet):
    """on_after_backward: one block weight's .grad REPLACED by a new tensor (half), the head's scaled in place;
    zero_grad(set_to_none=False) (the replaced tensor is then zeroed in place and stays the .grad)."""

    def __init__(self, to_none=False):
        super().__init__("adamw")
        self.to_none = to_none

    def on_after_backward(self):
        w = self.layers[2].lin.weight
        if w.grad is not None:
            w.grad = w.grad * 0.5
        if self.head.weight.grad is not None:
            self.head.weight.grad.mul_(2.0)

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=self.to_none)


@pytest.mark.parametrize("to_none", [False, True])
@pytest.mark.parametrize("accum", [1, 3])
def test_trainer_grads_edited_and_replaced_by_user_code(to_none, accum):
    kw = {"steps": 3, "accum": accum, "gradient_clip_val": 0.05}
    got = tfit("device", GradEditNet(to_none), **kw)
    assert_same_fit(got, tfit("host", GradEditNet(to_none), **kw))


@pytest.mark.parametrize("to_none", [False, True])
def test_fp32_grads_edited_and_replaced_by_user_code_as_auto(to_none):
    from test_review_clip_manual import assert_same

    kw = {"steps": 3, "accum": 3, "gradient_clip_val": 0.05}
    assert_same(hfit(LazyTrainStrategy(policy=serial()), GradEditNet(to_none), **kw),
                hfit("auto", GradEditNet(to_none), **kw))


# =====================================================================================================================
# Fabric (32-true: the copies land directly without any placement)
# =====================================================================================================================
def fabric_run(strategy, loop, steps=4, precision="32-true"):
    from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy

    torch.manual_seed(0)
    net = HNet("adamw")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision,
                      strategy="auto" if strategy == "auto" else LazyTrainFabricStrategy(policy=strategy))
    model, opt = fabric.setup(net, opt)
    try:
        out = loop(fabric, model, opt, steps)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        if strategy != "auto":
            fabric.strategy.teardown()
    return out, state


def loop_accumulate(fabric, model, opt, steps, *, micro=3, to_none_every=2, keep=True):
    """no_backward_sync over ``micro`` backwards, .grad after each, zero_grad alternating set_to_none True / False,
    the clip norm, and every step's .grad tensors kept by reference (compared after the run)."""
    raw = model.module if hasattr(model, "module") else model
    out, kept = [], []
    data = hdata(steps * micro, seed=4)
    for s in range(steps):
        for k in range(micro):
            with fabric.no_backward_sync(model, enabled=k < micro - 1):
                loss = raw.head(model(data[s * micro + k])).square().mean()
                if k == 1:  # a non-block weight used in one micro-batch only
                    loss = loss + 0.0 * raw.emb.bias.sum() if s % 2 else loss
                fabric.backward(loss)
            out.append(loss.detach().clone())
            out.extend(p.grad.clone() if p.grad is not None else torch.tensor(float("nan")) for p in raw.parameters())
        out.append(fabric.clip_gradients(model, opt, max_norm=0.05))
        if keep:
            kept.append([(p.grad, p.grad.clone()) for p in raw.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad(set_to_none=(s % to_none_every == 0))
    out.append(torch.tensor([float(all(torch.equal(g, v) for g, v in step)) for step in kept]))
    return out


@pytest.mark.parametrize("policy,precision", [("recompute_all", "32-true"), ("keep_all", "32-true"),
                                              ("megatrain", "32-true"), ("recompute_all", "bf16-mixed")])
def test_fabric_accumulation_direct_landing_as_auto(policy, precision):
    got, want = fabric_run(policy, loop_accumulate, precision=precision), fabric_run("auto", loop_accumulate,
                                                                                     precision=precision)
    assert len(got[0]) == len(want[0])
    bad = [i for i, (a, b) in enumerate(zip(got[0], want[0])) if not torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))]
    assert not bad, bad[:5]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


# ---- (29) the conversion buffer in many chunks, slow links (copies queue behind each other) -----------------------
@pytest.mark.parametrize("via", [1000, 4099])
@pytest.mark.parametrize("placement", ["both", "mixed"])
def test_engine_conversion_buffer_in_chunks_on_slow_links(model, tmp_path, monkeypatch, via, placement):
    from lightning_lazytrain.engine import param_staging
    from lightning_lazytrain.engine.copy_engine import LinkSpec

    monkeypatch.setattr(param_staging, "VIA_NUMEL", via)
    links = {"h2d": LinkSpec(1e8, 1e-4), "d2h": LinkSpec(1e8, 1e-4)}
    want = master(model, micro=2, steps=3)
    got = engine(model, "cpu_homes", placement, tmp_path, micro=2, steps=3, links=links, keep_refs=True)
    assert_same_run(got, want)
    for kept, step_grads in zip(got["kept"], [want["grads"][1], want["grads"][3]]):
        assert same_list(kept, step_grads)


@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_device_conversions_on_an_emulated_slow_link(accum):
    kw = {"steps": 3, "accum": accum, "gradient_clip_val": 0.05}

    def go(conversions):
        s = Seen()
        strategy = LazyTrainStrategy(policy=pipelined(), fp32_masters=True, conversions=conversions,
                                     emulate_link_gb_per_s=0.02)
        return (*hfit(strategy, HNet(), precision="bf16-true", callbacks=[s], **kw), s)

    got = go("device")
    assert_same_fit(got, go("host"))
    assert on_device(got[3])


# ---- (30) manual optimization: two forward + backward pairs per optimizer step (ad-hoc passes in one step) -------
class TwoBackwards:
    """A mixin: manual optimization, two forwards and two ``manual_backward`` per step (the second on a flipped
    batch), then the step."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.head(self(batch)).square().mean()
        self.manual_backward(loss)
        loss2 = 0.5 * self.head(self(batch.flip(1))).square().mean()
        self.manual_backward(loss2)
        opt.step()
        opt.zero_grad()
        if hasattr(self, "pairs"):  # the reference: the bf16 model is the masters rounded (manual: no optimizer_step)
            with torch.no_grad():
                for p, m in self.pairs:
                    p.copy_(m)
        self.log("loss", loss)
        return loss


class TwoBackwardsNet(TwoBackwards, HNet):
    pass


class TwoBackwardsMasterNet(TwoBackwards, HMasterNet):
    pass


@pytest.mark.parametrize("plan", ["serial", "pipelined"])
def test_trainer_two_backwards_per_step(plan):
    kw = {"steps": 3, "plan": plan}
    got = tfit("device", TwoBackwardsNet(), **kw)
    assert_same_fit(got, tfit("host", TwoBackwardsNet(), **kw))
    assert on_device(got[3])


def test_trainer_two_backwards_per_step_equal_master_training():
    """Against the reference (each backward's bf16 gradients added into the fp32 masters: on_after_backward)."""
    kw = {"steps": 3}
    losses, state, _, _ = tfit("device", TwoBackwardsNet(), **kw)
    ref = TwoBackwardsMasterNet()
    want_losses, _, _ = hfit("auto", ref, precision="bf16-true", **kw)
    assert losses == want_losses
    masters = {n: m for (n, _), (_, m) in zip(ref.named_parameters(), ref.pairs)}
    bad = [n for n, v in state.items() if not torch.equal(v, masters[n])]
    assert not bad, bad


# ---- (31) what the user is told and can set: the plan's header, the option's check, the train app ----------------
@pytest.mark.parametrize("conversions,says", [
    ("device", ("conversions: blocks: cast on device, grads widened on device; non-block: cast on device, grads "
                "widened on device")),
    ("host", "conversions: blocks: cast on host, grads widened on host; non-block: cast on host, grads widened on host")])
def test_the_plan_header_says_where_the_conversions_run(caplog, conversions, says):
    import logging

    with caplog.at_level(logging.INFO):
        tfit(conversions, HNet(), steps=1)
    assert any("lazytrain plan" in r.getMessage() and says in r.getMessage() for r in caplog.records)


def test_a_bad_conversions_value_is_named():
    with pytest.raises(ValueError, match="conversions='gpu'"):
        LazyTrainStrategy(fp32_masters=True, conversions="gpu")


def test_the_train_app_takes_strategy_conversions():
    from test_train_app import compose_cfg

    from lightning_lazytrain.cli.train import build_strategy

    s = build_strategy(compose_cfg("strategy.fp32_masters=true", "strategy.conversions=host"))
    assert s.fp32_masters is True and s.conversions == "host"
    with pytest.raises(ValueError, match="strategy.conversions='gpu'"):  # named as the app's key
        build_strategy(compose_cfg("strategy.fp32_masters=true", "strategy.conversions=gpu"))


# ---- (32) evaluation after the fit (test / predict) with the masters cast on the device --------------------------
class PredNet(HNet):
    def __init__(self):
        super().__init__("adamw")

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.head(self(batch)).square().mean())

    def predict_step(self, batch, batch_idx):
        return self.head(self(batch))


def test_trainer_test_and_predict_after_the_fit():
    def go(conversions):
        torch.manual_seed(11)
        m = PredNet()
        trainer = L.Trainer(strategy=LazyTrainStrategy(policy=serial(), fp32_masters=True, conversions=conversions),
                            accelerator="cpu", max_steps=3, logger=False, precision="bf16-true",
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(m, train_dataloaders=torch.utils.data.DataLoader(hdata(3), batch_size=None))
        loader = torch.utils.data.DataLoader(hdata(2, seed=9), batch_size=None)
        tested = trainer.test(m, dataloaders=loader, verbose=False)
        return tested, trainer.predict(m, dataloaders=loader)

    (t_got, p_got), (t_want, p_want) = go("device"), go("host")
    assert t_got == t_want
    assert all(torch.equal(a, b) for a, b in zip(p_got, p_want))


# ---- (33) .grad kept by reference, zeroed in place (set_to_none=False), then dropped by the user ----------------
@pytest.mark.parametrize("placement", ["host", "widen", "both"])
@pytest.mark.parametrize("which", ["two_params", "whole_block"])
def test_engine_kept_zeroed_grads_then_dropped_stay_zero(model, tmp_path, placement, which):
    """Under autograd a kept ``.grad`` zeroed by ``zero_grad(set_to_none=False)`` and then dropped (``p.grad = None``)
    stays zero: the next backward makes a new tensor. Here the next copy lands directly (a whole group dropped) or
    gives the dropped weights views of the same host range (part of a group): the kept tensors must not see it."""
    names = (["layers.1.q_proj.weight", "lm_head.weight"] if which == "two_params"
             else [n for n, _ in model.named_parameters() if n.startswith("layers.1.")])
    m = copy.deepcopy(model)
    ex = Executor(m, SCHEDULES["megatrain_K2"], nvme_dir=tmp_path, compute_dtype=torch.bfloat16)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    named = dict(m.named_parameters())
    kept, seen = None, []
    try:
        ex.set_placement(**PLACEMENTS[placement])
        for s, x in enumerate(tokens_for(3, 1)):
            ex.begin_microbatch()
            m.loss(x).backward()
            ex.end_microbatch()
            if kept is not None:
                seen.append([float(g.abs().max()) for g in kept])
            assert all(named[n].grad is not None and named[n].grad.abs().max() > 0 for n in names)
            kept = [named[n].grad for n in names]
            opt.step()
            opt.zero_grad(set_to_none=False)
            for n in names:
                named[n].grad = None
    finally:
        ex.close()
    assert seen == [[0.0] * len(names)] * 2
