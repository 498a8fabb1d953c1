"""Head maps as the field publishes them (DuoAttention, Retrieval_Head, TransformerLens-style tensors, probe's own
JSON), read into one `HeadMap` with its convention stated, and `compare(a, b)` of any two (docs/compare.md)."""

from probe.headmaps.compare import Comparison, align, compare, ranks
from probe.headmaps.formats import FORMATS, HeadFormat, read_map, register_format, write_map
from probe.headmaps.maps import GROUPINGS, KV, QUERY, HeadMap

__all__ = ["FORMATS", "GROUPINGS", "KV", "QUERY", "Comparison", "HeadFormat", "HeadMap", "align", "compare", "ranks",
           "read_map", "register_format", "write_map"]
