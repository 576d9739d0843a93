"""What torch's ``Optimizer`` contract asks of ``HybridAdamW`` beyond its math (hybrid_adamw.py).

- AdamW options it does not implement are refused wherever they arrive: the constructor's keywords
  (a ``TypeError`` from its signature), a param group's keys, a loaded state dict's groups
  (``refuse_unsupported``). torch's ``AdamW`` honours ``amsgrad``, ``maximize``,
  ``decoupled_weight_decay=False`` (L2 decay) and ``differentiable``; a group that asks for one and gets
  plain AdamW would train differently without a word. The implementation flags (``foreach``, ``fused``,
  ``capturable``) change no value, so a torch ``AdamW(fused=True)`` state dict still loads.
- Note: [step hooks] The step hooks (``register_step_pre_hook`` / ``_post_hook`` and torch's global ones) run around a
  pipelined step as torch runs them around ``step()``: the pre-hooks before its norm and its first update,
  the post-hooks once every layer is updated, on the thread that waits for it (``step_hooks``). A step the
  training core would pipeline is serial instead while any such hook exists (core/optimizer_steps.py): a
  post-hook that edits the weights must run before the next forward reads them.
- ``load_state_dict`` runs the load pre- and post-hooks, and parameter names do not decide the loading
  (torch: "the names of the parameters ... will not affect the loading process"; ``names_differ`` reports
  a difference beyond the wrappers' prefixes, e.g. ``torch.compile``'s ``_orig_mod.``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import chain
from typing import Any

from torch.optim import Optimizer
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

__all__ = ["has_step_hooks", "names_differ", "refuse_unsupported", "run_load_post_hooks", "run_load_pre_hooks",
           "step_hooks"]

# key -> (the value HybridAdamW implements, what to use instead)
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "amsgrad": (False, "torch.optim.AdamW(amsgrad=True)"),
    "maximize": (False, "a negated loss, or torch.optim.AdamW(maximize=True)"),
    "decoupled_weight_decay": (True, "torch.optim.Adam(weight_decay=...) for L2 decay"),
    "differentiable": (False, "torch.optim.AdamW(differentiable=True)"),
}

# prefixes that wrappers put before a module's parameter names
_WRAPPER_PREFIXES = ("_orig_mod.", "module.", "_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def refuse_unsupported(group: Mapping[str, Any], where: str) -> None:
    """Raise if ``group`` (a param group, or a saved one: ``where`` says which) asks for an AdamW option
    HybridAdamW does not implement."""
    for key, (supported, instead) in _UNSUPPORTED.items():
        if key in group and group[key] is not None and bool(group[key]) != supported:
            raise ValueError(
                f"HybridAdamW: {where} sets {key}={group[key]!r}, which HybridAdamW does not implement (it runs "
                f"AdamW with {key}={supported}); it would train differently from what was asked. Fix: drop "
                f"{key!r} from the group, or use {instead}")


def has_step_hooks(opt: Optimizer) -> bool:
    """Does a step of ``opt`` run hooks (its own or torch's global ones)?"""
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or _global_optimizer_pre_hooks or _global_optimizer_post_hooks)


def step_hooks(opt: Optimizer) -> Callable[[], None] | None:
    """Run ``opt``'s step pre-hooks now, as torch's ``step()`` does (``args`` = ``(opt,)``); returns what
    runs its post-hooks (None: it has none)."""
    args: tuple = (opt,)
    kwargs: dict = {}
    for pre_hook in chain(_global_optimizer_pre_hooks.values(), opt._optimizer_step_pre_hooks.values()):
        result = pre_hook(opt, args, kwargs)
        if result is not None and not (isinstance(result, tuple) and len(result) == 2):
            raise RuntimeError(f"an optimizer step pre-hook must return None or a tuple of (new_args, new_kwargs), "
                               f"but got {result}")
    if not (opt._optimizer_step_post_hooks or _global_optimizer_post_hooks):
        return None

    def post() -> None:
        for post_hook in chain(opt._optimizer_step_post_hooks.values(), _global_optimizer_post_hooks.values()):
            post_hook(opt, args, kwargs)

    return post


def run_load_pre_hooks(opt: Optimizer, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """torch's ``load_state_dict`` start: a shallow copy, then each load pre-hook (which may replace it)."""
    out = dict(state_dict)
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = pre_hook(opt, out)
        if result is not None:
            out = result
    return out


def run_load_post_hooks(opt: Optimizer) -> None:
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


def _bare(name: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")


def names_differ(names: Sequence[str] | None, saved: Sequence[str] | None) -> tuple[str, str] | None:
    """The first pair of names that differ beyond wrapper prefixes (None: they agree, or either is missing)."""
    if names is None or saved is None:
        return None
    for a, b in zip(names, saved):
        if _bare(a) != _bare(b):
            return a, b
    return None
