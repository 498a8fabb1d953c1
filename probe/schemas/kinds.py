"""The published kinds: those declared on their result class (probe.schemas.declare: the class' fields are the
payload's, `to_dict()` and the schema are made from them), listed in DECLARED, and those declared here, one
`register` each, beside a `to_dict()` written by hand. A field such a `to_dict()` gains must be declared here
(tests/test_schemas.py validates every command's file against its schema, and no schema admits an undeclared
field)."""

from __future__ import annotations

from probe.schemas.base import Field, Kind, register
from probe.schemas.common import (DTYPE, HEAD, HEAD_COLUMNS, LAYER, LAYER_NAMES, MODEL, NAME, NUMBER, SECONDS)

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

# steer --------------------------------------------------------------------------------------------------------------

register(Kind(
    "steer", 3, "probe.steering:SteerResult",
    "Steering through single heads: the metric against an intervention's value per head (scale: alpha), every head "
    "ranked at one value, greedy continuations (probe steer --json).",
    fields={
        "kind": Field("string", "steer"), "model": MODEL, "dtype": DTYPE, "metric": Field("string", "the metric"),
        "metric_description": Field("string", "what it measures"),
        "measure": Field("string", "what every value is: the metric itself, or, for a metric that is minus a "
                                   "quantity (logit_diff, task_margin), that quantity (logit difference, task margin), "
                                   "so that higher is more of the behaviour"),
        "data": Field("string", "what it was run on"),
        "baseline": Field("number", "the measure of the model as it is"),
        "baseline_figures": Field(("object", "null"), "task sets: the baseline's margin and accuracy"),
        "intervention": Field("string", "the intervention (a registered ablation method that takes a value: scale, "
                                        "...)"),
        "parameter": Field("string", "what its values are (scale: alpha)"),
        "values": Field("array", "the intervention's values of the curves", items=NUMBER),
        "curves": Field("array", "per head: the measure at each value", items=Field("object", "a head", fields={
            "layer": LAYER, "head": HEAD, "points": Field("array", "setting, value, delta, figures")})),
        "find": Field(("object", "null"), "--find: the setting, the path, every head ranked by |delta|"),
        "generations": Field(("object", "null"), "greedy continuations per head and setting"),
        "layer_names": Field(("array", "null"), "encoder-decoders' layer names"), "seconds": SECONDS,
    },
    rows="one per head and setting (the curves; --find: its ranking at its setting)",
    columns={**HEAD_COLUMNS, "setting": Field("number", "the intervention's value (scale: the alpha the head's "
                                                         "output is multiplied by)"),
             "value": Field("number", "the measure"), "delta": Field("number", "value - baseline")},
    column_patterns={r"^(margin|accuracy)$": Field("number", "task sets: the margin or accuracy")},
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
