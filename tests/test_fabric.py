"""The Fabric strategy: Fabric(strategy="lazytrain") trains bit-equal to strategy="auto" (fp32, CPU)
under every policy, with accumulation, several forwards per backward and no-grad forwards; the
user's forward runs as often as under auto; impossible budgets raise before the optimizer step;
teardown restores the blocks; checkpoints are plain state dicts."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_lazytrain.fabric_strategy import LazyTrainFabricStrategy  # (registers the strategies)
from lightning_lazytrain.planner import InfeasibleBudget, Schedule
from dist_runs import runs_fixtures, uses_runs
from models import tiny_llama

transformers = pytest.importorskip("transformers")

LAYERS = 4


def make_model() -> torch.nn.Module:
    return tiny_llama(0, layers=LAYERS)


def batches(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 32), generator=g) for _ in range(n)]


DATA = batches(12)
EVAL = batches(1, seed=2)[0]


def mixed_plan(path) -> str:
    """A plan.json with a CPU home, a recomputed boundary and a layer that keeps its internals."""
    s = Schedule(num_layers=LAYERS, homes=("gpu", "cpu", "recompute", "gpu", "gpu"),
                 keep_internals=(True, False, False, False), resident_weights=(False,) * LAYERS,
                 offload_window=(None, 1, None, None, None), reload_window=(None, 3, None, None, None),
                 policy="test-cpu-recompute")
    path.write_text(json.dumps({"schedule": s.to_json()}))
    return str(path)


def install_hooks(model: torch.nn.Module, seen: dict) -> None:
    """A user's parameter hooks: ``register_hook`` on a streamed block's weight (scales its gradient)
    and on the LM head's (records it), ``register_post_accumulate_grad_hook`` on the embedding
    (records the accumulated ``.grad``)."""
    seen.update(block=[], head=[], embed=[])

    def scale(g):
        seen["block"].append(g.clone())
        return g * 2.0

    model.model.layers[1].mlp.down_proj.weight.register_hook(scale)
    model.lm_head.weight.register_hook(lambda g: seen["head"].append(g.clone()))
    model.model.embed_tokens.weight.register_post_accumulate_grad_hook(lambda p: seen["embed"].append(p.grad.clone()))


def train(strategy, *, steps: int = 5, accumulate: int = 1, forwards: int = 1, no_grad_between: bool = False,
          precision: str = "32-true", teardown: bool = True, pattern: str | None = None, each_step=None) -> dict:
    """AdamW on fixed batches; returns per-micro-batch losses, final parameters, forward calls, a
    no-grad evaluation's logits, and the Fabric. ``pattern``: ``"hooks"`` (``install_hooks``),
    ``"detached"`` (a forward with grad whose detached output only shifts the loss, before the one
    that is backpropagated), ``"inference_mode"`` (a teacher pass under ``torch.inference_mode()``).
    ``each_step(fabric, step)``: called before each optimizer step's micro-batches."""
    model = make_model()
    calls = []
    seen: dict = {}
    if pattern == "hooks":
        install_hooks(model, seen)
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)
    model, opt = fabric.setup(model, opt)
    losses = []
    data = iter(DATA)
    for step in range(steps):
        if each_step is not None:
            each_step(fabric, step)
        for _ in range(accumulate):
            b = next(data)
            shift = None
            if pattern == "detached":
                shift = model(input_ids=b.flip(0)).logits.detach().mean()
            elif pattern == "inference_mode":
                with torch.inference_mode():
                    shift = model(input_ids=b.flip(0)).logits.mean()
            loss = model(input_ids=b, labels=b).loss
            if shift is not None:
                loss = loss + 1e-3 * shift.clone()
            for _ in range(forwards - 1):  # a further forward (reversed batch) feeding the same backward
                loss = loss + model(input_ids=b.flip(0), labels=b.flip(0)).loss
            if no_grad_between:
                with torch.no_grad():
                    model(input_ids=EVAL)
            fabric.backward(loss / accumulate)
            losses.append(loss.detach().clone())
        if accumulate > 1:
            fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        logits = model(input_ids=EVAL).logits
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"losses": losses, "params": params, "calls": len(calls), "logits": logits, "fabric": fabric,
           "model": model, "opt": opt, "seen": seen}
    if teardown:
        fabric.strategy.teardown()
    return out


