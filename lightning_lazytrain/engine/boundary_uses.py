"""A block's input used outside the block too: its gradient summed use by use, as autograd sums it.

Note: [one gradient per boundary use] Under plain autograd a tensor used several times gets one addition
per use into its gradient, in the order the backward reaches the uses. A block's input ``x`` (the boundary
below it) is used several times inside the block (Llama's decoder layer in fp32: the residual add and the
RMSNorm's two reads), and may be used outside it as well: a loss on ``hidden_states[i]``
(``output_hidden_states=True``: deep supervision, hidden-state distillation) or any code that reads the
boundary tensor. The block node (Note: [the block node] in block_fn.py) used to return the block's own uses
already summed; autograd then added the outside use to that sum -- ``o + (a + b + c)`` where plain autograd
computes ``((o + a) + b) + c``: the same value up to rounding, and every gradient below differed in the last
bits.

So before the backward, the strategy (``TrainingCore.before_backward``; an engine user calls
``Executor.mark_boundary_uses(loss)``) walks the graph from the loss (``mark_boundary_uses`` here: the
block nodes are opaque, so the walk is the graph outside the blocks, a few nodes per block) and marks each
block node whose input has another consumer (``BlockContext.split``). Such a node's backward records
each use's gradient of its input as the backward of the block's inside produces it (``InputUses``: a
post-hook on every node of the block's graph with an edge to the input's leaf, in the order autograd runs
them, which is plain autograd's order: the graph is the same) and returns them one per input slot: the node
takes ``x`` once more for each of ``EXTRA_INPUT_SLOTS`` (7) further slots (``BlockFunction.apply``), and autograd
adds a node's input gradients into their producer's buffer in input order -- after the outside use's, when
its node ran first, as under plain autograd, or before it, when it ran after. A block with more uses than
slots sums the last ones (rounding again; none of the zoo's decoder layers has more). A kept graph's input leaf
that a forward hook inside the block handed out, and user code then read, is such a use too (its gradient
reaches the leaf before the block's backward: it comes first). Unmarked nodes return the sum in the first slot,
as before: the walk is the only cost where nothing else reads a boundary.

Tensors routed into a block (``BlockCall``: the encoder's output into every decoder block, a skip connection
passed as a keyword) take 8 slots each too. A routed tensor that only blocks take, once per node, is chained
through them (Note: [one gradient per shared input]: exact, nothing to mark). One also used elsewhere -- outside
the blocks, as a block's input ``x``, or twice in one call (``b(h, skip=h)``) -- marks every node that takes it
(``_own_sum_exact``): each returns that tensor's uses apart and none chains it. The tensors of one node over the
same producer (``x`` and ``skip=x``) are one group (``SplitUses``): their uses, recorded together in the order
autograd runs them, fill the group's slots in input order, as they all add into that producer's buffer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["EXTRA_INPUT_SLOTS", "InputUses", "SplitUses", "mark_boundary_uses"]

EXTRA_INPUT_SLOTS: Final[int] = 7  # a block node takes its input this many more times (8 uses returned apart)


def _block_of(node: Any) -> Any:
    """The ``BlockContext`` of a block node (its backward object carries it as ``block``), else None."""
    return getattr(node, "block", None) if node is not None else None


def mark_boundary_uses(loss: torch.Tensor, reached: list | None = None) -> int:
    """Mark each block node reached from ``loss`` whose input, or a tensor routed into it, has a consumer the
    node's own sum cannot stand for (Note: [one gradient per boundary use]); returns how many were marked.
    ``reached``: a list to which the contexts of every block node reached are appended."""
    root = loss.grad_fn
    if root is None:
        return 0
    others: Counter[tuple[int, int]] = Counter()  # (id of producer node, output) -> consumers but block tensors
    uses: dict[tuple[int, int], dict[tuple[int, int], tuple[Any, int]]] = {}  # edge -> the block tensors taking it
    edge_of: dict[tuple[int, int], tuple[int, int]] = {}  # (id of block context, tensor) -> its edge
    leaves: dict[int, tuple[Any, int]] = {}  # id of a kept graph's leaf -> (its block, tensor): a hook handed it out
    accumulators: list[Any] = []  # leaves' gradient accumulators the graph reaches
    # the nodes seen, kept alive for the walk: torch before 2.12 makes a node's Python object afresh when the last
    # one is gone, and a new object can take a dead one's id
    seen: dict[int, Any] = {id(root): root}
    todo = [root]
    while todo:
        node = todo.pop()
        ctx = _block_of(node)
        tensor_at = ctx.tensor_at() if ctx is not None else {}
        if ctx is not None and reached is not None:
            reached.append(ctx)
        if ctx is not None and ctx.kept is not None:
            leaves[id(ctx.kept.x)] = (ctx, -1)
            leaves.update((id(r), (ctx, k)) for k, r in enumerate(ctx.kept.routed))
        for pos, (prev, nr) in enumerate(node.next_functions):
            if prev is None:
                continue
            edge = (id(prev), nr)
            k = tensor_at.get(pos)
            if k is None:
                others[edge] += 1
            else:
                uses.setdefault(edge, {})[(id(ctx), k)] = (ctx, k)
                edge_of[(id(ctx), k)] = edge
            if id(prev) not in seen:
                seen[id(prev)] = prev
                todo.append(prev)
                if hasattr(prev, "variable"):
                    accumulators.append(prev)
    split = {edge for edge, taken in uses.items() if others[edge] or not _own_sum_exact(list(taken.values()))}
    for acc in accumulators:  # a kept leaf itself read outside the node (a forward hook inside the block kept it)
        hit = leaves.get(id(acc.variable))
        if hit is not None and (id(hit[0]), hit[1]) in edge_of:
            split.add(edge_of[(id(hit[0]), hit[1])])
    groups: dict[int, tuple[Any, dict[tuple[int, int], list[int]]]] = {}  # id of context -> (context, edge -> tensors)
    for edge in split:
        for ctx, k in uses[edge].values():
            groups.setdefault(id(ctx), (ctx, {}))[1].setdefault(edge, []).append(k)
    for ctx, by_edge in groups.values():
        ctx.split = [tuple(sorted(ks)) for ks in by_edge.values()]
    return len(groups)


def _own_sum_exact(taken: list[tuple[Any, int]]) -> bool:
    """Does autograd add the same as plain autograd when each node returns its own sum of a tensor's uses? For a
    tensor one block node takes once and nothing else does, and for a tensor routed into blocks alone, once per
    node, each with a key (their gradient chained: Note: [one gradient per shared input])."""
    if len(taken) == 1:
        return True
    nodes = {id(ctx) for ctx, _ in taken}
    return len(nodes) == len(taken) and all(0 <= k < len(ctx.routed_keys) and ctx.routed_keys[k] is not None
                                           for ctx, k in taken)


class InputUses:
    """While the backward of a block's inside runs (``with``), each use's gradient of its input leaf ``x`` -- or
    of any of several leaves over one producer (``x`` and a routed tensor that is ``x`` again) -- in the order
    autograd delivers them (Note: [one gradient per boundary use])."""

    def __init__(self, leaves: torch.Tensor | Sequence[torch.Tensor],
                 roots: Sequence[torch.Tensor | GradientEdge | None],
                 root_grads: Sequence[torch.Tensor | None] | None = None) -> None:
        self.grads: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self.whole = False  # a root is a leaf itself, its gradient unknown here: return the sums
        live = [x for x in ([leaves] if isinstance(leaves, torch.Tensor) else leaves) if x.requires_grad]
        if not live:
            return
        accs = [get_gradient_edge(x).node for x in live]
        if root_grads is None:
            root_grads = [None] * len(roots)
            unknown = True
        else:
            unknown = False
        pairs = [(r, g) for r, g in zip(roots, root_grads, strict=True)
                 if r is not None and (isinstance(r, GradientEdge) or r.requires_grad)]
        # a root that IS a leaf (the block hands back a routed tensor unchanged, as T5's blocks do their position
        # bias): the gradient of that output reaches the leaf straight from the backward's root, before any node of
        # the block's inside runs -- as the output's consumers, under plain autograd, add into the tensor first
        direct = [g for r, g in pairs
                  if any(r is x for x in live) or (isinstance(r, GradientEdge) and any(r.node is a for a in accs))]
        self.whole = unknown and bool(direct)
        if self.whole:
            return
        for x in live:
            if x.grad is not None:
                # what reached the leaf before this backward (a use of it outside the node: a forward hook inside
                # the block handed it out) comes first, as autograd added it first; taken off the leaf, which
                # would add the block's uses into it in place
                self.grads.append(x.grad)
                x.grad = None
        self.grads.extend(g for g in direct if g is not None)
        roots = [r for r, _ in pairs]
        starts = [r.node if isinstance(r, GradientEdge) else r.grad_fn for r in roots]
        seen: dict[int, Any] = {}  # kept alive for the walk (see mark_boundary_uses)
        todo = [n for n in starts if n is not None]
        while todo:
            node = todo.pop()
            if id(node) in seen or any(node is a for a in accs):
                continue
            seen[id(node)] = node
            edges = [k for k, (prev, _) in enumerate(node.next_functions) if any(prev is a for a in accs)]
            if edges:
                self._handles.append(node.register_hook(self._recorder(edges)))
            todo.extend(prev for prev, _ in node.next_functions if prev is not None and id(prev) not in seen)

    def _recorder(self, edges: list[int]) -> Any:
        def record(grad_inputs: Sequence[torch.Tensor | None], grad_outputs: Any) -> None:
            self.grads.extend(grad_inputs[k] for k in edges if grad_inputs[k] is not None)
        return record

    def __enter__(self) -> InputUses:
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def slotted(self, slots: int) -> list[torch.Tensor | None]:
        """The uses' gradients, one per input slot (``slots`` of them; None where fewer uses); the uses past
        the last slot are summed into it, in order."""
        out: list[torch.Tensor | None] = list(self.grads[:slots])
        if len(self.grads) > slots:
            tail = out[-1]
            for g in self.grads[slots:]:
                tail = tail + g
            out[-1] = tail
        return out + [None] * (slots - len(out))


class SplitUses:
    """Around a marked block node's backprop (``with``): the uses of each of its split groups (``ctx.split``), then
    the gradients the node returns for ``x``, its routed tensors and its extra slots (Note: [one gradient per
    boundary use])."""

    def __init__(self, ctx: Any, x: torch.Tensor, routed: Sequence[torch.Tensor],
                 roots: Sequence[torch.Tensor | GradientEdge | None], root_grads: Sequence[torch.Tensor | None]) -> None:
        self.ctx = ctx
        self.leaves = {-1: x, **dict(enumerate(routed))}
        self.groups = [(group, InputUses([self.leaves[k] for k in group], roots, root_grads)) for group in ctx.split]

    def __enter__(self) -> SplitUses:
        return self

    def __exit__(self, *exc: Any) -> None:
        for _, uses in self.groups:
            uses.__exit__(*exc)

    def returned(self, grad_routed: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, list]:
        """The node's gradients: of ``x`` and of the routed tensors (``grad_routed``: what it would return without
        the split), the extra slots' in ``ctx.extra_grads``. A split group's uses go to its tensors' positions in
        input order (autograd adds a node's input gradients into their producer in that order)."""
        ctx = self.ctx
        first_extra = 2 + ctx.n_routed
        out: dict[int, torch.Tensor | None] = {0: self.leaves[-1].grad}
        out.update((2 + k, g) for k, g in enumerate(grad_routed))
        for group, uses in self.groups:
            positions = sorted(p for k in group for p in ctx.positions_of(k))
            if uses.whole:  # each tensor's sum in its own position
                values = {p: None for p in positions}
                values.update((ctx.positions_of(k)[0], self.leaves[k].grad) for k in group)
                out.update(values)
            else:
                out.update(zip(positions, uses.slotted(len(positions))))
        ctx.extra_grads = [out.get(first_extra + i) for i in range(ctx.n_extra())]
        return out[0], [out[2 + k] for k in range(ctx.n_routed)]
