"""Shared test settings."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Tests use small tensors: intra-op threading only adds synchronisation, and on a loaded
    2-core machine (the copy engine's worker threads want the other core) it made tiny-tensor
    tests up to 50x slower. Restored afterwards."""
    try:
        import torch
    except ImportError:  # the planner's tests need no torch
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Tests marked slow in files this hook's author did not own (the files' owners may move these marks into the files
# as @pytest.mark.slow). Slow = over ~2 s on a 2-core machine, mostly a fresh interpreter importing torch and
# Lightning; `python -m pytest -q -m "not slow"` then runs in about a minute (durations: bench/RESULTS.md,
# "Start-up, packaging and test time"). Entries are node ids without parameters.
SLOW = {
    "tests/test_device_kit.py::test_rehearsal_passes_every_cpu_stage_and_skips_the_cuda_ones",
    "tests/test_strategy.py::test_resumed_run_continues_with_the_same_losses",
    "tests/test_strategy.py::test_checkpoint_weights_load_without_this_package",
    "tests/test_examples.py::test_quickstart_cpu",
    "tests/test_examples.py::test_hf_example",
    "tests/test_activation_store.py::test_sigkill_mid_write_is_cleaned_at_next_start",
    "tests/test_optim_assign.py::test_works_without_bitsandbytes",
    "tests/test_planner_inputs.py::test_batch_search_finds_largest_and_best_throughput",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("[")[0] in SLOW:
            item.add_marker(pytest.mark.slow)
