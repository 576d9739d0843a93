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
causal LMs of the architecture matrix); a micro-batch whose labels are all ``ignore_index`` gives the
module's NaN loss and its zero gradients. Models whose head is not a plain linear layer (a soft-cap:
Gemma2's ``final_logit_softcapping``, RecurrentGemma's ``logits_soft_cap``, whatever its value; a scale
other than 1: Cohere's ``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``,
``logits_mup_width_multiplier``; a head with a bias as Phi's and GPT-J's) are refused by name, as are
models without ``logits_to_keep``.

Note: [the chunked loss's probe] No list of names keeps up with the library's models, so when the hooks
are installed the module's own loss is checked against the chunked one once, on a tiny input (2 x 8
tokens, one forward of the model without gradients, in eval mode, the global RNG untouched), with the
decoder's output scaled so the logits reach +-60 (where a soft-cap or a scale shows): a model whose
loss neither convention reproduces (a head transform, a loss of its own) is refused with both figures;
one whose own loss takes its labels unshifted (BART's, Pegasus's, Blenderbot's ``...ForCausalLM``) is
trained that way (``ChunkedLoss.shift``). The coefficient of an MoE model's router loss is read under
either name the library uses (``router_aux_loss_coef``, ``aux_loss_coef``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .loss import chunked_lm_loss

__all__ = ["ChunkedLoss", "chunked_loss_modules"]

# config attributes of a head that is not one plain linear layer (the chunked loss would differ): scales
# (1 is the identity) and soft-caps (tanh(x / c) * c is no identity for any c: only None switches one off)
_HEAD_SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "logits_mup_width_multiplier")
_HEAD_CAPS = ("final_logit_softcapping", "logits_soft_cap")
# an MoE model's coefficient of its load-balancing loss, added to the loss when it has labels
_AUX_COEFS = ("router_aux_loss_coef", "aux_loss_coef")
# the probe's tolerance on the loss (relative): fp32 heads, 16-bit heads (their logits rounded apart)
_PROBE_RTOL = {torch.float32: 1e-5, torch.float64: 1e-9}
_PROBE_RTOL_16 = 1e-2


def _causal_lm_names() -> frozenset[str]:
    """The class names of ``AutoModelForCausalLM``'s mapping (GPT-2's is ``GPT2LMHeadModel``); empty without
    transformers."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return frozenset()
    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _is_causal_lm(module: nn.Module) -> bool:
    """A Hugging Face causal LM: a ``...ForCausalLM``, or a class ``AutoModelForCausalLM`` builds (``GPT2LMHeadModel``,
    ...; one whose loss is no chunked linear + cross-entropy is refused by ``ChunkedLoss``'s probe, naming why)."""
    if not (hasattr(module, "get_decoder") and hasattr(module, "get_output_embeddings") and hasattr(module, "config")):
        return False
    name = type(module).__name__
    return name.endswith("ForCausalLM") or name in _causal_lm_names()


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
        for attr in _HEAD_SCALES + _HEAD_CAPS:
            value = getattr(config, attr, None)
            if value is not None and (attr in _HEAD_CAPS or value != 1):
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
        self.shift = self._probe(model)
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.get_decoder().register_forward_hook(self._keep_hidden),
            model.register_forward_hook(self._after),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    @staticmethod
    def _probe(model: nn.Module) -> bool:
        """Note: [the chunked loss's probe]: the module's own loss against the chunked one, once, on a
        tiny input (2 x 8 random tokens, a masked prompt), in eval mode without gradients (the global RNG
        untouched), with the decoder's last hidden state scaled so the logits reach +-60 (a soft-cap or
        a scale shows as a trained model's would). Returns whether the module shifts its labels (Hugging
        Face's causal LMs do; BART's and a few others' ``...ForCausalLM`` take them shifted already);
        raises ValueError where neither convention gives its loss, so a head transform or a loss that
        no list of names knows is refused instead of trained on silently."""
        name = type(model).__name__
        head = model.get_output_embeddings()
        weight = head.weight
        if weight.device.type == "meta":
            raise ValueError(f"chunked_loss: {name}'s weights are on the meta device: materialise them first")
        seen: dict[str, torch.Tensor] = {}

        def widen(module: nn.Module, args: tuple, output: Any) -> Any:
            hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            top = (hidden.float() @ weight.float().t()).abs().max().item()
            hidden = hidden * (60.0 / top if top > 0 else 1.0)
            seen["hidden"] = hidden
            if hasattr(output, "last_hidden_state"):
                output.last_hidden_state = hidden
                return output
            return (hidden, *output[1:])

        vocab = weight.shape[0]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2, 8), generator=gen).to(weight.device)
        # labels drawn apart from the inputs: with the inputs as labels, a tied head at +-60 predicts its
        # own input almost surely, and the unshifted loss is rounding noise (~1e-4)
        labels = torch.randint(0, vocab, (2, 8), generator=gen).to(weight.device)
        labels[0, :3] = -100
        modes = [(m, m.training) for m in model.modules()]
        devices = [weight.device] if weight.device.type == "cuda" else []
        handle = model.get_decoder().register_forward_hook(widen)
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                model.eval()
                try:
                    out = model(input_ids=ids, labels=labels)
                except Exception as err:
                    raise ValueError(f"chunked_loss: {name} could not be checked against its own loss on a tiny "
                                     f"input ({type(err).__name__}: {err}); use chunked_loss=False") from err
                own = out.loss
                if own is None or "hidden" not in seen:
                    raise ValueError(f"chunked_loss: {name} computed no loss from its labels, or its decoder "
                                     "(get_decoder()) did not run: use chunked_loss=False")
                aux = _aux_loss(model, out)
                got = {}
                for shift in (True, False):
                    targets = _targets(labels, -100, shift)
                    loss = chunked_lm_loss(seen["hidden"], weight, targets, ignore_index=-100)
                    got[shift] = (loss + aux if aux is not None else loss).float().item()
        finally:
            handle.remove()
            # train() (not only .training): a model may switch more with its mode (Hugging Face's kernels)
            model.train(modes[0][1])
            for m, mode in modes:
                if m.training != mode:
                    m.train(mode)
        want = own.float().item()
        rtol = _PROBE_RTOL.get(weight.dtype, _PROBE_RTOL_16)
        for shift in (True, False):  # a wrong convention or a transform moves the loss by whole nats
            if abs(got[shift] - want) <= rtol * abs(want) + 1e-4:
                return shift
        raise ValueError(f"chunked_loss: {name}'s own loss is not the chunked linear + cross-entropy of its "
                         f"decoder's output through its LM head's weight (on a tiny input: {want:.6g}, chunked "
                         f"{got[True]:.6g} with the labels shifted, {got[False]:.6g} without): its head or its loss "
                         "transforms the logits; train it with chunked_loss=False (its own loss, whose full "
                         "logits the plan counts)")

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is None:  # the module computes no loss without labels (shift_labels alone: none either)
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
        if targets is None:  # Hugging Face's shift: position t predicts label t + 1 (where the module shifts)
            targets = _targets(call["labels"], ignore, self.shift)
        head = module.get_output_embeddings()
        loss = chunked_lm_loss(hidden, head.weight, targets.to(hidden.device), self.chunk_tokens,
                               ignore_index=ignore, num_items_in_batch=call["num_items_in_batch"])
        aux = _aux_loss(module, output)
        if aux is not None:  # an MoE model adds its load-balancing loss when it has labels
            loss = loss + aux.to(loss.device)
        output.loss = loss
        return output


def _targets(labels: torch.Tensor, ignore: int, shift: bool) -> torch.Tensor:
    """Each position's target: Hugging Face's shift (position t predicts label t + 1, ``ignore`` appended),
    or the labels as given (a model whose own loss takes them shifted already)."""
    return nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:] if shift else labels


def _aux_loss(model: nn.Module, output: Any) -> torch.Tensor | None:
    """An MoE model's load-balancing loss times its coefficient, as the model adds it to the loss; or None."""
    aux = getattr(output, "aux_loss", None)
    coef = next((c for attr in _AUX_COEFS if (c := getattr(model, attr, None))), None)
    return coef * aux if aux is not None and coef else None
