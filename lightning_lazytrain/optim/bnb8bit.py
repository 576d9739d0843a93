"""8-bit blockwise AdamW states through bitsandbytes (imported lazily).

What bitsandbytes 0.50.2 really does for ``optimizer_update_8bit_blockwise("adam", ...)`` (read
from ``bitsandbytes/backends/{cpu,cuda}/ops.py``; the CUDA kernel from the PTX of
``kOptimizerStatic8bit2StateBlockwise<T, ADAM, 256, 1>`` in the shipped ``libbitsandbytes_cuda*.so``,
whose source is not installed; CPU facts checked by experiment, see tests/test_optim_bnb.py):

* CPU (``backends/cpu/ops.py``, ``_optimizer_update_8bit_blockwise_cpu``): dequantises both states
  (native ``dequantize_blockwise``), runs AdamW in float32 torch ops and re-quantises (native
  ``quantize_blockwise``, 64-bit element counts). Weight decay ``p *= 1 - lr * wd`` comes BEFORE the
  update, as in ``torch.optim.AdamW``. Non-finite gradient elements propagate unevenly: NaN makes
  that parameter NaN while the native quantiser ignores NaN in the block maximum (the moment is
  stored as a finite code); +-inf makes the block's absmax inf, so all 256 moments of the block
  dequantise to inf/NaN from then on.
* CUDA (``backends/cuda/ops.py`` ``_optimizer_update_8bit_blockwise_impl``): one kernel launch with
  no stream argument, on the legacy default stream; weight decay is applied AFTER the update,
  ``p = (p - step) * (1 - lr * wd)``; elements whose gradient is non-finite are skipped (parameter
  untouched, both moments of that element set to 0); the element count goes through
  ``ct.c_int32``, so 2^31 or more elements wrap (a negative count is a launch error, on which the
  library calls ``exit(1)``; 2^32 + k updates only k elements). The math uses fast approximate
  ``sqrt``/``div``/``ex2`` with flush-to-zero, so CPU and CUDA agree closely, never bitwise.
* The block size is fixed at 256 on CPU (``blocksize = 256`` inside the kernel) and on CUDA (the
  kernels' compile-time block); it is not an argument. ``block_size`` other than 256 is therefore
  refused with an error instead of being silently ignored.
* ``gnorm_scale`` is honoured on CPU (``grad = g.float() * gnorm_scale``) and CUDA: updating with
  ``gnorm_scale=c`` is bitwise identical to updating with ``c * g`` -- which is what makes the
  fused clip exact.
* ``skip_zeros`` is accepted but ignored on CPU; we always pass False.
* State 1 (exp_avg) uses the signed dynamic map, state 2 (exp_avg_sq) the unsigned one
  (``create_dynamic_map(signed=...)``), 256 float32 entries each, as ``bnb.optim.AdamW8bit``.

What :func:`adamw_8bit_update` makes of it -- one semantics on both devices:

* Weight decay: ours, ``p.mul_(1 - lr * wd)`` in the parameter's dtype before the kernel, which
  then gets ``weight_decay=0`` (torch AdamW's order and rounding; on CPU with float32 parameters
  this is bitwise what the kernel's own decay did).
* Non-finite gradients: "propagate by block". An element with a NaN/inf gradient gets a NaN
  parameter (as in torch AdamW, where its update is NaN) and the block scales (absmax) of its
  256-element block become NaN in both moments, so the block's moments read as NaN and its
  parameters turn NaN at the next update. (An 8-bit code cannot hold NaN, so per-element
  propagation is impossible; a block is the finest unit.) HybridAdamW normally never gets here:
  a non-finite global norm skips the whole step; only with ``skip_nonfinite=False`` and no
  clipping does a non-finite gradient reach the update, and the optimizer tells the update when
  the norm proved every gradient finite (``grads_finite=True``) so the check costs nothing then.
* Size: updates run in block-aligned chunks (``CPU_CHUNK_NUMEL``/``CUDA_CHUNK_NUMEL``), so any
  tensor works on CUDA; chunking is bitwise identical to one call (blocks are independent).
* Streams: CUDA work is ordered on the caller's current stream (see the Note in
  :func:`_legacy_stream_bridge`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
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
        bitsandbytes, bnb_f = _import_bnb()
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


def _import_bnb() -> tuple[ModuleType, ModuleType]:
    """Import bitsandbytes without its network access. On a CPU with AVX512-BF16, bitsandbytes
    (0.50) fetches a 4-bit GEMM kernel from the Hugging Face hub at import (``kernels.get_kernel``)
    and, offline or untrusted, logs "could not verify publisher trust status". The 8-bit optimizer
    never uses that kernel, and nothing may reach the network at run time: the ``kernels`` package
    is hidden for the import (bitsandbytes then keeps its own CPU path) and that one warning is
    not shown."""
    import logging
    import sys

    hide = "kernels" not in sys.modules
    if hide:
        sys.modules["kernels"] = None  # type: ignore[assignment]  # an import of it raises ImportError
    cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops.level
    cpu_ops.setLevel(logging.ERROR)
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnb_f
    finally:
        cpu_ops.setLevel(level)
        if hide and sys.modules.get("kernels", 0) is None:
            del sys.modules["kernels"]
    return bitsandbytes, bnb_f


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

#: CUDA updates run in block-aligned chunks of this many elements: the kernel takes its element
#: count as a C ``int`` (``ct.c_int32(g.numel())`` in bitsandbytes/backends/cuda/ops.py) and indexes
#: with 32-bit offsets, so one launch must cover fewer than 2^31 elements. 2^30 keeps a wide
#: margin and costs one extra launch per 1G elements. Read at call time (tests shrink it).
CUDA_CHUNK_NUMEL = 1 << 30

#: Largest block-aligned element count one CUDA launch can take (``n < 2^31``).
CUDA_KERNEL_MAX_NUMEL = (1 << 31) - BNB_BLOCK_SIZE


def default_chunk_numel(device: torch.device) -> int:
    """The chunk length :func:`adamw_8bit_update` uses on ``device`` when none is given."""
    return CUDA_CHUNK_NUMEL if device.type == "cuda" else CPU_CHUNK_NUMEL


def chunk_spans(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(numel)``; every start is a multiple of ``chunk_numel``."""
    if chunk_numel <= 0 or chunk_numel % BNB_BLOCK_SIZE:
        raise ValueError(f"chunk_numel must be a positive multiple of {BNB_BLOCK_SIZE}, got {chunk_numel}")
    return [(a, min(numel, a + chunk_numel)) for a in range(0, numel, chunk_numel)]


