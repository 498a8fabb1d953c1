"""QK attribution (docs/qk.md): a head's pre-softmax score q_t . k_s split into pairs of residual-stream components
(query side at t, key side at s), which sum to the model's own score exactly, the norm in front of the attention
frozen at the run. Each component's query and key come from a copy of the layer run on it (`_Twin`), so rotary,
grouped-query and parallel blocks are the model's own code. Refused where no exact decomposition exists
(`config_refusal`, `_target`). The pairs are summed into one matrix per view as the rows run, so memory does
not grow with the points read; the check is against the model's own scores within its rounding (`_rounding`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import torch
from torch import Tensor, nn

from probe.errors import ProbeError
from probe.frames import frame
from probe.hooks.capture import attention_hooks
from probe.hooks.restore import interrupts_deferred, restoring
from probe.hooks.run import run_model
from probe.hooks.transformers_api import has_implementation, register_attention, set_implementation
from probe.hooks.types import AttentionInputs, HookContext
from probe.models import LoadedModel
from probe.models.parts import position_embedding, pre_attention_norm, qk_norms, separate_projections
from probe.progress import ProgressArg, callback, reports
from probe.provenance import model_dtype
from probe.residual import (FrozenNorm, Recording, Structure, Targets, check_stream, frozen_norm, model_structure,
                            record_writes)
from probe.schemas.base import Field
from probe.schemas.common import DTYPE, HEAD, LAYER, MODEL, N_HEADS, N_LAYERS, NUMBER
from probe.schemas.declare import Payload, payload, published, schema_field

TOP_PAIRS = 20  # pairs listed in to_dict(), largest |contribution| first
CHUNK = 32  # components run through the layer's copy at once
CAPTURE = "probe_qk_capture"  # the attention implementation the copy runs: it stops at the queries and keys


def config_refusal(config: dict[str, Any]) -> str:
    """Why a model with this config.json cannot have its scores decomposed exactly ("" where it can)."""
    if config.get("attn_logit_softcapping") or config.get("attn_softcapping"):
        return ("attention soft-capping (a tanh of every score) is not linear in the residual stream: QK attribution "
                "cannot split a capped score into pairs")
    if config.get("kv_lora_rank"):
        return ("multi-head latent attention normalises a latent between its two key projections (a second norm per "
                "position, its rotary key shared by every head): QK attribution does not decompose it")
    if config.get("is_encoder_decoder") or config.get("add_cross_attention"):
        return ("cross-attention reads keys from another stream (the encoder's): QK attribution decomposes "
                "self-attention of one residual stream")
    if config.get("alibi") or config.get("model_type") in ("bloom", "mpt"):
        return ("ALiBi adds a position bias to every score outside the query and key: QK attribution reads models "
                "whose scores are q . k alone")
    return ""


class Component(Payload, frozen=True):
    """One residual-stream component; `bias` is the read's own (the norm's and the query/key projections' biases)."""

    name: str = schema_field("L16H0, MLP12, embed, pos, L3 bias or bias")
    kind: str = schema_field("embed, position, head, attention bias, mlp or bias")
    layer: int | None = schema_field("its layer (null: none)", default=None)
    head: int | None = schema_field("its head (null: none)", default=None)

    @property
    def group(self) -> str:
        return {"embed": "embeddings", "position": "embeddings", "head": "heads", "mlp": "MLPs"}.get(self.kind,
                                                                                                   "biases")

    @property
    def layer_group(self) -> str:
        return "embed" if self.group == "embeddings" else ("bias" if self.layer is None else f"L{self.layer}")


