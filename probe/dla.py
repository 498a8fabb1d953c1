"""Direct logit attribution (DLA): what each attention head, each MLP, the embeddings and the biases write into the
residual stream, read off directly by the unembedding, without any later layer in between.

The residual stream at the last layer is a sum: embeddings + every block's attention output + every block's MLP
output (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits"). An attention output is a sum over
heads, head h writing z_h W_O^h (its slice of the output projection; under grouped-query attention each query head
has its own slice), plus the projection's bias. The final norm is not linear, but with its scale frozen at each
position (the value it took on the clean run: 1 / rms for RMSNorm, 1 / std for LayerNorm, whose centring is linear
and applies to every component) it is, and so is everything after it: each component's share of a logit difference
is that component, centred where the norm centres, times the frozen scale and the norm's gain, dotted with
W_U[answer] - W_U[distractor] (Wang et al. 2022 read IOI heads this way). The norm's bias and the LM head's bias go
to `final_bias`. The shares sum to the model's own logit difference: `Attribution.residual` is how far they do not.

A head's share splits further by source position: z_h at the read position is a sum over keys of attention weight
times value, so its share is a sum over source positions (`head_positions`; transformers-interface models only).

Soft-capped logits (Gemma 2's final_logit_softcapping) are not linear in the residual stream: DLA is of the logits
before capping, and the identity is checked against them (`capped`). A block that writes anything but its attention
and MLP outputs into the stream (post-norms after them, Gemma 2; a residual added inside the attention, BLOOM) is
refused, as is a model without an LM head (an encoder).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.frames import frame, record_rows
from probe.ablation.blocks import Blocks, find_blocks
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.run import logits_of, run_model
from probe.hooks.types import HookContext
from probe.inputs import ContrastSet, logit_diffs
from probe.errors import ProbeError
from probe.overflow import forwards, require_finite
from probe.hooks.restore import interrupts_deferred, restoring
from probe.models import LoadedModel
from probe.models.parts import (FINAL_NORMS, MLPS, OUTPUT_PROJECTIONS, base_model, gain, named_child, output_embeddings,
                                output_projection_weight)
from probe.patterns import token_strings
from probe.provenance import model_dtype
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, N_HEADS, N_LAYERS, NUMBER, SELF_REPAIR
from probe.schemas.declare import Payload, columns, payload, published, schema_field

STREAM_TOLERANCE = 1e-3  # relative, float32: a block's write must be its attention + MLP outputs this closely


@dataclass(frozen=True)
class Targets:
    """Where the logits are read: one point per (row, position), scored as logit(answer) - logit(distractor), or
    logit(answer) alone where `distractor` is None (the correct next token over natural text)."""

    rows: Tensor  # (points,) long
    positions: Tensor  # (points,) long
    answer: Tensor  # (points,) token ids
    distractor: Tensor | None = None

    def direction(self, unembedding: Tensor) -> Tensor:
        """(points, d_model) float64: W_U[answer] - W_U[distractor] (W_U (vocab, d_model), as nn.Linear stores it)."""
        direction = unembedding[self.answer].double().cpu()
        return direction if self.distractor is None else direction - unembedding[self.distractor].double().cpu()

    def scored(self, values: Tensor) -> Tensor:
        """(points, vocab) -> (points,) float64: the answer's value minus the distractor's."""
        index = torch.arange(values.shape[0])
        score = values[index, self.answer].double()
        return score if self.distractor is None else score - values[index, self.distractor].double()

    def subset(self, rows: slice) -> Targets:
        keep = (self.rows >= rows.start) & (self.rows < rows.stop)
        return Targets(self.rows[keep] - rows.start, self.positions[keep], self.answer[keep],
                       None if self.distractor is None else self.distractor[keep])


def _first_tensor(value: Any) -> Tensor:
    return value if isinstance(value, Tensor) else next(item for item in value if isinstance(item, Tensor))


@dataclass
class Recording:
    """What one forward wrote into the residual stream, at the read points only (in the dtype the model runs in)."""

    targets: Targets
    per_position: bool
    block_in: dict[int, Tensor] = field(default_factory=dict)  # block -> (points, d_model)
    block_out: dict[int, Tensor] = field(default_factory=dict)
    attention: dict[int, Tensor] = field(default_factory=dict)  # layer -> (points, d_model)
    mlp: dict[int, Tensor] = field(default_factory=dict)  # block -> (points, d_model)
    heads: dict[int, Tensor] = field(default_factory=dict)  # layer -> (points, n_heads, head_dim)
    weights: dict[int, Tensor] = field(default_factory=dict)  # layer -> (points, n_heads, keys)
    values: dict[int, Tensor] = field(default_factory=dict)  # layer -> (points, n_kv_heads, keys, head_dim)
    final: list[Tensor] = field(default_factory=list)  # [the final norm's input, its output], (points, d_model)

    def at(self, value: Tensor) -> Tensor:
        """(batch, positions, ...) -> (points, ...)."""
        return value[self.targets.rows.to(value.device), self.targets.positions.to(value.device)].detach()

    def edit_heads(self, heads: Tensor, ctx: HookContext) -> Tensor:
        """The `z` point's handler: keeps the heads' outputs at the read points."""
        self.heads[ctx.layer] = self.at(heads)
        return heads

    def on_weights(self, weights: Tensor, ctx: HookContext) -> None:
        if not self.per_position:
            return
        layer, start = ctx.layer, ctx.start
        stored = self.weights.setdefault(layer, weights.new_zeros(len(self.targets.rows), weights.shape[1],
                                                                   weights.shape[-1]))
        inside = (self.targets.positions >= start) & (self.targets.positions < start + weights.shape[2])
        points = inside.nonzero().flatten()
        rows, queries = self.targets.rows[points], self.targets.positions[points] - start
        stored[points] = weights[rows.to(weights.device), :, queries.to(weights.device)].detach()

    def read_values(self, value: Tensor, ctx: HookContext) -> None:
        """The `v` hook point's reader: keeps the values of the read rows."""
        self.values[ctx.layer] = value[self.targets.rows.to(value.device)].transpose(1, 2).detach()


