"""Find the repeated transformer-block stack of a model.

The engine streams one block at a time, so it needs the ``nn.ModuleList`` that
holds the blocks. Everything outside that list (embeddings, final norm, head)
is "the rest" and is handled separately by the parameter store.

Discovery order (first hit wins):

1. an explicit dotted path (``blocks="model.layers"``), validated strictly;
2. well-known attribute paths of Hugging Face / litgpt models, matched as a
   *suffix* so wrappers (a LightningModule holding ``self.model``) still work;
3. the largest (by parameter count) ``nn.ModuleList`` whose >= 2 children all
   share one class.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

__all__ = ["BlockDiscoveryError", "BlockStack", "KNOWN_BLOCK_SUFFIXES", "find_blocks"]

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


class BlockDiscoveryError(ValueError):
    """No usable block stack was found (or an explicit path was invalid)."""


@dataclass(frozen=True)
class BlockStack:
    """The repeated blocks of a model and where they live."""

    path: str  # dotted path from the root module, e.g. "model.model.layers"
    blocks: nn.ModuleList
    owner: nn.Module  # module that holds ``blocks`` as attribute ``attr``
    attr: str

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.blocks)

    def __getitem__(self, i: int) -> nn.Module:
        return self.blocks[i]

    def block_path(self, i: int) -> str:
        return f"{self.path}.{i}" if self.path else str(i)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() dedupes tied params


def _module_lists(root: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    return [(name, m) for name, m in root.named_modules() if isinstance(m, nn.ModuleList)]


def _homogeneous(ml: nn.ModuleList) -> bool:
    return len(ml) >= 2 and len({type(c) for c in ml}) == 1


def _describe(ml: nn.ModuleList) -> str:
    counts = Counter(type(c).__name__ for c in ml)
    kinds = ", ".join(f"{n}x{k}" if n > 1 else k for k, n in counts.most_common())
    return f"len={len(ml)}, children=[{kinds or 'empty'}]"


def _candidates_text(root: nn.Module) -> str:
    lists = _module_lists(root)
    if not lists:
        return "  (the model contains no nn.ModuleList at all)"
    shown = lists[:25]
    lines = [f"  - {name or '<root>'!s}: {_describe(ml)}" for name, ml in shown]
    if len(lists) > len(shown):
        lines.append(f"  ... and {len(lists) - len(shown)} more")
    return "\n".join(lines)


def _error(root: nn.Module, problem: str) -> BlockDiscoveryError:
    return BlockDiscoveryError(
        f"{problem}\nnn.ModuleList candidates in {type(root).__name__}:\n"
        f"{_candidates_text(root)}\n"
        "Pass the dotted path of the repeated transformer blocks explicitly, e.g. "
        "blocks=\"model.layers\" (it must name an nn.ModuleList with at least one module; "
        "a nn.Sequential stack has to be wrapped in an nn.ModuleList)."
    )


def _stack(root: nn.Module, path: str, ml: nn.ModuleList) -> BlockStack:
    prefix, _, attr = path.rpartition(".")
    owner = root.get_submodule(prefix) if prefix else root
    return BlockStack(path=path, blocks=ml, owner=owner, attr=attr)


def _resolve_explicit(root: nn.Module, path: str) -> BlockStack:
    path = path.strip().strip(".")
    if not path:
        raise _error(root, "blocks='' is empty.")
    try:
        target = root.get_submodule(path)
    except AttributeError as e:
        raise _error(root, f"blocks={path!r} does not exist in {type(root).__name__}: {e}.") from None
    if not isinstance(target, nn.ModuleList):
        raise _error(
            root, f"blocks={path!r} is a {type(target).__name__}, not an nn.ModuleList."
        )
    if len(target) == 0:
        raise _error(root, f"blocks={path!r} is an empty nn.ModuleList.")
    return _stack(root, path, target)


def _matches_suffix(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("." + suffix)


def find_blocks(module: nn.Module, blocks: str | None = None) -> BlockStack:
    """Return the block stack of ``module``; see the module docstring for the rules."""
    if blocks is not None:
        return _resolve_explicit(module, blocks)

    # The root itself is never a candidate: the stack needs an owner attribute.
    lists = [(p, ml) for p, ml in _module_lists(module) if p and len(ml) >= 1]
    # Known suffixes, in preference order. Several hits for one suffix (e.g. an
    # encoder-decoder or a model wrapping a draft model) -> the biggest one.
    for suffix in KNOWN_BLOCK_SUFFIXES:
        hits = [(p, ml) for p, ml in lists if _matches_suffix(p, suffix)]
        if hits:
            path, ml = max(hits, key=lambda h: (_num_params(h[1]), len(h[1])))
            return _stack(module, path, ml)

    # Generic fallback. Parameter count rather than length so that a per-block
    # list of MoE experts (many identical children, nested inside each block)
    # never beats the stack that contains it.
    homogeneous = [(p, ml) for p, ml in lists if _homogeneous(ml)]
    if homogeneous:
        path, ml = max(homogeneous, key=lambda h: (_num_params(h[1]), len(h[1]), -len(h[0])))
        return _stack(module, path, ml)

    raise _error(
        module,
        f"Could not find the repeated transformer blocks of {type(module).__name__}: "
        "no known path (" + ", ".join(KNOWN_BLOCK_SUFFIXES) + ") and no nn.ModuleList "
        "with >= 2 children of one class.",
    )
