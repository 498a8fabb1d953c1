"""The published kinds: those declared on their result class (probe.schemas.declare: the class' fields are the
payload's, `to_dict()` and the schema are made from them), listed in DECLARED, and those declared here, one
`register` each, beside a `to_dict()` written by hand. A field such a `to_dict()` gains must be declared here
(tests/test_schemas.py validates every command's file against its schema, and no schema admits an undeclared
field)."""

from __future__ import annotations

from probe.schemas.base import Field, Kind, register
from probe.schemas.common import (CLASSES, DTYPE, HEAD, HEAD_COLUMNS, LAYER, LAYER_NAMES, MODEL, N_HEADS, N_LAYERS,
                                  NAME, NAME_RE, NUMBER, SECONDS, THRESHOLDS, other_than)

DECLARED = (
    "probe.heads.classify:Classification",
    "probe.ablation.results:AblationResult",
    "probe.dla:Attribution",
    "probe.patching.heads:PatchResult",
    "probe.kv.result:KVHeads",
    "probe.selfrepair:SelfRepair",
    "probe.ablation.prune:PruneResult",
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

# atlas --------------------------------------------------------------------------------------------------------------

register(Kind(
    "atlas", 1, "probe.atlas.result:Atlas",
    "Every head of a model: its classes with their evidence, metrics, examples, writes, partners and effects "
    "(probe atlas --json).",
    fields={
        "model": MODEL, "n_layers": N_LAYERS, "n_heads": N_HEADS, "dtype": DTYPE, "layer_names": LAYER_NAMES,
        "settings": Field("object", "the options of the build and the baselines it measured"),
        "stages": Field("array", "each stage run", items=Field("object", "a stage", fields={
            "name": Field("string", "the stage"), "seconds": Field("number", "its wall time"),
            "note": Field("string", "skipped, estimated, ... ('' where nothing to say)")})),
        "classes": CLASSES, "metrics": Field("object", "the metrics the heads have, with what each means",
                                             patterns={NAME_RE: Field("string", "what the metric means")}),
        "evidence": Field("object", "the evidence rules and their thresholds"),
        "summary": Field("object", "counts of labels by support, where pattern and cause disagree"),
        "heads": Field("array", "every head, layer by layer", items=Field("object", "one head's dashboard", fields={
            "layer": LAYER, "head": HEAD,
            "classes": Field("array", "its classes, each with its evidence"),
            "status": Field("string", "the strongest support any of its labels has"),
            "pattern": Field(("string", "null"), "the probe set its pattern is shown on"),
            "metrics": Field("object", "its numbers by metric", patterns={NAME_RE: NUMBER}),
            "examples": Field("array", "where it attends most, in context"),
            "writes": Field("array", "what it writes through the unembedding"),
            "partners": Field("object", "its composition feeders and readers"),
            "effects": Field("object", "its causal effects"),
            "task": Field(("object", "null"), "a task set's effects"),
            "self_repair": Field(("object", "null"), "its self-repair, where measured")})),
    },
    rows="one per head, layer by layer",
    columns=(ATLAS_COLUMNS := {**HEAD_COLUMNS, "status": Field("string", "the strongest support of its labels"),
                               "pattern": Field(("string", "null"), "the probe set of its pattern"),
                               "classes": Field("string", "its classes, comma-separated")}),
    column_patterns={other_than(ATLAS_COLUMNS): Field("number", "a metric of the head (a column per metric: the "
                                                                "atlas' metrics)")},
))

# track --------------------------------------------------------------------------------------------------------------

register(Kind(
    "track", 1, "probe.track.result:TrackResult",
    "Heads across training: every checkpoint's head scores, loss and ICL score, and the phase changes "
    "(probe track --json).",
    fields={
        "model": MODEL, "kind": Field("string", "how the checkpoints were given: folders, revisions, state_dicts"),
        "dtype": DTYPE, "n_layers": N_LAYERS, "n_heads": N_HEADS, "thresholds": THRESHOLDS, "classes": CLASSES,
        "options": Field("object", "the options of the run, and the run's checkpoints"),
        "min_rise": Field("number", "the smallest rise that counts as a phase change"),
        "heads_ablated": Field("array", "--heads: the heads whose ablation delta is tracked", required=False),
        "checkpoints": Field("array", "each checkpoint in step order", items=Field("object", "a checkpoint", fields={
            "name": Field("string", "its file, folder or revision"), "step": Field("integer", "its step"),
            "loss": Field("number", "the probe text's loss"),
            "icl_score": Field("number", "the in-context learning score (null where the context is too short)"),
            "heads": Field("array", "every head's scores (and delta)"),
            "notes": Field("array", "what to know of it", required=False)})),
        "phase_changes": Field("array", "per class, the interval of the best head's largest rise"),
        "icl_change": Field(("object", "null"), "where the ICL score changes most"),
    },
    rows="one per checkpoint and head",
    columns=(TRACK_COLUMNS := {
        "checkpoint": Field("string", "the checkpoint's name"), "step": Field("integer", "its step"),
        "loss": Field("number", "its loss"), "icl_score": Field("number", "its ICL score"), **HEAD_COLUMNS,
        "delta": Field("number", "--heads: the head's ablation delta", required=False)}),
    column_patterns={other_than(TRACK_COLUMNS): Field("number", "the head's score of this class at this checkpoint")},
))

# syntax -------------------------------------------------------------------------------------------------------------

register(Kind(
    "syntax", 1, "probe.syntax.result:SyntaxResult",
    "Syntactic heads: per dependency relation and direction, each head's accuracy against the best positional "
    "baseline (probe syntax --json).",
    fields={
        "model": MODEL, "scheme": Field("string", "the dependency scheme"),
        "scheme_title": Field("string", "its title"), "source": Field("string", "the parsed corpus"),
        "causal": Field("boolean", "whether the model is causal (a dependent sees only earlier words)"),
        "n_layers": N_LAYERS, "n_heads": N_HEADS, "dtype": DTYPE, "sentences": Field("integer", "sentences read"),
        "words": Field("integer", "words read"), "min_count": Field("integer", "arcs a relation needs to be judged"),
        "margin": Field("number", "how far above the baseline a syntactic head's accuracy is"),
        "relations": Field("array", "each relation and direction", items=Field("object", "a relation", fields={
            "relation": Field("string", "the relation"), "direction": Field("string", "dep->head or head->dep"),
            "count": Field("integer", "its arcs"), "judged": Field("boolean", "count >= min_count"),
            "baseline": Field("number", "the best fixed-offset accuracy"),
            "baseline_offset": Field("integer", "that offset"), "best": Field("array", "the best heads"),
            "accuracy": Field("array", "every head's accuracy, layers x heads")})),
        "syntactic": Field("array", "the heads syntactic for some relation", items=Field("object", "a head", fields={
            "layer": LAYER, "head": HEAD, "relations": Field("array", "'relation direction' names")})),
        "confident": Field("object", "the share of confident rows per head"),
        "skipped": Field("array", "what was skipped and why"),
        "examples": Field("array", "sentences with their arcs and each head's hits"),
    },
    rows="one per head and relation (and direction)",
    columns={**HEAD_COLUMNS, "relation": Field("string", "the relation"),
             "direction": Field("string", "dep->head or head->dep"), "count": Field("integer", "its arcs"),
             "judged": Field("boolean", "whether the relation has enough arcs"),
             "accuracy": Field("number", "the head's accuracy on it"),
             "baseline": Field("number", "the best fixed-offset accuracy"),
             "margin": Field("number", "accuracy - baseline"),
             "syntactic": Field("boolean", "judged and above the margin")},
))

# circuits -----------------------------------------------------------------------------------------------------------

register(Kind(
    "circuits", 1, "probe.circuits.pairs:Circuits",
    "Induction heads, their K-composing feeders against the random baseline, and the ablation check "
    "(probe circuits --json).",
    fields={
        "model": MODEL, "dtype": DTYPE,
        "random_baseline": Field("number", "K-composition of random matrices of the same shapes"),
        "folded_norm": Field(("string", "null"), "the norm whose gains were folded into the weights"),
        "rotary_ignored": Field("boolean", "whether rotary embeddings are left out of the scores"),
        "seconds": SECONDS,
        "baseline_second_copy_loss": Field("number", "the second copy's loss, unablated"),
        "induction_heads": Field("array", "each induction head", items=Field("object", "an induction head", fields={
            "layer": LAYER, "head": HEAD, "induction_score": Field("number", "its induction score"),
            "feeders": Field("array", "its strongest K-composing feeders"),
            "checked": Field(("object", "null"), "the feeder ablated with it"),
            "second_copy_deltas": Field("object", "feeder, induction, together: second-copy loss deltas"),
            "interaction": Field("number", "together - feeder - induction")})),
        "previous_token_pairs": Field("object", "the previous-token heads' ranks among the feeders"),
    },
    rows="one per induction head and feeder",
    columns={**HEAD_COLUMNS, "induction_score": Field("number", "the induction head's score"),
             "feeder_layer": Field("integer", "the feeder's layer"), "feeder_head": Field("integer", "its head"),
             "feeder_name": Field("string", "its name (L5H1)"),
             "k_composition": Field("number", "its K-composition into the induction head"),
             "rank_in_layer": Field("integer", "1: the strongest of its layer"),
             "previous_token": Field("boolean", "whether the feeder is a previous-token head")},
))

# steer --------------------------------------------------------------------------------------------------------------

register(Kind(
    "steer", 2, "probe.steering:SteerResult",
    "Steering through single heads: the metric against alpha per head, every head ranked at one alpha, greedy "
    "continuations (probe steer --json).",
    fields={
        "kind": Field("string", "steer"), "model": MODEL, "dtype": DTYPE, "metric": Field("string", "the metric"),
        "metric_description": Field("string", "what it measures"),
        "measure": Field("string", "what every value is: the metric itself, or, for a metric that is minus a "
                                   "quantity (logit_diff, task_margin), that quantity (logit difference, task margin), "
                                   "so that higher is more of the behaviour"),
        "data": Field("string", "what it was run on"),
        "baseline": Field("number", "the measure at alpha 1 (the model as it is)"),
        "baseline_figures": Field(("object", "null"), "task sets: the baseline's margin and accuracy"),
        "alphas": Field("array", "the alphas of the curves", items=NUMBER),
        "curves": Field("array", "per head: the measure at each alpha", items=Field("object", "a head", fields={
            "layer": LAYER, "head": HEAD, "points": Field("array", "alpha, value, delta, figures")})),
        "find": Field(("object", "null"), "--find: the alpha, the path, every head ranked by |delta|"),
        "generations": Field(("object", "null"), "greedy continuations per head and alpha"),
        "layer_names": Field(("array", "null"), "encoder-decoders' layer names"), "seconds": SECONDS,
    },
    rows="one per head and alpha (the curves; --find: its ranking at its alpha)",
    columns={**HEAD_COLUMNS, "alpha": Field("number", "the head's output multiplied by alpha"),
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

# compare ------------------------------------------------------------------------------------------------------------

MAP_HEAD = Field("integer", "the head within its layer: a query head, or a KV head where `convention` is kv")
CELLS = Field("array", "heads as [layer, head], in order", items=Field("array", "[layer, head]",
                                                                        items=Field("integer", "layer, then head")))
OVERLAP = {"count": Field("integer", "heads in both sets"),
           "jaccard": Field("number", "count / heads in either set (undefined where both sets are empty)"),
           "both": CELLS, "only_a": CELLS, "only_b": CELLS}
MAP_FACTS = {
    "source": Field("string", "the file (or DuoAttention folder) as given"),
    "format": Field("string", "the head-map format that read it (docs/compare.md: duo, probe-classify, tensor, ...)"),
    "score": Field("string", "the score read from it (a class, retrieval, full_attention, value, ...)"),
    "convention": Field("string", "what a column is after any conversion: query (heads) or kv (heads)"),
    "n_layers": Field("integer", "layers of the map"),
    "columns": Field("integer", "heads per layer in its convention"),
    "n_heads": Field(("integer", "null"), "query heads per layer, where the file says"),
    "n_kv_heads": Field(("integer", "null"), "KV heads per layer, where the file says"),
    "dtype": Field(("string", "null"), "the dtype of the run that made it, where the file says"),
    "model": Field(("string", "null"), "the model it was made from, where the file says"),
    "label_name": Field(("string", "null"), "what its labelled heads are (full, induction, value > 0.5); null: no "
                                            "labels"),
    "threshold": Field("number", "the threshold its labels came from (null: none)"),
    "quantity": Field(("string", "null"), "what a value measures, as its format declares it (null: the file does "
                                          "not say, as a tensor's)"),
    "unit": Field(("string", "null"), "the unit of a value, where the format knows it"),
    "signed": Field("boolean", "whether its values may be negative (drawn on a scale centred on 0)"),
}
COMPARE_ROW = {
    "layer": LAYER, "head": MAP_HEAD, "a": Field("number", "A's value (null: A has none)"),
    "b": Field("number", "B's value (null: B has none)"),
    "difference": Field("number", "b - a, rounded to 6 places (null where measure is ranks)"),
    "rank_a": Field(("integer", "null"), "the head's rank in A (1: largest) among the heads both maps have"),
    "rank_b": Field(("integer", "null"), "its rank in B"),
    "rank_difference": Field(("integer", "null"), "rank_b - rank_a (negative: B ranks it higher)"),
    "label_a": Field(("boolean", "null"), "whether A labels it (null: A has no labels)"),
    "label_b": Field(("boolean", "null"), "whether B labels it (null: B has no labels)"),
}

register(Kind(
    "compare", 1, "probe.headmaps.compare:Comparison",
    "Two head maps over the same heads (after an explicit conversion where one is over query heads, the other over "
    "KV heads): per-head difference B - A, rank and linear correlation, top-k and labelled overlaps, the heads that "
    "moved most (probe compare --json).",
    fields={
        "kind": Field("string", "compare"),
        "measure": Field("string", "difference (b - a: both maps hold the same kind of score) or ranks (rank B - "
                                   "rank A: different kinds, whose difference would mean nothing)"),
        "a": Field("object", "map A as read", fields=MAP_FACTS),
        "b": Field("object", "map B as read", fields=MAP_FACTS),
        "conversion": Field("string", "how one map was converted to the other's heads ('' where none was)"),
        "convention": Field("string", "the heads compared: query or kv"),
        "n_layers": N_LAYERS,
        "heads_per_layer": Field("integer", "heads per layer compared (query or KV heads, per `convention`)"),
        "dtype": Field(("string", "null"), "the dtype both maps were computed in (null where they differ or neither "
                                           "file says: see dtypes)"),
        "dtypes": Field("object", "each map's dtype, where its file says", fields={
            "a": Field(("string", "null"), "A's"), "b": Field(("string", "null"), "B's")}),
        "heads": Field("integer", "heads with a value in both maps: every statistic is over these"),
        "spearman": Field("number", "Spearman's rank correlation (ties share their mean rank; undefined where a "
                                    "map is constant or fewer than two heads)"),
        "pearson": Field("number", "Pearson's correlation (undefined as Spearman's)"),
        "mean_abs_difference": Field("number", "mean |b - a| (null where measure is ranks)"),
        "max_abs_difference": Field("number", "max |b - a| (null where measure is ranks)"),
        "top_k": Field("object", "the overlap of each map's k largest heads", fields={
            "k": Field("integer", "the top set's size (--top, at most `heads`)"), **OVERLAP}),
        "labelled": Field(("object", "null"), "the overlap of the labelled heads (null unless both maps have labels: "
                                              "their own, or --threshold's)", fields={
            **OVERLAP, "a": Field(("string", "null"), "what A's labels are"),
            "b": Field(("string", "null"), "what B's labels are"),
            "count_a": Field("integer", "heads A labels"), "count_b": Field("integer", "heads B labels")}),
        "movers": Field("array", "the heads of largest |difference| (|rank_difference| where measure is ranks), "
                                 "largest first (15 at most)",
                        items=Field("object", "a head, as in rows", fields=COMPARE_ROW)),
        "rows": Field("array", "every head, layer by layer", items=Field("object", "a head", fields=COMPARE_ROW)),
    },
    rows="one per head compared, layer by layer",
    columns={"layer": LAYER, "head": MAP_HEAD,
             "name": Field("string", "the head's name for a table: L18H6 over query heads, L5KV1 over KV heads (a KV "
                                     "head is no query head)"),
             **{name: entry for name, entry in COMPARE_ROW.items() if name not in ("layer", "head")}},
))

# qk -----------------------------------------------------------------------------------------------------------------

QK_SIDE = Field("array", "each component's contribution on this side, the other side summed (components' order)",
                items=NUMBER)
QK_GROUPS = Field("array", "components grouped, each group's query-side and key-side sums", items=Field(
    "object", "a group", fields={"group": Field("string", "embeddings / heads / MLPs / biases, or embed / L3 / bias"),
                                 "query": NUMBER, "key": NUMBER}))
QK_VIEW = Field("object", "one view's pairs, mean over its points", fields={
    "model_score": Field("number", "the model's own mean (score or contrast)"),
    "sum": Field("number", "the pairs' sum"), "points": Field("integer", "(query, key) points averaged over"),
    "max_residual": Field("number", "max over points of |pairs' sum - the model's own|"),
    "rounding_bound": Field("number", "the bound the model's own rounding allows"),
    "query": QK_SIDE, "key": QK_SIDE,
    "top_pairs": Field("array", "the pairs of largest |contribution|, largest first", items=Field(
        "object", "a pair", fields={"query": Field("integer", "the query-side component (index into components)"),
                                    "key": Field("integer", "the key-side component"), "value": NUMBER})),
    "groups": Field("object", "grouped views", fields={"kind": QK_GROUPS, "layer": QK_GROUPS}),
    "matrix": Field("array", "(components, components): row a query-side component, column a key-side one",
                    items=Field("array", "a query-side component's row", items=NUMBER)),
})
QK_SIDE_COLUMNS = {
    f"{side}{suffix}": Field(kind, f"the {side}-side component's {what}") for side in ("query", "key")
    for suffix, kind, what in (("", "string", "name (L16H0, MLP12, embed, pos, L3 bias, bias)"),
                               ("_kind", "string", "kind: embed, position, head, attention bias, mlp, bias"),
                               ("_layer", "integer", "layer (-1: none)"), ("_head", "integer", "head (-1: none)"))}

register(Kind(
    "qk", 1, "probe.qk:QKAttribution",
    "QK attribution: a head's pre-softmax scores split into pairs of query-side and key-side residual components, "
    "with each side's marginals, grouped views and the check against the model's own scores (probe qk --json).",
    fields={
        "model": MODEL, "layer": LAYER, "head": HEAD, "kv_head": Field("integer", "its key/value head"),
        "n_layers": N_LAYERS, "n_heads": N_HEADS, "source": Field("string", "what it was measured on"),
        "rule": Field("string", "which key each query is read at: a rule's name, or positions (--query/--key)"),
        "query": Field(("integer", "null"), "the query position given (null: the rule's)"),
        "key": Field(("integer", "null"), "the key position given (null: the rule's)"),
        "dtype": DTYPE,
        "components": Field("array", "the residual components, in stream order", items=Field(
            "object", "a component", fields={
                "name": Field("string", "L16H0, MLP12, embed, pos, L3 bias or bias"),
                "kind": Field("string", "embed, position, head, attention bias, mlp or bias"),
                "layer": Field(("integer", "null"), "its layer (null: none)"),
                "head": Field(("integer", "null"), "its head (null: none)")})),
        "views": Field("object", "the score and the contrast (the key's score minus the mean of the query's other "
                                 "keys')", fields={"score": QK_VIEW, "contrast": QK_VIEW}),
    },
    rows="one per (query-side, key-side) component pair",
    columns={**QK_SIDE_COLUMNS, "score": Field("number", "the pair's mean contribution to the score"),
             "contrast": Field("number", "the pair's mean contribution to the contrast")},
))
