"""Models larger than one device: accelerate's device maps, for Hugging Face models and custom ones alike. probe's
hooks run inside the attention modules' forward, on tensors accelerate has moved already; what cares is where the
input ids go (`input_device`), since with offloading the first parameter can be on 'meta'."""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from probe.errors import ProbeError, first_line
from probe.reading import is_file, loads

DeviceMap = str | dict[str, int | str]
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
"""accelerate's strategies: fill the GPUs evenly (auto, balanced), spare GPU 0, or fill them in order."""
_OFF_DEVICE = ("cpu", "disk", "meta")


def parse_device_map(value: DeviceMap | None) -> DeviceMap | None:
    """A strategy name, a JSON object (inline or a .json file) of module -> device, or a dict; checked shallowly."""
    if value is None or isinstance(value, dict):
        mapping = value
    elif value in STRATEGIES:
        return value
    else:
        text = value.strip()
        if not text.startswith("{"):
            path = Path(text)
            if not is_file(path):
                raise ProbeError(f"device_map {value!r}: use one of {', '.join(STRATEGIES)}, a JSON object of "
                                 "module -> device, or a .json file holding one", parameter="device_map")
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise ProbeError(f"device_map {value!r} cannot be read as UTF-8 text: {error}",
                                 parameter="device_map") from None
        try:
            mapping = loads(text)
        except json.JSONDecodeError as error:
            raise ProbeError(f"device_map is not valid JSON: {error}", parameter="device_map") from error
        if not isinstance(mapping, dict):
            raise ProbeError("device_map must be a JSON object of module -> device, e.g. "
                             '{"model.embed_tokens": 0, "model.layers.0": 1, "lm_head": "cpu"}', parameter="device_map")
    if mapping is None:
        return None
    if not mapping:
        raise ProbeError("device_map is an empty object: name at least one module (\"\" is the whole model)",
                         parameter="device_map")
    checked: dict[str, int | str] = {}
    for name, device in mapping.items():
        if isinstance(device, bool) or not isinstance(device, (int, str)):
            raise ProbeError(f"device_map: device of {name!r} must be a GPU index, 'cpu', 'disk' or a torch "
                             f"device string, got {device!r}", parameter="device_map")
        if isinstance(device, str) and device not in _OFF_DEVICE:
            try:
                torch.device(device)
            except RuntimeError as error:
                raise ProbeError(f"device_map: {device!r} (for {name!r}) is not a device",
                                 parameter="device_map") from error
        checked[str(name)] = device
    return checked


def check_device_map(device_map: dict[str, int | str], module_names: Iterable[str],
                     parameter_names: Iterable[str]) -> None:
    """Every key names a module and every parameter gets a device, else one line (accelerate only warns)."""
    modules = set(module_names) | {""}
    for name in device_map:
        if name not in modules:
            close = sorted(m for m in modules if m and (m.endswith(name) or name.endswith(m)))
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ProbeError(f"device_map names {name!r}, which is not a module of this model{hint}",
                             parameter="device_map")
    for parameter in parameter_names:
        if not any(key == "" or parameter == key or parameter.startswith(key + ".") for key in device_map):
            raise ProbeError(f"device_map gives no device to parameter {parameter!r}: add its module "
                             "(or a parent of it) to the map", parameter="device_map")


def input_device(model: nn.Module) -> torch.device:
    """Where a forward's inputs go: a device map's first GPU, else the first parameter's device not 'meta', else cpu."""
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict) and device_map:
        for device in device_map.values():
            if not (isinstance(device, str) and device in _OFF_DEVICE):
                return torch.device(device)
        return torch.device("cpu")
    for parameter in model.parameters():
        if parameter.device.type != "meta":
            return parameter.device
    return torch.device("cpu")


def placed(model: nn.Module, dtype: torch.dtype, placement: dict[str, Any] | None) -> nn.Module:
    """A model in memory cast to `dtype`, and placed with accelerate's hooks where a device map is given; a strategy
    keeps every nn.ModuleList item whole (a custom forward may add tensors computed inside one block)."""
    model = model.to(dtype)
    if placement is None or placement.get("device_map") is None:
        return model
    device_map, offload_folder = placement["device_map"], placement.get("offload_folder")
    max_memory = placement.get("max_memory")
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if isinstance(device_map, str):  # accelerate must not split the items of its ModuleLists
        blocks = {type(child).__name__ for module in model.modules() if isinstance(module, nn.ModuleList)
                  for child in module}
        no_split = sorted(blocks | set(getattr(model, "_no_split_modules", None) or []))
        if device_map in ("auto", "balanced", "balanced_low_0"):
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             low_zero=device_map == "balanced_low_0")
        chosen = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    else:
        check_device_map(device_map, (name for name, _ in model.named_modules()),
                         (name for name, _ in model.named_parameters()))
        chosen = dict(device_map)
    folder = None
    if "disk" in chosen.values():
        if offload_folder is None:
            raise ProbeError("the device map puts modules on disk: give an offload folder (offload_folder=DIR)",
                             parameter="offload_folder")
        # accelerate reuses any index.json it finds in offload_dir, even one another model wrote: offload this
        # model's weights into a fresh folder of its own, removed when the model is
        Path(offload_folder).mkdir(parents=True, exist_ok=True)
        folder = tempfile.mkdtemp(dir=offload_folder, prefix="probe-offload-")
        weakref.finalize(model, shutil.rmtree, folder, True)
    try:
        # nn.MultiheadAttention's own forward reads out_proj.weight without calling out_proj: its offloaded
        # weights must be brought in with the parent's
        return dispatch_model(model, device_map=chosen, offload_dir=folder,
                              preload_module_classes=["MultiheadAttention"])
    except (ValueError, RuntimeError, KeyError) as error:
        first = first_line(error) or type(error).__name__
        raise ProbeError(f"cannot place the model with this device_map: {first}", parameter="device_map") from error

