"""``Schedule``: one training iteration's decisions, as data. Every policy produces it; the
simulator and the executor consume it. The ops each window issues (``Schedule.windows()``, the
transfer plan) are built in ``schedule_windows``.

Windows (one micro-batch; ``L`` layers)::

    F0 .. F{L-1}   forward of layer j                      index j
    H              head: final norm, LM head, loss, fwd+bwd index L
    B{L-1} .. B0   backward of layer t                     index 2L - t
    T              once per iteration: last grads to host, optimizer, first weights   index 2L + 1

A window lasts as long as its busiest lane (compute, h2d, d2h, nvme_read, nvme_write, cpu, host) or
its longest chain of dependent ops; the transfers assigned to a window start with it and end within
it (see ``simulator``). ``cpu`` is the host optimizer; ``host`` is the engine's one host worker
thread (FIFO): it casts a layer's masters to the compute dtype right before each weight fetch
(``cast``; the fetch waits for it) and adds each landed gradient D2H into the fp32 host grads,
with the layer's squared norm (``accumulate``; it waits for the D2H). A window's accumulates come
after its casts in the op list (so a fetch never queues behind a gradient D2H); in T the
optimizer waits for the accumulates.

Decisions:
- ``homes[i]`` for boundary ``i`` (the hidden state entering layer ``i``; ``L`` enters the head):
  ``gpu``, ``cpu``, ``nvme`` or ``recompute``. Boundaries 0 and L are ``gpu``. Consecutive
  materialised boundaries ``s < e`` form a recompute block when ``e - s >= 2``: at the start of
  ``B{e-1}`` layers ``s .. e-2`` are re-run without grad (their weights streamed again) and the
  boundaries ``s+1 .. e-1`` stay on the GPU until their layer's backward.
- ``keep_internals[j]``: layer j's forward runs with grad and its saved tensors stay on the GPU
  until ``B{j}`` (no local recompute). Requires ``homes[j] == "gpu"`` (the input is one of them).
  Otherwise the forward runs without grad and ``B{j}`` re-runs the layer with grad first.
- ``resident_weights[j]``: layer j's weights stay on the GPU from ``F{j}`` to ``B{j}`` (no second
  fetch). A resident layer is never inside a recompute block.
- ``offload_window[i]``: forward window (a layer index) whose D2H lane moves a cpu/nvme boundary
  to the host; an nvme boundary's file write runs in the following window.
- ``reload_window[i]``: backward window (a layer index ``t`` for ``B{t}``, or ``L`` for ``H``)
  whose H2D lane brings the boundary back; an nvme boundary's file read runs one window earlier.
  It must end before the boundary's first use (``B{e-1}`` for block ``(i, e)``).
- ``internals_offload_window[j]`` / ``internals_reload_window[j]`` (both ``None``, or both set and
  only for a layer that keeps its internals): the layer's saved tensors other than its input
  boundary (``internal_bytes - boundary_bytes[j]`` bytes) go to host memory over the D2H lane of
  ``F{w}``, ``j < w <= L-1``, and come back over the H2D lane of ``B{t}`` (``H`` for ``t = L``),
  ``j < t <= L``, which ends before ``B{j}``. On the device they live in ``F{j}..F{w}`` and from
  the reload window to ``B{j}``. An empty tuple means no layer moves its internals.
- ``partial_keep[j]``: layer j's forward runs with grad under selective
  activation checkpointing and keeps only the outputs of its matmul-class ops (projections, the
  attention kernel's outputs; ``Workload`` ``partial_bytes``) from ``F{j}`` to ``B{j}``; ``B{j}``
  re-runs only the elementwise ops (``partial_recompute``, ``partial_seconds``) instead of the whole
  layer. Requires ``homes[j] == "gpu"`` and ``keep_internals[j]`` False. Not a re-run of the layer
  (``recomputed_forwards`` does not count it). An empty tuple means no layer partially keeps.
- ``backward_prefetch``: the weights for ``B{t}`` are fetched during ``B{t+1}`` (MegaTrain: no,
  they are fetched inside ``B{t}`` before its compute).
- ``optimizer``: ``serial`` (all updates in T) or ``pipelined`` (T updates layer 0, then the
  first micro-batch's ``F{j}`` updates layer ``j+1`` just before fetching it).
- ``updates_in_backward`` (pipelined, one rank, no ``serial_layers``; the plan's choice where the run
  allows it, ``Workload.updates_in_backward``; Note: [updates in the backward pass] in
  core/optimizer_steps.py): layer ``t+1`` is updated in ``B{t}``, right after its last gradient
  accumulation (the last micro-batch's), and T updates the non-block parts and layer 0; the F windows
  carry no update (the CPU lane is FIFO: T ends after every update).
- ``serial_layers`` (``pipelined`` only; the per-layer mode): layers ``j >= 1``
  updated in T after layer 0 (the CPU lane, in ascending order; T ends when they are done) instead
  of in ``F{j-1}``: where a window's update -> cast -> fetch chain is longer than its forward, the
  update may cost less in T, under T's fetch tail. Empty: every layer but 0 rides its F window.
- ``data_parallel`` (several ranks, ``multi.py``; one rank's windows): ``none`` (one GPU, the ops
  above and nothing else); ``shard`` (hybrid sharding: every weight fetch moves this rank's shard
  and is followed by a device all-gather, ``collective gather``, which the block's compute waits
  for; every gradient D2H moves the shard and waits for the block's device reduce-scatter,
  ``collective reduce``, issued first in its window); ``replicate`` (full blocks per rank; in T
  one host all-reduce per group, ``collective allreduce``, after the last accumulate and before
  every update: today's engine); ``replicate_overlap`` (each group's host all-reduce right after
  its accumulate in the last micro-batch's ``B`` windows and T). The ``collective`` lane is FIFO
  like the others.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Literal

from .errors import InvalidInput
from .schedule_windows import Op, ScheduleWindows, Window, window_index  # noqa: F401 - public here too

SCHEDULE_VERSION = 1
HOMES = ("gpu", "cpu", "nvme", "recompute")
LANES = ("compute", "h2d", "d2h", "nvme_read", "nvme_write", "cpu", "host", "collective")
DATA_PARALLEL = ("none", "shard", "replicate", "replicate_overlap")

Home = Literal["gpu", "cpu", "nvme", "recompute"]


@dataclass(frozen=True, kw_only=True)
class Schedule(ScheduleWindows):
    num_layers: int
    homes: tuple[str, ...]
    keep_internals: tuple[bool, ...]
    resident_weights: tuple[bool, ...]
    offload_window: tuple[int | None, ...]
    reload_window: tuple[int | None, ...]
    internals_offload_window: tuple[int | None, ...] = ()  # () = no layer moves its internals
    internals_reload_window: tuple[int | None, ...] = ()
    partial_keep: tuple[bool, ...] = ()  # () = no layer partially keeps (all False)
    backward_prefetch: bool = True
    optimizer: str = "pipelined"
    serial_layers: tuple[int, ...] = ()  # pipelined: layers updated in T instead of their F window
    # pipelined, one rank: layer t+1 updated in B{t} where the run allows it (``Workload.updates_in_backward``)
    updates_in_backward: bool = False
    data_parallel: str = "none"
    policy: str = ""
    version: int = SCHEDULE_VERSION
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for key in ("internals_offload_window", "internals_reload_window"):
            value = tuple(getattr(self, key))
            object.__setattr__(self, key, value if value else (None,) * max(self.num_layers, 0))
        partial = tuple(bool(p) for p in self.partial_keep)
        object.__setattr__(self, "partial_keep", partial if partial else (False,) * max(self.num_layers, 0))
        object.__setattr__(self, "serial_layers", tuple(int(j) for j in self.serial_layers))
        self._check()

    # ---- validation ---------------------------------------------------------------------------
    def _check(self) -> None:
        L = self.num_layers
        if L < 1:
            raise InvalidInput("schedule.num_layers", L, "must be >= 1")
        for key, n in (("homes", L + 1), ("keep_internals", L), ("resident_weights", L),
                       ("offload_window", L + 1), ("reload_window", L + 1)):
            if len(getattr(self, key)) != n:
                raise InvalidInput(f"schedule.{key}", len(getattr(self, key)), f"needs {n} entries")
        for i, home in enumerate(self.homes):
            if home not in HOMES:
                raise InvalidInput(f"schedule.homes[{i}]", home, f"must be one of {HOMES}")
        if self.homes[0] != "gpu" or self.homes[L] != "gpu":
            raise InvalidInput("schedule.homes", (self.homes[0], self.homes[L]), "boundaries 0 and L must be 'gpu'")
        if self.optimizer not in ("serial", "pipelined"):
            raise InvalidInput("schedule.optimizer", self.optimizer, "must be 'serial' or 'pipelined'")
        if self.data_parallel not in DATA_PARALLEL:
            raise InvalidInput("schedule.data_parallel", self.data_parallel, f"must be one of {DATA_PARALLEL}")
        if self.serial_layers:
            if self.optimizer != "pipelined" or self.data_parallel != "none":
                raise InvalidInput("schedule.serial_layers", self.serial_layers,
                                   "only a pipelined optimizer on one rank updates some layers in T")
            if list(self.serial_layers) != sorted(set(self.serial_layers)) or not all(
                    1 <= j < L for j in self.serial_layers):
                raise InvalidInput("schedule.serial_layers", self.serial_layers,
                                   f"must be ascending distinct layers in 1..{L - 1} (T always updates layer 0)")
        if self.updates_in_backward and (self.optimizer != "pipelined" or self.data_parallel != "none"
                                         or self.serial_layers):
            raise InvalidInput("schedule.updates_in_backward", True,
                               "only a pipelined optimizer on one rank without serial_layers updates in the backward")
        if self.version != SCHEDULE_VERSION:
            raise InvalidInput("schedule.version", self.version, f"this code reads version {SCHEDULE_VERSION}")
        nxt = self.next_materialised()
        for j in range(L):
            if self.keep_internals[j] and self.homes[j] != "gpu":
                raise InvalidInput(f"schedule.keep_internals[{j}]", True, f"needs homes[{j}]='gpu', got {self.homes[j]!r}")
        for s, e in self.recompute_blocks:
            for j in range(s, e - 1):
                if self.resident_weights[j]:
                    raise InvalidInput(f"schedule.resident_weights[{j}]", True,
                                       f"layer {j} is re-run in recompute block {(s, e)}")
        for i, home in enumerate(self.homes):
            off, rel = self.offload_window[i], self.reload_window[i]
            if home in ("cpu", "nvme"):
                if off is None or not i <= off <= L - 1:
                    raise InvalidInput(f"schedule.offload_window[{i}]", off, f"must be in [{i}, {L - 1}]")
                last = L if home == "cpu" else L - 1
                first = nxt[i]  # must end before B{e-1}, i.e. run in B{t} with t >= e
                if rel is None or not first <= rel <= last:
                    raise InvalidInput(f"schedule.reload_window[{i}]", rel, f"must be in [{first}, {last}]")
            elif off is not None or rel is not None:
                raise InvalidInput(f"schedule.offload_window[{i}]", (off, rel), f"only cpu/nvme boundaries move, this is {home!r}")
        for key in ("internals_offload_window", "internals_reload_window"):
            if len(getattr(self, key)) != L:
                raise InvalidInput(f"schedule.{key}", len(getattr(self, key)), f"needs {L} entries (or none)")
        for j in range(L):
            off, rel = self.internals_offload_window[j], self.internals_reload_window[j]
            if off is None and rel is None:
                continue
            if off is None or rel is None:
                raise InvalidInput(f"schedule.internals_offload_window[{j}]", (off, rel),
                                   "offload and reload windows of a layer's internals are both set or both None")
            if not self.keep_internals[j]:
                raise InvalidInput(f"schedule.internals_offload_window[{j}]", off,
                                   f"layer {j} does not keep its internals (keep_internals[{j}] is False)")
            if not j + 1 <= off <= L - 1:
                raise InvalidInput(f"schedule.internals_offload_window[{j}]", off,
                                   f"must be a forward window after F{j}: in [{j + 1}, {L - 1}]")
            if not j + 1 <= rel <= L:
                raise InvalidInput(f"schedule.internals_reload_window[{j}]", rel,
                                   f"must end before B{j}: in [{j + 1}, {L}] (B{{t}}, or H for {L})")
        if len(self.partial_keep) != L:
            raise InvalidInput("schedule.partial_keep", len(self.partial_keep), f"needs {L} entries (or none)")
        for j in range(L):
            if not self.partial_keep[j]:
                continue
            if self.keep_internals[j]:
                raise InvalidInput(f"schedule.partial_keep[{j}]", True,
                                   f"layer {j} keeps all its internals (keep_internals[{j}] is True)")
            if self.homes[j] != "gpu":
                raise InvalidInput(f"schedule.partial_keep[{j}]", True, f"needs homes[{j}]='gpu', got {self.homes[j]!r}")

    def in_mode(self, data_parallel: str) -> Schedule:
        """This schedule for ranks of a ``data_parallel`` job (the same decisions; the mode adds the
        collectives to the windows): a policy's schedule for a rank's workload."""
        if data_parallel == self.data_parallel:
            return self
        one = data_parallel == "none"  # serial layers and updates in the backward: one rank only
        return dataclasses.replace(self, data_parallel=data_parallel, serial_layers=self.serial_layers if one else (),
                                   updates_in_backward=self.updates_in_backward and one)

    # ---- derived structure --------------------------------------------------------------------
    def next_materialised(self) -> list[int]:
        """For each boundary i < L, the next materialised boundary above it (L for the last)."""
        L = self.num_layers
        out = [L] * (L + 1)
        nxt = L
        for i in range(L - 1, -1, -1):
            out[i] = nxt
            if self.homes[i] != "recompute":
                nxt = i
        return out

    @property
    def materialised(self) -> tuple[int, ...]:
        return tuple(i for i, h in enumerate(self.homes) if h != "recompute")

    @property
    def recompute_blocks(self) -> tuple[tuple[int, int], ...]:
        m = self.materialised
        return tuple((s, e) for s, e in zip(m, m[1:]) if e - s >= 2)

    def block_ending_at(self, e: int) -> tuple[int, int] | None:
        for s, end in self.recompute_blocks:
            if end == e:
                return (s, end)
        return None

    def count_homes(self) -> dict[str, int]:
        return {h: sum(1 for x in self.homes if x == h) for h in HOMES}

    @property
    def offloaded_internals(self) -> tuple[int, ...]:
        """Layers whose kept internals go to host memory and back."""
        return tuple(j for j, w in enumerate(self.internals_offload_window) if w is not None)

    @property
    def partial_layers(self) -> tuple[int, ...]:
        """Layers that keep only their matmul outputs (``partial_keep``)."""
        return tuple(j for j, p in enumerate(self.partial_keep) if p)

    @property
    def recomputed_layers(self) -> int:
        """Extra forward passes per micro-batch: block recompute plus local recompute (a partial
        keep's elementwise recompute is not one)."""
        block = sum(e - 1 - s for s, e in self.recompute_blocks)
        local = sum(1 for k, p in zip(self.keep_internals, self.partial_keep) if not k and not p)
        return block + local


    # ---- serialisation ------------------------------------------------------------------------
    def to_json(self, *, nonblock_parts: int = 1) -> dict:
        """The decisions and every window's ops (T in ``nonblock_parts`` parts: the workload's)."""
        return {
            "version": self.version,
            "policy": self.policy,
            "num_layers": self.num_layers,
            "homes": list(self.homes),
            "keep_internals": list(self.keep_internals),
            "resident_weights": list(self.resident_weights),
            "offload_window": list(self.offload_window),
            "reload_window": list(self.reload_window),
            **({"internals_offload_window": list(self.internals_offload_window),
                "internals_reload_window": list(self.internals_reload_window)} if self.offloaded_internals else {}),
            **({"partial_keep": list(self.partial_keep)} if self.partial_layers else {}),
            "backward_prefetch": self.backward_prefetch,
            "optimizer": self.optimizer,
            **({"serial_layers": list(self.serial_layers)} if self.serial_layers else {}),
            **({"updates_in_backward": True} if self.updates_in_backward else {}),
            **({"data_parallel": self.data_parallel} if self.data_parallel != "none" else {}),
            "recompute_blocks": [list(b) for b in self.recompute_blocks],
            "home_counts": self.count_homes(),
            "windows": [{"name": w.name, "ops": [[o.lane, o.kind, o.index, o.after] for o in w.ops]}
                        for w in self.windows(nonblock_parts=nonblock_parts)],
            "meta": self.meta,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)

    @classmethod
    def from_json(cls, data: dict) -> Schedule:
        version = data.get("version")
        if version != SCHEDULE_VERSION:
            raise InvalidInput("schedule.version", version, f"this code reads version {SCHEDULE_VERSION}")
        return cls(num_layers=data["num_layers"], homes=tuple(data["homes"]),
                   keep_internals=tuple(bool(k) for k in data["keep_internals"]),
                   resident_weights=tuple(bool(r) for r in data["resident_weights"]),
                   offload_window=tuple(data["offload_window"]), reload_window=tuple(data["reload_window"]),
                   internals_offload_window=tuple(data.get("internals_offload_window", ())),
                   internals_reload_window=tuple(data.get("internals_reload_window", ())),
                   partial_keep=tuple(bool(p) for p in data.get("partial_keep", ())),
                   backward_prefetch=bool(data["backward_prefetch"]), optimizer=data["optimizer"],
                   serial_layers=tuple(data.get("serial_layers", ())),
                   updates_in_backward=bool(data.get("updates_in_backward", False)),
                   data_parallel=data.get("data_parallel", "none"), policy=data.get("policy", ""), meta=data.get("meta", {}))

    @classmethod
    def loads(cls, text: str) -> Schedule:
        return cls.from_json(json.loads(text))
