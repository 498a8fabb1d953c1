"""What a model's forward returned (logits, or last hidden states), read one way by loading and every stage."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from probe.errors import ProbeError


def logits_of(output: Any) -> Tensor:
    """The logits (or, for a model without an LM head, the last hidden states) of a forward's output."""
    if isinstance(output, Tensor):
        return output
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    raise ProbeError(f"the model's forward returned {type(output).__name__}: expected logits (batch, seq, vocab) "
                     "or a tuple whose first item is the logits")
