"""The payload of each published kind as a TypedDict (`to_dict()`, or its JSON file read back), generated from the
kinds' declarations by docs/_build/payload_types.py (`python docs/_build/generate.py`): never edit it by hand. Reports
name these types for the type checker only (`if TYPE_CHECKING:`), so that a field read by a report is a field its
kind declares."""

from __future__ import annotations

import sys
from typing import Any

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:
    from typing_extensions import NotRequired, TypedDict


class Header(TypedDict):
    """What a file of any kind starts with (a payload from `to_dict()` has none of it)."""

    schema: NotRequired[str]
    schema_version: NotRequired[int]
    provenance: NotRequired[dict[str, Any]]


class AblatePayload(Header):
    model: str
    method: str
    data: str
    metric: str
    metric_description: str
    baseline_loss: float
    heads: list[dict[str, Any]]
    n_layers: int
    n_heads: int
    mode: str
    path: str
    dtype: str
    layer_names: NotRequired[list[str]]
    groups: NotRequired[list[dict[str, Any]]]
    mean: NotRequired[str]
    probe_set: NotRequired[dict[str, Any]]
    seconds: NotRequired[float]
    forward_equivalents: NotRequired[float]
    baseline_task: NotRequired[dict[str, Any]]


class AtlasPayloadStagesItem(TypedDict):
    name: str
    seconds: float
    note: str


class AtlasPayloadHeadsItem(TypedDict):
    layer: int
    head: int
    classes: list[Any]
    status: str
    pattern: str | None
    metrics: dict[str, float]
    examples: list[Any]
    writes: list[Any]
    partners: dict[str, Any]
    effects: dict[str, Any]
    task: dict[str, Any] | None
    self_repair: dict[str, Any] | None


class AtlasPayload(Header):
    model: str
    n_layers: int
    n_heads: int
    dtype: str
    layer_names: NotRequired[list[str]]
    settings: dict[str, Any]
    stages: list[AtlasPayloadStagesItem]
    classes: dict[str, dict[str, Any]]
    metrics: dict[str, str]
    evidence: dict[str, Any]
    summary: dict[str, Any]
    heads: list[AtlasPayloadHeadsItem]


class CircuitsPayloadInductionHeadsItem(TypedDict):
    layer: int
    head: int
    induction_score: float
    feeders: list[Any]
    checked: dict[str, Any] | None
    second_copy_deltas: dict[str, Any]
    interaction: float


class CircuitsPayload(Header):
    model: str
    dtype: str
    random_baseline: float
    folded_norm: str | None
    rotary_ignored: bool
    seconds: float
    baseline_second_copy_loss: float | None
    induction_heads: list[CircuitsPayloadInductionHeadsItem]
    previous_token_pairs: dict[str, Any]


class ClassifyPayloadFlaggedValueItem(TypedDict):
    layer: int
    head: int
    score: float


class ClassifyPayloadHeadsItem(TypedDict):
    layer: int
    head: int
    scores: dict[str, float]
    labels: list[str]


class ClassifyPayload(Header):
    model: str
    n_layers: int
    n_heads: int
    layer_names: NotRequired[list[str]]
    path: NotRequired[str]
    dtype: str
    thresholds: dict[str, float]
    classes: dict[str, dict[str, Any]]
    probe_sets: dict[str, dict[str, Any]]
    flagged: dict[str, list[ClassifyPayloadFlaggedValueItem]]
    not_applicable: NotRequired[dict[str, Any]]
    heads: list[ClassifyPayloadHeadsItem]


class ComparePayloadA(TypedDict):
    source: str
    format: str
    score: str
    convention: str
    n_layers: int
    columns: int
    n_heads: int | None
    n_kv_heads: int | None
    dtype: str | None
    model: str | None
    label_name: str | None
    threshold: float
    quantity: str | None
    unit: str | None
    signed: bool


ComparePayloadB = ComparePayloadA


class ComparePayloadDtypes(TypedDict):
    a: str | None
    b: str | None


class ComparePayloadTopK(TypedDict):
    k: int
    count: int
    jaccard: float
    both: list[list[int]]
    only_a: list[list[int]]
    only_b: list[list[int]]


class ComparePayloadLabelled(TypedDict):
    count: int
    jaccard: float
    both: list[list[int]]
    only_a: list[list[int]]
    only_b: list[list[int]]
    a: str | None
    b: str | None
    count_a: int
    count_b: int


