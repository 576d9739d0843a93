"""8-bit blockwise AdamW states through bitsandbytes (imported lazily).

What bitsandbytes 0.50.2 really does (read from ``bitsandbytes/backends/cpu/ops.py`` and checked
by experiment, see tests/test_optim_bnb.py):

* ``bitsandbytes.functional.optimizer_update_8bit_blockwise("adam", ...)`` has a CPU kernel that
  dequantises both states (native ``dequantize_blockwise``), runs decoupled-weight-decay AdamW in
  float32 torch ops and re-quantises (native ``quantize_blockwise``). It is AdamW, not Adam: the
  weight decay is ``p *= 1 - lr * wd`` before the update, as in ``torch.optim.AdamW``.
* The block size is fixed at 256 on CPU (``blocksize = 256`` inside the kernel) and on CUDA (the
  8-bit blockwise kernels' compile-time block); it is not an argument. ``block_size`` other than
  256 is therefore refused with an error instead of being silently ignored.
* ``gnorm_scale`` is honoured on CPU (``grad = g.float() * gnorm_scale``) and CUDA: updating with
  ``gnorm_scale=c`` is bitwise identical to updating with ``c * g`` -- which is what makes the
  fused clip exact.
* ``skip_zeros`` is accepted but ignored on CPU; we always pass False.
* State 1 (exp_avg) uses the signed dynamic map, state 2 (exp_avg_sq) the unsigned one
  (``create_dynamic_map(signed=...)``), 256 float32 entries each, as ``bnb.optim.AdamW8bit``.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .assign import BNB_BLOCK_SIZE

_MIN_VERSION = (0, 50)
_bnb_functional: ModuleType | None = None


def require_bnb() -> ModuleType:
    """Import ``bitsandbytes.functional`` on first use; a clear error if missing or too old."""
    global _bnb_functional
    if _bnb_functional is not None:
        return _bnb_functional
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnb_f
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "8-bit optimizer states need bitsandbytes>=0.50 (pip install 'lightning-lazytrain[train]'); "
            "eight_bit='none' works without it"
        ) from exc
    version = tuple(int(x) for x in bitsandbytes.__version__.split(".")[:2] if x.isdigit())
    if version < _MIN_VERSION:
        raise ImportError(
            f"bitsandbytes {bitsandbytes.__version__} is too old: the CPU 8-bit blockwise update needs >= 0.50"
        )
    _bnb_functional = bnb_f
    return bnb_f


def blocks_for(numel: int) -> int:
    """Number of 256-element blocks (= absmax entries per state) for ``numel`` elements."""
    return -(-numel // BNB_BLOCK_SIZE)


def bnb_available() -> bool:
    try:
        require_bnb()
    except ImportError:
        return False
    return True


def validate_block_size(block_size: int) -> None:
    if block_size != BNB_BLOCK_SIZE:
        raise ValueError(
            f"block_size={block_size} is not supported: bitsandbytes' 8-bit blockwise AdamW kernels use a "
            f"fixed block of {BNB_BLOCK_SIZE} elements on CPU and CUDA (it is not a kernel argument)"
        )


def make_qmaps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed map for exp_avg, unsigned map for exp_avg_sq) on ``device``."""
    bnb_f = require_bnb()
    return (
        bnb_f.create_dynamic_map(signed=True).to(device),
        bnb_f.create_dynamic_map(signed=False).to(device),
    )