@dataclass(frozen=True)
class Structure:
    """Where a model's residual stream is written: blocks, their attention layers and MLPs, final norm, LM head."""

    layers: list[AttentionLayer]
    blocks: Blocks
    mlps: list[nn.Module]
    projections: list[tuple[Tensor, Tensor | None]]  # per layer: (W (n_heads * head_dim, d_model), bias or None)
    norm: nn.Module
    head: nn.Linear


def _projection(layer: AttentionLayer, d_model: int) -> tuple[Tensor, Tensor | None]:
    width = layer.n_heads * layer.value_dim
    found = output_projection_weight(layer.module, width, d_model)
    if found is None:
        raise ProbeError(f"attention layer {layer.index} ({type(layer.module).__name__}) has no output projection "
                         f"probe can read ({', '.join(OUTPUT_PROJECTIONS)} of {width} -> {d_model}): DLA cannot split "
                         "it into heads", parameter="model")
    return found


def _child(parent: nn.Module, names: tuple[str, ...], what: str) -> nn.Module:
    _, found = named_child(parent, names)
    if found is None:
        raise ProbeError(f"{type(parent).__name__} has no {what} probe can find ({', '.join(names)}): direct logit "
                         "attribution cannot decompose this model", parameter="model")
    return found


def model_structure(model: nn.Module) -> Structure:
    """The parts DLA reads; ProbeError (one line) for a model it cannot decompose."""
    head = output_embeddings(model)
    if not isinstance(head, nn.Linear):
        raise ProbeError(f"direct logit attribution needs an LM head (logits over the vocabulary): "
                         f"{type(model).__name__} has none (an encoder gives hidden states, not logits)",
                         parameter="model")
    layers = attention_layers(model)
    blocks, why = find_blocks(model, layers)
    if blocks is None:
        raise ProbeError(f"direct logit attribution reads one list of blocks: {why}", parameter="model")
    if len(set(blocks.of_layer)) != len(blocks.of_layer):
        raise ProbeError("a block with two attention layers: DLA reads one per block", parameter="model")
    d_model = head.weight.shape[1]
    body = base_model(model)
    return Structure(layers, blocks, [_child(block, MLPS, "MLP") for block in blocks.container],
                      [_projection(layer, d_model) for layer in layers],
                      _child(model if body is None else body, FINAL_NORMS, "final norm"), head)


