"""Find the repeated transformer-block stack of a model.

The engine streams one block at a time, so it needs the container that holds the blocks: an
``nn.ModuleList`` or an ``nn.Sequential``. Everything outside the blocks (embeddings, final norm,
head) is "the rest" and is handled separately by the parameter store.

A stack is one of:

* an ``nn.ModuleList``: every child is a block (``self.layers = nn.ModuleList(...)``);
* an ``nn.Sequential`` whose children share one class: every child is a block
  (``self.blocks = nn.Sequential(*[Block() for _ in range(n)])``, timm's ViT, torchvision's);
* a *run* of >= 2 consecutive children of one class inside an ``nn.Sequential`` that holds other
  modules too (``self.net = nn.Sequential(emb, *blocks, norm, head)``): the run is the stack, the
  children around it are the rest. Its path reads ``"net[1:5]"`` (children 1..4, Python slice
  notation), which ``blocks=`` accepts back.

Discovery order (first hit wins):

1. an explicit path (``blocks="model.layers"``, ``blocks="net[1:5]"``), validated strictly;
2. well-known attribute paths of Hugging Face / litgpt models, matched as a *suffix* so
   wrappers (a LightningModule holding ``self.model``) still work;
3. the largest (by parameter count) candidate: an ``nn.ModuleList`` whose >= 2 children all share
   one class, or an ``nn.Sequential`` run of >= 2 consecutive children of one class. A run of
   leaf layers (children without submodules: ``nn.Linear``, ``nn.Conv2d``, ...) is usually an MLP
   or a head rather than a stack of blocks, so it ranks below every other candidate.

The root module itself is never a candidate: the stack needs an owner attribute.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

__all__ = ["KNOWN_BLOCK_SUFFIXES", "BlockDiscoveryError", "BlockStack", "find_blocks"]

# Ordered by preference. Matched on whole dotted segments at the end of a path,
# so "model.layers" matches "model.layers" and "model.model.layers" but not
# "model.vision_model.encoder.layers".
KNOWN_BLOCK_SUFFIXES: tuple[str, ...] = (
    "model.layers",  # Llama, Mistral, Qwen2/Qwen3, Gemma, Phi-3, ...
    "language_model.layers",  # multimodal wrappers (Gemma 3, Llava-style)
    "transformer.h",  # GPT-2, litgpt, Falcon, Bloom
    "gpt_neox.layers",  # GPT-NeoX / Pythia
    "model.decoder.layers",  # OPT
    "transformer.blocks",  # MPT
)

_Container = nn.ModuleList | nn.Sequential


class BlockDiscoveryError(ValueError):
    """No usable block stack was found (or an explicit path was invalid)."""


@dataclass(frozen=True)
class BlockStack:
    """The repeated blocks of a model and where they live."""

    # dotted path from the root module, e.g. "model.model.layers"; for a run of children inside a
    # larger nn.Sequential, the container's path and the run's slice, e.g. "net[1:5]"
    path: str
    # the blocks, in order: the container itself, or (a run) an unregistered nn.ModuleList of them
    blocks: nn.ModuleList | nn.Sequential
    owner: nn.Module  # module that holds the container as attribute ``attr``
    attr: str
    start: int = 0  # position of blocks[0] among the container's children

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.blocks)

    def __getitem__(self, i: int) -> nn.Module:
        return self.blocks[i]

    @property
    def container_path(self) -> str:
        """Dotted path of the nn.ModuleList / nn.Sequential that holds the blocks."""
        return self.path.partition("[")[0]

    @property
    def container(self) -> nn.Module:
        return getattr(self.owner, self.attr)

    def block_path(self, i: int) -> str:
        """Dotted path of block ``i`` (its parameters are named ``f"{block_path(i)}.{name}"``)."""
        name = list(self.container._modules)[self.start + i]  # a Sequential's children may be named
        return f"{self.container_path}.{name}" if self.container_path else name


# ------------------------------------------------------------------------------ candidates
@dataclass(frozen=True)
class _Candidate:
    path: str  # the container's path
    container: _Container
    start: int
    stop: int

    @property
    def children(self) -> list[nn.Module]:
        return list(self.container)[self.start:self.stop]

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == len(self.container)

    @property
    def leaf(self) -> bool:
        """A Sequential run of leaf layers (nn.Linear, nn.Conv2d, ...): an MLP or a head, more likely
        than a stack of blocks."""
        return isinstance(self.container, nn.Sequential) and all(
            next(c.children(), None) is None for c in self.children)

    def size(self) -> tuple[int, int]:
        return _num_params(self.children), self.stop - self.start

    def rank(self) -> tuple[bool, int, int, int]:
        # Parameter count rather than length so that a per-block list of MoE experts (many
        # identical children, nested inside each block) never beats the stack that contains it.
        return (not self.leaf, *self.size(), -len(self.path))


def _num_params(modules: list[nn.Module]) -> int:
    seen: dict[int, int] = {}  # dedupe parameters tied between the modules
    for m in modules:
        for p in m.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def _containers(root: nn.Module) -> list[tuple[str, _Container]]:
    """Every nn.ModuleList, then every nn.Sequential, in module order (the root's name is '')."""
    mods = list(root.named_modules())
    return ([(n, m) for n, m in mods if isinstance(m, nn.ModuleList)]
            + [(n, m) for n, m in mods if isinstance(m, nn.Sequential)])


def _runs(mods: nn.Sequential | list[nn.Module]) -> list[tuple[int, int]]:
    """Maximal runs ``(start, stop)`` of consecutive children of one class."""
    kinds = [type(c) for c in mods]
    runs, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] is not kinds[start]:
            runs.append((start, i))
            start = i
    return runs


