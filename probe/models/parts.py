"""A model's embeddings, typed. `nn.Module` types every attribute it does not declare as `Tensor | Module`, so a
call of transformers' `get_input_embeddings()` / `get_output_embeddings()` on an `nn.Module` needs a cast at each
reader; they ask here instead (a model without them, or whose getter raises, has none)."""

from __future__ import annotations

from torch import nn


def _part(model: nn.Module, getter_name: str) -> nn.Module | None:
    getter = getattr(model, getter_name, None)
    try:
        found = getter() if callable(getter) else None
    except NotImplementedError:  # transformers' base class for a model that has none
        return None
    return found if isinstance(found, nn.Module) else None


def input_embeddings(model: nn.Module) -> nn.Module | None:
    """The token embedding (`get_input_embeddings()`), or None."""
    return _part(model, "get_input_embeddings")


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The LM head (`get_output_embeddings()`), or None."""
    return _part(model, "get_output_embeddings")
