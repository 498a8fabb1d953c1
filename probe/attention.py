"""Find a model's attention layers, and hook them: read each head's attention weights, edit each head's output.

The public face of `probe.hooks` (one module per job there): everything goes through one context manager,
`attention_hooks`, which installs what it needs on entry and restores the model exactly on exit.
"""

from probe.hooks.blocked import BLOCK_BYTES, CAUSAL_BLOCK, blocked_attention
from probe.hooks.capture import attention_hooks, capture_attention, stream_attention
from probe.hooks.custom import OUTPUT_PROJECTIONS
from probe.hooks.hf import is_hf_model
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.run import Source, accepts_argument, logits_of, run_model
from probe.hooks.stacks import layer_names
from probe.hooks.types import HeadsEdit, WeightsHook

__all__ = ["BLOCK_BYTES", "CAUSAL_BLOCK", "OUTPUT_PROJECTIONS", "AttentionLayer", "HeadsEdit", "Source", "WeightsHook",
           "accepts_argument", "attention_hooks", "attention_layers", "blocked_attention", "capture_attention",
           "is_hf_model", "layer_names", "logits_of", "run_model", "stream_attention"]