def _sequential_stacks(path: str, seq: nn.Sequential) -> list[_Candidate]:
    """The stacks a Sequential offers: itself whole when its children share one class, else each
    run of >= 2 consecutive children of one class."""
    runs = _runs(seq)
    if len(runs) > 1:
        runs = [(a, b) for a, b in runs if b - a >= 2]
    return [_Candidate(path, seq, a, b) for a, b in runs]


def _fallback_candidates(path: str, c: _Container) -> list[_Candidate]:
    """Stacks of >= 2 blocks of one class: a ModuleList's children, or a Sequential's (runs)."""
    if isinstance(c, nn.ModuleList):
        return [_Candidate(path, c, 0, len(c))] if len(c) >= 2 and len({type(m) for m in c}) == 1 else []
    return [cand for cand in _sequential_stacks(path, c) if cand.stop - cand.start >= 2]


def _best(cands: list[_Candidate]) -> _Candidate:
    return max(cands, key=_Candidate.rank)


# ------------------------------------------------------------------------------ messages
def _kinds_in_order(mods: list[nn.Module]) -> str:
    """Children as runs, in order: ``Embedding, 4xBlock, Linear``."""
    names = [(type(mods[a]).__name__, b - a) for a, b in _runs(mods)]
    return ", ".join(f"{n}x{k}" if n > 1 else k for k, n in names)


def _describe(c: _Container) -> str:
    if isinstance(c, nn.Sequential):  # in order: a run of one class can be the stack
        base, kinds = "nn.Sequential", _kinds_in_order(list(c))
    else:
        counts = Counter(type(m).__name__ for m in c)
        base, kinds = "nn.ModuleList", ", ".join(f"{n}x{k}" if n > 1 else k for k, n in counts.most_common())
    if type(c).__name__ != base[3:]:
        base += f" ({type(c).__name__})"  # a subclass
    return f"{base}, len={len(c)}, children=[{kinds or 'empty'}]"


def _candidates_text(root: nn.Module) -> str:
    found = _containers(root)
    if not found:
        return "  (the model contains no nn.ModuleList or nn.Sequential at all)"
    shown = found[:25]
    lines = [f"  - {name or '<root>'!s}: {_describe(c)}" for name, c in shown]
    if len(found) > len(shown):
        lines.append(f"  ... and {len(found) - len(shown)} more")
    return "\n".join(lines)


def _error(root: nn.Module, problem: str) -> BlockDiscoveryError:
    return BlockDiscoveryError(
        f"{problem}\nnn.ModuleList / nn.Sequential candidates in {type(root).__name__}:\n"
        f"{_candidates_text(root)}\n"
        "Pass the dotted path of the repeated transformer blocks explicitly, e.g. "
        "blocks=\"model.layers\": an nn.ModuleList (every child is a block) or an nn.Sequential (every "
        "child if they share one class, else its largest run of consecutive children of one class); "
        "blocks=\"net[1:5]\" takes children 1 to 4 of either."
    )


