"""The fit stage's DeepSpeed ZeRO-3 offload run (``stage_fit.py``'s child side).

What DeepSpeed's CPU Adam needs to be JIT-built here (``ensure_ninja``, ``deepspeed_preflight``), its
build (``build_cpu_adam``, also run in the background by ``stage_fit.py ds-build``), the run itself
(``run_deepspeed``) and ``Skip``, the reason a variant cannot run here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

from fit_clock import Clock, first_line, say
from fit_variants import ONE_B_FIELDS, fit_module, hf_llama, loader, token_batches, trainer_kwargs

def ensure_ninja() -> str | None:
    """The ``ninja`` torch's JIT builds run: on PATH, else the carried ``ninja`` wheel's (``<site>/bin`` after
    ``pip install --target``, or the package's ``BIN_DIR``), put on PATH."""
    from torch.utils.cpp_extension import is_ninja_available

    if is_ninja_available():
        return shutil.which("ninja")
    dirs = [Path(p) / "bin" for p in sys.path if p]
    with contextlib.suppress(Exception):
        import ninja

        if getattr(ninja, "BIN_DIR", ""):
            dirs.insert(0, Path(ninja.BIN_DIR))
    for d in dirs:
        exe = d / "ninja"
        if exe.is_file():
            if not os.access(exe, os.X_OK):
                with contextlib.suppress(OSError):
                    exe.chmod(0o755)
            os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
            if is_ninja_available():
                return str(exe)
    return None


def deepspeed_preflight(cuda: bool) -> dict:
    """What DeepSpeed's CPU Adam needs to be JIT-built here. Raises ``Skip`` with the exact reason when
    something is missing (or on the CPU, after checking the rest)."""
    info: dict = {}
    try:
        import deepspeed
    except Exception as err:  # noqa: BLE001 - recorded
        raise Skip(f"deepspeed is not importable ({first_line(err, 200)}): carry it (fetch_wheels.py ships it when "
                   "it is installed where the wheels are fetched: pip install deepspeed)") from None
    info["deepspeed"] = deepspeed.__version__
    problems = []
    info["ninja"] = ensure_ninja()
    if info["ninja"] is None:
        problems.append("no ninja (torch's JIT builds need it: the carried ninja wheel, or ninja on PATH)")
    cxx = os.environ.get("CXX", "c++")
    info["cxx"] = shutil.which(cxx)
    if info["cxx"] is None:
        problems.append(f"no C++ compiler: {cxx!r} is not on PATH (torch builds with $CXX, default c++)")
    else:
        with contextlib.suppress(Exception):
            info["cxx_version"] = subprocess.run([info["cxx"], "--version"], capture_output=True, text=True,
                                                 timeout=20).stdout.splitlines()[0]
    include = sysconfig.get_paths().get("include", "")
    info["python_h"] = str(Path(include) / "Python.h")
    if not (Path(include) / "Python.h").is_file():
        problems.append(f"no Python.h in {include} (the interpreter's development headers)")
    from torch.utils import cpp_extension

    info["cuda_home"] = cpp_extension.CUDA_HOME
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        builder = CPUAdamBuilder()
        info["cpu_adam_builder"] = f"{type(builder).__module__}.{type(builder).__name__}"
        info["cpu_adam_compatible"] = bool(builder.is_compatible(verbose=False))
        if not info["cpu_adam_compatible"]:
            problems.append(f"CPUAdamBuilder().is_compatible() is False: {getattr(builder, 'error_log', '')}")
    except Exception as err:  # noqa: BLE001 - recorded
        problems.append(f"CPUAdamBuilder: {first_line(err, 200)}")
    info["problems"] = problems
    if not cuda:
        raise Skip("CUDA only: Lightning's DeepSpeed strategy (ZeRO-3 offload) needs a GPU; checked here: "
                   + ("; ".join(problems) if problems else "deepspeed imports, ninja, a C++ compiler and Python.h "
                      "are there and CPUAdamBuilder().is_compatible()"), info)
    if problems:
        raise Skip("DeepSpeedCPUAdam cannot be JIT-built on this image: " + "; ".join(problems), info)
    return info


def build_cpu_adam(info: dict) -> None:
    """JIT-build (or load the built) DeepSpeed CPU Adam; raises ``Skip`` with the compiler's own error."""
    from deepspeed.ops.op_builder import CPUAdamBuilder

    t0 = time.perf_counter()
    try:
        CPUAdamBuilder().load(verbose=False)
    except Exception as err:  # noqa: BLE001 - recorded
        lines = [ln for ln in str(err).splitlines() if "error" in ln.lower()] or str(err).splitlines()[-5:]
        info["build_error"] = "\n".join(lines[:8])[:1500]
        raise Skip(f"DeepSpeedCPUAdam's JIT build failed: {' | '.join(lines[:3])[:500]}", info) from None
    info["build_or_load_seconds"] = round(time.perf_counter() - t0, 2)


def run_deepspeed(a: argparse.Namespace, res: dict, save: Callable[..., None]) -> None:
    cuda = a.device == "cuda"
    save(phase="preflight")
    try:
        res["preflight"] = deepspeed_preflight(cuda)
        save(phase="cpu_adam build")
        build_cpu_adam(res["preflight"])
    except Skip as s:
        res["preflight"] = s.info
        raise
    say(f"deepspeed_offload: CPU Adam ready in {res['preflight']['build_or_load_seconds']:.1f} s")
    import lightning as L

    spec = ONE_B_FIELDS
    ckpt = not a.no_peer_checkpointing
    clock = Clock(a.device, 0, a.warmup, a.timed)
    data = token_batches(clock.total, a.batch, a.seq, spec["vocab"])
    module = fit_module("ds_cpu_adam", model=hf_llama(spec, a.seq, a.device, ckpt))
    res["parameters"] = sum(p.numel() for p in module.parameters())
    res["settings"] = {"strategy": "deepspeed_stage_3_offload (ZeRO-3, optimizer and parameters offloaded to the CPU)",
                       "precision": "bf16-mixed",
                       "optimizer": "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True), lr 3e-4, weight decay 0.1",
                       "activation_checkpointing": "per decoder layer (Hugging Face, non-reentrant)" if ckpt else "off",
                       "model": "transformers.LlamaForCausalLM, fp32 cross-entropy over full logits"}
    trainer = L.Trainer(strategy="deepspeed_stage_3_offload", precision="bf16-mixed",
                        **trainer_kwargs(a.workdir / "deepspeed", clock, cuda))
    save(phase="fit")
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=loader(data))
    res["fit_seconds"] = round(time.perf_counter() - t0, 2)
    res.update(clock.result(a.batch * a.seq))
    res["optimizer_note"] = "the DeepSpeed engine's step (CPU Adam on the offloaded fp32 states), after the backward"


class Skip(Exception):
    """A variant that cannot run here: recorded ``skipped`` with this reason (``info``: what was found)."""

    def __init__(self, reason: str, info: dict | None = None) -> None:
        super().__init__(reason)
        self.info = info or {}