def init_8bit_state(p: torch.Tensor, qmap1: torch.Tensor, qmap2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zero 8-bit states in bitsandbytes' layout and key names (so ``bnb.optim.AdamW8bit`` agrees)."""
    if not p.is_contiguous():
        raise ValueError("8-bit optimizer states need contiguous parameters")
    blocks = blocks_for(p.numel())
    return {
        "step": torch.zeros((), dtype=torch.float32),
        "state1": torch.zeros_like(p, dtype=torch.uint8),
        "state2": torch.zeros_like(p, dtype=torch.uint8),
        "qmap1": qmap1,
        "qmap2": qmap2,
        "absmax1": torch.zeros((blocks,), dtype=torch.float32, device=p.device),
        "absmax2": torch.zeros((blocks,), dtype=torch.float32, device=p.device),
    }


def check_8bit_state(p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
    """Validate a loaded 8-bit state against its parameter (shapes, dtypes, block count)."""
    blocks = blocks_for(p.numel())
    for key in ("state1", "state2"):
        t = state[key]
        if t.dtype != torch.uint8 or tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"8-bit {key} must be uint8 of shape {tuple(p.shape)}, got {t.dtype} {tuple(t.shape)}")
    for key in ("absmax1", "absmax2"):
        t = state[key]
        if t.dtype != torch.float32 or t.numel() != blocks:
            raise ValueError(f"{key} must be float32 with {blocks} block scales, got {t.dtype} x {t.numel()}")
    for key in ("qmap1", "qmap2"):
        if state[key].numel() != 256 or state[key].dtype != torch.float32:
            raise ValueError(f"{key} must be a float32 map of 256 entries")


#: CPU updates run in block-aligned chunks of this many elements. The CPU kernel dequantises
#: both states to float32 and copies the gradient, i.e. ~4 float32 temporaries of the tensor's
#: size: for a 65M-element embedding that is 1 GiB of host memory per call, freshly mapped
#: (and page-faulted) every step. Chunks of 1M elements keep the temporaries at ~16 MiB, reused by
#: the allocator, and were ~25 % faster on the 2-core dev box. Blockwise quantisation and the
#: AdamW math are per block / per element, so chunking at block boundaries is bitwise identical
#: (tests/test_optim_bnb.py checks this).
CPU_CHUNK_NUMEL = 1 << 20


def adamw_8bit_update(
    p: torch.Tensor,
    grad: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    gnorm_scale: float,
    chunk_numel: int | None = CPU_CHUNK_NUMEL,
) -> None:
    """One AdamW step on 8-bit states; the gradient is multiplied by ``gnorm_scale`` in-kernel.

    Increments ``state["step"]``. ``grad`` is read, never written. On CPU the tensor is updated in
    chunks of ``chunk_numel`` elements (a multiple of 256; None = one call); CUDA is one call.
    """
    bnb_f = require_bnb()
    if grad.is_sparse:
        raise RuntimeError("HybridAdamW does not support sparse gradients")
    if chunk_numel is not None and chunk_numel % BNB_BLOCK_SIZE:
        raise ValueError(f"chunk_numel must be a multiple of {BNB_BLOCK_SIZE}")
    n = p.numel()
    if chunk_numel is None or p.device.type != "cpu" or n <= chunk_numel:
        spans = [(0, n)]
    else:
        spans = [(a, min(n, a + chunk_numel)) for a in range(0, n, chunk_numel)]
    grad = grad.contiguous()
    state["step"] += 1
    step = int(state["step"].item())  # CPU tensor: no device sync
    flat = (p.view(-1), grad.view(-1), state["state1"].view(-1), state["state2"].view(-1))
    for a, b in spans:
        blocks = slice(a // BNB_BLOCK_SIZE, blocks_for(b))
        if len(spans) == 1:
            p_c, g_c, s1, s2 = p, grad, state["state1"], state["state2"]
        else:
            p_c, g_c, s1, s2 = (t[a:b] for t in flat)
        bnb_f.optimizer_update_8bit_blockwise(
            "adam",
            g_c,
            p_c,
            s1,
            s2,
            beta1,
            beta2,
            0.0,  # beta3: AdEMAMix only
            0.0,  # alpha: AdEMAMix only
            eps,
            step,
            lr,
            state["qmap1"],
            state["qmap2"],
            state["absmax1"][blocks],
            state["absmax2"][blocks],
            weight_decay=weight_decay,
            gnorm_scale=gnorm_scale,
            skip_zeros=False,
        )


def dequantized_moments(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) as float32, for inspection and tests."""
    bnb_f = require_bnb()
    m = bnb_f.dequantize_blockwise(
        state["state1"], absmax=state["absmax1"], code=state["qmap1"], blocksize=BNB_BLOCK_SIZE
    )
    v = bnb_f.dequantize_blockwise(
        state["state2"], absmax=state["absmax2"], code=state["qmap2"], blocksize=BNB_BLOCK_SIZE
    )
    return m, v
