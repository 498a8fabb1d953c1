"""Encoder-decoders (T5, BART): their attention layers as three named stacks, and the one place that names them.
Internally layers keep one flat index in call order; users name them by stack and index within it: `enc3`, `dec3`,
`x3` (`--heads x3.1`). Both stacks read each probe-set row, the decoder teacher-forced behind its start token, so
that its logits at t predict token t + 1 as a decoder-only model's do and every metric applies unchanged; a source
of its own goes as `source=(ids, mask)` or a pairs set (probe.inputs.pairs)."""

from __future__ import annotations

from typing import Any

from torch import nn

from probe.errors import ProbeError

STACKS = {"encoder": "enc", "decoder": "dec", "cross": "x"}
"""Stack -> the prefix of its short layer name."""
CROSS_ATTRIBUTES = ("EncDecAttention", "encoder_attn")
"""The attribute a decoder block keeps its cross-attention under (T5, BART)."""


def is_encoder_decoder(model: nn.Module) -> bool:
    """Whether the model is an encoder-decoder (its config says so)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def decoder_start(model: nn.Module) -> int | None:
    """The token an encoder-decoder's decoder starts from (T5: pad, BART: </s>); None for any other model."""
    if not is_encoder_decoder(model):
        return None
    start = getattr(model.config, "decoder_start_token_id", None)
    return start if isinstance(start, int) else None


def stack_of(model: nn.Module, module: nn.Module) -> str:
    """`encoder`, `decoder` or `cross`: which stack an attention module of an encoder-decoder belongs to."""
    encoder = model.get_encoder()  # type: ignore[operator]
    if any(module is inner for inner in encoder.modules()):
        return "encoder"
    name = next(name for name, inner in model.named_modules() if inner is module)
    return "cross" if name.rsplit(".", 1)[-1] in CROSS_ATTRIBUTES else "decoder"


def split_layer_part(text: str, stacks: set[str], item: str, parameter: str = "heads") -> tuple[str, str]:
    """`x3-4` -> ("cross", "3-4"): the layer part of the head (or layer) `item`; a model with stacks needs one, a
    model without takes none."""
    text = text.strip()
    prefix = next((p for p in sorted(STACKS.values(), key=len, reverse=True) if text.lower().startswith(p)), "")
    stack = next((name for name, short in STACKS.items() if short == prefix), "")
    noun, example = ("head", "x3.1") if parameter == "heads" else ("layer", "x3")
    if stacks and stack not in stacks:
        names = ", ".join(f"{STACKS[s]}N" for s in STACKS if s in stacks)
        raise ProbeError(f"{parameter} {item!r}: this encoder-decoder names its layers by stack ({names}), "
                         f"e.g. {example} "
                         f"for cross-attention layer 3{', head 1' if noun == 'head' else ''}", parameter=parameter)
    if not stacks and stack:
        raise ProbeError(f"{parameter} {item!r}: this model has one stack of layers; name a layer by its number, e.g. "
                         f"{example[1:]}", parameter=parameter)
    return stack, text[len(prefix):]


def layer_names(layers: list[Any]) -> list[str] | None:
    """The short name of every layer (`enc0`, ..., `dec0`, `x0`, ...) in flat order, or None for a model of one
    stack, whose layers are plain numbers."""
    if not any(layer.stack for layer in layers):
        return None
    return [f"{STACKS[layer.stack]}{layer.in_stack}" for layer in layers]
