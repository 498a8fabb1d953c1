"""Models wrapped by TransformerLens 4 (`TransformerBridge`) or nnsight: probe probes the Hugging Face module inside,
with the wrapper's tokenizer, and leaves the wrapper working. Each library is one `WrapperKind`, recognised by class
name and module, so that nothing is imported until one of its objects is in hand."""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from probe.errors import ProbeError, first_line


@dataclass(frozen=True)
class WrapperKind:
    """One library's wrapped models: how probe recognises them and finds what it probes."""

    library: str  # what messages and docs call it, with the classes users know: `nnsight (NNsight, LanguageModel)`
    package: str  # the top-level module its classes live in
    classes: tuple[str, ...]  # the classes it takes: any of them in the object's class hierarchy
    model: Callable[[Any], nn.Module]  # the module probe runs, as transformers built it; the wrapper left in eval mode
    tokenizer: Callable[[Any], Any | None]  # the wrapper's tokenizer (None: it has none)
    name: Callable[[Any], str | None]  # a name for reports (None: the model's own config names it)

    def takes(self, obj: Any) -> bool:
        """Whether `obj` is one of this library's wrappers: its class or a base is one of `classes`, from
        `package`; the class's own module says so without importing the library."""
        return any(kind.__module__.split(".")[0] == self.package and kind.__name__ in self.classes
                   for kind in type(obj).__mro__)


WRAPPERS: list[WrapperKind] = []
"""The libraries whose wrapped models `load_model` takes, asked in order."""


def register_wrapper(kind: WrapperKind) -> WrapperKind:
    """Add a library (a package named twice is refused: one kind says how its objects are probed)."""
    if any(known.package == kind.package for known in WRAPPERS):
        raise ValueError(f"a wrapper kind for {kind.package!r} is registered already")
    WRAPPERS.append(kind)
    return kind


def wrapper_of(obj: Any) -> WrapperKind | None:
    """The kind that takes `obj`, or None for anything else (a module, a string)."""
    return next((kind for kind in WRAPPERS if kind.takes(obj)), None)


def unwrapped_view(module: nn.Module, unwrap: Callable[[nn.Module], nn.Module | None],
                   seen: dict[int, nn.Module] | None = None) -> nn.Module:
    """`module` with every wrapper module replaced by the module it wraps (`unwrap`; None: wraps nothing). Modules
    above a wrapper are shallow copies with their own dicts (children, hooks) and methods bound to the copy, sharing
    every tensor, so that what probe sets on them never reaches the wrapped tree."""
    seen = {} if seen is None else seen
    inner = unwrap(module)
    while inner is not None:
        module, inner = inner, unwrap(inner)
    if id(module) in seen:  # a module the model holds twice (tied, shared) stays one module in the view
        return seen[id(module)]
    children = {name: None if child is None else unwrapped_view(child, unwrap, seen)
                for name, child in module._modules.items()}
    view = module
    if any(child is not module._modules[name] for name, child in children.items()):
        view = copy.copy(module)
        for key, value in vars(module).items():
            view.__dict__[key] = copy.copy(value) if isinstance(value, dict | set) else _rebound(value, module, view)
        view._modules.update(children)
    seen[id(module)] = view
    return view


def _rebound(value: Any, old: nn.Module, new: nn.Module) -> Any:
    """`value`, a method or partial bound to `old` (accelerate's `forward` and `_old_forward`), bound to `new`."""
    if isinstance(value, types.MethodType) and value.__self__ is old:
        return types.MethodType(value.__func__, new)
    if isinstance(value, functools.partial) and value.args and value.args[0] is old:
        return functools.update_wrapper(functools.partial(value.func, new, *value.args[1:], **value.keywords), value)
    return value


def _bridge_model(bridge: Any) -> nn.Module:
    """A TransformerBridge's Hugging Face model, its components (attention outside probe's hooks) unwrapped."""
    try:
        model = bridge.original_model
    except AttributeError as error:
        raise ProbeError(f"this TransformerBridge runs no local torch model ({first_line(error)}): probe needs one, "
                         "e.g. a bridge from TransformerBridge.boot_transformers") from error
    bridge.eval()  # the bridge's components and the model's modules alike, before the view copies their flags
    return unbridged(model)


def holds_bridge_components(module: nn.Module) -> bool:
    """Whether a bare module has TransformerBridge components in place of its own modules (a bridge's
    `original_model` given alone): probed as it is, probe's hooks would never fire there."""
    return any(type(child).__module__.startswith("transformer_lens.") for child in module.modules())


def unbridged(model: nn.Module) -> nn.Module:
    """`unwrapped_view` of a model a TransformerBridge has booted (the weights shared, nothing copied)."""
    from transformer_lens.model_bridge.generalized_components.base import GeneralizedComponent

    def original(module: nn.Module) -> nn.Module | None:
        if not isinstance(module, GeneralizedComponent):
            return None
        if not isinstance(module.original_component, nn.Module):
            raise ProbeError(f"the TransformerBridge component {module.name!r} wraps no module of the model: probe "
                             "cannot find the model's own attention there")
        return module.original_component

    return unwrapped_view(model, original)


def _bridge_name(bridge: Any) -> str | None:
    name = getattr(getattr(bridge, "cfg", None), "model_name", None)
    return name if isinstance(name, str) and name else None


def _envoy_model(envoy: Any) -> nn.Module:
    """The module an nnsight model wraps, in place (nnsight's controllers are inert outside a trace), a lazy one
    loaded first; an envoy of a submodule is refused."""
    if envoy.parent is not None:
        raise ProbeError(f"this nnsight envoy is one submodule ({envoy.path}) of a model: give load_model the model")
    if getattr(envoy, "dispatched", True) is False:
        envoy.dispatch()
    model = envoy._module
    if not isinstance(model, nn.Module):
        raise ProbeError(f"this nnsight model wraps a {type(model).__name__}, not a torch module: probe needs one")
    return model


register_wrapper(WrapperKind(
    library="TransformerLens (TransformerBridge)", package="transformer_lens", classes=("TransformerBridge",),
    model=_bridge_model, tokenizer=lambda bridge: getattr(bridge, "tokenizer", None), name=_bridge_name))
register_wrapper(WrapperKind(
    library="nnsight (NNsight, LanguageModel, TransformersModel)", package="nnsight", classes=("Envoy",),
    model=_envoy_model,
    tokenizer=lambda envoy: getattr(envoy, "tokenizer", None), name=lambda envoy: None))