@contextlib.contextmanager
def _legacy_stream_bridge(device: torch.device) -> Iterator[None]:
    """Run the body on the legacy default stream, ordered after and before the caller's stream.

    Note: [bitsandbytes' 8-bit optimizer kernels ignore the current stream]
    ``_optimizer_update_8bit_blockwise_impl`` (bitsandbytes/backends/cuda/ops.py) calls
    ``cadam_8bit_blockwise_grad_*`` without a stream argument (unlike its quantise/dequantise ops,
    which pass ``torch._C._cuda_getCurrentRawStream``); the host launcher
    ``optimizerStatic8bitBlockwise`` pushes its call configuration with stream 0 and the library
    imports ``cudaLaunchKernel``, not the per-thread ``cudaLaunchKernel_ptsz``, so the kernel runs on
    the *legacy* default stream -- which is torch's default stream (``cuda_stream == 0``). Wrapping
    the call in ``torch.cuda.stream(...)`` therefore changes nothing for the kernel. PyTorch's own
    side streams are created non-blocking, so the legacy stream does not implicitly wait for them:
    called on a side stream, the kernel would race with the caller's pending work (the gradient
    not yet written, the weights still being uploaded) and the caller's next kernels would race
    with it. So when the current stream is not the default stream, the legacy stream waits for the
    current one (an event, no host sync), the whole update -- our decay and non-finite handling
    included, so that the caching allocator sees every temporary used on the stream that used it --
    runs on the legacy stream, and the current stream then waits for the legacy one. The caller sees
    the update as if it ran on its stream. The price: the legacy stream also serialises with other
    blocking streams' work (none of ours: torch's streams are non-blocking), and the update cannot
    be captured in a CUDA graph (bitsandbytes' launch on stream 0 could not be either).
    """
    if device.type != "cuda":
        yield
        return
    current = torch.cuda.current_stream(device)
    legacy = torch.cuda.default_stream(device)
    if current == legacy:
        yield
        return
    legacy.wait_stream(current)
    try:
        with torch.cuda.stream(legacy):
            yield
    finally:
        current.wait_stream(legacy)


