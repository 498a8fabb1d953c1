"""Host reads issued by probe inside a model's forward: what would wait for a GPU there (issue 44: no host
synchronisation inside a forward). Tests have no GPU, so this reads the operations themselves, on any device:

- tensor methods that hand values to Python or the host (`.tolist()`, `.cpu()`, `.numpy()`, `.item()`, `bool(t)`,
  `int(t)`, `float(t)`, `if t:`), seen by a TorchFunctionMode;
- operations whose result's shape depends on the values (`nonzero`, `unique`, `masked_select`, `bincount`, boolean-mask
  indexing, `repeat_interleave` by a tensor) and `_local_scalar_dense` (every `.item()`), seen by a TorchDispatchMode.

- blocking copies to the device of host data (a GPU's stream waits for each): `.to(device)` of a tensor made before
  the forward (the batch's tokens and masks; a tensor any operation made inside the forward counts as the device's),
  `torch.tensor(..., device=...)`, and a Python list as an index (sent to the device as a tensor). A copy with
  `non_blocking=True` does not wait and is allowed.

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
from torch.utils.weak import WeakTensorKeyDictionary

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
        self.forward = False  # set by the model's forward pre-hook, cleared by its forward hook
        self.made = WeakTensorKeyDictionary()  # tensors made inside a forward: the device's

    def record(self, what: str) -> None:
        caller = _probe_caller(self.model)
        if caller is not None:
            self.reads.append(f"{what} at {caller}")


class _Methods(TorchFunctionMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name, kwargs = getattr(func, "__name__", ""), kwargs or {}
        if name in READS:
            self.state.record(f"Tensor.{name}")
        elif self.state.forward and _sent_to_device(self.state, name, args, kwargs):
            self.state.record(f"{name}: host data sent to the device, blocking")
        return func(*args, **kwargs)


def _sent_to_device(state: _State, name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether this call copies host data to the device and waits (on a GPU): see the module docstring."""
    if name in ("tensor", "as_tensor"):
        return kwargs.get("device") is not None
    if name in ("__getitem__", "__setitem__"):
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any(isinstance(part, list) for part in index)
    if name != "to" or kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    device = any(isinstance(arg, (torch.device, str, torch.Tensor)) for arg in args[1:]) or "device" in kwargs
    return device and isinstance(args[0], torch.Tensor) and args[0] not in state.made


class _Operations(TorchDispatchMode):
    def __init__(self, state: _State) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in SHAPE_FROM_VALUES or (func in BOOLEAN_INDEXING and any(
                isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                for index in (args[1] or ()))):
            self.state.record(str(func))
        out = func(*args, **(kwargs or {}))
        if self.state.forward:
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor):
                    self.state.made[tensor] = True
        return out


@contextmanager
def host_reads(model: torch.nn.Module) -> Iterator[list[str]]:
    """Within the block, the list of 'operation at probe file:line function' that probe asked for inside the
    model's forwards, outside Batch.memo (empty: nothing would wait for a GPU)."""
    state = _State(model)

    def enter(*_: Any) -> None:
        state.forward = True

    def leave(*_: Any) -> None:  # not called where a BaseException ends the forward (score_heads' early stop): the
        state.forward = False  # flag then stays set, and tensors made after count as the device's (fewer reports)

    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    try:
        with _Methods(state), _Operations(state):
            yield state.reads
    finally:
        for handle in handles:
            handle.remove()
