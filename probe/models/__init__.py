"""Loading models (`load_model`), and where a loaded model's inputs go (`placement`)."""

from probe.models.aliases import (ALIASES, DEFAULT_MODEL, HUB_ALIASES, Alias, HubAlias, alias_path, cache_root,
                                  hub_cached, resolve_alias)
from probe.models.load import LoadedModel, check_device, load_model
from probe.models.placement import DeviceMap, input_device, parse_device_map

__all__ = ["ALIASES", "DEFAULT_MODEL", "HUB_ALIASES", "Alias", "DeviceMap", "HubAlias", "LoadedModel", "alias_path",
           "cache_root", "check_device", "hub_cached", "input_device", "load_model", "parse_device_map",
           "resolve_alias"]