def _propagate_nonfinite(
    p: torch.Tensor, grad: torch.Tensor, absmax1: torch.Tensor, absmax2: torch.Tensor
) -> None:
    """The "propagate by block" policy for one block-aligned chunk (flat views); no host sync.

    Elements whose gradient is non-finite get a NaN parameter; the block scales of their blocks
    become NaN in both moments (whatever the kernel stored there: CUDA skipped the element, CPU
    stored a NaN as a finite code or made the block's scale inf).
    """
    bad = ~torch.isfinite(grad)
    p.masked_fill_(bad, math.nan)
    blocks = absmax1.numel()
    padded = torch.zeros(blocks * BNB_BLOCK_SIZE, dtype=torch.bool, device=bad.device)
    padded[: bad.numel()] = bad
    bad_blocks = padded.view(blocks, BNB_BLOCK_SIZE).any(dim=1)
    absmax1.masked_fill_(bad_blocks, math.nan)
    absmax2.masked_fill_(bad_blocks, math.nan)


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
    chunk_numel: int | None = None,
    grads_finite: bool = False,
) -> None:
    """One AdamW step on 8-bit states, torch AdamW semantics on CPU and CUDA (see module doc).

    The gradient is multiplied by ``gnorm_scale`` in-kernel. Increments ``state["step"]``. ``grad``
    is read, never written. The tensor is updated in chunks of ``chunk_numel`` elements (a
    multiple of 256; None: :func:`default_chunk_numel`; on CUDA at most ``CUDA_KERNEL_MAX_NUMEL``).
    ``grads_finite=True`` promises that every gradient element is finite (the caller's global
    norm was finite) and skips the non-finite handling. On CUDA the work is ordered on the
    caller's current stream, nothing waits on the host.
    """
    bnb_f = require_bnb()
    if grad.is_sparse:
        raise RuntimeError("HybridAdamW does not support sparse gradients")
    if chunk_numel is None:
        chunk_numel = default_chunk_numel(p.device)
    if p.device.type == "cuda" and chunk_numel > CUDA_KERNEL_MAX_NUMEL:
        raise ValueError(
            f"chunk_numel={chunk_numel} is too large for bitsandbytes' CUDA kernel (32-bit element count); "
            f"at most {CUDA_KERNEL_MAX_NUMEL}"
        )
    n = p.numel()
    spans = chunk_spans(n, chunk_numel)
    state["step"] += 1
    step = int(state["step"].item())  # CPU tensor: no device sync
    if n == 0:  # the CUDA launcher would fail on an empty grid (and bitsandbytes exits on launch errors)
        return
    decay = 1.0 - lr * weight_decay
    with torch.no_grad(), _legacy_stream_bridge(p.device):
        flat = (p.view(-1), grad.contiguous().view(-1), state["state1"].view(-1), state["state2"].view(-1))
        for a, b in spans:
            blocks = slice(a // BNB_BLOCK_SIZE, blocks_for(b))
            p_c, g_c, s1, s2 = (t[a:b] for t in flat)
            absmax1, absmax2 = state["absmax1"][blocks], state["absmax2"][blocks]  # views: written in place
            if weight_decay != 0.0:
                p_c.mul_(decay)  # torch AdamW's decoupled decay, before the update, in p's dtype
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
                absmax1,
                absmax2,
                weight_decay=0.0,  # applied above: CUDA would apply it after the update
                gnorm_scale=gnorm_scale,
                skip_zeros=False,
            )
            if not grads_finite:
                _propagate_nonfinite(p_c, g_c, absmax1, absmax2)


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Blockwise dequantisation as bitsandbytes does it, ``qmap[code] * absmax`` of the code's block of 256, in
    torch (bit for bit bitsandbytes' result: tests/test_optim_bnb.py): reading 8-bit states needs no
    bitsandbytes (review 25: a 32-bit resume of an 8-bit checkpoint on a host without it was refused)."""
    flat = qmap[codes.reshape(-1).long()]
    pad = (-flat.numel()) % BNB_BLOCK_SIZE
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, BNB_BLOCK_SIZE) * absmax.view(-1, 1)
    return blocks.reshape(-1)[: flat.numel()].view(codes.shape)


def dequantized_moments(state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq) as float32, each shaped as its codes."""
    return (dequantize_blockwise(state["state1"], state["absmax1"], state["qmap1"]),
            dequantize_blockwise(state["state2"], state["absmax2"], state["qmap2"]))


def measure_adamw_8bit_params_per_s(numel: int = 1 << 22, repeats: int = 2) -> float | None:
    """Parameters per second of the 8-bit AdamW update on the host (bitsandbytes' CPU kernel, as
    HybridAdamW runs it), best of ``repeats`` after a warm-up; None without bitsandbytes. The plan
    prices an 8-bit slice with it (Note: [planned 8-bit slice] in state_bits.py)."""
    import time

    if not bnb_available():
        return None
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).mul_(1e-3)
    state = init_8bit_state(p, *make_qmaps(p.device))
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, gnorm_scale=1.0, grads_finite=True)
    adamw_8bit_update(p, grad, state, **kw)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        adamw_8bit_update(p, grad, state, **kw)
        best = min(best, time.perf_counter() - t0)
    return numel / best
