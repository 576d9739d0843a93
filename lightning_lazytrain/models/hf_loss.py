"""Hugging Face causal LMs with the project's chunked linear + cross-entropy (``models/loss.py``).

Note: [chunked loss for Hugging Face models] A Hugging Face ``...ForCausalLM`` computes its loss
inside ``forward``: the LM head's logits for every position in the compute dtype, their fp32 copy,
the cross-entropy, and in the backward their gradient: at 32 x 1024 tokens and a 32k vocabulary
4.2 GB of fp32 logits alone (152k-248k vocabularies: 5-8x that). The device must hold that peak in
the head window, and the plan counts it as the profile measures it. ``ChunkedLoss`` (what
``LazyTrainStrategy(chunked_loss=True)`` installs, or yourself) makes ``model(input_ids,
labels=labels).loss`` the chunked loss instead, with module hooks (no method of the model is
replaced):

- a forward pre-hook takes ``labels`` (and ``shift_labels``) out of the call and asks the model for
  the last position's logits only (``logits_to_keep=1``), so it computes no full logits and no loss;
- a forward hook on the decoder keeps its last hidden state (after the final norm);
- a forward hook on the model computes the loss from that hidden state through the LM head's weight
  ``chunk_tokens`` tokens at a time (``chunked_lm_loss``), with Hugging Face's semantics: the labels
  shifted left (a label of ``ignore_index`` appended; or ``shift_labels`` as given), positions with
  ``ignore_index`` (-100) adding no loss and no gradient, the mean over the other positions or, with
  ``num_items_in_batch``, their sum divided by it; an MoE model's ``router_aux_loss_coef * aux_loss``
  is added as the model adds it. The output's ``loss`` is that; its ``logits`` hold the last position
  only (compute full logits yourself if you need them).

Equal to the module's own loss up to summation order (fp32: within 1e-5 relative; tested on the
causal LMs of the architecture matrix). Models whose head is not a plain linear layer (Gemma2's
final logit soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``, a head with a bias
as Phi's and GPT-J's) are refused by name, as are models without ``logits_to_keep``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .loss import chunked_lm_loss

__all__ = ["ChunkedLoss", "chunked_loss_modules"]

# config attributes of a head that is not one plain linear layer (the chunked loss would differ)
_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _is_causal_lm(module: nn.Module) -> bool:
    return (hasattr(module, "get_decoder") and hasattr(module, "get_output_embeddings")
            and hasattr(module, "config") and type(module).__name__.endswith("ForCausalLM"))


def chunked_loss_modules(root: nn.Module) -> list[nn.Module]:
    """The Hugging Face causal LMs in ``root`` (outermost ones: not inside another)."""
    found: list[nn.Module] = []
    for m in root.modules():
        if _is_causal_lm(m) and not any(m in set(f.modules()) for f in found):
            found.append(m)
    return found


class ChunkedLoss:
    """Note: [chunked loss for Hugging Face models]: hooks on ``model`` (a ``...ForCausalLM``);
    ``remove()`` takes them off."""

    def __init__(self, model: nn.Module, chunk_tokens: int = 4096) -> None:
        name = type(model).__name__
        if not _is_causal_lm(model):
            raise ValueError(f"chunked_loss: {name} is not a Hugging Face causal LM (a ...ForCausalLM with "
                             "get_decoder and get_output_embeddings)")
        config = model.config
        for attr in _HEAD_TRANSFORMS:
            value = getattr(config, attr, None)
            if value not in (None, 1, 1.0):
                raise ValueError(f"chunked_loss: {name} transforms its logits ({attr}={value!r}), so the chunked "
                                 "linear + cross-entropy would not be its loss; train it with chunked_loss=False "
                                 "(its own loss, whose full logits the plan counts)")
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise ValueError(f"chunked_loss: {name}'s LM head has a bias, which the chunked linear + cross-entropy "
                             "does not add; train it with chunked_loss=False (its own loss)")
        if "logits_to_keep" not in inspect.signature(model.forward).parameters:
            raise ValueError(f"chunked_loss: {name}.forward takes no logits_to_keep, so it would still compute "
                             "every position's logits; use chunked_loss=False")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model = model
        self.chunk_tokens = int(chunk_tokens)
        self._call: dict[str, Any] | None = None
        self._hidden: torch.Tensor | None = None
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.get_decoder().register_forward_hook(self._keep_hidden),
            model.register_forward_hook(self._after),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is None and shift is None:
            self._call = None
            return None
        kwargs = dict(kwargs)
        kwargs.pop("labels", None)
        kwargs.pop("shift_labels", None)
        if kwargs.get("return_dict") is False:
            raise ValueError("chunked_loss needs the model's output object: call it without return_dict=False")
        kwargs["logits_to_keep"] = 1
        self._call = {"labels": labels, "shift_labels": shift, "ignore_index": kwargs.get("ignore_index", -100),
                      "num_items_in_batch": kwargs.get("num_items_in_batch")}
        self._hidden = None
        return args, kwargs

    def _keep_hidden(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._call is not None:
            self._hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def _after(self, module: nn.Module, args: tuple, output: Any) -> Any:
        call, hidden = self._call, self._hidden
        self._call = self._hidden = None
        if call is None:
            return None
        if hidden is None:
            raise RuntimeError(f"chunked_loss: {type(module).__name__}'s decoder did not run in its forward")
        ignore = call["ignore_index"]
        targets = call["shift_labels"]
        if targets is None:  # Hugging Face's shift: position t predicts label t + 1
            targets = nn.functional.pad(call["labels"], (0, 1), value=ignore)[..., 1:]
        head = module.get_output_embeddings()
        loss = chunked_lm_loss(hidden, head.weight, targets.to(hidden.device), self.chunk_tokens,
                               ignore_index=ignore, num_items_in_batch=call["num_items_in_batch"])
        aux = getattr(output, "aux_loss", None)
        coef = getattr(module, "router_aux_loss_coef", None)
        if aux is not None and coef:  # an MoE model adds its load-balancing loss when it has labels
            loss = loss + coef * aux.to(loss.device)
        output.loss = loss
        return output