class ComparePayloadMoversItem(TypedDict):
    layer: int
    head: int
    a: float
    b: float
    difference: float
    rank_a: int | None
    rank_b: int | None
    rank_difference: int | None
    label_a: bool | None
    label_b: bool | None


ComparePayloadRowsItem = ComparePayloadMoversItem


class ComparePayload(Header):
    kind: str
    measure: str
    a: ComparePayloadA
    b: ComparePayloadA
    conversion: str
    convention: str
    n_layers: int
    heads_per_layer: int
    dtype: str | None
    dtypes: ComparePayloadDtypes
    heads: int
    spearman: float
    pearson: float
    mean_abs_difference: float
    max_abs_difference: float
    top_k: ComparePayloadTopK
    labelled: ComparePayloadLabelled | None
    movers: list[ComparePayloadMoversItem]
    rows: list[ComparePayloadMoversItem]


class DlaPayloadIdentity(TypedDict):
    sum: float
    max_residual: float
    rounding_bound: float | None


class DlaPayloadComponents(TypedDict):
    embeddings: float
    heads: float
    attention_biases: float
    mlps: list[float]
    final_bias: float


class DlaPayloadHeadsItem(TypedDict):
    layer: int
    head: int
    dla: float


class DlaPayload(Header):
    model: str
    source: str
    metric: str
    points: int
    n_layers: int
    n_heads: int
    capped: bool
    logit_diff: float
    logit_diff_corrupt: float | None
    dtype: str
    identity: DlaPayloadIdentity
    components: DlaPayloadComponents
    heads: list[DlaPayloadHeadsItem]
    per_position: dict[str, Any] | None
    self_repair: NotRequired[SelfRepairPayload]


class HeatmapPayloadHeadsItem(TypedDict):
    layer: int
    head: int
    name: str
    weights: list[list[float]]


class HeatmapPayload(Header):
    model: str
    dtype: str
    source: str
    tokens: list[str]
    first: int
    total_tokens: int
    decimals: int
    causal: bool
    note: str
    layer_names: NotRequired[list[str]]
    heads: list[HeatmapPayloadHeadsItem]


class KvBudgetPayload(Header):
    model: str
    dtype: str
    sink: int
    recent: int
    budget: dict[str, Any] | None
    n_streaming: int
    streaming: list[Any]


class KvHeadsPayloadKvHeadsItem(TypedDict):
    layer: int
    kv_head: int
    label: str
    retrieval: float
    streaming: float
    rank: int
    query_heads: list[int]


class KvHeadsPayloadHeadsItem(TypedDict):
    layer: int
    head: int
    kv_head: int
    retrieval: float
    streaming: float


class KvHeadsPayload(Header):
    model: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    sink: int
    recent: int
    options: dict[str, Any]
    dtype: str
    aggregation: str
    kv_heads: list[KvHeadsPayloadKvHeadsItem]
    heads: list[KvHeadsPayloadHeadsItem]
    order: list[Any]
    n_streaming: int
    needle_accuracy: list[Any]
    curve: dict[str, Any] | None
    budget: dict[str, Any] | None
    duo_full_attention_heads: list[Any]
    seconds: dict[str, Any]


class PatchPayloadHeadsItem(TypedDict):
    layer: int
    head: int
    patch_effect: float
    dla: float | None
    logit_diff: float
    classes: NotRequired[list[Any]]
    kv_head: NotRequired[int]


class PatchPayload(Header):
    model: str
    component: str
    direction: str
    data: str
    clean_logit_diff: float
    corrupt_logit_diff: float
    n_layers: int
    n_heads: int
    n_kv_heads: int
    heads: list[PatchPayloadHeadsItem]
    by_position: list[Any]
    tokens: list[Any]
    mode: str
    path: str
    seconds: float
    dtype: str
    dla_note: NotRequired[str]
    paths: NotRequired[dict[str, Any]]
    layer_names: NotRequired[list[str]]
    self_repair: NotRequired[SelfRepairPayload]


class PrunePayloadCurvesItem(TypedDict):
    ordering: str
    seed: int | None
    stopped: str
    kept_mask: list[Any]
    steps: list[dict[str, Any]]


class PrunePayload(Header):
    model: str
    metric: str
    method: str
    data: str
    units: str
    n_units: int
    n_layers: int
    n_heads: int
    dtype: str
    measured_on: str
    baseline_loss: float
    step: float
    max_loss: float | None
    seconds: float
    costs: dict[str, Any]
    note: str | None
    curves: list[PrunePayloadCurvesItem]
    layer_names: NotRequired[list[str]]