def _components(structure: Structure, recording: Recording, block: int,
                positions: Tensor | None) -> Iterator[tuple[Component, Tensor]]:
    """Every component written before `block`, (positions, d_model) float64 on the CPU, in stream order."""
    embed = recording.block_in[0].double().cpu()
    if positions is None:
        yield Component("embed", "embed"), embed
    else:
        yield Component("embed", "embed"), embed - positions
        yield Component("pos", "position"), positions
    for layer, (_, bias) in zip(structure.layers, structure.projections):
        if structure.blocks.of_layer[layer.index] >= block:
            continue
        z = recording.heads[layer.index].double().cpu()  # (positions, heads, value_dim)
        writes = torch.einsum("nhv,hvd->hnd", z, structure.head_matrix(layer.index))
        for head in range(layer.n_heads):
            yield Component(f"L{layer.index}H{head}", "head", layer.index, head), writes[head]
        if bias is not None:
            yield Component(f"L{layer.index} bias", "attention bias", layer.index), bias.expand_as(embed)
    for index in range(block):
        yield Component(f"MLP{index}", "mlp", index), recording.mlp[index].double().cpu()


class _Stop(Exception):
    """Raised once a layer has handed on its queries and keys (its args, for the copy): nothing after them is run."""


def _stop(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
          **kwargs: Any) -> Any:
    raise _Stop(query, key)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast(item, dtype) for item in value)
    return value


