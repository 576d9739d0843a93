"""HybridAdamW's updates in the backward (``updates_in_backward=True``: allowed, the plan chooses
where they run; a plan file with ``updates_in_backward`` forces them there) against updates at the
step (pipelined under the next forward), same process, same data: step seconds and their ratio, and
the simulator's prediction for both.

    python bench/bench_updates_in_backward.py [--layers 8] [--hidden 512] [--batch 4] [--seq 128]
                                              [--steps 8] [--rounds 3] [--compute-threads 1]

A ``LlamaLM`` (``--layers`` x ``--hidden``, intermediate 2.75x, vocab 4096) in a ``CausalLMModule``,
``Trainer(strategy=LazyTrainStrategy(), precision="32-true")`` on the CPU, HybridAdamW lr 3e-4
constant, no clip, no non-finite skip (both runs). Each round runs both settings one after the other
(the order alternates); per run the median step seconds of the steps after the profiled first one
and one warm-up step; the ratio (in the backward / at the step) is taken per round, the median over
``--rounds`` is printed. The training thread runs torch with ``--compute-threads`` threads and the
optimizer's worker whatever torch has left (on a 2-core machine: one core each), so the overlap has a
core to run on, as the GPU case has a GPU beside the host. The two runs' final weights are compared
(bitwise equal: the updates are the same arithmetic). ``--update-delay-ms D`` makes each layer's
update first sleep D ms (no core used): the overlap the mechanism buys when the host update is slow
and the compute runs elsewhere, which a 2-core CPU run cannot otherwise show; the plan is then given
the host AdamW rate that prices that delay (``measure_hardware`` with ``cpu_adam_params_per_s`` lowered
to a block's update time plus the delay), so its predicted steps and choice can be compared with the
measured ones.

``--compare-order`` (Note: [most urgent first] in optim/pipeline.py): both runs update in the backward
(a plan file forces it: keep_all with the updates in the backward), one as the optimizer does (the
blocks still waiting when the step comes go in the next forward's order, and the step does not wait for
them), one first in, first out (the blocks handed over first, then the non-block layers and block 0 the
forward needs first); the ratio is urgent-first / first-in-first-out. It shows only where the host
update is slower than the backward (``--update-delay-ms``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def forced_in_backward(layers: int) -> str:
    """A plan file: keep_all, pipelined, with the updates in the backward (a plan file's choice is kept)."""
    import dataclasses
    import json
    import tempfile

    from lightning_lazytrain.planner import keep_all

    s = dataclasses.replace(keep_all(layers), optimizer="pipelined", updates_in_backward=True,
                            policy="bench-in-backward")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"schedule": s.to_json()}, f)
    return f.name


