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