class QkPayloadComponentsItem(TypedDict):
    name: str
    kind: str
    layer: int | None
    head: int | None


class QkPayloadViewsScoreTopPairsItem(TypedDict):
    query: int
    key: int
    value: float


class QkPayloadViewsScoreGroupsKindItem(TypedDict):
    group: str
    query: float
    key: float


QkPayloadViewsScoreGroupsLayerItem = QkPayloadViewsScoreGroupsKindItem


class QkPayloadViewsScoreGroups(TypedDict):
    kind: list[QkPayloadViewsScoreGroupsKindItem]
    layer: list[QkPayloadViewsScoreGroupsKindItem]


class QkPayloadViewsScore(TypedDict):
    model_score: float
    sum: float
    points: int
    max_residual: float
    rounding_bound: float
    query: list[float]
    key: list[float]
    top_pairs: list[QkPayloadViewsScoreTopPairsItem]
    groups: QkPayloadViewsScoreGroups
    matrix: list[list[float]]


QkPayloadViewsContrastTopPairsItem = QkPayloadViewsScoreTopPairsItem


QkPayloadViewsContrastGroupsKindItem = QkPayloadViewsScoreGroupsKindItem


QkPayloadViewsContrastGroupsLayerItem = QkPayloadViewsScoreGroupsKindItem


QkPayloadViewsContrastGroups = QkPayloadViewsScoreGroups


QkPayloadViewsContrast = QkPayloadViewsScore


class QkPayloadViews(TypedDict):
    score: QkPayloadViewsScore
    contrast: QkPayloadViewsScore


class QkPayload(Header):
    model: str
    layer: int
    head: int
    kv_head: int
    n_layers: int
    n_heads: int
    source: str
    rule: str
    query: int | None
    key: int | None
    dtype: str
    components: list[QkPayloadComponentsItem]
    views: QkPayloadViews


class SelfRepairPayloadHeadsItem(TypedDict):
    layer: int
    head: int
    total: float
    direct: float
    self_repair: float
    repaired: float | None
    by_heads: float
    by_mlps: float
    by_norm: float
    compensating: list[dict[str, Any]]


class SelfRepairPayload(Header):
    model: str
    source: str
    metric: str
    method: str
    reference: str
    dtype: str
    points: int
    n_layers: int
    n_heads: int
    compensation_unit: str
    path: str
    repair_floor: float
    heads: list[SelfRepairPayloadHeadsItem]


class SteerPayloadCurvesItem(TypedDict):
    layer: int
    head: int
    points: list[Any]


class SteerPayload(Header):
    kind: str
    model: str
    dtype: str
    metric: str
    metric_description: str
    measure: str
    data: str
    baseline: float
    baseline_figures: dict[str, Any] | None
    intervention: str
    parameter: str
    values: list[float]
    curves: list[SteerPayloadCurvesItem]
    find: dict[str, Any] | None
    generations: dict[str, Any] | None
    layer_names: list[Any] | None
    seconds: float


class SyntaxPayloadRelationsItem(TypedDict):
    relation: str
    direction: str
    count: int
    judged: bool
    baseline: float
    baseline_offset: int
    best: list[Any]
    accuracy: list[Any]


class SyntaxPayloadSyntacticItem(TypedDict):
    layer: int
    head: int
    relations: list[Any]


class SyntaxPayload(Header):
    model: str
    scheme: str
    scheme_title: str
    source: str
    causal: bool
    n_layers: int
    n_heads: int
    dtype: str
    sentences: int
    words: int
    min_count: int
    margin: float
    relations: list[SyntaxPayloadRelationsItem]
    syntactic: list[SyntaxPayloadSyntacticItem]
    confident: dict[str, Any]
    skipped: list[Any]
    examples: list[Any]


class TrackPayloadCheckpointsItem(TypedDict):
    name: str
    step: int
    loss: float
    icl_score: float
    heads: list[Any]
    notes: NotRequired[list[Any]]


class TrackPayload(Header):
    model: str
    kind: str
    dtype: str
    n_layers: int
    n_heads: int
    thresholds: dict[str, float]
    classes: dict[str, dict[str, Any]]
    options: dict[str, Any]
    min_rise: float
    heads_ablated: NotRequired[list[Any]]
    checkpoints: list[TrackPayloadCheckpointsItem]
    phase_changes: list[Any]
    icl_change: dict[str, Any] | None
