"""Old import path of `probe.models.placement`, kept for probe.distributed and scripts."""

from probe.models.placement import DeviceMap, check_device_map, dispatch_custom, input_device, parse_device_map

__all__ = ["DeviceMap", "check_device_map", "dispatch_custom", "input_device", "parse_device_map"]