_AUTO: dict = {}


def auto(**kw) -> dict:
    key = tuple(sorted(kw.items()))
    if key not in _AUTO:
        _AUTO[key] = train("auto", **kw)
    return _AUTO[key]


def assert_same(got: dict, want: dict) -> None:
    assert len(got["losses"]) == len(want["losses"])
    for i, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert torch.equal(a, b), (i, a.item(), b.item())
    assert got["params"].keys() == want["params"].keys()
    for name, p in want["params"].items():
        assert torch.equal(got["params"][name], p), name
    assert torch.equal(got["logits"], want["logits"])
    assert got["calls"] == want["calls"]  # the user's forward runs no extra time (no separate profile)


def test_registered_names_are_accepted_by_fabric():
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    LazyTrainFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # what a second import does: no error
    for name, policy in (("lazytrain", "milp"), ("lazytrain_megatrain", "megatrain")):
        fabric = L.Fabric(accelerator="cpu", strategy=name)
        assert isinstance(fabric.strategy, LazyTrainFabricStrategy)
        assert fabric.strategy.policy == policy and fabric.device == torch.device("cpu")


@pytest.mark.parametrize("policy", ["milp", "recompute_all", "megatrain", "plan.json"])
@pytest.mark.slow
def test_same_losses_and_parameters_as_auto(policy, tmp_path):
    if policy == "plan.json":
        policy = mixed_plan(tmp_path / "plan.json")
    got = train(LazyTrainFabricStrategy(policy=policy), teardown=False)
    strategy = got["fabric"].strategy
    assert strategy.plan is not None and strategy.executor.schedule is strategy.plan.schedule
    blocks = got["model"].module.model.layers
    assert all("forward" in vars(b) for b in blocks)
    strategy.teardown()
    assert strategy.executor is None and all("forward" not in vars(b) for b in blocks)  # blocks restored
    assert_same(got, auto())


def test_each_backward_exposes_the_step_metrics_the_trainer_logs():
    """``fabric.strategy.metrics``: the ``lazytrain/*`` figures of the last step, as the Trainer's
    strategy logs them (same keys, from ``StepStats.metrics``), ready for ``fabric.log_dict``."""
    got = train("lazytrain", steps=2, teardown=False)
    strategy = got["fabric"].strategy
    metrics = strategy.metrics
    assert {"lazytrain/step_seconds", "lazytrain/predicted_step_seconds", "lazytrain/stall_seconds",
            "lazytrain/peak_tracked_gb", "lazytrain/h2d_gb"} <= set(metrics)
    assert metrics == strategy.last_stats.metrics(metrics["lazytrain/step_seconds"],
                                                  strategy.plan.result.sim.iteration_seconds)
    assert metrics["lazytrain/step_seconds"] > 0 and metrics["lazytrain/h2d_gb"] > 0
    strategy.teardown()


def test_several_devices_without_launch_are_refused_with_the_way_out():
    """Several devices run one process each, started by ``fabric.launch()`` (tests/dist_fabric.py runs them)."""
    model = make_model()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=LazyTrainFabricStrategy())
    with pytest.raises(RuntimeError, match=r"on 2 devices runs one process per device: call fabric.launch\(\)"):
        fabric.setup(model)


def test_free_memory_is_measured_before_the_executor_allocates(monkeypatch):
    """``hardware="measure"``: the device's free memory is read before the executor's slots exist
    (once; the plan uses that reading)."""
    import lightning_lazytrain.core.planning as planning
    import lightning_lazytrain.core.training_core as core

    order = []
    real_measure, real_executor = planning.measure_hardware, core.Executor
    monkeypatch.setattr(planning, "measure_hardware", lambda *a, **k: order.append("measure") or real_measure(*a, **k))
    monkeypatch.setattr(core, "Executor", lambda *a, **k: order.append("executor") or real_executor(*a, **k))
    got = train(LazyTrainFabricStrategy(hardware="measure"), steps=2)
    assert order == ["measure", "executor"]
    assert_same(got, auto(steps=2))


def test_gradient_accumulation_and_clipping():
    got = train("lazytrain", steps=3, accumulate=2)
    assert_same(got, auto(steps=3, accumulate=2))


