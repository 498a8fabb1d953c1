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
    """The mask where the forward takes an `attention_mask`; a model that takes none cannot be given padding."""
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

    `logits=False` (only attention is read) has a Hugging Face LM compute the last position's logits only (at 8192
    tokens a 49k vocabulary's full logits take 1.6 GB); a 1-D tensor of positions, those positions'. Encoder-decoders:
    the decoder reads `input_ids` teacher-forced, the encoder `source` = (ids, mask or None), by default the same
    sequence (probe.hooks.stacks).
    """
    input_ids = input_ids.to(input_device(model))
    if source is not None and not is_encoder_decoder(model):
        raise ProbeError("a source sequence is for encoder-decoders (t5, bart): this model reads one sequence",
                         parameter="source")
    if is_hf_model(model):
        return model(**_hf_arguments(model, input_ids, attention_mask, logits, source))
    return model(input_ids, **_custom_arguments(model, attention_mask, input_ids.device))
