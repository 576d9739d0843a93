"""HybridAdamW's gradient norms and clip: the norms handed over by the engine (per layer, squared, or per
parameter with the stale check), the global norm a step takes, and the clip asked for the next step. A mixin of
``HybridAdamW`` (its ``param_groups``, ``_layer_groups``, ``_inbox``, ``skip_nonfinite``, ``max_grad_norm``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence

import torch

from .clip import ClipDecision, clip_coefficient, global_grad_norm, grad_total_norm, norm_from_sq_norms


class GradNorms:
    """Norms handed over and the clip of ``HybridAdamW`` (Note: [exact clip] in clip.py)."""

    def add_layer_sq_norm(self, layer: Hashable, sq_norm: torch.Tensor | float) -> None:
        """Hand over (part of) a layer's squared gradient norm; parts of one layer add up.

        When any norm was handed over for a step, every layer with gradients must have one;
        the step then uses them instead of the ``_foreach_norm`` pass.
        """
        if layer not in self._layer_groups:
            raise KeyError(f"unknown layer {layer!r}; layers are {self.layers}")
        self._inbox.add(layer, sq_norm)

    def set_grad_sq_norms(
        self, sq_norms: Mapping[Hashable, torch.Tensor | float] | Sequence[torch.Tensor | float]
    ) -> None:
        """Hand over all layers' squared norms at once (a sequence is indexed by layer id)."""
        layers = sq_norms.keys() if isinstance(sq_norms, Mapping) else range(len(sq_norms))
        unknown = [layer for layer in layers if layer not in self._layer_groups]
        if unknown:
            raise KeyError(f"unknown layers {unknown}; layers are {self.layers}")
        self._inbox.replace(sq_norms)

    def set_grad_norms(self, norms: Mapping[torch.Tensor, torch.Tensor] | None, *,
                       recompute: Callable[[list[torch.Tensor]], Mapping[torch.Tensor, torch.Tensor]] | None = None
                       ) -> None:
        """Hand over each parameter's gradient L2 norm (0-d, as ``torch._foreach_norm`` computes it
        from that ``.grad``) for the next step, keyed by the parameter; ``None`` withdraws them.

        The step then takes the global norm from these instead of reading the gradients, and it
        equals ``clip_grad_norm_(params)``'s bit for bit (Note: [exact clip]). A parameter with a
        ``.grad`` but no norm here has its norm computed at the step. Takes precedence over
        squared norms handed per layer.

        Note: [stale norms] A norm is used only if the parameter's ``.grad`` is still the tensor it
        was taken from, unmodified (its autograd version counter unchanged: every in-place edit,
        also through another view of the same buffer or ``.detach()``, bumps it): a hook or callback
        that scaled, clipped, zeroed or replaced a gradient between the hand-over and the step gets
        its gradient's own norm taken at the step (``stale_norms`` counts them). Edits through
        ``.data`` bypass the counter: a caller that cannot rule them out hands over ``{}`` (every
        norm taken at the step). ``recompute(stale_params)``, if given, supplies the norms of the
        stale parameters (e.g. the whole-parameter norms of sharded gradients, which need a
        collective); it is called at every step, stale parameters or not.
        """
        if norms is None:
            self._grad_norms, self._recompute_norms = None, None
            return
        self._grad_norms = {p: (n, p.grad, p.grad._version) for p, n in norms.items() if p.grad is not None}
        self._recompute_norms = recompute

    def _fresh_handed_norms(self, params: list[torch.Tensor],
                            handed: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor, int]],
                            recompute: Callable[[list[torch.Tensor]], Mapping[torch.Tensor, torch.Tensor]] | None
                            ) -> list[torch.Tensor | None]:
        """Per parameter, its handed-over norm if its gradient is unchanged since (Note: [stale
        norms]), else what ``recompute`` gives, else None (taken by the caller)."""
        norms: list[torch.Tensor | None] = []
        for p in params:
            entry = handed.get(p)
            norms.append(entry[0] if entry is not None and entry[1] is p.grad and entry[2] == p.grad._version
                         else None)
        self.handed_norms_used = sum(n is not None for n in norms)
        self.stale_norms = len(norms) - self.handed_norms_used
        if recompute is not None:
            fresh = recompute([p for p, n in zip(params, norms) if n is None])
            norms = [fresh.get(p) if n is None else n for p, n in zip(params, norms)]
        return norms

    def _global_norm(self, clip: float | None) -> torch.Tensor | None:
        handed_norms, self._grad_norms = self._grad_norms, None
        recompute, self._recompute_norms = self._recompute_norms, None
        self.handed_norms_used = self.stale_norms = 0
        handed = self._inbox.take()
        if handed_norms is not None:
            params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
            return grad_total_norm([p.grad for p in params], self._fresh_handed_norms(params, handed_norms, recompute))
        with_grads = {
            layer
            for layer, gis in self._layer_groups.items()
            if any(p.grad is not None for gi in gis for p in self.param_groups[gi]["params"])
        }
        if handed:
            missing = with_grads - handed.keys()
            if missing:
                raise ValueError(
                    f"squared gradient norms were handed over but not for layers {sorted(map(str, missing))}; "
                    "hand over every layer's or none"
                )
            values = [v for layer in handed for v in handed[layer]]
            device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
            return norm_from_sq_norms(values, device)
        if clip is None and not self.skip_nonfinite:
            return None
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return global_grad_norm(grads)

    def clip_next_step(self, max_norm: float | None) -> None:
        """Clip the next step's gradients to ``max_norm`` (the global L2 norm), fused into its update,
        as a ``clip_grad_norm_`` run just before it would (Note: [exact clip] in clip.py); the step after
        it is not clipped unless asked again. The Trainer's ``gradient_clip_val`` arrives here (the
        strategy's precision plugin). ``max_grad_norm`` (the constructor's) stays the optimizer's own
        clip; with both, the plugin clips the gradients itself first, as under ``strategy="auto"``."""
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"max_norm must be positive or None, got {max_norm}")
        self._step_clip = max_norm

    def _clip_now(self) -> float | None:
        """The clip of the step about to run: the one asked for it (``clip_next_step``), else its own."""
        return self._step_clip if self._step_clip is not None else self.max_grad_norm

    def _clipped_nonfinite(self, total: torch.Tensor, clip: float) -> ClipDecision:
        """A clip asked for this step (the Trainer's, ``clip_next_step``) over a non-finite norm, as
        ``clip_grad_norm_`` then this step would run it: the gradients are multiplied by its factor (0 for
        an infinite norm -- a 16-bit norm may overflow while every gradient is finite --, NaN for a NaN
        one) and the step runs on them; ``skip_nonfinite`` skips it only where a scaled gradient is not
        finite (this step's own norm of them, under strategy="auto")."""
        coef = clip_coefficient(total, clip)
        factor = float(coef.float().item())
        value = float(total.float().item())
        if self.skip_nonfinite and not (math.isfinite(factor) and all(
                bool(torch.isfinite(p.grad).all()) for g in self.param_groups for p in g["params"] if p.grad is not None)):
            return ClipDecision(grad_norm=value, scale=1.0, finite=False, scale_tensor=None)
        return ClipDecision(grad_norm=value, scale=factor, finite=True, scale_tensor=coef)
