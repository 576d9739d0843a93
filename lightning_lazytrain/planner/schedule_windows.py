"""The transfer plan: one training iteration's windows and the ops issued in each, derived from a
``Schedule``'s decisions. ``Op`` (one item of work on a lane) and ``Window`` (a named op list) are the
data; ``ScheduleWindows`` (a mixin of ``schedule.Schedule``) builds ``Schedule.windows()``: the list the
executor follows and the simulator times, and the MILP's window-time rows mirror (``milp_times``). The
windows, lanes and decisions themselves are described in ``schedule``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Op:
    """One item of work in a window: a compute op or a transfer on a lane.

    ``kind``: forward, head, recompute, local_recompute, partial_recompute, backward (compute); weights,
    recompute_weights, reload, reload_internals (h2d); grads, offload, offload_internals (d2h);
    nvme_write, nvme_read; optimizer (cpu);
    cast (before every weights/recompute_weights op of the same index, which has ``after`` on
    it), accumulate (after every grads op of the same index, ``after`` on it) (host).
    ``index``: a layer (weights, grads, compute, optimizer, cast, accumulate, offload_internals,
    reload_internals) or a boundary (offload, reload);
    -1 for the non-block parameters. ``after``: position in the window's op list of an op that
    must finish before this one starts, or -1.
    """

    lane: str
    kind: str
    index: int
    after: int = -1


@dataclass(frozen=True, slots=True)
class Window:
    name: str
    ops: tuple[Op, ...]


def _fetch(ops: list[Op], kind: str, index: int, after: int = -1, gather: bool = False) -> int:
    """Append a weight fetch (``kind``: weights / recompute_weights) behind its host cast; the cast
    takes ``after``. With ``gather`` (shard) the device all-gather follows the fetch. Returns the
    position of the last op (the fetch, or its all-gather): what the weights' users wait for."""
    ops.append(Op("host", "cast", index, after=after))
    ops.append(Op("h2d", kind, index, after=len(ops) - 1))
    if gather:
        ops.append(Op("collective", "gather", index, after=len(ops) - 1))
    return len(ops) - 1


def _grads(ops: list[Op], index: int, reduce: bool = False) -> int:
    """Append a gradient D2H (with ``reduce``, shard: behind the device reduce-scatter); returns the
    D2H's position (its accumulate is appended by ``_accumulate``)."""
    if reduce:
        ops.append(Op("collective", "reduce", index))
        ops.append(Op("d2h", "grads", index, after=len(ops) - 1))
    else:
        ops.append(Op("d2h", "grads", index))
    return len(ops) - 1


def _accumulate(ops: list[Op], grads: list[int], allreduce: bool = False) -> None:
    """Append the host accumulate of each gradient D2H at positions ``grads`` (with ``allreduce``,
    replicate_overlap: each followed by the group's host all-reduce)."""
    for pos in grads:
        ops.append(Op("host", "accumulate", ops[pos].index, after=pos))
        if allreduce:
            ops.append(Op("collective", "allreduce", ops[pos].index, after=len(ops) - 1))


def window_index(name: str, num_layers: int) -> int:
    """Position of a window in one micro-batch's order (F0..F{L-1}, H, B{L-1}..B0, T)."""
    if name == "H":
        return num_layers
    if name == "T":
        return 2 * num_layers + 1
    kind, layer = name[0], int(name[1:])
    return layer if kind == "F" else 2 * num_layers - layer