def run(updates_in_backward: bool, a: argparse.Namespace, most_urgent_first: bool = True
        ) -> tuple[float, list[torch.Tensor], dict]:
    import lightning as L

    from lightning_lazytrain.lit_module import CausalLMModule
    from lightning_lazytrain.optim import HybridAdamW
    from lightning_lazytrain.strategy import LazyTrainStrategy

    delay = a.update_delay_ms / 1e3

    class SlowHost(HybridAdamW):
        """``--update-delay-ms``: each layer's update waits that long first, without using a core (as a
        host update beside a GPU, which leaves the compute to the device)."""

        _most_urgent_first = most_urgent_first  # Note: [most urgent first]: False only for --compare-order

        def _update_layer(self, layer, plan):
            if delay:
                time.sleep(delay)
            super()._update_layer(layer, plan)

    class Module(CausalLMModule):
        def configure_optimizers(self):
            return SlowHost(self.param_groups(), lr=self.lr, betas=self.betas, eps=self.eps,
                            weight_decay=self.weight_decay, eight_bit="none", skip_nonfinite=False,
                            updates_in_backward=updates_in_backward)

    times: list[float] = []
    phases: list[tuple[float, float, float]] = []
    info: dict = {}

    class Clock(L.Callback):
        reads_gradients_only = True

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_before_backward(self, trainer, pl_module, loss):
            self.t1 = time.perf_counter()

        def on_after_backward(self, trainer, pl_module):
            self.t2 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            t3 = time.perf_counter()
            times.append(t3 - self.t0)
            # the step's phases: forward (with its waits for updates), backward, the rest (optimizer step, hooks)
            phases.append((self.t1 - self.t0, self.t2 - self.t1, t3 - self.t2))
            plan = trainer.strategy.core.plan
            if plan is not None:
                info["predicted_s"] = plan.result.sim.iteration_seconds
                info["priced_in_backward"] = plan.result.workload.updates_in_backward
                info["chosen"] = plan.result.schedule.updates_in_backward

    torch.manual_seed(0)
    spec = dict(name="bench", num_layers=a.layers, hidden=a.hidden, intermediate=int(a.hidden * 2.75),
                heads=max(1, a.hidden // 64), kv_heads=max(1, a.hidden // 64), head_dim=64, vocab=4096)
    module = Module(model_name=None, model_overrides=spec, optimizer="hybrid_adamw", lr=3e-4, lr_schedule="constant",
                    warmup_steps=0)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 4096, (a.batch, a.seq + 1), generator=g) for _ in range(a.steps)]
    trainer = L.Trainer(strategy=LazyTrainStrategy(policy=a.policy, hardware=a.hardware), accelerator="cpu", max_steps=a.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Clock()], precision="32-true")
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    opt = trainer.optimizers[0]
    opt.wait_step()
    info["left_at_step"] = opt.backward_updates_left_at_step
    info["phases"] = tuple(statistics.median(ph[k] for ph in phases[2:]) for k in range(3))
    return statistics.median(times[2:]), [p.detach().clone() for p in module.parameters()], info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--compute-threads", type=int, default=1)
    ap.add_argument("--policy", default="milp", help="the strategy's policy (a plan file forces the choice)")
    ap.add_argument("--update-delay-ms", type=float, default=0.0,
                    help="each layer's host update sleeps this long first (a slow host update that leaves the "
                         "cores to the compute, as beside a GPU)")
    ap.add_argument("--compare-order", action="store_true",
                    help="both runs in the backward: urgent-first (as the optimizer does) vs first in, first out")
    a = ap.parse_args()
    torch.set_num_threads(a.compute_threads)
    a.hardware = "measure"
    if a.update_delay_ms:  # the plan prices the slowed update: the host AdamW rate that makes a block's update
        # take the delay more (the non-block layers' are priced at the same rate: an approximation)
        from lightning_lazytrain.core.autoplan import measure_hardware

        hw = measure_hardware(torch.device("cpu"))
        inter = int(a.hidden * 2.75)
        block = 4 * a.hidden * a.hidden + 3 * a.hidden * inter + 2 * a.hidden  # the bench's LlamaLM block
        seconds = block / hw.cpu_adam_params_per_s + a.update_delay_ms / 1e3
        a.hardware = hw.replace(cpu_adam_params_per_s=block / seconds)
        print(f"priced host AdamW: {hw.cpu_adam_params_per_s / 1e9:.3f} -> {a.hardware.cpu_adam_params_per_s / 1e9:.4f} "
              f"G params/s ({seconds * 1e3:.1f} ms per block)", flush=True)
    if a.compare_order:
        compare_order(a)
        return
    ratios, rows = [], []
    for r in range(a.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {flag: run(flag, a) for flag in order}
        (tb, pb, ib), (ts, ps, is_) = got[True], got[False]
        assert all(torch.equal(x, y) for x, y in zip(pb, ps)), "the two runs' weights differ"
        ratios.append(tb / ts)
        rows.append((tb, ts, ib.get("predicted_s"), is_.get("predicted_s"), ib.get("priced_in_backward")))
        print(f"round {r}: allowed (the plan chose {'the backward' if ib.get('chosen') else 'the step'}) {tb:.4f} s/step (predicted {ib.get('predicted_s', float('nan')):.4f}), "
              f"at the step {ts:.4f} s/step (predicted {is_.get('predicted_s', float('nan')):.4f}); "
              f"ratio {tb / ts:.3f}; weights bitwise equal", flush=True)
    pred = [b / s for _, _, b, s, _ in rows if b and s]
    print(f"median ratio (allowed / at the step) {statistics.median(ratios):.3f} over {a.rounds} rounds "
          f"(range {min(ratios):.3f}..{max(ratios):.3f}); predicted ratio "
          f"{statistics.median(pred) if pred else float('nan'):.3f}")


def compare_order(a: argparse.Namespace) -> None:
    """``--compare-order``: urgent-first against first-in-first-out, both in the backward."""
    a.policy = forced_in_backward(a.layers)
    ratios = []
    for r in range(a.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {flag: run(True, a, most_urgent_first=flag) for flag in order}
        (tu, pu, iu), (tf, pf, if_) = got[True], got[False]
        assert all(torch.equal(x, y) for x, y in zip(pu, pf)), "the two runs' weights differ"
        ratios.append(tu / tf)
        print(f"round {r}: urgent first {tu:.4f} s/step ({iu['left_at_step']} blocks still waiting at a step over "
              f"the run), first in first out {tf:.4f} s/step ({if_['left_at_step']}); ratio {tu / tf:.3f}; "
              "weights bitwise equal", flush=True)
        for name, info in (("urgent first", iu), ("first in first out", if_)):
            f, b, rest = info["phases"]
            print(f"  {name}: median forward {f:.4f} s (its waits for updates included), backward {b:.4f} s, "
                  f"step and hooks {rest:.4f} s", flush=True)
    print(f"median ratio (urgent first / first in first out) {statistics.median(ratios):.3f} over {a.rounds} "
          f"rounds (range {min(ratios):.3f}..{max(ratios):.3f})")


if __name__ == "__main__":
    main()
