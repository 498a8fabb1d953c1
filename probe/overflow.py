"""A model forward that stops being finite: refuse its results, saying where it first did and what to load instead.

A half-precision model can overflow in its own forward: float16 ends at 65504, so a large activation or attention
logit becomes infinite and everything after it NaN. Every number probe derives from such a forward (a loss, a logit
difference, a head's share) is then NaN, and a table of NaN says nothing. So a baseline that is not finite is
refused in one line: where the forward first went non-finite (found by one more forward, with a hook on every
module, run only once the check has failed) and what to do. The check itself reads one value the caller fetches to
the host anyway, so a CUDA forward is not made to wait.
"""

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
    """Whether a module's output (a tensor, or tensors inside a tuple, list, dict or model output) holds a value
    `bad` marks: a NaN or an infinity by default."""
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
    """The name of the first module, in the order modules finish, whose output holds a NaN or an infinity during
    `run()` (a forward of `model`); None where every output is finite. A module finishes after the modules it calls,
    so the first one to turn finite inputs into a non-finite output is the innermost around the overflow (an
    attention module's o_proj reads the NaN its softmax made: the attention module is named, not o_proj)."""
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
    """The refusal of a baseline `what` that is not finite: where the model's forward first was not (`site`, else
    the first of `runs` that shows it), and what to do, for the model's dtype."""
    site = site or _site(model, runs)
    dtype = module_dtype(model)
    where = f" (first in {site})" if site is not None else ""
    return NotFiniteError(f"{what} came out NaN or infinite, because the model's own {dtype} forward does{where}: "
                          f"{_advice(dtype)}", parameter="dtype")


def overflowed(what: str, model: nn.Module, runs: Iterable[Callable[[], Any]]) -> NotFiniteError | None:
    """The refusal of results `what` that hold NaN, where one of `runs` shows the model's own forward going
    non-finite; None where every forward is finite (the NaN are the results' own, such as a class that does not
    apply)."""
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
