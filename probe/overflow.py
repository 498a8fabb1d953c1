"""A forward that stops being finite (float16 ends at 65504): its results refused in one line, saying where (one more
forward, hooked, only after the check failed, which reads a value fetched anyway) and what to load instead."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.hooks.restore import restoring
from probe.hooks.run import run_model
from probe.provenance import module_dtype


class NotFiniteError(ProbeError):
    """The model's own forward gave NaN or infinity where probe needs a number (a baseline)."""


def _has_non_finite(value: Any, bad: Callable[[Tensor], Tensor] = lambda t: ~torch.isfinite(t)) -> bool:
    """Whether a module's output (tensors anywhere inside it) holds a value `bad` marks (NaN or infinity by default)."""
    if isinstance(value, Tensor):
        return value.is_floating_point() and bool(bad(value).any())
    if isinstance(value, dict):
        return any(_has_non_finite(item, bad) for item in value.values())
    if isinstance(value, (tuple, list)):
        return any(_has_non_finite(item, bad) for item in value)
    return False


def _nan_or_positive_inf(tensor: Tensor) -> Tensor:
    """What an overflow hands on, but an attention mask does not hold (masks add -inf or the dtype's minimum)."""
    return tensor.isnan() | tensor.isposinf()


def first_non_finite(model: nn.Module, run: Callable[[], Any]) -> str | None:
    """The first module to finish with a NaN or infinity during `run()` (the innermost around the overflow), or None."""
    names = {id(module): name or type(module).__name__ for name, module in model.named_modules()}
    found: list[str] = []

    def look(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not found and _has_non_finite(output) and not _has_non_finite((args, kwargs), _nan_or_positive_inf):
            found.append(names.get(id(module), type(module).__name__))

    with restoring() as undo:
        for module in model.modules():
            undo.append(module.register_forward_hook(look, with_kwargs=True).remove)
        with torch.no_grad():
            run()
    return found[0] if found else None


def _advice(dtype: str) -> str:
    """What to load instead, for `dtype` as provenance names it (a mix, 'bfloat16+float16', by its narrowest)."""
    kinds = dtype.split("+")
    if "float16" in kinds:
        return ("float16 ends at 65504 and this model's values pass it; load it with dtype bfloat16 (float32's range "
                "at float16's size) or float32")
    if "bfloat16" in kinds:
        return "try dtype float32; if that is not finite either, the model's weights or inputs are broken"
    return "its weights or inputs are broken"


def _site(model: nn.Module, runs: Iterable[Callable[[], Any]]) -> str | None:
    """The first module of the first of `runs` (each one forward) whose output is not finite."""
    return next((found for found in (first_non_finite(model, run) for run in runs) if found is not None), None)


def not_finite(what: str, model: nn.Module, runs: Iterable[Callable[[], Any]] = (), *,
               site: str | None = None) -> NotFiniteError:
    """The refusal of a baseline that is not finite: where the forward first was not, and what to do for its dtype."""
    site = site or _site(model, runs)
    dtype = module_dtype(model)
    where = f" (first in {site})" if site is not None else ""
    return NotFiniteError(f"{what} came out NaN or infinite, because the model's own {dtype} forward does{where}: "
                          f"{_advice(dtype)}", parameter="dtype")


def overflowed(what: str, model: nn.Module, runs: Iterable[Callable[[], Any]]) -> NotFiniteError | None:
    """The refusal of results holding NaN where one of `runs` goes non-finite; None: the NaN are the results' own."""
    site = _site(model, runs)
    return None if site is None else not_finite(what, model, site=site)


def require_finite(value: Tensor | float, what: str, model: nn.Module,
                   runs: Iterable[Callable[[], Any]] = ()) -> None:
    """Refuse (`not_finite`) a baseline `value` with a NaN or an infinity; one host read of `value`."""
    finite = bool(torch.isfinite(torch.as_tensor(value)).all())
    if not finite:
        raise not_finite(what, model, runs)


def forwards(model: nn.Module, ids: Tensor, mask: Tensor | None, batch_size: int) -> list[Callable[[], Any]]:
    """The model's forwards over `ids`, `batch_size` rows at a time: where `not_finite` looks for the overflow."""
    return [partial(run_model, model, ids[start:start + batch_size], None if mask is None else
                    mask[start:start + batch_size]) for start in range(0, ids.shape[0], batch_size)]