def test_several_forwards_and_a_no_grad_forward_before_one_backward(tmp_path):
    got = train(LazyTrainFabricStrategy(policy=mixed_plan(tmp_path / "plan.json")), steps=3, forwards=2,
                no_grad_between=True)
    assert_same(got, auto(steps=3, forwards=2, no_grad_between=True))


@pytest.mark.parametrize("pattern", ["hooks", "detached", "inference_mode"])
@pytest.mark.parametrize("policy", ["recompute_all", "mixed"])
def test_hooks_detached_forwards_and_inference_mode_as_under_auto(pattern, policy, tmp_path):
    """The Trainer's four exactness patterns under Fabric: parameter hooks fire as under auto and
    what they return is used; a forward with grad whose output is detached, and a teacher pass under
    ``torch.inference_mode()``, train exactly as under auto (with accumulation)."""
    chosen = mixed_plan(tmp_path / "plan.json") if policy == "mixed" else policy
    got = train(LazyTrainFabricStrategy(policy=chosen), steps=3, accumulate=2, pattern=pattern)
    want = auto(steps=3, accumulate=2, pattern=pattern)
    assert_same(got, want)
    for kind, values in want["seen"].items():
        assert len(values) == 6 and len(got["seen"][kind]) == 6, kind  # once per backward
        assert all(torch.equal(a, b) for a, b in zip(got["seen"][kind], values)), kind


def test_bf16_mixed_is_autocast_over_fp32_masters():
    # fp32 slots under Fabric's autocast; re-runs (recompute_all) replay it: exact on CPU too
    got = train(LazyTrainFabricStrategy(policy="recompute_all"), steps=3, precision="bf16-mixed")
    assert got["logits"].dtype == torch.float32  # Fabric's convert_output, as under auto
    assert_same(got, auto(steps=3, precision="bf16-mixed"))


@pytest.mark.parametrize("precision", ["bf16-true", "64-true"])
def test_other_precisions_are_refused(precision):
    with pytest.raises(ValueError, match=precision):
        L.Fabric(accelerator="cpu", strategy="lazytrain", precision=precision)


