"""Head maps as the field publishes them, read into one `HeadMap`; `compare(a, b)` of any two; kvpress's view."""

from probe.headmaps.compare import Comparison, align, compare, ranks
from probe.headmaps.formats import FORMATS, HeadFormat, read_map, register_format, write_map
from probe.headmaps.kvpress import kvpress_head_ratio, kvpress_pattern
from probe.headmaps.maps import GROUPINGS, KV, QUERY, HeadMap

__all__ = ["FORMATS", "GROUPINGS", "KV", "QUERY", "Comparison", "HeadFormat", "HeadMap", "align", "compare",
           "kvpress_head_ratio", "kvpress_pattern", "ranks", "read_map", "register_format", "write_map"]
