"""probe: find out what each attention head of a transformer does."""

from probe.attention import attention_hooks, attention_layers, capture_attention
from probe.classify import Classification, classify  # the module first, then the name: probe.classify is the function
from probe.errors import ProbeError
from probe.kv import KVHeads, kv_heads
from probe.models import LoadedModel, load_model

__all__ = ["Classification", "KVHeads", "LoadedModel", "ProbeError", "attention_hooks", "attention_layers",
           "capture_attention", "classify", "kv_heads", "load_model"]