@contextmanager
def record_writes(structure: Structure, recording: Recording) -> Iterator[None]:
    """Forward hooks that fill `recording`; all removed on exit."""
    at = recording.at

    def keep(store: dict[int, Tensor], key: int) -> Any:
        return lambda _module, _args, output: store.__setitem__(key, at(_first_tensor(output)))

    def keep_input(store: Any, key: int) -> Any:
        def hook(_module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
            stream = args[0] if args else kwargs["hidden_states"]
            if stream.dim() != 3:  # e.g. Gemma 3n's AltUp: (predictions, batch, positions, d_model)
                raise ProbeError(f"block {key}'s input is not one residual stream (shape {tuple(stream.shape)}): "
                                 "direct logit attribution cannot decompose this model")
            store[key] = at(stream)
        return hook

    final: dict[int, Tensor] = {}
    with restoring() as undo:
        with interrupts_deferred():
            for index, block in enumerate(structure.blocks.container):
                undo.append(block.register_forward_pre_hook(keep_input(recording.block_in, index),
                                                            with_kwargs=True).remove)
                undo.append(block.register_forward_hook(keep(recording.block_out, index)).remove)
                undo.append(structure.mlps[index].register_forward_hook(keep(recording.mlp, index)).remove)
            for layer in structure.layers:
                undo.append(layer.module.register_forward_hook(keep(recording.attention, layer.index)).remove)
            undo.append(structure.norm.register_forward_pre_hook(keep_input(final, 0), with_kwargs=True).remove)
            undo.append(structure.norm.register_forward_hook(keep(final, 1)).remove)
        yield
    recording.final[:] = [final[0], final[1]]


# ---------------------------------------------------------------------------------------------------------------
# the decomposition


@dataclass(frozen=True)
class FrozenNorm:
    """A norm as a linear map at each read point: x -> centre(x) * scale * gain, its bias kept apart."""

    centred: bool  # LayerNorm subtracts the mean (linear: applied to every component)
    scale: Tensor  # (points,) float64: 1 / rms (RMSNorm) or 1 / std (LayerNorm) of the clean run's stream
    gain: Tensor  # (d_model,) float64
    bias: Tensor | None

    def apply(self, component: Tensor) -> Tensor:
        """(..., points, d_model) -> what the norm makes of it, its bias apart."""
        centred = component - component.mean(dim=-1, keepdim=True) if self.centred else component
        return centred * self.scale[:, None] * self.gain

    def read(self, direction: Tensor) -> Tensor:
        """(points, d_model): the vector a component is dotted with, so that its share is component . vector."""
        vector = self.scale[:, None] * self.gain * direction
        return vector - vector.mean(dim=-1, keepdim=True) if self.centred else vector


def frozen_norm(norm: nn.Module, stream: Tensor) -> FrozenNorm:
    """`norm` with its scale frozen at the clean run's `stream` (points, d_model); an epsilon it lacks is 0 (the
    identity's residual shows it)."""
    name = type(norm).__name__
    centred = "RMS" not in name and (isinstance(norm, nn.LayerNorm) or "LayerNorm" in name)
    if "RMS" not in name and not centred:
        raise ProbeError(f"the final norm is a {name}, neither RMSNorm nor LayerNorm: direct logit attribution "
                         "cannot freeze its scale", parameter="model")
    eps = next((float(getattr(norm, key)) for key in ("variance_epsilon", "eps", "epsilon")
                if isinstance(getattr(norm, key, None), (int, float))), 0.0)
    x = stream.double()
    x = x - x.mean(dim=-1, keepdim=True) if centred else x
    scale = (x.pow(2).mean(dim=-1) + eps).rsqrt()
    found = gain(norm)
    bias = getattr(norm, "bias", None)
    return FrozenNorm(centred, scale, torch.ones(x.shape[-1], dtype=torch.float64) if found is None else found.cpu(),
                       bias.detach().double().cpu() if isinstance(bias, Tensor) else None)


def _check_close(found: Tensor, expected: Tensor, what: str, magnitude: Tensor, dtype: torch.dtype) -> None:
    """Refuse where a write the decomposition assumes is not what the model computed. The tolerance scales with the
    dtype the model runs in: float32's relative STREAM_TOLERANCE, plus 2 eps of that dtype times `magnitude` (each
    element's sum of |terms| the model rounded: a bfloat16 stream of size 100 rounds a block's small write by 0.4)."""
    gap = (found.double() - expected.double()).abs()
    eps = torch.finfo(dtype).eps
    allowed = STREAM_TOLERANCE * max(1.0, float(expected.double().abs().max())) + 2 * eps * magnitude.to(gap.device)
    if bool((gap > allowed).any()):
        worst, name = int((gap - allowed).argmax()), str(dtype).removeprefix("torch.")
        raise ProbeError(f"{what} (off by {float(gap.flatten()[worst]):.3g} where {name} rounding allows "
                         f"{float(allowed.flatten()[worst]):.3g}): direct logit attribution cannot decompose this "
                         "model", parameter="model")


def check_stream(structure: Structure, recording: Recording, heads: dict[int, Tensor]) -> None:
    """Each attention output is its heads through the output projection; each block writes attention + MLP. Sums in
    float64 from the recorded values, so that only the model's own rounding is left to tolerate."""
    for layer, (matrix, bias) in zip(structure.layers, structure.projections):
        z = heads[layer.index].flatten(1).double()
        made = z @ matrix.to(z.device)
        magnitude = z.abs() @ matrix.to(z.device).abs() + (0 if bias is None else bias.to(z.device).abs())
        _check_close(made + (0 if bias is None else bias.to(made.device)), recording.attention[layer.index],
                     f"attention layer {layer.index}'s output is not its heads through its output projection",
                     magnitude, recording.attention[layer.index].dtype)
    for block in range(len(structure.blocks)):
        attention = [recording.attention[index].double() for index, owner in enumerate(structure.blocks.of_layer)
                     if owner == block]
        written = sum(attention) + recording.mlp[block].double()
        into, out = recording.block_in[block], recording.block_out[block]
        magnitude = into.double().abs() + out.double().abs() + recording.mlp[block].double().abs() + \
            sum(part.abs() for part in attention)
        _check_close(written, out.double() - into.double(),
                     f"block {block} adds more than its attention and MLP outputs to the residual stream (a norm "
                     "after them, as in Gemma 2, or a residual added inside one, as in MPT's MLP)", magnitude,
                     out.dtype)


@dataclass
class Shares:
    """Every component's share of the score at each read point, float64 on the CPU; they sum to `model_score`."""

    embeddings: Tensor  # (points,)
    heads: Tensor  # (points, n_layers, n_heads)
    attention_biases: Tensor  # (points, n_layers)
    mlps: Tensor  # (points, n_blocks)
    final_bias: Tensor  # (points,)
    model_score: Tensor  # (points,)
    head_positions: Tensor | None  # (points, n_layers, n_heads, keys)
    rounding: Tensor | None = None  # (points,) how far the model's own rounding may put the shares' sum from its score


def head_shares(structure: Structure, recording: Recording, read: Tensor) -> tuple[Tensor, Tensor | None]:
    """(points, n_layers, n_heads) and, where recorded, (points, n_layers, n_heads, keys)."""
    shares, by_position = [], []
    for layer, (matrix, _) in zip(structure.layers, structure.projections):
        z = recording.heads[layer.index].double().cpu()  # (points, n_heads, head_dim)
        per_head = (read @ matrix.T).view(*z.shape)  # what each head's z is dotted with
        shares.append((z * per_head).sum(dim=-1))
        if layer.index in recording.values and layer.index in recording.weights:
            values = recording.values[layer.index].double().cpu()  # (points, n_kv_heads, keys, head_dim)
            values = values.repeat_interleave(layer.n_heads // values.shape[1], dim=1)
            weights = recording.weights[layer.index].double().cpu()  # (points, n_heads, keys)
            by_position.append(weights * torch.einsum("phkd,phd->phk", values, per_head))
    positions = torch.stack(by_position, dim=1) if len(by_position) == len(shares) else None
    return torch.stack(shares, dim=1), positions


def _shares(structure: Structure, recording: Recording, logits: Tensor | None) -> Shares:
    """Every component's share of the score at each read point, and the model's own score."""
    targets = recording.targets
    stream, normed = (value.double().cpu() for value in recording.final)
    norm = frozen_norm(structure.norm, stream)
    direction = targets.direction(structure.head.weight.detach())
    read = norm.read(direction)  # (points, d_model)

    def share(component: Tensor) -> Tensor:
        return (component.double().cpu() * read).sum(dim=-1)

    heads, positions = head_shares(structure, recording, read)
    biases = [torch.zeros(len(read), dtype=torch.float64) if bias is None else share(bias.expand_as(read))
              for _, bias in structure.projections]
    final_bias = torch.zeros(len(read), dtype=torch.float64) if norm.bias is None else direction @ norm.bias
    head_bias = structure.head.bias
    if head_bias is not None:
        final_bias = final_bias + targets.scored(head_bias.detach().double().cpu().expand(len(read), -1))
    if logits is None:  # soft-capped: the score before capping
        logits = structure.head(recording.final[1]).detach()
    return Shares(share(recording.block_in[0]), heads, torch.stack(biases, dim=1),
                   torch.stack([share(recording.mlp[block]) for block in range(len(structure.blocks))], dim=1),
                   final_bias, targets.scored(logits.double().cpu()), positions,
                   _rounding(recording, read, normed, direction, logits))


def _rounding(recording: Recording, read: Tensor, normed: Tensor, direction: Tensor, logits: Tensor) -> Tensor:
    """(points,) a bound on how far the model's own rounding puts its score from the exact sum of the shares: 2 eps
    of its dtype times what it rounded (each block's stream, dotted in absolute value with what a share reads; the
    final norm's output with the direction; the logits read). float32: ~1e-6; bfloat16: ~1e-1 on SmolLM2."""
    eps = torch.finfo(recording.final[0].dtype).eps  # the stream's dtype: what the model rounded it to
    stream = sum(((out.double().cpu().abs() * read.abs()).sum(dim=-1) for out in recording.block_out.values()),
                 torch.zeros(len(read), dtype=torch.float64))
    targets, values = recording.targets, logits.double().cpu().abs()
    index = torch.arange(len(read))
    read_logits = values[index, targets.answer] + (0 if targets.distractor is None else
                                                   values[index, targets.distractor])
    return 2 * eps * (stream + (normed.abs() * direction.abs()).sum(dim=-1) + read_logits)


def logits_capped(model: nn.Module) -> bool:
    """Whether the logits are soft-capped after the LM head (Gemma 2)."""
    return bool(getattr(getattr(model, "config", None), "final_logit_softcapping", None))


def _batch_shares(loaded: LoadedModel, structure: Structure, ids: Tensor, mask: Tensor | None, targets: Targets,
                  per_position: bool) -> Shares:
    """One clean forward with every write into the residual stream recorded at the read points, decomposed."""
    recording = Recording(targets, per_position)
    with torch.no_grad():
        with record_writes(structure, recording), attention_hooks(loaded.model, points={
                "z": recording.edit_heads,
                **({"pattern": recording.on_weights, "v": recording.read_values} if per_position else {})}):
            output = run_model(loaded.model, ids, mask)
        check_stream(structure, recording, recording.heads)
        return _shares(structure, recording, None if logits_capped(loaded.model) else recording.at(logits_of(output)))


def _joined(parts: list[Shares]) -> Shares:
    def joined(values: list[Tensor | None]) -> Tensor | None:
        present = [value for value in values if value is not None]
        return torch.cat(present) if len(present) == len(values) else None

    return Shares(*(torch.cat([getattr(part, name) for part in parts])  # type: ignore[misc]
                     for name in ("embeddings", "heads", "attention_biases", "mlps", "final_bias", "model_score")),
                   head_positions=joined([part.head_positions for part in parts]),
                   rounding=joined([part.rounding for part in parts]))


def attribute(loaded: LoadedModel, ids: Tensor, targets: Targets, *, mask: Tensor | None = None,
              per_position: bool = False, batch_size: int = 8) -> Shares:
    """Every component's direct share of the score at each read point of `targets` (module docstring), rows of `ids`
    run `batch_size` at a time. `per_position`: heads' shares by source position too, where the model's attention
    goes through transformers' interface (else None)."""
    if batch_size < 1:
        raise ProbeError(f"batch_size must be at least 1, got {batch_size}", parameter="batch_size")
    structure = model_structure(loaded.model)
    if len({layer.n_heads for layer in structure.layers}) != 1:
        raise ProbeError("layers with different numbers of heads: DLA's (layer, head) table needs one",
                         parameter="model")
    per_position = per_position and all(layer.kind == "hf" for layer in structure.layers)
    parts = []
    for start in range(0, ids.shape[0], batch_size):
        rows = slice(start, min(start + batch_size, ids.shape[0]))
        batch_targets = targets.subset(rows)
        if len(batch_targets.rows):
            parts.append(_batch_shares(loaded, structure, ids[rows], None if mask is None else mask[rows],
                                       batch_targets, per_position))
    if not parts:
        raise ProbeError("no position to read the logits at", parameter="targets")
    shares = _joined(parts)
    require_finite(shares.model_score, "the logit difference DLA decomposes", loaded.model,
                   forwards(loaded.model, ids, mask, batch_size))
    return shares


# ---------------------------------------------------------------------------------------------------------------
# results

PER_POSITION_HEADS = 5  # heads whose shares by source position to_dict() gives


class Identity(Payload, frozen=True):
    """The shares sum to the model's own score, within its rounding."""

    sum: float = schema_field("the shares' mean sum")
    max_residual: float = schema_field("max |sum of shares - the model's own score|")
    rounding_bound: float | None = schema_field("the bound the model's own rounding allows")


class Components(Payload, frozen=True):
    """The mean share of each kind of component."""

    embeddings: float = schema_field(NUMBER)
    heads: float = schema_field(NUMBER)
    attention_biases: float = schema_field(NUMBER)
    mlps: list[float] = schema_field("each layer's MLP", items=NUMBER)
    final_bias: float = schema_field(NUMBER)


class HeadShare(Payload, frozen=True):
    """One head's mean share."""

    layer: int = schema_field(LAYER)
    head: int = schema_field(HEAD)
    dla: float = schema_field("its mean share", column="the head's mean direct logit attribution")


@published("dla", 1, "Direct logit attribution: each head's mean share of the score, the other components, and the "
           "identity check (probe dla --json).", rows="one per head, largest |share| first",
           columns=columns(HEAD_COLUMNS, HeadShare), sections={"self_repair": SELF_REPAIR})
class Attribution(Payload):
    """Direct logit attribution at each read point, float64: every component's share of the score, which they sum
    to (`residual`: how far not). For a contrast set a point is a pair (its last prompt position, clean run)."""

    model: str = schema_field(MODEL)
    source: str = schema_field("what it was measured on")  # what was read
    metric: str = schema_field("logit difference, or the logit of the next token")
    shares: Shares
    tokens: list[list[str]]  # per point: a contrast pair's prompt (what head_positions are over); else the read token

    @payload("positions (or pairs) averaged over")
    def points(self) -> int:
        return len(self.tokens)

    @payload(N_LAYERS.description)
    def n_layers(self) -> int:
        return int(self.shares.heads.shape[1])

    @payload(N_HEADS.description)
    def n_heads(self) -> int:
        return int(self.shares.heads.shape[2])

    corrupt_score: Tensor | None = None  # (points,) the model's logit difference on the corrupt prompts
    capped: bool = schema_field("whether the model soft-caps its logits",
                                default=False)  # DLA and the score are of the logits before capping

    @payload("the model's own mean score")
    def logit_diff(self) -> float:
        return float(self.shares.model_score.mean())

    @payload("a contrast set's corrupt runs' mean score (null on text)")
    def logit_diff_corrupt(self) -> float | None:
        return None if self.corrupt_score is None else float(self.corrupt_score.mean())

    dtype: str = schema_field(DTYPE, default="float32")  # the shares are float64 sums of the model's values in it

    @payload("the decomposition's check")
    def identity(self) -> Identity:
        return Identity(float(self.total.mean()), self.residual, self.rounding_bound)

    @payload("the mean share of each component")
    def components(self) -> Components:
        shares = self.shares
        return Components(float(shares.embeddings.mean()), float(shares.heads.sum(dim=(1, 2)).mean()),
                          float(shares.attention_biases.sum(dim=1).mean()), shares.mlps.mean(dim=0).tolist(),
                          float(shares.final_bias.mean()))

    @payload("every head, largest |share| first", key="heads", items="one head")
    def head_shares(self) -> list[HeadShare]:
        per_head = self.per_head
        return [HeadShare(layer, head, float(per_head[layer, head]))
                for layer, head in self.top_heads(per_head.numel())]

    @payload("the top heads' shares by source position", type=("object", "null"))
    def per_position(self) -> dict[str, Any] | None:
        positions = self.shares.head_positions
        if positions is None:
            return None
        heads = self.top_heads(PER_POSITION_HEADS)
        return {"heads": [{"layer": layer, "head": head} for layer, head in heads],
                "points": [{"tokens": tokens, "values": [positions[point, layer, head, :len(tokens)].tolist()
                                                         for layer, head in heads]}
                           for point, tokens in enumerate(self.tokens)]}

    @property
    def per_head(self) -> Tensor:
        """(n_layers, n_heads): each head's share, mean over points."""
        return self.shares.heads.mean(dim=0)

    @property
    def total(self) -> Tensor:
        shares = self.shares
        return (shares.embeddings + shares.heads.sum(dim=(1, 2)) + shares.attention_biases.sum(dim=1)
                + shares.mlps.sum(dim=1) + shares.final_bias)

    @property
    def residual(self) -> float:
        return float((self.total - self.shares.model_score).abs().max())

    @property
    def rounding_bound(self) -> float | None:
        """The largest bound the model's own rounding allows the residual (docs/precision.md)."""
        return None if self.shares.rounding is None else float(self.shares.rounding.max())

    def top_heads(self, count: int) -> list[tuple[int, int]]:
        order = self.per_head.abs().flatten().argsort(descending=True)[:count]
        return [divmod(int(index), self.per_head.shape[1]) for index in order]

    def to_frame(self) -> Any:
        """A pandas DataFrame, one row per head, largest |share| first (the dla schema's columns). Needs pandas."""
        return frame(record_rows(self.head_shares))


def logit_attribution(loaded: LoadedModel, contrast: ContrastSet, *, batch_size: int = 8,
                      per_position: bool = True) -> Attribution:
    """DLA of logit(answer) - logit(distractor) at each pair's last prompt position, on the clean prompts; the
    corrupt prompts' logit differences are run too, for the report."""
    rows = torch.arange(len(contrast))
    targets = Targets(rows, contrast.last, contrast.answer, contrast.distractor)
    shares = attribute(loaded, contrast.clean, targets, mask=contrast.mask, per_position=per_position,
                       batch_size=batch_size)
    corrupt = logit_diffs(loaded, contrast, contrast.corrupt, batch_size=batch_size)
    tokens = [token_strings(loaded, contrast.clean[row, :int(contrast.last[row]) + 1]) for row in range(len(contrast))]
    return Attribution(loaded.name, contrast.description, "logit difference", shares, tokens, corrupt,
                       logits_capped(loaded.model), model_dtype(loaded))


def next_token_attribution(loaded: LoadedModel, ids: Tensor, mask: Tensor | None = None, *,
                           batch_size: int = 8) -> Attribution:
    """The direct effect of each component on the logit of the correct next token, at every position of natural
    text (`ids` (rows, positions), right-padded under `mask`) whose next token is a token."""
    present = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
    rows, positions = (present[:, 1:] & present[:, :-1]).nonzero(as_tuple=True)
    targets = Targets(rows, positions, ids[rows, positions + 1])
    shares = attribute(loaded, ids, targets, mask=mask, batch_size=batch_size)
    tokens = [[token] for token in token_strings(loaded, ids[rows, positions])]
    return Attribution(loaded.name, f"natural text, {ids.shape[0]} sequences, {len(rows)} positions",
                       "logit of the next token", shares, tokens, capped=logits_capped(loaded.model),
                       dtype=model_dtype(loaded))