def test_impossible_budget_raises_before_the_optimizer_step():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    strategy = LazyTrainFabricStrategy(hardware="measure", gpu_memory_budget_gb=1e-6)
    fabric = L.Fabric(accelerator="cpu", strategy=strategy)
    model, opt = fabric.setup(model, opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    b = DATA[0]
    with pytest.raises(InfeasibleBudget, match="gpu memory short by"):
        fabric.backward(model(input_ids=b, labels=b).loss)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state  # the optimizer never stepped
    fabric.strategy.teardown()


def test_loss_backward_without_fabric_is_refused():
    model = make_model()
    fabric = L.Fabric(accelerator="cpu", strategy="lazytrain")
    model = fabric.setup(model)
    with pytest.raises(RuntimeError, match="fabric.backward"):
        model(input_ids=DATA[0], labels=DATA[0]).loss.backward()
    fabric.strategy.teardown()


def test_save_and_load_round_trip(tmp_path):
    first = train("lazytrain", steps=3, teardown=False)
    fabric, model, opt = first["fabric"], first["model"], first["opt"]
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt, "step": 3})
    raw = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    plain = make_model().state_dict()
    assert raw["model"].keys() == plain.keys()  # a plain state dict: no wrapper prefix
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in raw["model"].values())

    def two_more_steps(fabric, model, opt) -> list[torch.Tensor]:
        losses = []
        for b in DATA[3:5]:
            loss = model(input_ids=b, labels=b).loss
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    want = two_more_steps(fabric, model, opt)
    fabric.strategy.teardown()

    model2 = make_model()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    fabric2 = L.Fabric(accelerator="cpu", strategy="lazytrain")
    model2, opt2 = fabric2.setup(model2, opt2)
    state = {"model": model2, "optimizer": opt2, "step": 0}
    fabric2.load(tmp_path / "ckpt.pt", state)
    assert state["step"] == 3
    assert all(torch.equal(v, raw["model"][k]) for k, v in model2.state_dict().items())
    got = two_more_steps(fabric2, model2, opt2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    fabric2.strategy.teardown()

    # one flipped bit: fabric.load refuses the file, naming it (the CRCs are checked first)
    from lightning_lazytrain.fabric_strategy import CorruptCheckpoint

    data = bytearray((tmp_path / "ckpt.pt").read_bytes())
    data[len(data) // 2] ^= 0x04
    (tmp_path / "bad.pt").write_bytes(bytes(data))
    fabric3 = L.Fabric(accelerator="cpu", strategy="lazytrain")
    with pytest.raises(CorruptCheckpoint, match="bad.pt"):
        fabric3.load(tmp_path / "bad.pt", {"step": 0})


@pytest.mark.parametrize("kw, pattern", [
    (dict(gpu_memory_budget_gb=0), r"gpu_memory_budget_gb=0: must be a number of GB > 0"),
    (dict(emulate_link_gb_per_s=-1), r"emulate_link_gb_per_s=-1: must be a number of GB/s > 0"),
    (dict(hardware="h900"), r"hardware='h900'"),
    (dict(policy="nope"), r"'nope' is neither one of"),
])
def test_bad_options_fail_at_construction_with_the_users_names(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        LazyTrainFabricStrategy(**kw)


def test_the_budget_applies_to_a_hardware_object_and_no_nvme_tier_without_nvme_dir():
    """As the Trainer's strategy: a ``Hardware`` gets the budget too (an impossible one raises before
    the optimizer step), and a profile with an NVMe drive plans none without ``nvme_dir``."""
    from lightning_lazytrain.config import load_hardware

    hw = load_hardware("cpu")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fabric = L.Fabric(accelerator="cpu", strategy=LazyTrainFabricStrategy(hardware=hw, gpu_memory_budget_gb=1e-6))
    model, opt = fabric.setup(model, opt)
    with pytest.raises(InfeasibleBudget, match="gpu memory short by"):
        fabric.backward(model(input_ids=DATA[0], labels=DATA[0]).loss)
    assert not opt.state
    fabric.strategy.teardown()
    h800 = LazyTrainFabricStrategy(hardware="h800").core.hardware()
    assert load_hardware("h800").nvme_capacity_bytes > 0 and h800.nvme_capacity_bytes == 0


def test_module_without_block_stack_and_unusable_accelerator_are_clear_errors():
    from lightning.fabric.accelerators import Accelerator

    from lightning_lazytrain.fabric_strategy import BlockDiscoveryError

    fabric = L.Fabric(accelerator="cpu", strategy="lazytrain")
    with pytest.raises(BlockDiscoveryError):
        fabric.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    # stands for MPS / XLA / any accelerator the engine cannot drive
    Weird = type("Weird", (Accelerator,), {m: (lambda *a, **k: None) for m in Accelerator.__abstractmethods__})
    strategy = LazyTrainFabricStrategy()
    strategy.accelerator = Weird()
    with pytest.raises(RuntimeError, match="CUDA GPU or the CPU"):
        strategy.root_device


def test_init_module_creates_the_masters_on_the_host():
    strategy = LazyTrainFabricStrategy(device="meta")  # stands for a GPU: fabric.init_module() must not use it
    with strategy.module_init_context():
        layer = torch.nn.Linear(4, 4)
    assert layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
    with strategy.tensor_init_context():  # plain tensors still go to the device
        assert torch.empty(1).device.type == "meta"


# ---- re-planning and several processes (through the training core, as the Trainer's strategy) ----------

def test_a_run_whose_allocator_outgrows_the_plan_re_plans(monkeypatch):
    """As tests/test_allocator.py for the Trainer: the allocator's peaks of each step are injected (from the
    third on it reserves 1.3x what it allocates); the Fabric strategy re-plans once, with that ratio, and the
    training is auto's bit for bit."""
    from lightning_lazytrain.core.allocator import MemoryWatch
    from test_allocator import inject_allocator_peaks

    inject_allocator_peaks(monkeypatch, lambda k, allocated: allocated * (1.3 if k >= 3 else 1.0))
    strategy = LazyTrainFabricStrategy(policy="milp", hardware="cpu", gpu_memory_budget_gb=100.0)

    def as_on_cuda(fabric, step):
        if step == 0:  # the reserve ratio of CUDA with expandable segments
            fabric.strategy.core.planner.memory = MemoryWatch(ratio=1.05)

    got = train(strategy, steps=6, each_step=as_on_cuda)
    memory = [r for r in strategy.replans if r["reason"].startswith("memory:")]
    assert len(memory) == 1 and "1.300x what it allocated" in memory[0]["reason"], strategy.replans
    assert strategy.core.planner.memory.ratio == pytest.approx(1.3 * 1.02, rel=1e-3)
    assert_same(got, auto(steps=6))


class SlowsDown:
    """Makes the emulated host<->device link ``factor`` times slower from step ``at`` on (before its forward)."""

    def __init__(self, at: int, factor: float):
        self.at, self.factor = at, factor

    def __call__(self, fabric, step):
        if step != self.at:
            return
        from lightning_lazytrain.engine.copy_engine import LinkSpec

        engine = fabric.strategy.executor.engine
        for lane in ("h2d", "d2h"):
            worker = engine._workers[lane]
            worker.link = LinkSpec(worker.link.bandwidth_bytes_per_s / self.factor, worker.link.latency_s)


@pytest.mark.slow
def test_a_slower_link_mid_run_triggers_a_replan_and_training_stays_exact():
    """As tests/test_replan.py for the Trainer: the link slows down 40x at step 3; the strategy re-profiles,
    re-plans from what it measured and trains exactly as auto through it."""
    strategy = LazyTrainFabricStrategy(emulate_link_gb_per_s=0.2, replan={"threshold": 0.5, "patience": 2,
                                                                           "profile_check": 0})
    got = train(strategy, steps=10, each_step=SlowsDown(at=3, factor=40))
    assert len(strategy.replans) >= 1, strategy.replans
    r = strategy.replans[0]
    assert "moved from" in r["reason"] and r["step"] >= 5, r
    assert r["warm_start"] is not None
    assert_same(got, auto(steps=10))


DIST_SCRIPT = Path(__file__).with_name("dist_fabric.py")


def record(out: Path) -> dict:
    """Each rank's record of a tests/dist_fabric.py run with 2 processes (``fabric.launch()`` starts the second)."""
    return {r: json.loads((out / f"losses_rank{r}.json").read_text()) for r in range(2)}


def fabric_runs(policy, accum, clip, overlap) -> dict[str, dict]:
    common = dict(batch=2, steps=3, accum=accum, clip=clip, same_init=False)
    return {"lazy": dict(policy=policy, overlap=overlap, **common), "ddp": dict(strategy="ddp", **common)}


dist_runs, runs = runs_fixtures(DIST_SCRIPT, __file__)  # shared runs: tests/dist_runs.py, Note: [shared runs]


@pytest.mark.slow
@pytest.mark.parametrize("policy, accum, clip, overlap", [
    ("milp", 1, None, True),
    ("recompute_all", 2, 0.5, False),  # accumulation: every backward averages, as DDP without no_sync
])
@uses_runs(fabric_runs)
def test_two_processes_train_as_fabric_ddp_and_as_one_with_twice_the_batch(runs, policy, accum, clip, overlap):
    """Two gloo processes on the CPU (tests/dist_fabric.py): the same training as Fabric's DDP bit for bit
    (ranks start differently: rank 0's weights are broadcast), and as one process with both ranks'
    batches to 1e-6, with a plan rank 0 made for both and the gradients' all-reduces on the collective lane."""
    common = dict(batch=2, steps=3, accum=accum, clip=clip, same_init=False)
    lazy, ddp = record(runs["lazy"]), record(runs["ddp"])
    assert [lazy[r]["losses"] for r in range(2)] == [ddp[r]["losses"] for r in range(2)]
    weights, ddp_weights = torch.load(runs["lazy"] / "weights.pt"), torch.load(runs["ddp"] / "weights.pt")
    for name, value in ddp_weights.items():
        assert torch.equal(weights[name], value), name
    assert lazy[0]["policy"] is not None and all(lazy[r]["collective"] > 0 for r in range(2))

    import importlib.util

    spec = importlib.util.spec_from_file_location("dist_fabric", DIST_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    ref = script.train({"strategy": "auto", "union_of": 2, **common})  # one process, rank 0's start
    ours = [(x + y) / 2 for x, y in zip(lazy[0]["losses"], lazy[1]["losses"])]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref["losses"]), rtol=1e-6, atol=0.0)
    for name, value in ref["weights"].items():  # summation order differs: 1e-6 of each tensor's norm
        assert (weights[name] - value).norm() <= 1e-6 * value.norm(), name
