"""The boolean masks transformers makes for `probe_sdpa`, recognised where they are padding, causal and a sliding
window, so that a fused kernel gets each sequence's key mask (b, kv) and the window as an int instead of the
(b, 1, n, kv) mask made additive.

The mask function probe registers for `probe_sdpa` (probe.hooks.transformers_api.noting_sdpa_mask) makes the mask as
transformers does and, where its arguments show what it was made from (the batch's 2-D padding mask or none, causal
or not, the config's sliding window, no cache), notes that structure on the mask tensor itself. Nothing is read from
the device: the structure comes from the arguments, not the values. Any other mask (packed sequences, chunked
attention, image tokens seeing each other, a cache) is not noted and goes to the backend dense, as before.
"""

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
    """The structure noted on this mask tensor when it was made, or None (not made by probe's mask function, or not
    one of the recognised forms)."""
    return None if mask is None else mask.__dict__.get(NOTE)


def note_structure(mask: Tensor, padding: Tensor | None, q_length: int | None, causal: bool,
                   window: int | None) -> None:
    """Note on a (b, 1, n, kv) boolean mask that it hides the keys the 2-D padding mask `padding` (b, >= kv) hides
    (none where None), later keys where `causal`, keys `window` or more before the query where given; nothing where
    the mask is of another shape or dtype, or its queries are not its keys (a cache)."""
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