@dataclass
class _Twin:
    """A copy of the attention layer in `dtype` whose attention function raises the queries and keys it is handed,
    called with the arguments the layer had in the row's run (its rotary tables among them); what that run showed of
    the layer besides: its attention's inputs and the position embeddings."""

    module: nn.Module
    dtype: torch.dtype
    head: int  # the head read, among the queries the copy hands on
    kv_head: int
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    inputs: AttentionInputs | None = None
    positions: Tensor | None = None

    def keep_call(self, _module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """The layer's pre-hook: the run's arguments, the cache left out."""
        self.args = tuple(_cast(arg, self.dtype) for arg in args)
        self.kwargs = {name: (None if "past_key" in name or name in ("cache", "layer_past") else
                              _cast(value, self.dtype)) for name, value in kwargs.items()}

    def keep_inputs(self, inputs: AttentionInputs, _ctx: HookContext) -> AttentionInputs:
        self.inputs = inputs
        raise _Stop

    def __call__(self, stream: Tensor) -> tuple[Tensor, Tensor]:
        """(batch, positions, d_model) -> the head's queries and its key/value head's keys (batch, positions, d),
        float64 on the CPU; the copy runs where the layer does (its parameters' device)."""
        device = next(self.module.parameters()).device
        stream = stream.to(device=device, dtype=self.dtype)
        args, kwargs = self.args, dict(self.kwargs)
        if args:
            args = (stream, *args[1:])
        else:
            kwargs["hidden_states"] = stream
        try:
            self.module(*args, **kwargs)
        except _Stop as captured:
            query, key = captured.args
            return query[:, self.head].double().cpu(), key[:, self.kv_head].double().cpu()
        raise ProbeError(f"{type(self.module).__name__} did not hand its queries and keys to transformers' attention "
                         "interface: QK attribution cannot read them", parameter="model")


def make_twin(module: nn.Module, dtype: torch.dtype, head: int, kv_head: int, head_dim: int) -> _Twin:
    """The layer's copy; where it has separate q/k/v linears, it keeps only the rows of the head and its key/value
    head (a ninth of the work on SmolLM2), which are then the first it hands on."""
    register_attention(CAPTURE, _stop)
    config: Any = getattr(module, "config", None)
    if not has_implementation(config):
        raise ProbeError(f"{type(module).__name__} has no transformers config: QK attribution reads the queries and "
                         "keys through transformers' attention interface", parameter="model")
    twin = copy.deepcopy(module).to(dtype).requires_grad_(False)
    own_config = copy.copy(config)
    set_implementation(own_config, CAPTURE)  # the copy's own config: nothing to switch back
    twin.config = own_config
    linears = separate_projections(twin)
    if linears is None:
        return _Twin(twin, dtype, head, kv_head)
    for linear, index in zip(linears, (head, kv_head, kv_head)):
        rows = slice(index * head_dim, (index + 1) * head_dim)
        linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
        linear.out_features = head_dim
    return _Twin(twin, dtype, 0, 0)


def project(twin: _Twin, norm: FrozenNorm,
            parts: Iterator[tuple[Component, Tensor]]) -> tuple[list[Component], Tensor, Tensor]:
    """Every component's query for `head` and key for `kv_head`, (components, positions, d) float64, rotated at its
    own position; the last component is `bias`, what the layer computes from no stream at all."""
    names, queries, keys = [], [], []
    positions = norm.scale.shape[0]
    zero_q, zero_k = twin(torch.zeros(1, positions, norm.gain.shape[0], dtype=torch.float64))
    while chunk := list(islice(parts, CHUNK)):
        names += [component for component, _ in chunk]
        query, key = twin(norm.apply(torch.stack([part for _, part in chunk])))  # (components, positions, d)
        queries.append(query - zero_q[0])
        keys.append(key - zero_k[0])
    names.append(Component("bias", "bias"))
    bias_q, bias_k = (zero_q, zero_k) if norm.bias is None else twin(norm.bias.expand(1, positions, -1))
    return names, torch.cat([*queries, bias_q]), torch.cat([*keys, bias_k])


@dataclass(frozen=True)
class KeyRule:
    """Which key each query is read at: `keys(ids, scores)` -> (positions,) key per query, -1 where it has none
    (`scores`: the head's own (positions, positions) scores, -inf where the query cannot see the key)."""

    name: str
    summary: str
    keys: Callable[[Tensor, Tensor], Tensor]


def _induction(ids: Tensor, scores: Tensor) -> Tensor:
    """The token after the query token's latest earlier occurrence (Olsson et al. 2022's induction key)."""
    n = ids.shape[0]
    same = (ids[:, None] == ids[None, :]) & torch.ones(n, n, dtype=torch.bool).tril(-1)
    latest = torch.where(same, torch.arange(n)[None, :], -1).max(dim=-1).values
    return torch.where(latest >= 0, latest + 1, -1)


KEY_RULES: dict[str, KeyRule] = {rule.name: rule for rule in [
    KeyRule("attended", "the key the head attends to most (its largest score)", lambda ids, scores: scores.argmax(-1)),
    KeyRule("induction", "an induction head's key: the token after the previous occurrence of the query's token",
            _induction),
    KeyRule("previous", "a previous-token head's key: t - 1", lambda ids, scores: torch.arange(ids.shape[0]) - 1),
]}
"""Where the default aggregation reads each query: by rule name (`--at`)."""


@contextmanager
def _watch_call(layer: Any, positions: nn.Module | None, twin: _Twin, at: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """Keep the layer's arguments and the position embeddings' output in `twin`; the hooks removed on exit."""
    def keep_positions(_module: nn.Module, _args: Any, output: Tensor) -> None:
        twin.positions = at(output if output.dim() == 3 else output[None]).double().cpu()

    with restoring() as undo:
        with interrupts_deferred():
            undo.append(layer.module.register_forward_pre_hook(twin.keep_call, with_kwargs=True).remove)
            if positions is not None:
                undo.append(positions.register_forward_hook(keep_positions).remove)
        yield


def _valid_keys(inputs: AttentionInputs, n: int) -> Tensor:
    """(n, n) bool: the keys each query sees (causal, and the mask's); an additive bias besides is refused."""
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    if inputs.softcap:
        raise ProbeError("the layer soft-caps its scores (a tanh of each): QK attribution cannot split a capped "
                         "score into pairs", parameter="model")
    if inputs.position_bias is not None:
        raise ProbeError("the layer adds a position bias to its scores: QK attribution reads scores that are "
                         "q . k alone", parameter="model")
    mask = inputs.mask
    if mask is None:
        return causal
    mask = mask.detach().cpu()[0, 0] if mask.dim() == 4 else mask.detach().cpu().reshape(-1, n, n)[0]
    mask = mask[-n:, -n:]
    if mask.dtype == torch.bool:
        return causal & mask
    seen = mask > torch.finfo(mask.dtype).min / 2
    if bool((mask[seen & causal] != 0).any()):
        raise ProbeError("the layer's mask adds a bias to its scores (ALiBi or similar): QK attribution reads "
                         "scores that are q . k alone", parameter="model")
    return causal & seen


ROUNDING = 4.0  # eps of the model's dtype times |q| |k| (scaled) that its projections and rotation may round off


def _rounding(twin: _Twin, queries: Tensor, keys: Tensor, own_q: Tensor, own_k: Tensor, scaling: float,
              eps: float) -> Tensor:
    """(positions, positions): how far rounding may put the model's score from the pairs' sum. What the model
    rounded in its stream and norm is measured: the layer's copy run on the input the layer really got gives the
    queries and keys of that rounding (the pairs' sums are those of the exact sum of the components); what its
    projections and rotary embedding round is bounded, ROUNDING eps * |q| |k|; and what the copy itself rounds,
    ROUNDING eps of its dtype * sum_i |q_i| |k| (and the same of the keys)."""
    given = twin.args[0] if twin.args else twin.kwargs["hidden_states"]
    read_q, read_k = twin(given.detach().double().cpu()[:1])
    query, key = queries.sum(dim=0), keys.sum(dim=0)  # (positions, d)
    gap_q, gap_k = read_q[0] - query, read_k[0] - key
    measured = (gap_q @ own_k.T).abs() + (query @ gap_k.T).abs()
    q_norm, k_norm = own_q.norm(dim=-1), own_k.norm(dim=-1)
    rest = ROUNDING * eps * q_norm[:, None] * k_norm[None, :]
    copy = ROUNDING * torch.finfo(twin.dtype).eps * (queries.norm(dim=-1).sum(dim=0)[:, None] * k_norm[None, :]
                                                     + q_norm[:, None] * keys.norm(dim=-1).sum(dim=0)[None, :])
    return scaling * (measured + rest + copy)


@dataclass
class _View:
    """One view's running sums: pairs (components, components), the model's own score, the check."""

    pairs: Tensor
    own: float = 0.0
    points: int = 0
    residual: float = 0.0
    bound: float = 0.0

    def add(self, queries: Tensor, keys: Tensor, own: Tensor, scaling: float, bound: Tensor) -> None:
        if own.numel() == 0:
            return
        self.pairs += scaling * queries.flatten(1) @ keys.flatten(1).T
        made = (queries.sum(dim=0) * keys.sum(dim=0)).sum(dim=-1) * scaling
        self.residual = max(self.residual, float((made - own).abs().max()))
        self.bound = max(self.bound, float(bound.max()))
        self.own += float(own.sum())
        self.points += own.numel()

    def check(self, what: str, dtype: str) -> None:
        if self.residual > max(self.bound, 1e-9):
            raise ProbeError(f"the pairs of {what} do not sum to the model's own score: off by up to "
                             f"{self.residual:.3g}, more than its {dtype} rounding allows ({self.bound:.3g}); this "
                             "model computes its queries or keys in a way QK attribution does not decompose",
                             parameter="model")


@dataclass
class _Target:
    """The head read, and what every row's run needs of the model."""

    loaded: LoadedModel
    structure: Structure
    layer: Any  # AttentionLayer
    head: int
    kv_head: int
    block: int
    norm: nn.Module | None
    positions: nn.Module | None


def _run_row(target: _Target, twin: _Twin, ids: Tensor) -> Recording:
    """One row's forward, every write into the stream recorded at every position, the layer's call kept in `twin`."""
    n = ids.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    recording = Recording(Targets(zeros, torch.arange(n), zeros))
    twin.inputs = twin.positions = None
    model = target.loaded.model
    try:
        with record_writes(target.structure, recording), _watch_call(target.layer, target.positions, twin,
                                                                       recording.at), \
                attention_hooks(model, points={"z": recording.edit_heads}), \
                attention_hooks(model, layers={target.layer.index}, points={"inputs": twin.keep_inputs}):
            run_model(model, ids[None], logits=False)
    except _Stop:  # the layers after the head's are not run
        pass
    if twin.inputs is None:
        raise ProbeError(f"attention layer {target.layer.index} did not run through transformers' attention "
                         "interface: QK attribution cannot read its queries and keys", parameter="model")
    return recording


def _row_points(rule: KeyRule | None, at: tuple[int, int] | None, ids: Tensor,
                scores: Tensor) -> tuple[Tensor, Tensor]:
    """(queries, keys) read on this row: the explicit (query, key), or the rule's key for every query."""
    n = ids.shape[0]
    if at is not None:
        query, key = at
        inside = query < n and 0 <= key <= query and bool(torch.isfinite(scores[query, key]))
        return (torch.tensor([query]), torch.tensor([key])) if inside else (torch.zeros(0, dtype=torch.long),) * 2
    assert rule is not None
    keys = rule.keys(ids, scores)
    queries = torch.arange(n)
    keep = keys >= 0
    keep[keep.clone()] = torch.isfinite(scores[queries[keep], keys[keep]])
    return queries[keep], keys[keep]


def _add_row(target: _Target, twin: _Twin, ids: Tensor, rule: KeyRule | None, at: tuple[int, int] | None,
             views: dict[str, _View]) -> list[Component]:
    """One row's forward, its components' queries and keys, their pairs added to the views."""
    recording = _run_row(target, twin, ids)
    assert twin.inputs is not None
    check_stream(target.structure, recording, "QK attribution", target.block)
    inputs, n = twin.inputs, ids.shape[0]
    norm = frozen_norm(target.norm, recording.block_in[target.block].double().cpu())
    names, queries, keys = project(twin, norm, _components(target.structure, recording, target.block, twin.positions))
    scaling = float(inputs.scaling)
    own_q = inputs.query[0, target.head].detach().double().cpu()
    own_k = inputs.key[0, target.kv_head].detach().double().cpu()
    valid = _valid_keys(inputs, n)
    scores = (own_q @ own_k.T * scaling).masked_fill(~valid, float("-inf"))
    rows, cols = _row_points(rule, at, ids, scores)
    bound = _rounding(twin, queries, keys, own_q, own_k, scaling, torch.finfo(inputs.query.dtype).eps)
    views.setdefault("score", _View(queries.new_zeros(len(names), len(names))))
    views["score"].add(queries[:, rows], keys[:, cols], scores[rows, cols], scaling, bound[rows, cols])
    others = valid[rows].clone()
    others[torch.arange(len(rows)), cols] = False
    count = others.sum(dim=-1)
    keep = count > 0
    rows, cols, others, count = rows[keep], cols[keep], others[keep].double(), count[keep].double()
    mean_keys = (others @ keys.transpose(0, 1).flatten(1)).view(len(rows), *keys.shape[::2]) / count[:, None, None]
    contrast_keys = keys[:, cols] - mean_keys.transpose(0, 1)
    own_others = (others * scores[rows].nan_to_num(neginf=0.0)).sum(dim=-1) / count
    views.setdefault("contrast", _View(queries.new_zeros(len(names), len(names))))
    views["contrast"].add(queries[:, rows], contrast_keys, scores[rows, cols] - own_others, scaling,
                          bound[rows, cols] + (others * bound[rows]).sum(dim=-1) / count)
    return names


def _target(loaded: LoadedModel, head: tuple[int, int]) -> _Target:
    try:
        structure = model_structure(loaded.model)
    except ProbeError as error:  # its words are DLA's; the reason holds for QK attribution too
        raise ProbeError(f"QK attribution reads the residual stream as direct logit attribution does: {error}",
                         parameter="model") from None
    layer_index, head_index = head
    if not 0 <= layer_index < len(structure.layers):
        raise ProbeError(f"layer {layer_index} is out of range: the model has {len(structure.layers)} attention "
                         f"layers (0-{len(structure.layers) - 1})", parameter="head")
    layer = structure.layers[layer_index]
    if not 0 <= head_index < layer.n_heads:
        raise ProbeError(f"head {head_index} is out of range: layer {layer_index} has {layer.n_heads} heads "
                         f"(0-{layer.n_heads - 1})", parameter="head")
    config: Any = getattr(loaded.model, "config", None)
    why = config_refusal(config.to_dict()) if hasattr(config, "to_dict") else ""
    if why:
        raise ProbeError(why, parameter="model")
    if layer.kind != "hf":
        raise ProbeError(f"attention layer {layer.index} ({type(layer.module).__name__}) does not go through "
                         "transformers' attention interface, where QK attribution reads the queries and keys",
                         parameter="model")
    norms = qk_norms(layer.module)
    if norms:
        raise ProbeError(f"attention layer {layer.index} normalises its queries and keys ({', '.join(norms)}), a "
                         "second norm per head and position: QK attribution does not decompose it",
                         parameter="model")
    _, norm = pre_attention_norm(loaded.model, layer.module)
    return _Target(loaded, structure, layer, head_index, head_index // (layer.n_heads // layer.n_kv_heads),
                   structure.blocks.of_layer[layer_index], norm, position_embedding(loaded.model))


@reports("qk attribution")
def qk_attribution(loaded: LoadedModel, ids: Tensor, head: tuple[int, int], *, mask: Tensor | None = None,
                   at: str = "attended", query: int | None = None, key: int | None = None, source: str = "",
                   progress: ProgressArg = None) -> QKAttribution:
    """The head's pre-softmax scores on the rows of `ids` (right-padded under `mask`), each split into pairs of
    query-side and key-side components (module docstring), averaged over the points read: every query at the key of
    rule `at` (`KEY_RULES`), or the one (`query`, `key`) of each row that has both. Also the contrast: the score of
    that key minus the mean score of the query's other keys, split the same way. `progress=True` draws a bar on
    stderr; a callable gets `(done, total)` in rows."""
    if (query is None) != (key is None):
        raise ProbeError("give both query and key (positions), or neither", parameter="query")
    if query is not None and key is not None and not 0 <= key <= query:
        raise ProbeError(f"key {key} must lie in 0..query ({query}): a causal head's query sees earlier keys only",
                         parameter="key")
    rule = None if query is not None else KEY_RULES.get(at)
    if query is None and rule is None:
        raise ProbeError(f"no key rule {at!r}; the rules are {', '.join(KEY_RULES)}", parameter="at")
    target = _target(loaded, head)
    lengths = (torch.full((ids.shape[0],), ids.shape[1]) if mask is None else mask.bool().sum(dim=1)).tolist()
    views: dict[str, _View] = {}
    names: list[Component] = []
    report = callback(progress) or (lambda done, total: None)
    parameters = next(loaded.model.parameters())
    twin = make_twin(target.layer.module, torch.float64 if parameters.dtype == torch.float64 else torch.float32,
                     target.head, target.kv_head, target.layer.head_dim)
    report(0, len(lengths))  # the count is known before the first row, however long it runs
    with torch.no_grad():
        for row, length in enumerate(lengths):
            names = _add_row(target, twin, ids[row, :length].cpu(), rule, None if query is None else (query, key or 0),
                             views)
            report(row + 1, len(lengths))
    if not views or views["score"].points == 0:
        raise ProbeError("no (query, key) point to read: every row is shorter than the query position, or the rule "
                         "finds no key", parameter="query" if query is not None else "at")
    dtype = model_dtype(loaded)
    head_name = f"{head[0]}.{head[1]}"
    views["score"].check(f"head {head_name}'s scores", dtype)
    views["contrast"].check(f"head {head_name}'s contrasts", dtype)
    rule_name = "positions" if rule is None else rule.name
    return QKAttribution(loaded.name, head[0], head[1], target.kv_head, source, rule_name, query, key, names,
                         views["score"], views["contrast"], n_heads=target.layer.n_heads,
                         n_layers=len(target.structure.layers), dtype=dtype)


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


@published("qk", 1, "QK attribution: a head's pre-softmax scores split into pairs of query-side and key-side residual "
           "components, with each side's marginals, grouped views and the check against the model's own scores (probe "
           "qk --json).", rows="one per (query-side, key-side) component pair",
           columns={**QK_SIDE_COLUMNS, "score": Field("number", "the pair's mean contribution to the score"),
                    "contrast": Field("number", "the pair's mean contribution to the contrast")})
class QKAttribution(Payload):
    """A head's scores split into pairs of components, mean over the points read (float64 sums of the model's
    values); `pairs(view)` is (query-side components, key-side components), rows summing to the query side's
    marginal."""

    model: str = schema_field(MODEL)
    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    kv_head: int = schema_field("its key/value head")
    n_layers: int = schema_field(N_LAYERS, kw_only=True)
    n_heads: int = schema_field(N_HEADS, kw_only=True)
    source: str = schema_field("what it was measured on")
    rule: str = schema_field(  # a KEY_RULES name, or "positions" (query and key given)
        "which key each query is read at: a rule's name, or positions (--query/--key)")
    query: int | None = schema_field("the query position given (null: the rule's)")
    key: int | None = schema_field("the key position given (null: the rule's)")
    dtype: str = schema_field(DTYPE, default="float32", kw_only=True)
    components: list[Component] = schema_field("the residual components, in stream order", items="a component")
    score: _View
    contrast: _View

    @payload("the score and the contrast (the key's score minus the mean of the query's other keys')",
             fields={"score": QK_VIEW, "contrast": QK_VIEW})
    def views(self) -> dict[str, Any]:
        return {"score": self._view("score"), "contrast": self._view("contrast")}

    def pairs(self, view: str = "score") -> Tensor:
        """(components, components) float64: the mean contribution of (query-side i, key-side j)."""
        chosen = getattr(self, view)
        return chosen.pairs / max(chosen.points, 1)

    def key_side(self, view: str = "score") -> Tensor:
        return self.pairs(view).sum(dim=0)

    def query_side(self, view: str = "score") -> Tensor:
        return self.pairs(view).sum(dim=1)

    def top_key_components(self, count: int = 3, view: str = "score") -> list[str]:
        """The key-side components of largest contribution (signed: what raises the score most), largest first."""
        order = self.key_side(view).argsort(descending=True)[:count]
        return [self.components[int(index)].name for index in order]

    def _view(self, name: str) -> dict[str, Any]:
        chosen, pairs = getattr(self, name), self.pairs(name)
        flat, size = pairs.flatten(), pairs.shape[1]
        top = [{"query": int(index) // size, "key": int(index) % size, "value": float(flat[index])}
               for index in flat.abs().argsort(descending=True)[:TOP_PAIRS] if float(flat[index]) != 0.0]
        query_side, key_side = pairs.sum(dim=1), pairs.sum(dim=0)
        return {"model_score": chosen.own / max(chosen.points, 1), "sum": float(pairs.sum()),
                "points": chosen.points, "max_residual": chosen.residual, "rounding_bound": chosen.bound,
                "query": query_side.tolist(), "key": key_side.tolist(), "top_pairs": top,
                "groups": {"kind": self._groups(query_side, key_side, "group"),
                           "layer": self._groups(query_side, key_side, "layer_group")},
                "matrix": pairs.tolist()}

    def _groups(self, query_side: Tensor, key_side: Tensor, attribute: str) -> list[dict[str, Any]]:
        groups: dict[str, list[float]] = {}
        for component, q, k in zip(self.components, query_side.tolist(), key_side.tolist()):
            sums = groups.setdefault(getattr(component, attribute), [0.0, 0.0])
            sums[0] += q
            sums[1] += k
        return [{"group": name, "query": q, "key": k} for name, (q, k) in groups.items()]

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per (query-side, key-side) pair: the qk schema's columns. Needs pandas."""
        return frame(pair_rows(self.to_dict()))


def _side(side: str, component: dict[str, Any]) -> dict[str, Any]:
    return {side: component["name"], f"{side}_kind": component["kind"],
            **{f"{side}_{key}": -1 if component[key] is None else component[key] for key in ("layer", "head")}}


def pair_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (query-side, key-side) component pair of a payload (a layer or head of -1 where none)."""
    components = payload["components"]
    score, contrast = payload["views"]["score"]["matrix"], payload["views"]["contrast"]["matrix"]
    return [{**_side("query", query), **_side("key", key), "score": score[i][j], "contrast": contrast[i][j]}
            for i, query in enumerate(components) for j, key in enumerate(components)]