class ScheduleWindows:
    """``Schedule``'s windows and their ops, from its decisions (``homes``, ``offload_window``, ...)."""

    # ---- windows and their ops (the transfer plan) -------------------------------------------
    def window_names(self) -> list[str]:
        L = self.num_layers
        return [f"F{j}" for j in range(L)] + ["H"] + [f"B{t}" for t in range(L - 1, -1, -1)] + ["T"]

    def windows(self, *, first_microbatch: bool = True, last_microbatch: bool = True,
                nonblock_parts: int = 1, updates_in_backward: bool = False,
                early_parts: tuple[int, ...] = (), no_backward: tuple[int, ...] = ()) -> list[Window]:
        """Every window's ops in issue order; the executor follows this list, the simulator times it.

        ``first_microbatch``: the pipelined optimizer runs in this micro-batch's forward windows.
        ``last_microbatch``: the T window follows; otherwise layer 0's grads go in the next F0.
        ``updates_in_backward`` (one rank, pipelined): the last micro-batch's ``B{t}`` updates layer
        ``t+1`` after its accumulate, no F window updates; the simulator passes the schedule's choice
        where the workload allows it (``Schedule.updates_in_backward and Workload.updates_in_backward``).

        Host lane: every weight fetch is preceded by its cast (the fetch waits for it); every
        gradient D2H is followed by its accumulate (which waits for it). The accumulates of F and B
        windows come last in the window, so the FIFO host lane runs the window's casts first.

        Recompute block in ``B{t}`` (layers ``s..t-1``): per layer j, ``cast j`` (after the
        recompute of j-2: the buffer it reuses), ``recompute_weights j`` (after the cast), then
        ``recompute j`` (after its fetch; after j-1 by the compute lane's order); the prefetch of
        layer t-1 casts after the recompute of t-1 (the spare buffer). Nothing else changes order.

        Offloaded internals: ``offload_internals j`` on the D2H lane of ``F{w}`` after the window's
        boundary offloads, ``reload_internals j`` on the H2D lane of ``B{t}`` / ``H`` after its
        boundary reloads (ascending layer order, no ``after``: the lanes' FIFO order only).

        ``nonblock_parts`` (one rank; ``Workload.nonblock_part_count``): T moves, accumulates, updates
        and fetches the non-block group in that many parts, op indices ``-1, -2, ...`` (Note:
        [non-block parts]).

        ``early_parts`` (with the updates in the backward; ``Workload.backward_parts``): those parts of the
        non-block group are written back, accumulated and updated at the end of the last micro-batch's
        first B window (their gradients are complete before the blocks' backward: Note: [early non-block
        parts] in engine/early_parts.py); T only casts and fetches them.

        ``no_backward`` (``Workload.no_backward``; the simulator passes it, the executor does not: it
        decides at run time): the layers no gradient reaches (Note: [layers without a backward]). Their
        B windows hold no compute (no backward, no local or partial recompute, no re-run of a block
        ending there) and no fetch of their weights (but layer 0's: its slot serves the next
        micro-batch's F0); their gradient D2H (with its accumulate) is left out unless they are
        resident, and their internals are neither kept nor moved.
        """
        L = self.num_layers
        nb = frozenset(no_backward)
        refetch = lambda j: j == 0 or j not in nb  # noqa: E731 - a backward-side window fetches layer j
        moves = lambda j: j not in nb  # noqa: E731 - layer j's internals are kept (and may move)
        pipelined = self.optimizer == "pipelined"
        in_backward = pipelined and updates_in_backward and self.data_parallel == "none"
        sh = self.data_parallel == "shard"
        overlap = self.data_parallel == "replicate_overlap" and last_microbatch
        out: list[Window] = []
        for j in range(L):
            ops: list[Op] = [Op("compute", "forward", j)]
            grads: list[int] = []
            if j == 0 and not first_microbatch:
                grads.append(_grads(ops, 0, reduce=sh))  # layer 0's grads of the previous micro-batch
            for i in range(L + 1):
                if self.homes[i] in ("cpu", "nvme") and self.offload_window[i] == j:
                    ops.append(Op("d2h", "offload", i))
                if self.homes[i] == "nvme" and self.offload_window[i] == j - 1:
                    ops.append(Op("nvme_write", "offload", i))
            for k in range(L):
                if self.internals_offload_window[k] == j and moves(k):
                    ops.append(Op("d2h", "offload_internals", k))
            if j + 1 < L:
                if pipelined and first_microbatch and not in_backward and j + 1 not in self.serial_layers:
                    ops.append(Op("cpu", "optimizer", j + 1))
                    _fetch(ops, "weights", j + 1, after=len(ops) - 1, gather=sh)
                else:
                    _fetch(ops, "weights", j + 1, gather=sh)
            _accumulate(ops, grads)
            out.append(Window(f"F{j}", tuple(ops)))
        ops = [Op("compute", "head", -1)]
        for i in range(L + 1):
            if self.homes[i] == "nvme" and self.offload_window[i] == L - 1:
                ops.append(Op("nvme_write", "offload", i))
        if self.backward_prefetch and not self.resident_weights[L - 1] and refetch(L - 1):
            _fetch(ops, "weights", L - 1, gather=sh)
        ops += self._reload_ops(L, nb)
        out.append(Window("H", tuple(ops)))
        for t in range(L - 1, -1, -1):
            ops = []
            grads = []
            sends = t + 1 < L and (t + 1 not in nb or self.resident_weights[t + 1])  # layer t+1's grads
            if sh and sends:  # the reduce-scatter of layer t+1 goes first: its backward just ended
                grads.append(_grads(ops, t + 1, reduce=True))
            fetch_here = not self.backward_prefetch and not self.resident_weights[t] and refetch(t)
            dep = _fetch(ops, "weights", t, gather=sh) if fetch_here else -1
            block = self.block_ending_at(t + 1) if t not in nb else None
            rerun: dict[int, int] = {}  # layer -> position of its recompute
            if block is not None:
                # Each re-run waits for its own weights. The engine streams the block through two
                # buffers (Note: [recompute double buffer] in engine/backward_windows.py): layer j's fetch
                # reuses layer j-2's buffer, so it is issued once that layer's recompute is done
                # (its cast waits for it); layer t-1's prefetch reuses the spare buffer, issued
                # once the whole block is re-run.
                for j in range(block[0], t):
                    fetch = _fetch(ops, "recompute_weights", j, after=rerun.get(j - 2, -1), gather=sh)
                    ops.append(Op("compute", "recompute", j, after=fetch))
                    rerun[j] = len(ops) - 1
            if t not in nb:  # else no compute: the window passes (Note: [layers without a backward])
                if self.partial_keep[t]:
                    ops.append(Op("compute", "partial_recompute", t, after=dep))
                elif not self.keep_internals[t]:
                    ops.append(Op("compute", "local_recompute", t, after=dep))
                ops.append(Op("compute", "backward", t, after=dep))
            if sends and not sh:
                grads.append(_grads(ops, t + 1))
            if self.backward_prefetch and t >= 1 and not self.resident_weights[t - 1] and refetch(t - 1):
                _fetch(ops, "weights", t - 1, after=rerun.get(t - 1, -1), gather=sh)
            ops += self._reload_ops(t, nb)
            _accumulate(ops, grads, allreduce=overlap)
            if in_backward and last_microbatch and t + 1 < L and t + 1 not in nb:  # after its (last) accumulate
                ops.append(Op("cpu", "optimizer", t + 1, after=len(ops) - 1))
            if in_backward and last_microbatch and t == L - 1:  # the early parts, after the window's other ops
                for p in early_parts:
                    _accumulate(ops, [_grads(ops, -1 - p)])
                    ops.append(Op("cpu", "optimizer", -1 - p, after=len(ops) - 1))
            out.append(Window(f"B{t}", tuple(ops)))
        if last_microbatch and self.data_parallel != "none":
            out.append(Window("T", tuple(self._t_ops_data_parallel())))
        elif last_microbatch:
            # Note: [non-block parts] grads of layer 0, then of each part of the non-block group ->
            # host, each accumulated there once it landed (so part p's accumulate overlaps part p+1's
            # D2H); every update waits for the last accumulate (a clip needs every norm); the parts
            # are updated first, in order, then layer 0 (serial: every layer); each part's and layer
            # 0's fresh weights are cast and go back to the device as soon as its update is done (so
            # part p's cast and fetch overlap part p+1's update). One part: the single-group T.
            ops = []
            parts = [-1 - p for p in range(nonblock_parts)]
            early = {-1 - p for p in early_parts} if in_backward else set()
            _accumulate(ops, [_grads(ops, 0)])
            for idx in parts:
                if idx not in early:
                    _accumulate(ops, [_grads(ops, idx)])
            ready = len(ops) - 1
            pos = {}
            for j in [i for i in parts if i not in early] + (
                    [0] if in_backward else [0, *self.serial_layers] if pipelined else list(range(L))):
                ops.append(Op("cpu", "optimizer", j, after=ready))
                pos[j] = len(ops) - 1
            for j in parts + [0]:  # an early part was updated in the backward: its fetch waits for nothing
                _fetch(ops, "weights", j, after=pos.get(j, -1))
            out.append(Window("T", tuple(ops)))
        return out

    def _t_ops_data_parallel(self) -> list[Op]:
        """T with several ranks: layer 0's and the non-block grads (shard: each behind its
        reduce-scatter) are accumulated; replicate: then every group's host all-reduce, serially
        (``-1, 0 .. L-1``); replicate_overlap: layer 0's and the non-block group's (the others ran in
        the B windows); then the updates (``-1, 0`` pipelined, else all), each waiting for the last
        of those ops; the non-block and layer 0's fresh weights are cast and fetched (shard:
        all-gathered) once their updates are done."""
        L, sh = self.num_layers, self.data_parallel == "shard"
        ops: list[Op] = []
        for idx in (0, -1):
            _accumulate(ops, [_grads(ops, idx, reduce=sh)], allreduce=self.data_parallel == "replicate_overlap")
        if self.data_parallel == "replicate":
            first = len(ops) - 1
            for idx in [-1] + list(range(L)):
                ops.append(Op("collective", "allreduce", idx, after=first if idx == -1 else -1))
        ready = len(ops) - 1
        order = [-1, 0] if self.optimizer == "pipelined" else [-1] + list(range(L))
        pos = {}
        for j in order:
            ops.append(Op("cpu", "optimizer", j, after=ready))
            pos[j] = len(ops) - 1
        _fetch(ops, "weights", -1, after=pos[-1], gather=sh)
        _fetch(ops, "weights", 0, after=pos[0], gather=sh)
        return ops

    def _reload_ops(self, t: int, no_backward: frozenset[int] = frozenset()) -> list[Op]:
        ops = []
        for i in range(self.num_layers + 1):
            home = self.homes[i]
            if home in ("cpu", "nvme") and self.reload_window[i] == t:
                ops.append(Op("h2d", "reload", i))
            if home == "nvme" and self.reload_window[i] == t - 1:
                ops.append(Op("nvme_read", "reload", i))
        for j in range(self.num_layers):
            if self.internals_reload_window[j] == t and j not in no_backward:
                ops.append(Op("h2d", "reload_internals", j))
        return ops
