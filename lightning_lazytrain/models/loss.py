"""Next-token cross-entropy through the LM head, a chunk of tokens at a time.

``chunked_lm_loss(hidden, weight, targets, chunk_tokens)`` is ``F.cross_entropy(hidden @ weight.T, targets)``
(mean over tokens) without ever holding the logits of more than ``chunk_tokens`` tokens: the vocabulary
is large (152k-248k for Qwen), so full fp32 logits of a 72 x 1024-token micro-batch would take 73 GB.
As in Liger's fused linear cross-entropy, the gradients are computed in the forward, chunk by chunk
(the loss is a scalar: its backward only scales them), so no logits are recomputed and the head costs
the usual 6 * tokens * vocab * hidden FLOPs.

Memory (what ``planner.memory_model.head_memory`` counts): per chunk the logits in the compute dtype,
their fp32 copy (turned into probabilities in place; the compute-dtype copy is freed first), the
probabilities' gradient in the compute dtype; for the whole micro-batch the gradient of ``hidden`` and
of ``weight`` (compute dtype, accumulated over chunks with ``addmm_``), kept until the backward.
"""

from __future__ import annotations

import torch


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                chunk: int, ignore_index: int | None = None, denominator: torch.Tensor | None = None) -> torch.Tensor:
        if ignore_index is not None or denominator is not None:
            return _masked_forward(ctx, hidden, weight, targets, chunk, ignore_index, denominator)
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # the matmuls run in the weight's dtype whatever autocast says (explicit casts, out= buffers)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, chunk):
                hc, tc = hidden[s:s + chunk].to(weight.dtype), targets[s:s + chunk]
                logits = (hc @ weight.t()).float()  # a no-op for fp32; else the compute-dtype logits go here
                picked = logits.gather(1, tc[:, None])
                top = logits.amax(dim=-1, keepdim=True)
                logits.sub_(top).exp_()
                norm = logits.sum(dim=-1, keepdim=True)
                total += (norm.log() + top - picked).sum()
                if dh is None and dw is None:
                    continue
                probs = logits.div_(norm)  # softmax, in place
                probs.scatter_add_(1, tc[:, None], torch.full_like(picked, -1.0))  # d(loss_i)/d(logits_i)
                probs.mul_(1.0 / n)
                g = probs.to(weight.dtype)  # a no-op for fp32
                del logits, probs
                if dh is not None:
                    if dh.dtype == weight.dtype:
                        torch.mm(g, weight, out=dh[s:s + chunk])
                    else:
                        dh[s:s + chunk].copy_(g @ weight)
                if dw is not None:
                    dw.addmm_(g.t(), hc)
                del g
        ctx.grads = (dh, dw)
        return total / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        dh, dw = ctx.grads
        ctx.grads = None
        if dh is not None:
            dh.mul_(grad.to(dh.dtype))
        if dw is not None:
            dw.mul_(grad.to(dw.dtype))
        return dh, dw, None, None, None, None


def _masked_forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                    ignore_index: int | None, denominator: torch.Tensor | None) -> torch.Tensor:
    """The forward with rows to ignore (``targets == ignore_index``: no loss, no gradient) and the sum
    divided by ``denominator`` (default: the rows not ignored), as ``F.cross_entropy(...,
    ignore_index=...)`` with ``reduction="mean"`` or Hugging Face's ``num_items_in_batch`` sum."""
    n = hidden.shape[0]
    valid = targets != ignore_index if ignore_index is not None else torch.ones_like(targets, dtype=torch.bool)
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    denom = valid.sum().float() if denominator is None else torch.as_tensor(denominator, device=hidden.device).float()
    # d(loss)/d(row loss): 1/denominator, 0 where ignored -- also when every row is (denominator 0: the loss
    # is 0/0 = NaN as F.cross_entropy's, its gradient 0 as F.cross_entropy's, not 0/0)
    scale = torch.where(valid, 1.0 / denom, torch.zeros((), device=hidden.device))
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dh = torch.empty_like(hidden) if need_h else None
    dw = torch.zeros_like(weight) if need_w else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for s in range(0, n, chunk):
            hc, tc, sc = hidden[s:s + chunk].to(weight.dtype), safe[s:s + chunk], scale[s:s + chunk]
            logits = (hc @ weight.t()).float()
            picked = logits.gather(1, tc[:, None])
            top = logits.amax(dim=-1, keepdim=True)
            logits.sub_(top).exp_()
            norm = logits.sum(dim=-1, keepdim=True)
            total += ((norm.log() + top - picked).squeeze(1) * valid[s:s + chunk]).sum()
            if dh is None and dw is None:
                continue
            probs = logits.div_(norm)
            probs.scatter_add_(1, tc[:, None], torch.full_like(picked, -1.0))
            probs.mul_(sc[:, None])
            g = probs.to(weight.dtype)
            del logits, probs
            if dh is not None:
                if dh.dtype == weight.dtype:
                    torch.mm(g, weight, out=dh[s:s + chunk])
                else:
                    dh[s:s + chunk].copy_(g @ weight)
            if dw is not None:
                dw.addmm_(g.t(), hc)
            del g
    ctx.grads = (dh, dw)
    return total / denom


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                    chunk_tokens: int = 4096, *, ignore_index: int | None = None,
                    num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` (``hidden [..., h]``, ``weight [V, h]``) against
    ``targets [...]``, ``chunk_tokens`` rows of logits at a time (fp32 softmax). ``ignore_index``:
    targets with that value add no loss and no gradient, and the mean is over the others;
    ``num_items_in_batch``: the sum is divided by it instead (Hugging Face's gradient-accumulation
    normalisation)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    h = hidden.shape[-1]
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, h), weight, targets.reshape(-1), int(chunk_tokens),
                                            ignore_index, num_items_in_batch)
