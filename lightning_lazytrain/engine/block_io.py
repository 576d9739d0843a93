"""Everything that crosses a streamed block's boundary, and what a re-run must reproduce.

The contract (see the design note on exactness): a block's autograd node is the only path between
the inside of the block and the rest of the graph. This file provides the pieces the executor uses
to keep it:

- ``BlockCall``: the call's arguments after the hidden state, flattened (``torch.utils._pytree``).
  Tensor leaves that require grad (cross-attention ``encoder_hidden_states``, T5's shared position
  bias, a non-block parameter passed by keyword) are *routed*: they become inputs of the node, so
  its backward returns their gradients. A re-run rebuilds the call with fresh leaves in their place.
- ``BlockOutput``: the block's return value. The hidden state is the first item; every other
  floating-point tensor in it (an auxiliary loss, a position bias) is routed out through the node,
  so gradients that reach it flow back into the block.
- ``HookCapture``: tensors that forward hooks on the block's submodules see (Hugging Face records
  MoE router logits this way). Outputs of a custom ``autograd.Function`` are the very tensor
  objects its ``forward`` returned, so returning a hooked module's output tensors as extra node
  outputs makes them differentiable *where the hook stored them*. During re-runs the hooks are
  silenced (their side effects happened once, in the forward) and the same positions are captured
  again to backpropagate from. A hook that *changes* its module's input or output cannot be
  replayed without firing twice: that is refused.
- ``ForwardState``: what a re-run must replay — the random state (dropout), the autocast state
  (Lightning enters autocast only around ``training_step``; backward and so every re-run runs
  outside it) — and the buffers the forward changed (BatchNorm running statistics), which a
  re-run must leave as the forward left them.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes
from torch import nn

__all__ = ["BlockCall", "BlockOutput", "CacheReplay", "ForwardState", "HookCapture", "UnsupportedBlockPattern",
           "rerun_call"]


class UnsupportedBlockPattern(RuntimeError):
    """A pattern the executor cannot run exactly; raised while the first step runs (before any
    optimizer step), naming the pattern and the way out."""


def _routable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


@dataclass
class BlockCall:
    """The arguments after the hidden state, with grad-requiring tensors routed through the node."""

    spec: pytree.TreeSpec
    leaves: list  # routed positions hold None
    routed: list[int]  # leaf positions of the routed tensors

    @classmethod
    def pack(cls, args: tuple, kwargs: dict) -> tuple[BlockCall, list[torch.Tensor]]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        routed = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        tensors = [leaves[i] for i in routed]
        leaves = [None if i in routed else t for i, t in enumerate(leaves)]
        return cls(spec, leaves, routed), tensors

    def build(self, tensors: list[torch.Tensor] | tuple) -> tuple[tuple, dict]:
        leaves = [leaf.fresh() if isinstance(leaf, CacheReplay) else leaf for leaf in self.leaves]
        for i, t in zip(self.routed, tensors, strict=True):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), dict(kwargs)


class CacheReplay:
    """A Hugging Face KV cache as block ``j`` found it, for re-runs.

    A re-run must not append to the real cache a second time, but dropping the cache changes the
    function: the cache's ``torch.cat`` makes keys and values contiguous, and kernels round
    differently on other layouts. So each re-run gets a fresh cache object whose layer ``j`` is a
    copy of that layer's state before the block's forward (usually empty) and whose other layers
    are empty: the same ``update`` runs, nothing leaks, and no other layer's keys stay alive.
    Encoder-decoder caches (``self_attention_cache`` / ``cross_attention_cache`` / ``is_updated``)
    are handled part by part. ``capture`` returns None for objects it does not know (the cache is
    then dropped, as before)."""

    def __init__(self, shell: Any, layer: Any, j: int, parts: dict, is_updated: dict | None) -> None:
        self.shell, self.layer, self.j, self.parts, self.is_updated = shell, layer, j, parts, is_updated

    @classmethod
    def capture(cls, cache: Any, j: int) -> CacheReplay | None:
        parts = {}
        for name in ("self_attention_cache", "cross_attention_cache"):
            if hasattr(cache, name):
                part = cls.capture(getattr(cache, name), j)
                if part is None:
                    return None
                parts[name] = part
        layers = getattr(cache, "layers", None)
        if not parts and not (isinstance(layers, list) and j < len(layers)):
            return None
        shell = copy.copy(cache)
        layer = None
        if not parts:
            shell.layers = [_empty_layer(lay) for lay in layers]
            layer = _snapshot_layer(layers[j])
        updated = getattr(cache, "is_updated", None)
        return cls(shell, layer, j, parts, dict(updated) if isinstance(updated, dict) else None)

    def fresh(self) -> Any:
        c = copy.copy(self.shell)
        for name, part in self.parts.items():
            setattr(c, name, part.fresh())
        if self.layer is not None:
            c.layers = list(self.shell.layers)
            c.layers[self.j] = _snapshot_layer(self.layer)
        if self.is_updated is not None:
            c.is_updated = dict(self.is_updated)
        return c


def _empty_layer(layer: Any) -> Any:
    e = copy.copy(layer)
    if hasattr(e, "keys") and hasattr(e, "is_initialized"):
        e.keys = e.values = None
        e.is_initialized = False
    if isinstance(getattr(e, "has_previous_state", None), dict):  # Note: [recurrent cache state]
        for name in ("conv_states", "recurrent_states"):
            if isinstance(getattr(e, name, None), dict):
                setattr(e, name, dict.fromkeys(getattr(e, name)))
        for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state"):
            if isinstance(getattr(e, name, None), dict):
                setattr(e, name, dict.fromkeys(getattr(e, name), False))
        if isinstance(getattr(e, "cumulative_length_linear", None), torch.Tensor):
            with _disable_current_modes(), torch.no_grad():
                e.cumulative_length_linear = torch.zeros_like(e.cumulative_length_linear)
    return e


def _snapshot_layer(layer: Any) -> Any:
    """Note: [recurrent cache state] A copy of a cache layer whose state is its own: every tensor attribute
    cloned, every dict or list of them copied with its tensors cloned. A KV layer's state is replaced, not
    changed (``torch.cat`` makes new keys), so a shallow copy used to do; a linear-attention / state-space
    layer (transformers' ``LinearAttentionLayer``: Mamba, Jamba, Qwen3-Next, LFM2, ...) changes its state in
    place as the block runs (``has_previous_state[i] = True``, ``conv_states[i].copy_(...)``,
    ``cumulative_length_linear.add_(...)``), so a shallow copy shared it with the forward, and a re-run
    started from the state the forward left (the one-token decode path): wrong gradients, no error. The
    clones run outside any dispatch mode (a partial keep's re-run records its ops: these are not the
    block's)."""
    out = copy.copy(layer)
    with _disable_current_modes(), torch.no_grad():
        for name, value in list(vars(layer).items()):
            if isinstance(value, torch.Tensor):
                setattr(out, name, value.detach().clone())
            elif isinstance(value, dict):
                setattr(out, name, {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                    for k, v in value.items()})
            elif isinstance(value, list):
                setattr(out, name, [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in value])
    return out


@dataclass
class BlockOutput:
    """A block's return value: hidden state first, routed floating tensors, the rest as is."""

    spec: pytree.TreeSpec | None  # None: the block returned a bare tensor
    leaves: list
    routed: list[int]

    @classmethod
    def split(cls, result: Any) -> tuple[BlockOutput, torch.Tensor, list[torch.Tensor]]:
        if isinstance(result, torch.Tensor):
            return cls(None, [], []), result, []
        if not (isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor)):
            raise TypeError(f"a block must return a tensor or a tuple starting with one, got {type(result).__name__}")
        leaves, spec = pytree.tree_flatten(tuple(result[1:]))
        routed = [i for i, t in enumerate(leaves) if _routable(t)]
        return cls(spec, leaves, routed), result[0], [leaves[i] for i in routed]

    @property
    def bare(self) -> bool:
        return self.spec is None

    def build(self, hidden: torch.Tensor, tensors: list[torch.Tensor] | tuple) -> Any:
        if self.spec is None:
            return hidden
        leaves = list(self.leaves)
        for i, t in zip(self.routed, tensors, strict=True):
            leaves[i] = t
        return (hidden, *pytree.tree_unflatten(leaves, self.spec))


def _module_hooks(block: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in block.named_modules() if m._forward_hooks or m._forward_pre_hooks]


class HookCapture:
    """Capture the floating tensors that a block's hooked submodules output, in call order.

    ``first=True`` (the block's forward): user hooks run as usual, but each is watched; one that
    returns a value (a hook that changes its module's input or output) is refused, because a re-run
    would have to fire it again. ``first=False`` (a re-run): user hooks are silenced.

    Global module hooks (``register_module_forward_hook``: profilers, FLOP counters, module
    trackers) are left alone: they observe re-runs as the extra forwards they are, and what they
    capture is not routed."""

    def __init__(self, block: nn.Module, where: str, *, first: bool, refuse_changes: bool = True) -> None:
        self.block, self.where, self.first, self.refuse_changes = block, where, first, refuse_changes
        self.captured: list[torch.Tensor] = []
        self._hooked = _module_hooks(block)

    @property
    def active(self) -> bool:
        return bool(self._hooked)

    def _record(self, module: nn.Module, args: Any, output: Any) -> None:
        self.captured.extend(t for t in pytree.tree_leaves(output) if _routable(t))

    @contextlib.contextmanager
    def __call__(self) -> Iterator[HookCapture]:
        if not self._hooked:
            yield self
            return
        saved: list[tuple[nn.Module, Any, Any]] = []
        handles = []
        try:
            for name, m in self._hooked:
                saved.append((m, m._forward_pre_hooks, m._forward_hooks))
                if self.first and self.refuse_changes:
                    self._watch(name, m)
                elif not self.first:
                    m._forward_pre_hooks = type(m._forward_pre_hooks)()
                    m._forward_hooks = type(m._forward_hooks)()
                handles.append(m.register_forward_hook(self._record))
            yield self
        finally:
            for h in handles:
                h.remove()
            for m, pre, post in saved:
                m._forward_pre_hooks, m._forward_hooks = pre, post

    def _watch(self, name: str, m: nn.Module) -> None:
        """Replace the module's hook dicts, for this call only, by copies whose hooks report a
        returned value (the originals are put back on exit)."""
        path = f"{self.where}.{name}" if name else self.where

        def watched(hook: Any, kind: str) -> Any:
            def run(*a: Any, **k: Any) -> Any:
                out = hook(*a, **k)
                if out is not None:
                    raise UnsupportedBlockPattern(
                        f"a forward {kind} on {path} ({type(m).__name__}) changes its module's "
                        f"{'input' if kind == 'pre-hook' else 'output'}: a streamed block re-runs its forward in "
                        "backward and cannot fire the hook again without repeating its side effects. Apply the "
                        "change in the module's forward, register the hook outside the block stack, or use "
                        "policy='keep_all' (no re-runs).")
                return out
            return run

        m._forward_pre_hooks = type(m._forward_pre_hooks)(
            (k, watched(h, "pre-hook")) for k, h in m._forward_pre_hooks.items())
        m._forward_hooks = type(m._forward_hooks)((k, watched(h, "hook")) for k, h in m._forward_hooks.items())


@dataclass
class ForwardState:
    """What the block's forward started from, for re-runs to replay."""

    cpu_rng: torch.Tensor
    cuda_rng: torch.Tensor | None
    device: torch.device
    autocast: tuple[bool, torch.dtype, bool]
    changed_buffers: list[tuple[nn.Module, str]] = field(default_factory=list)

    @classmethod
    def capture(cls, device: torch.device) -> ForwardState:
        kind = device.type
        cuda = torch.cuda.get_rng_state(device) if kind == "cuda" else None
        autocast = (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled())
        return cls(torch.get_rng_state(), cuda, device, autocast)

    @contextlib.contextmanager
    def watch_buffers(self, block: nn.Module, known: dict) -> Iterator[None]:
        """Around the block's forward: which buffers does it change (BatchNorm's running statistics)?

        Kernels may update a buffer without bumping its version counter (``batch_norm`` under
        ``no_grad``), so the first forward in each train/eval configuration of the block compares
        values; the answer is kept in ``known`` (the executor's, per block)."""
        key = tuple(m.training for m in block.modules() if m._buffers)
        if key in known:
            self.changed_buffers = known[key]
            yield
            return
        before = [(m, name, b, b.clone()) for m in block.modules() for name, b in m._buffers.items() if b is not None]
        yield
        self.changed_buffers = known[key] = [
            (m, name) for m, name, b, old in before if m._buffers[name] is not b or not torch.equal(b, old)]

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Around a re-run: the forward's random and autocast state; buffers as the forward left them."""
        snapshot = [(m, name, m._buffers[name], m._buffers[name].clone()) for m, name in self.changed_buffers]
        devices = [self.device] if self.device.type == "cuda" else []
        enabled, dtype, cache = self.autocast
        try:
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(self.cpu_rng)
                if self.cuda_rng is not None:
                    torch.cuda.set_rng_state(self.cuda_rng, self.device)
                with torch.autocast(self.device.type, dtype=dtype, enabled=enabled, cache_enabled=cache):
                    yield
        finally:
            with torch.no_grad():
                for m, name, buf, value in snapshot:
                    m._buffers[name] = buf
                    buf.copy_(value)


# Keyword arguments through which a block appends to a KV cache (Hugging Face: ``cache`` in
# transformers 5, ``past_key_values`` / ``past_key_value`` before, GPT-2's ``layer_past``). A
# re-run of a block must not append to the real cache a second time (``block_io.CacheReplay``).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def rerun_call(signature: inspect.Signature | None, args: tuple, kwargs: dict, j: int = 0) -> tuple[tuple, dict]:
    """The arguments (after the hidden state) for re-running block ``j``: every KV cache, passed by
    keyword or by position (GPT-2 passes it second), replaced by a ``CacheReplay`` of its state
    before the block ran; a cache of an unknown kind by None, with ``use_cache`` False."""
    def replace(value: Any) -> Any:
        return None if value is None else CacheReplay.capture(value, j)

    if signature is not None:
        try:
            bound = signature.bind_partial(None, *args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            changed, dropped = False, False
            for name in list(bound.arguments):
                if name in _CACHE_KWARGS and bound.arguments[name] is not None:
                    bound.arguments[name] = replace(bound.arguments[name])
                    changed, dropped = True, dropped or bound.arguments[name] is None
            if dropped and bound.arguments.get("use_cache"):
                bound.arguments["use_cache"] = False
            if changed:
                return tuple(bound.args[1:]), dict(bound.kwargs)
            return args, kwargs
    out = {k: (replace(v) if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
    if "use_cache" in out and any(k in _CACHE_KWARGS and out[k] is None and kwargs[k] is not None for k in out):
        out["use_cache"] = False
    return args, out
