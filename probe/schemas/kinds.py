"""The published kinds: those declared on their result class (probe.schemas.declare: the class' fields are the
payload's, `to_dict()` and the schema are made from them), listed in DECLARED, and those declared here, one
`register` each, beside a `to_dict()` written by hand. A field such a `to_dict()` gains must be declared here
(tests/test_schemas.py validates every command's file against its schema, and no schema admits an undeclared
field)."""

from __future__ import annotations

from probe.schemas.base import Field, Kind, register
from probe.schemas.common import (DTYPE, HEAD, HEAD_COLUMNS, LAYER, LAYER_NAMES, MODEL, NAME, NUMBER)

DECLARED = (
    "probe.heads.classify:Classification",
    "probe.ablation.results:AblationResult",
    "probe.dla:Attribution",
    "probe.patching.heads:PatchResult",
    "probe.kv.result:KVHeads",
    "probe.selfrepair:SelfRepair",
    "probe.ablation.prune:PruneResult",
    "probe.syntax.result:SyntaxResult",
    "probe.circuits.pairs:Circuits",
    "probe.qk:QKAttribution",
    "probe.headmaps.compare:Comparison",
    "probe.track.result:TrackResult",
    "probe.atlas.result:Atlas",
    "probe.steering:SteerResult",
)
"""The result classes that declare their kind (`module:Class`), imported when the registry is first read."""

for _declared in DECLARED:
    register(_declared)

# kv-heads ---------------------------------------------------------------------------------------------------------

register(Kind(
    "kv-budget", 1, "probe.kv:Budget",
    "The budget file written beside a --export: how the budget was chosen, what was measured, which KV heads "
    "stream.",
    fields={"model": MODEL, "dtype": DTYPE, "sink": Field("integer", "the streaming cache's sink keys"),
            "recent": Field("integer", "its recent keys"),
            "budget": Field(("object", "null"), "the rule, the number streamed, every point measured"),
            "n_streaming": Field("integer", "KV heads that stream"),
            "streaming": Field("array", "the streaming KV heads as [layer, kv_head]")},
    rows="one per point the budget's search measured",
    columns={"k": Field("integer", "KV heads streamed, first k of the order"),
             "loss_change": Field("number", "the loss change with them streamed"),
             "needle_accuracy": Field("number", "the needle accuracy with them streamed"),
             "accepted": Field("boolean", "whether the point is within the budget's rule")},
))

# heatmap ------------------------------------------------------------------------------------------------------------

register(Kind(
    "heatmap", 1, "probe.patterns:Patterns",
    "The shown heads' attention weights on one text (probe heatmap --json): per head a list of query rows.",
    fields={
        "model": MODEL, "dtype": DTYPE, "source": Field("string", "what the tokens are"),
        "tokens": Field("array", "the visible token strings", items=Field("string", "a token")),
        "first": Field("integer", "the position of the first token shown"),
        "total_tokens": Field("integer", "tokens in the input before any cut"),
        "decimals": Field("integer", "decimals the weights are rounded to"),
        "causal": Field("boolean", "whether a query sees only earlier keys"),
        "note": Field("string", "what was cut, if anything"), "layer_names": LAYER_NAMES,
        "heads": Field("array", "each head shown", items=Field("object", "a head", fields={
            "layer": LAYER, "head": HEAD, "name": NAME,
            "weights": Field("array", "query rows of key weights", items=Field("array", "a row", items=NUMBER))})),
    },
    rows="one per head, query and key position",
    columns={**HEAD_COLUMNS, "query": Field("integer", "the query's position"),
             "key": Field("integer", "the key's position"),
             "query_token": Field("string", "the query's token"), "key_token": Field("string", "the key's token"),
             "weight": Field("number", "the attention weight")},
))
