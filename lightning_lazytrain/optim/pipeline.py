"""Layer-pipelined optimizer step: update layer by layer on a worker thread.

The executor's next forward needs layer 0 first, then layer 1, ... A serial ``step()`` makes it
wait for every layer's update. :class:`LayerPipeline` runs the same per-layer updates on one
worker thread in the order the forward needs them and sets a per-layer "updated" event, so
the forward of layer ``l`` waits only for layer ``l`` (``wait_updated(l)``). The arithmetic is the
serial step's, layer by layer (``HybridAdamW.step`` itself runs layer by layer), so results are
bitwise identical -- no stale weights: a layer is never read before its event is set.

Layers are the ``"layer"`` key of the optimizer's param groups (several groups may share a layer,
e.g. decay / no-decay). :func:`group_by_layer` builds such groups from named parameters.

CUDA parameters: the worker issues its kernels on the stream that was current on the caller's
thread when the step started, so the host-side event is enough for ordering -- kernels of the
next forward are enqueued after the layer's update kernels on the same stream.

Deferred ``zero_grad``: a training loop usually calls ``zero_grad()`` right after ``step()``. While a
pipelined step is in flight that would pull gradients from under the worker, so the request is
recorded and each layer's gradients are cleared as soon as that layer has been updated.

Open-ended steps (Note: [updates in backward] in backward_updates.py): ``LayerPipeline(order,
open_ended=True)`` starts with nothing to do; ``submit(layer, after)`` queues one layer (the worker
first calls ``after()``, e.g. waiting for the layer's gradients to be accumulated on the host),
``close(order)`` queues every layer not yet submitted in that order and ends the step; ``abort()``
ends it without updating the rest.

Note: [most urgent first]
    A step begun in the backward hands its blocks over last block first, as their gradients complete;
    the next forward needs them first block first. Where the host update is slower than the backward
    (a small batch beside a GPU), blocks handed over are still waiting when the optimizer step closes
    the step, and a first-in-first-out worker would update all of them before the non-block weights
    and block 0, which the next forward needs first: the forward would wait for the whole queue. So
    ``close(order)`` puts every layer not started yet -- submitted or not -- in ``order`` (the
    forward's), ahead of nothing already running; the forward then runs while the worker updates the
    layers it needs next. Each layer's update is the same arithmetic in any order (bit for bit).
    ``close(order, reorder=False)`` keeps the submitted ones first, in their order (the bench's
    comparison). ``waiting_at_close`` counts the submitted layers not started when the step closed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

logger = logging.getLogger("lightning_lazytrain.optim")


def group_by_layer(
    named_params: Iterable[tuple[str, torch.Tensor]],
    layer_of: Callable[[str], Hashable],
    **group_options: object,
) -> list[dict[str, object]]:
    """Param groups (one per layer, in first-seen order) with ``"layer"`` keys and named params.

    ``layer_of`` maps a parameter name to its layer id, e.g. ``lambda n: n.split(".")[1]`` for
    ``"layers.3.mlp.weight"``. ``group_options`` (lr, weight_decay, ...) are copied into every group.
    """
    groups: dict[Hashable, list[tuple[str, torch.Tensor]]] = {}
    for name, p in named_params:
        groups.setdefault(layer_of(name), []).append((name, p))
    return [{"params": params, "layer": layer, **group_options} for layer, params in groups.items()]


class LayerPipeline:
    """One in-flight pipelined step. Created and started by ``HybridAdamW.step_pipelined``.

    ``update_layer(layer)`` does the layer's update; ``clear_grads(layer, set_to_none)`` zeroes
    its gradients (for deferred ``zero_grad``); ``on_finish()`` runs on the worker once all layers
    are done (bookkeeping of the step), before ``wait_all`` returns; ``on_waited()`` runs once, on the
    thread whose ``wait_all`` first sees the step complete (the step's post-hooks).
    """

    def __init__(
        self,
        order: Sequence[Hashable],
        update_layer: Callable[[Hashable], None],
        clear_grads: Callable[[Hashable, bool], None],
        on_finish: Callable[[], None] | None = None,
        cuda_devices: Sequence[torch.device] = (),
        *,
        open_ended: bool = False,
        on_waited: Callable[[], None] | None = None,
    ) -> None:
        if len(set(order)) != len(order):
            raise ValueError("pipeline order lists a layer twice")
        # open-ended: ``order`` names every layer of the step, submitted one by one (module doc)
        self.order: tuple[Hashable, ...] = tuple(order)
        self._update_layer = update_layer
        self._clear_grads = clear_grads
        self._on_finish = on_finish
        self._on_waited = on_waited  # once, on the thread whose wait_all sees the step complete
        self._events = {layer: threading.Event() for layer in self.order}
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._done: set[Hashable] = set()
        self._zero_request: bool | None = None  # set_to_none flag once zero_grad was asked for
        self._error: BaseException | None = None
        # (layer, after) items not started yet, in the order the worker takes them; None ends the step
        self._queue: deque = deque()
        self._ready = threading.Condition(self._lock)
        self.waiting_at_close = 0  # Note: [most urgent first]: submitted layers not started at close()
        self._submitted: list[Hashable] = []
        self._closed = False
        self._aborted: list[Hashable] = []
        if not open_ended:
            self.close(self.order)
        # Streams current on the caller's thread now; the worker issues on them (see module doc).
        self._streams = [torch.cuda.current_stream(d) for d in cuda_devices]
        self._thread = threading.Thread(target=self._run, name="HybridAdamW-layer-pipeline", daemon=True)

    def start(self) -> LayerPipeline:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            with contextlib.ExitStack() as stack:
                # Grad mode is thread-local: the worker must not record the updates.
                stack.enter_context(torch.no_grad())
                for s in self._streams:
                    stack.enter_context(torch.cuda.stream(s))
                while (item := self._take()) is not None:
                    layer, after = item
                    if after is not None:
                        after()
                    self._update_layer(layer)
                    with self._lock:
                        self._done.add(layer)
                        if self._zero_request is not None:
                            self._clear_grads(layer, self._zero_request)
                    self._events[layer].set()
                if self._on_finish is not None:
                    self._on_finish()
        except BaseException as exc:  # re-raised on the caller's thread by wait_*()
            self._error = exc
            logger.error("pipelined optimizer step failed: %r", exc)
            for ev in self._events.values():
                ev.set()
        finally:
            self._finished.set()

    def _take(self) -> tuple[Hashable, Callable[[], None] | None] | None:
        with self._ready:
            while not self._queue:
                self._ready.wait()
            return self._queue.popleft()

    def _put(self, *items: tuple[Hashable, Callable[[], None] | None] | None) -> None:
        """Queue ``items`` (the caller holds the lock)."""
        self._queue.extend(items)
        self._ready.notify()

    def submit(self, layer: Hashable, after: Callable[[], None] | None = None) -> None:
        """Queue ``layer``'s update (an open-ended step); the worker calls ``after()`` first."""
        if layer not in self._events:
            raise KeyError(f"layer {layer!r} is not part of this pipelined step")
        with self._lock:
            if self._closed:
                raise RuntimeError("the pipelined step is closed: no layer can be submitted")
            if layer in self._submitted:
                raise ValueError(f"layer {layer!r} was submitted twice in one step")
            self._submitted.append(layer)
            self._put((layer, after))

    def close(self, order: Sequence[Hashable], *, reorder: bool = True) -> None:
        """Queue every layer not yet submitted, in ``order`` (which must name them all), and end the step;
        the submitted layers not started yet take their places in ``order`` too (``reorder``, Note:
        [most urgent first]), else they go first as submitted."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the pipelined step is already closed")
            rest = [layer for layer in order if layer not in self._submitted]
            missing = set(self._events) - set(self._submitted) - set(rest)
            if missing:
                raise ValueError(f"close() must list every layer not submitted yet: missing {sorted(map(str, missing))}")
            self._submitted.extend(rest)
            self._closed = True
            self.waiting_at_close = len(self._queue)
            items = [*self._queue, *((layer, None) for layer in rest)]
            if reorder:
                rank = {layer: i for i, layer in enumerate(order)}
                items.sort(key=lambda item: rank.get(item[0], -1))
            self._queue.clear()
            self._put(*items, None)

    def abort(self) -> list[Hashable]:
        """End an open-ended step without updating the layers not submitted (their events are set: a
        reader does not hang); returns them."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            self._aborted = [layer for layer in self.order if layer not in self._submitted]
            self._put(None)
        for layer in self._aborted:
            self._events[layer].set()
        return list(self._aborted)

    @property
    def submitted(self) -> tuple[Hashable, ...]:
        """The layers queued so far (all of them once closed)."""
        with self._lock:
            return tuple(self._submitted)

    @property
    def closed(self) -> bool:
        return self._closed

    def wait_submitted(self, timeout: float | None = None) -> None:
        """Block until every layer submitted so far is updated (the step may stay open)."""
        for layer in self.submitted:
            if not self._events[layer].wait(timeout):
                raise TimeoutError(f"layer {layer!r} was not updated within {timeout} s")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("pipelined optimizer step failed on the worker thread") from self._error

    def wait_updated(self, layer: Hashable, timeout: float | None = None) -> None:
        """Block until ``layer`` holds its updated weights (only that layer, not the rest)."""
        try:
            event = self._events[layer]
        except KeyError:
            raise KeyError(f"layer {layer!r} is not part of this pipelined step") from None
        if not event.wait(timeout):
            raise TimeoutError(f"layer {layer!r} was not updated within {timeout} s")
        self._raise_if_failed()

    def is_updated(self, layer: Hashable) -> bool:
        return self._events[layer].is_set() and self._error is None

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every layer is updated and the step's bookkeeping is done."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"pipelined step not finished within {timeout} s")
        self._thread.join()
        self._raise_if_failed()
        waited, self._on_waited = self._on_waited, None
        if waited is not None:  # the step's post-hooks (torch_contract.py)
            waited()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def request_zero_grad(self, set_to_none: bool) -> None:
        """Zero the gradients of updated layers now and of the others right after their update."""
        with self._lock:
            self._zero_request = set_to_none
            for layer in self._done:
                self._clear_grads(layer, set_to_none)
