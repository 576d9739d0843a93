"""NVMe tier at the executor level: directory problems fail before the first step, and a killed
run's spill files are removed by the next start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lightning_lazytrain.engine.executor import Executor
from lightning_lazytrain.engine.nvme import NvmeDirError
from lightning_lazytrain.models import LlamaLM
from lightning_lazytrain.planner import ModelSpec, Schedule

SPEC = ModelSpec(name="tiny", num_layers=4, hidden=64, intermediate=176, heads=4, kv_heads=2, head_dim=16, vocab=256)
NVME = Schedule(num_layers=4, homes=("gpu", "nvme", "nvme", "gpu", "gpu"), keep_internals=(False,) * 4,
                resident_weights=(False,) * 4, offload_window=(None, 1, 2, None, None),
                reload_window=(None, 2, 3, None, None))


def test_unusable_directory_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(NvmeDirError, match="not a directory|cannot be created"):
        Executor(LlamaLM(SPEC), NVME, nvme_dir=blocker / "spill")


def test_directory_too_small_for_the_plan_fails_at_construction(tmp_path):
    with pytest.raises(NvmeDirError, match="free, but the plan needs"):
        Executor(LlamaLM(SPEC), NVME, nvme_dir=tmp_path, nvme_required_bytes=1 << 60)


def test_missing_nvme_dir_is_a_clear_error():
    with pytest.raises(ValueError, match="nvme_dir"):
        Executor(LlamaLM(SPEC), NVME)


def spill_files(root) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if not f.startswith("."))


@pytest.mark.slow
def test_killed_run_leaves_files_that_the_next_start_removes(tmp_path):
    # The child writes NVMe spill files through an emulated 10 kB/s link, so each 16 kB read takes 1.6 s;
    # it is killed with SIGKILL while the step is in flight.
    code = textwrap.dedent(f"""
        import torch, sys
        from lightning_lazytrain.engine.copy_engine import LinkSpec
        from lightning_lazytrain.engine.executor import Executor
        from lightning_lazytrain.models import LlamaLM
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_executor_nvme import SPEC, NVME
        m = LlamaLM(SPEC)
        ex = Executor(m, NVME, nvme_dir={str(tmp_path)!r}, links={{"nvme_read": LinkSpec(1e4, 0.0)}})
        ex.begin_microbatch()
        loss = m.loss(torch.randint(0, 256, (2, 33)))
        print("forward done", flush=True)
        loss.backward()
        print("finished", flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "forward done"
        deadline = time.monotonic() + 30
        while not spill_files(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = spill_files(tmp_path)
        assert left, "the child wrote no spill file"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    assert all(os.path.exists(f) for f in left)  # the killed run could not clean up
    ex = Executor(LlamaLM(SPEC), NVME, nvme_dir=tmp_path)  # start-up removes the dead run's files
    try:
        assert not any(os.path.exists(f) for f in left)
        ex.begin_microbatch()
        m = ex.module
        m.loss(torch.randint(0, 256, (2, 33))).backward()
        ex.end_microbatch()
        assert spill_files(tmp_path) == []  # removed at the end of the step
    finally:
        ex.close()


def test_spill_directory_removed_mid_run_fails_clearly_and_closes_cleanly(tmp_path):
    """Fault injection: the spill directory disappears during a step. The step fails with an error
    naming the file, nvme_dir and a fix; close() still runs every step (no leaked worker threads,
    blocks restored) and does not raise the same failure again."""
    import shutil
    import threading

    from lightning_lazytrain.engine.copy_engine import CopyError

    before = threading.active_count()
    model = LlamaLM(SPEC)
    ex = Executor(model, NVME, nvme_dir=tmp_path)
    tokens = torch.randint(0, SPEC.vocab, (2, 17))
    ex.begin_microbatch()
    shutil.rmtree(ex.acts.spill.path)  # the drive's directory vanishes before the first spill write
    with pytest.raises(CopyError) as info:
        model.loss(tokens).backward()
        ex.end_microbatch()
    message = str(info.value)
    assert ".spill" in message and f"nvme_dir={tmp_path}" in message and "Fix:" in message
    # one sentence: the OS error by name and what it means here, not nested reprs or a list of guesses
    assert "No such file or directory (ENOENT); the spill directory was removed while training ran" in message
    assert "CopyError(" not in message and "OSError(" not in message and "\\'" not in message
    assert "is full" not in message and "not writable" not in message
    ex.close()  # must not raise the same failure again
    assert all("forward" not in vars(b) for b in model.layers)
    deadline = time.time() + 5
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before
