"""The boolean masks transformers makes for `probe_sdpa`, recognised where they are padding, causal and a sliding
window, so that a fused kernel gets a (b, kv) key mask and an int window instead of a dense additive mask. The
structure is noted on the mask tensor when it is made, from the mask function's arguments: nothing is read from the
device. Any other mask goes to the backend dense."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NOTE = "probe_mask_structure"  # the attribute a recognised mask tensor carries its MaskStructure in


@dataclass(frozen=True)
class MaskStructure:
    """What a recognised mask hides: keys outside `key_mask` (b, kv) bool, later keys where `causal`, keys
    `window` or more before the query where given."""

    key_mask: Tensor
    causal: bool
    window: int | None


def structure_of(mask: Tensor | None) -> MaskStructure | None:
    """The structure noted on this mask tensor when it was made, or None."""
    return None if mask is None else mask.__dict__.get(NOTE)


def note_structure(mask: Tensor, padding: Tensor | None, q_length: int | None, causal: bool,
                   window: int | None) -> None:
    """Note what a (b, 1, n, kv) boolean mask hides (the 2-D `padding`'s keys, later keys where `causal`, keys
    `window` or more back); nothing for another shape or dtype, or a cache."""
    kv_length = int(mask.shape[-1])
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or q_length != kv_length or \
            int(mask.shape[2]) != q_length:
        return
    if padding is None:
        key_mask = torch.ones(mask.shape[0], kv_length, dtype=torch.bool, device=mask.device)
    elif padding.dim() == 2 and padding.shape[0] == mask.shape[0] and padding.shape[1] >= kv_length:
        key_mask = padding[:, :kv_length].to(torch.bool)  # a view of its own: what the dense bias is kept by
    else:
        return
    mask.__dict__[NOTE] = MaskStructure(key_mask, causal, window)
