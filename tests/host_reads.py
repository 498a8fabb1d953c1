"""Host reads issued by probe inside a model's forward: what would wait for a GPU there (issue 44: no host
synchronisation inside a forward). Tests have no GPU, so this reads the operations themselves, on any device:

- tensor methods that hand values to Python or the host (`.tolist()`, `.cpu()`, `.numpy()`, `.item()`, `bool(t)`,
  `int(t)`, `float(t)`, `if t:`), seen by a TorchFunctionMode;
- operations whose result's shape depends on the values (`nonzero`, `unique`, `masked_select`, `bincount`, boolean-mask
  indexing, `repeat_interleave` by a tensor) and `_local_scalar_dense` (every `.item()`), seen by a TorchDispatchMode.

Only operations asked for by probe's own code count (the nearest caller outside torch is a file of probe/): Triton's
interpreter copies every argument to the host and back, transformers makes its masks, and neither is probe's. Reads
inside `Batch.memo` are allowed (made once per batch, what every layer of it then reads), as are reads outside the
forward (a read counts where the model's own `nn.Module` call is on the stack).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import probe

PROBE = str(Path(probe.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)
HERE = str(Path(__file__).resolve())
MEMO = str(Path(PROBE) / "heads" / "scores.py")
READS = {"tolist", "cpu", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"}
aten = torch.ops.aten
SHAPE_FROM_VALUES = {aten._local_scalar_dense.default, aten.nonzero.default, aten._unique2.default,
                     aten.unique_consecutive.default, aten.unique_dim.default, aten.masked_select.default,
                     aten.bincount.default, aten.repeat_interleave.Tensor, aten.equal.default}
BOOLEAN_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
                    aten._index_put_impl_.default}


def _probe_caller(model: torch.nn.Module) -> str | None:
    """'file:line function' of the nearest caller outside torch (and this file) where that is probe's code, inside
    the model's forward (None where it is not, or where the read is made inside Batch.memo: once per batch)."""
    frame = sys._getframe(2)
    caller, inside = None, False
    while frame is not None:
        name = frame.f_code.co_filename
        if name == MEMO and frame.f_code.co_name == "memo":
            return None
        if frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is model:
            inside = True
        if caller is None and not name.startswith(TORCH) and name != HERE:
            if not name.startswith(PROBE):
                return None
            caller = f"{name[len(PROBE) + 1:]}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return caller if inside else None


class _State:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.reads: list[str] = []

    def record(self, what: str) -> None:
        caller = _probe_caller(self.model)
        if caller is not None:
            self.reads.append(f"{what} at {caller}")


class _Methods(TorchFunctionMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in READS:
            self.state.record(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _Operations(TorchDispatchMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SHAPE_FROM_VALUES or (func in BOOLEAN_INDEXING and any(
                isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                for index in (args[1] or ()))):
            self.state.record(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads(model: torch.nn.Module) -> Iterator[list[str]]:
    """Within the block, the list of 'operation at probe file:line function' that probe asked for inside the
    model's forwards, outside Batch.memo (empty: nothing would wait for a GPU)."""
    state = _State(model)
    with _Methods(state), _Operations(state):
        yield state.reads
