"""One forward pass the way probe runs every model."""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.hf import is_hf_model
from probe.models.outputs import logits_of
from probe.hooks.stacks import is_encoder_decoder
from probe.models.placement import input_device

__all__ = ["Source", "accepts_argument", "logits_of", "run_model"]

Source = tuple[Tensor, "Tensor | None"]
"""An encoder-decoder's encoder input: (ids (batch, source positions), mask or None)."""


def accepts_argument(model: nn.Module, argument: str) -> bool:
    """Whether the model's forward takes `argument` by name."""
    try:
        return argument in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _hf_arguments(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                  logits: bool | Tensor, source: Source | None = None) -> dict[str, Any]:
    """An encoder-decoder's decoder reads `input_ids`, teacher-forced, and its encoder the source, by default the
    same sequence; any other model reads `input_ids`."""
    device = input_ids.device
    kwargs: dict[str, Any] = {}
    if is_encoder_decoder(model):
        kwargs["decoder_input_ids"] = input_ids
        if attention_mask is not None:
            kwargs["decoder_attention_mask"] = attention_mask.to(device)
        if source is not None:
            input_ids, attention_mask = source
    kwargs["input_ids"] = input_ids.to(device)
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if getattr(model.config, "use_cache", None) is not None:
        kwargs["use_cache"] = False
    if (isinstance(logits, Tensor) or not logits) and accepts_argument(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = logits.to(device) if isinstance(logits, Tensor) else 1
    return kwargs


def _custom_arguments(model: nn.Module, attention_mask: Tensor | None, device: Any) -> dict[str, Any]:
    """A custom model gets the mask (1 = token, 0 = padding, as in Hugging Face) where its forward takes an
    `attention_mask`; one that takes none cannot be given padding, since it would attend to the pad tokens."""
    if attention_mask is None:
        return {}
    if accepts_argument(model, "attention_mask"):
        return {"attention_mask": attention_mask.to(device)}
    if bool(attention_mask.bool().all()):  # nothing is padding: the mask says nothing the model needs
        return {}
    raise ProbeError(f"attention_mask marks padding, but {type(model).__name__}.forward takes no attention_mask, "
                     "so the model would attend to the padding: give sequences without padding (attention_mask=None)"
                     ", or add an attention_mask argument (1 = token, 0 = padding) to its forward",
                     parameter="attention_mask")


def run_model(model: nn.Module, input_ids: Tensor, attention_mask: Tensor | None = None, *,
              logits: bool | Tensor = True, source: Source | None = None) -> Any:
    """One forward: Hugging Face models with their mask and no KV cache; custom models with the ids, and the mask
    where their forward takes an `attention_mask`.

    `logits=False`: the caller only reads attention, so a Hugging Face LM computes the logits of the last position
    only (`logits_to_keep=1`); at 8192 tokens the full logits of a 49k vocabulary would take 1.6 GB. A 1-D tensor of
    positions: the logits of those positions only. Models without `logits_to_keep` compute all, as before.

    Encoder-decoders (T5, BART): `input_ids` are what the decoder reads, teacher-forced (its logits at position t
    predict token t + 1, as a decoder-only model's do); the encoder reads `source` = (ids, mask or None), by default
    the same sequence (probe.hooks.stacks says why).
    """
    input_ids = input_ids.to(input_device(model))
    if source is not None and not is_encoder_decoder(model):
        raise ProbeError("a source sequence is for encoder-decoders (t5, bart): this model reads one sequence",
                         parameter="source")
    if is_hf_model(model):
        return model(**_hf_arguments(model, input_ids, attention_mask, logits, source))
    return model(input_ids, **_custom_arguments(model, attention_mask, input_ids.device))
