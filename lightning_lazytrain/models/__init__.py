"""Small reference models built from a ``ModelSpec`` (no download, no transformers needed)."""

from .llama import LlamaBlock, LlamaLM

__all__ = ["LlamaBlock", "LlamaLM"]
