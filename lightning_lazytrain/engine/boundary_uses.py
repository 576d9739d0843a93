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
block node whose input has another consumer (``BlockContext.split_input``). Such a node's backward records
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

Not covered (rounding-level, tests/test_review13_boundary_uses.py): an input routed into blocks as a keyword
(the encoder's output into every decoder block, a skip connection) and also used outside them: its gradient
is chained through the blocks (Note: [one gradient per shared input]) and returned as one sum.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Final

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["EXTRA_INPUT_SLOTS", "InputUses", "mark_boundary_uses"]

EXTRA_INPUT_SLOTS: Final[int] = 7  # a block node takes its input this many more times (8 uses returned apart)


def _block_of(node: Any) -> Any:
    """The ``BlockContext`` of a block node (its backward object carries it as ``block``), else None."""
    return getattr(node, "block", None) if node is not None else None


def mark_boundary_uses(loss: torch.Tensor) -> int:
    """Mark each block node reached from ``loss`` whose input has a consumer besides the node's own input
    slots (Note: [one gradient per boundary use]); returns how many were marked."""
    root = loss.grad_fn
    if root is None:
        return 0
    consumers: dict[tuple[int, int], int] = {}  # (id of producer node, output) -> uses outside the input slots
    inputs: list[tuple[Any, tuple[int, int]]] = []  # (block context, its input's edge)
    leaves: dict[int, Any] = {}  # id of a kept graph's input leaf -> its block (a hook in the block handed it out)
    accumulators: list[Any] = []  # leaves' gradient accumulators the graph reaches
    seen, todo = {id(root)}, [root]
    while todo:
        node = todo.pop()
        ctx = _block_of(node)
        slots = ctx.input_slots() if ctx is not None else frozenset()
        nexts = node.next_functions
        if ctx is not None:
            if nexts and nexts[0][0] is not None:
                inputs.append((ctx, (id(nexts[0][0]), nexts[0][1])))
            if ctx.kept is not None:
                leaves[id(ctx.kept.x)] = ctx
        for k, (prev, nr) in enumerate(nexts):
            if prev is None:
                continue
            if k not in slots:
                key = (id(prev), nr)
                consumers[key] = consumers.get(key, 0) + 1
            if id(prev) not in seen:
                seen.add(id(prev))
                todo.append(prev)
                if hasattr(prev, "variable"):
                    accumulators.append(prev)
    as_input = Counter(edge for _, edge in inputs)  # an edge that is two nodes' input: each is the other's outside use
    marked = {id(ctx): ctx for ctx, edge in inputs if consumers.get(edge, 0) or as_input[edge] > 1}
    for acc in accumulators:  # the kept leaf itself read outside the node (a forward hook inside the block kept it)
        ctx = leaves.get(id(acc.variable))
        if ctx is not None:
            marked[id(ctx)] = ctx
    for ctx in marked.values():
        ctx.split_input = True
    return len(marked)


class InputUses:
    """While the backward of a block's inside runs (``with``), each use's gradient of its input leaf ``x``, in
    the order autograd delivers them (Note: [one gradient per boundary use])."""

    def __init__(self, x: torch.Tensor, roots: Iterable[torch.Tensor | GradientEdge | None]) -> None:
        self.grads: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self.whole = False  # a root is the leaf itself: its gradient reaches the leaf unrecorded; return the sum
        if not x.requires_grad:
            return
        acc = get_gradient_edge(x).node
        roots = [r for r in roots if r is not None and (isinstance(r, GradientEdge) or r.requires_grad)]
        self.whole = any(r is x or (isinstance(r, GradientEdge) and r.node is acc) for r in roots)
        if x.grad is not None and not self.whole:
            # what reached the leaf before this backward (a use of it outside the node: a forward hook inside the
            # block handed it out) comes first, as autograd added it first; taken off the leaf, which would add
            # the block's uses into it in place
            self.grads.append(x.grad)
            x.grad = None
        starts = [r.node if isinstance(r, GradientEdge) else r.grad_fn for r in roots]
        seen: set[int] = set()
        todo = [n for n in starts if n is not None]
        while todo:
            node = todo.pop()
            if id(node) in seen or node is acc:
                continue
            seen.add(id(node))
            edges = [k for k, (prev, _) in enumerate(node.next_functions) if prev is acc]
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