# ------------------------------------------------------------------------------ resolution
def _stack(root: nn.Module, cand: _Candidate) -> BlockStack:
    prefix, _, attr = cand.path.rpartition(".")
    owner = root.get_submodule(prefix) if prefix else root
    if cand.whole:
        return BlockStack(path=cand.path, blocks=cand.container, owner=owner, attr=attr)
    return BlockStack(path=f"{cand.path}[{cand.start}:{cand.stop}]", blocks=nn.ModuleList(cand.children),
                      owner=owner, attr=attr, start=cand.start)


_SLICE = re.compile(r"^(?P<path>[^\[\]]*)\[\s*(?P<a>-?\d*)\s*:\s*(?P<b>-?\d*)\s*\]$")


def _resolve_explicit(root: nn.Module, path: str) -> BlockStack:
    given = path
    path = path.strip().strip(".")
    if not path:
        raise _error(root, "blocks='' is empty.")
    bounds = None
    m = _SLICE.match(path)
    if m:
        path = m["path"].strip().strip(".")
        bounds = tuple(int(v) if v else None for v in (m["a"], m["b"]))
    elif "[" in path or "]" in path:
        raise _error(root, f"blocks={given!r} is not a dotted path or a dotted path with a slice like 'net[1:5]'.")
    if not path:
        raise _error(root, f"blocks={given!r} names no module.")
    try:
        target = root.get_submodule(path)
    except AttributeError as e:
        raise _error(root, f"blocks={path!r} does not exist in {type(root).__name__}: {e}.") from None
    if not isinstance(target, (nn.ModuleList, nn.Sequential)):
        raise _error(root, f"blocks={path!r} is a {type(target).__name__}, not an nn.ModuleList or nn.Sequential.")
    kind = "nn.ModuleList" if isinstance(target, nn.ModuleList) else "nn.Sequential"
    if len(target) == 0:
        raise _error(root, f"blocks={path!r} is an empty {kind}.")
    if bounds is not None:  # exactly the children named, whatever their classes
        start, stop, _ = slice(*bounds).indices(len(target))
        if stop <= start:
            raise _error(root, f"blocks={given!r} selects no child of {path!r} ({kind}, len={len(target)}).")
        return _stack(root, _Candidate(path, target, start, stop))
    if isinstance(target, nn.ModuleList):  # every child, whatever their classes (as always)
        return _stack(root, _Candidate(path, target, 0, len(target)))
    runs = _sequential_stacks(path, target)  # the whole Sequential when its children share one class
    if not runs:
        raise _error(
            root, f"blocks={path!r} is an nn.Sequential of mixed classes ({_kinds_in_order(list(target))}) without "
                  f"a run of >= 2 consecutive children of one class; name the blocks with a slice, e.g. "
                  f"blocks={path + '[0:' + str(len(target)) + ']'!r}, or hold them in an nn.ModuleList.")
    return _stack(root, _best(runs))


def _matches_suffix(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("." + suffix)


def find_blocks(module: nn.Module, blocks: str | None = None) -> BlockStack:
    """Return the block stack of ``module``; see the module docstring for the rules."""
    if blocks is not None:
        return _resolve_explicit(module, blocks)

    # The root itself is never a candidate: the stack needs an owner attribute.
    containers = [(p, c) for p, c in _containers(module) if p]
    # Known suffixes, in preference order. Several hits for one suffix (e.g. an encoder-decoder or
    # a model wrapping a draft model) -> the biggest one. A ModuleList there is taken whatever its
    # children; a Sequential offers its runs (the whole of it when its children share one class).
    for suffix in KNOWN_BLOCK_SUFFIXES:
        hits: list[_Candidate] = []
        for p, c in containers:
            if not _matches_suffix(p, suffix) or len(c) == 0:
                continue
            if isinstance(c, nn.ModuleList):
                hits.append(_Candidate(p, c, 0, len(c)))
            else:
                hits += _sequential_stacks(p, c)
        if hits:
            return _stack(module, max(hits, key=_Candidate.size))

    # Generic fallback: the biggest ModuleList of one class or Sequential run of one class.
    cands = [cand for p, c in containers for cand in _fallback_candidates(p, c)]
    if cands:
        return _stack(module, _best(cands))

    raise _error(
        module,
        f"Could not find the repeated transformer blocks of {type(module).__name__}: "
        "no known path (" + ", ".join(KNOWN_BLOCK_SUFFIXES) + "), no nn.ModuleList "
        "with >= 2 children of one class and no nn.Sequential with >= 2 consecutive children of one class.",
    )
