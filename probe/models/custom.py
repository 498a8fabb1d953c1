"""`FILE.py:FUNCTION`: a custom PyTorch model, made by calling FUNCTION() of that file (which imports and runs it)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from torch import nn

from probe.errors import ProbeError
from probe.reading import is_file


def is_custom_spec(spec: str) -> bool:
    """A `FILE.py:FUNCTION` spec (a path ending in .py, a colon, a name)."""
    return ":" in spec and spec.rpartition(":")[0].endswith(".py")


def _import_file(file: str) -> Any:
    path = Path(file)
    if not is_file(path):
        raise ProbeError(f"model file not found: {file}", parameter="spec")
    module_name = f"probe_custom_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise ProbeError(f"cannot import {file}: it is not a Python file", parameter="spec")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except Exception as error:
        raise ProbeError(f"importing {file} failed: {type(error).__name__}: {error}") from error
    return module


def load_custom(spec: str) -> tuple[nn.Module, Any | None]:
    """`FILE.py:FUNCTION`: FUNCTION() returns an nn.Module or (nn.Module, tokenizer)."""
    file, _, function = spec.rpartition(":")
    factory = getattr(_import_file(file), function, None)
    if not callable(factory):
        raise ProbeError(f"{file} has no function named {function!r}", parameter="spec")
    try:
        result = factory()
    except Exception as error:
        raise ProbeError(f"{spec}() raised {type(error).__name__}: {error}") from error
    tokenizer = None
    if isinstance(result, tuple):
        if len(result) != 2:
            raise ProbeError(f"{spec}() must return an nn.Module or (nn.Module, tokenizer), got a tuple of "
                             f"{len(result)}")
        result, tokenizer = result
    if not isinstance(result, nn.Module):
        raise ProbeError(f"{spec}() must return an nn.Module or (nn.Module, tokenizer), got {type(result).__name__}")
    return result, tokenizer

