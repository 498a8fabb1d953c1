"""Hugging Face folders and hub ids: the model class that fits the architecture, its tokenizer, and never a line of
the folder's own Python code unless the caller trusts it (`trust_remote_code`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import warnings

import torch
from torch import nn

from probe.errors import ProbeError
from probe.models.placement import check_device_map


ENCODER_DECODERS = ("t5", "bart")
"""config.model_type of the encoder-decoders probe reads (their attention goes through transformers' interface;
`probe.hooks.stacks` names their three stacks)."""


def encoder_decoder_refusal(model_type: str) -> str:
    """One line: why an encoder-decoder other than T5 and BART is refused."""
    if model_type == "whisper":
        return ("whisper is an encoder-decoder whose encoder reads audio features, not token ids, and probe feeds "
                f"token ids to both stacks (supported encoder-decoders: {', '.join(ENCODER_DECODERS)}); "
                "it is not supported")
    return (f"{model_type} is an encoder-decoder that probe does not read yet (supported: "
            f"{', '.join(ENCODER_DECODERS)}: their three stacks are named and checked against the model's own "
            "attentions); it is not supported")


def refuses_encoder_decoder(config: Any) -> bool:
    """Whether the config is an encoder-decoder probe does not read."""
    return bool(getattr(config, "is_encoder_decoder", False)) and config.model_type not in ENCODER_DECODERS


def _needs_remote_code(error: Exception) -> bool:
    return isinstance(error, ValueError) and "trust_remote_code=True" in str(error)


@contextmanager
def loading_bars_off() -> Iterator[None]:
    """transformers' "Loading weights" bars off while probe loads a model; download bars as they were."""
    from huggingface_hub import utils as hub
    from transformers.utils import logging as hf_logging

    was_on, hub_off = hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()
    hf_logging.disable_progress_bar()  # turns the hub's off too: a download keeps its bar
    if not hub_off:
        hub.enable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
        if hub_off:
            hub.disable_progress_bars()


@contextmanager
def remote_code_refused(source: str) -> Iterator[None]:
    """transformers' refusal to run a model's own code, as one ProbeError saying how to allow it."""
    try:
        yield
    except ValueError as error:
        if not _needs_remote_code(error):
            raise
        raise ProbeError(f"{source} needs its own Python code to load (auto_map in its config), which probe does not "
                         "run unless told: pass trust_remote_code=True, and only if you trust where the model comes "
                         "from", parameter="trust_remote_code") from error


def _check_placement(config: Any, device_map: dict[str, int | str], trust_remote_code: bool) -> None:
    """A dict device map checked against an empty (meta) skeleton, so that a typo fails before a weight is read."""
    from accelerate import init_empty_weights

    *first, last = _model_classes(config)
    with init_empty_weights():  # the same class as loaded below, so that the module names are the same
        try:
            if not first:
                raise ValueError("an encoder loads with AutoModel")
            skeleton = first[0].from_config(config, trust_remote_code=trust_remote_code)
        except ValueError as error:
            if _needs_remote_code(error):
                raise
            skeleton = last.from_config(config, trust_remote_code=trust_remote_code)
    check_device_map(device_map, (name for name, _ in skeleton.named_modules()),
                     (name for name, _ in skeleton.named_parameters()))


def _model_classes(config: Any) -> list[Any]:
    """The Auto classes to try in order: the sequence classifier where the config names one, else the causal LM
    first, except for encoders (masked-LM architectures not configured as decoders: BERT & co. have a *ForCausalLM
    class, but only as a decoder) and encoder-decoders (the sequence-to-sequence LM), then the bare model."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if any(str(name).endswith("ForSequenceClassification") for name in getattr(config, "architectures", None) or []):
        return [AutoModelForSequenceClassification, AutoModel]
    if getattr(config, "is_encoder_decoder", False):  # BART has a *ForCausalLM class too: its decoder alone
        return [AutoModelForSeq2SeqLM, AutoModel]
    encoder = config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)
    return [AutoModel] if encoder else [AutoModelForCausalLM, AutoModel]


def from_pretrained(source: str, dtype: torch.dtype, placement: dict[str, Any] | None = None, *,
                    trust_remote_code: bool = False, **kwargs: Any) -> nn.Module:
    """The first of `_model_classes` that loads; `placement`: device_map, offload_folder, max_memory."""
    from transformers import AutoConfig

    with remote_code_refused(source), loading_bars_off():
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
        if refuses_encoder_decoder(config):  # whisper would load as its decoder alone
            raise ProbeError(encoder_decoder_refusal(config.model_type), parameter="spec")
        placement = {key: value for key, value in (placement or {}).items() if value is not None}
        if isinstance(placement.get("device_map"), dict):
            _check_placement(config, placement["device_map"], trust_remote_code)
        *first, last = _model_classes(config)
        for auto in first:
            try:
                return auto.from_pretrained(source, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                            **kwargs, **placement)
            except ValueError as error:
                if "Unrecognized configuration class" not in str(error):
                    raise
        return last.from_pretrained(source, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                    **kwargs, **placement)


SAMPLE_TEXT = "The quick brown fox jumps over the lazy dog while seven curious birds sing."
MIN_DISTINCT_IDS = 4


def encodes_text(tokenizer: Any) -> bool:
    """Whether the tokenizer turns a plain English sentence into at least a few distinct non-special ids: a folder
    without tokenizer files gives a placeholder (GPT-2: one token, nothing encoded; BERT: five, all [UNK])."""
    try:
        ids = tokenizer(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    except Exception:
        return False
    special = {i for i in getattr(tokenizer, "all_special_ids", []) if i is not None}
    return len(set(ids) - special) >= MIN_DISTINCT_IDS


def load_tokenizer(source: str, *, trust_remote_code: bool = False, **kwargs: Any) -> Any | None:
    """The folder's tokenizer, or None where none loads or encodes text (probe sets then use random tokens)."""
    from transformers import AutoTokenizer

    try:
        with remote_code_refused(source):
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if not encodes_text(tokenizer):
        warnings.warn(f"the tokenizer of {source} cannot encode text ({len(tokenizer)} tokens; no tokenizer files?): "
                      "probe uses random tokens in place of text", stacklevel=2)
        return None
    return tokenizer
