"""Finished multi-process runs, shared by the tests that assert on them (tests/test_distributed.py with
dist_train.py, tests/test_fabric.py with dist_fabric.py).

Note: [shared runs]. Several tests train the same configuration (the same DDP run, the same
uninterrupted run); each is run once per session, and the runs of all the selected tests start
together, one after another in the same processes (a script given a JSON list of options runs them in
turn; its first run launches the other ranks, the later ones find them): the start-up, a fresh
interpreter importing torch, Lightning and transformers per rank, one rank after the other, is most of
a short run's time. A test names its runs with ``uses_runs(spec)``: spec maps the test's parameters to
{name: the script's options}; the module's ``runs`` fixture gives {name: the run's output directory},
launching on first use whatever the selected tests of the module need that is not there yet (so any
subset, in any order, launches what it needs). Options beyond the script's: ``save`` a file name in
the run's directory; ``resume`` {"run": options}: that run's ``save``, launched in a later batch (in
fresh processes) after the run that saved it. The script writes ``done_rank{r}`` in a run's ``out``
when rank r finished it, and prints ``<script>: run <out>`` as it starts one: a batch that stops shows
which run it stopped in; that run's tests fail with its output, the later runs are launched again when
needed; processes that exit with an error after finishing every run fail the tests of all their runs.
Runs that are meant to fail are launched on their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest


def run_each(name: str, run: Callable[[dict], None]) -> None:
    """A script's side (Note: [shared runs]): one run (a JSON object in ``sys.argv[1]``), or a JSON list of runs
    one after another in the same processes -- the first launches the other ranks (Lightning's or Fabric's
    launcher sets LOCAL_RANK), the later ones find them -- each in its ``out`` (the Trainer's default root), and
    ``<name>: run <out>`` printed as each starts."""
    runs = json.loads(sys.argv[1])
    for opts in runs if isinstance(runs, list) else [runs]:
        print(f"{name}: run {opts['out']}", flush=True)
        os.chdir(opts["out"])
        run(opts)


def key_of(opts: dict) -> str:
    return json.dumps({"devices": 2, **opts}, sort_keys=True)


class Runs:
    def __init__(self, script: Path, root: Path, declared: Callable[[], list[dict]],
                 resolve: Callable[[Runs, dict, Path], dict] | None = None):
        self.script = script
        self.root = root
        self.declared = declared  # () -> the options of every run the selected tests name, in test order
        self.resolve = resolve  # (runs, options, out) -> the script's options, for options of its own
        self.done: dict[str, Path] = {}
        self.failed: dict[str, str] = {}
        self._n = 0

    def get(self, opts: dict) -> Path:
        key = key_of(opts)
        if key not in self.done and key not in self.failed:
            self._launch(opts)
        if key in self.failed:
            pytest.fail(self.failed[key], pytrace=False)
        return self.done[key]

    def _ready(self, opts: dict) -> bool:
        dep = (opts.get("resume") or {}).get("run")
        return dep is None or key_of(dep) in self.done

    def _resolved(self, opts: dict, out: Path) -> dict:
        o = {"devices": 2, **opts, "out": str(out)}
        if "save" in o:
            o["save"] = str(out / o["save"])
        dep = o.get("resume")
        if isinstance(dep, dict) and "run" in dep:
            o["resume"] = str(self.get(dep["run"]) / dep["run"]["save"])
        return self.resolve(self, o, out) if self.resolve is not None else o

    def _launch(self, opts: dict) -> None:
        dep = (opts.get("resume") or {}).get("run")
        if dep is not None:
            self.get(dep)  # (a run's checkpoint is written in an earlier batch)
        devices = opts.get("devices", 2)
        batch, keys = [], set()
        for o in [opts, *self.declared()]:
            k = key_of(o)
            if (k in keys or k in self.done or k in self.failed or o.get("devices", 2) != devices
                    or not self._ready(o)):
                continue
            keys.add(k)
            batch.append(o)
        # lazytrain's runs first: the first run's strategy makes the process group (its timeout)
        batch.sort(key=lambda o: o.get("strategy", "lazytrain") != "lazytrain")
        outs = []
        for _ in batch:
            self._n += 1
            outs.append(self.root / f"run{self._n}")
            outs[-1].mkdir()
        resolved = [self._resolved(o, out) for o, out in zip(batch, outs)]
        try:
            proc = subprocess.run([sys.executable, str(self.script), json.dumps(resolved)], capture_output=True,
                                  text=True, timeout=180 + 90 * len(batch), cwd=self.root)
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            text = (lambda b: b.decode(errors="replace") if isinstance(b, bytes) else b or "")
            stdout, stderr, rc = text(e.stdout), text(e.stderr) + f"\n(timed out after {e.timeout} s)", None
        for o, out in zip(batch, outs):
            if all((out / f"done_rank{r}").exists() for r in range(devices)):
                self.done[key_of(o)] = out
            else:  # the run the batch stopped in; the later ones are launched again when needed
                start = stdout.find(f": run {out}\n")
                self.failed[key_of(o)] = (f"{self.script.name} exited with {rc} in the run {json.dumps(o)}:\n"
                                          + stdout[max(start, 0):][-3000:] + stderr[-8000:])
                break
        else:
            if rc != 0:  # every run finished, yet the processes did not exit cleanly: the runs' tests fail
                for o in batch:
                    del self.done[key_of(o)]
                    self.failed[key_of(o)] = (f"{self.script.name} exited with {rc} after its runs:\n"
                                              + stdout[-3000:] + stderr[-8000:])


def uses_runs(spec: Callable[..., dict[str, dict]]):
    """The test's runs: ``spec(**the test's parameters)`` -> {name: options}."""
    def mark(test):
        test.dist_runs = spec
        return test

    return mark


def _params(node) -> dict:
    callspec = getattr(node, "callspec", None)
    return callspec.params if callspec is not None else {}


def runs_fixtures(script: Path, module_file: str, resolve: Callable[[Runs, dict, Path], dict] | None = None):
    """The fixtures ``dist_runs`` (this module's ``Runs``, one per session) and ``runs`` ({name: output
    directory} of the runs the test names), for the tests of ``module_file``."""
    module = Path(module_file).resolve()

    @pytest.fixture(scope="session")
    def dist_runs(request, tmp_path_factory) -> Runs:
        def declared() -> list[dict]:
            out = []
            for item in request.session.items:
                spec = getattr(getattr(item, "function", None), "dist_runs", None)
                if spec is not None and Path(str(item.path)).resolve() == module:
                    out.extend(spec(**_params(item)).values())
            return out

        return Runs(script, tmp_path_factory.mktemp(script.stem), declared, resolve)

    @pytest.fixture
    def runs(request, dist_runs) -> dict[str, Path]:
        spec = request.function.dist_runs(**_params(request.node))
        return {name: dist_runs.get(opts) for name, opts in spec.items()}

    return dist_runs, runs
