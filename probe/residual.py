"""The residual stream as a sum of components, shared by DLA, QK attribution and self-repair: the parts of a model
that write it (`model_structure`), a forward's writes at the read points (`record_writes`), a norm frozen into a
linear map (`frozen_norm`) and the check that the writes sum to the stream (`check_stream`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from probe.ablation.blocks import Blocks, find_blocks
from probe.errors import ProbeError
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.restore import interrupts_deferred, restoring
from probe.hooks.types import HookContext
from probe.inputs import ContrastSet
from probe.models.parts import (FINAL_NORMS, MLPS, OUTPUT_PROJECTIONS, base_model, gain, named_child, output_embeddings,
                                output_projection_weight)

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

    @classmethod
    def of_contrast(cls, contrast: ContrastSet) -> Targets:
        """logit(answer) - logit(distractor) at each pair's last prompt position."""
        return cls(torch.arange(len(contrast)), contrast.last, contrast.answer, contrast.distractor)

    @classmethod
    def next_tokens(cls, ids: Tensor, mask: Tensor | None) -> Targets:
        """The next token at every position of `ids` (right-padded under `mask`) whose next token is a token."""
        present = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        rows, positions = (present[:, 1:] & present[:, :-1]).nonzero(as_tuple=True)
        return cls(rows, positions, ids[rows, positions + 1])

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

    def head_matrix(self, layer: int) -> Tensor:
        """(n_heads, value_dim, d_model): the rows of layer `layer`'s output projection each head writes through."""
        at = self.layers[layer]
        return self.projections[layer][0].view(at.n_heads, at.value_dim, -1)


def one_head_count(structure: Structure, tool: str) -> Structure:
    """`structure`, refused where its layers have different numbers of heads (a (layer, head) table needs one)."""
    if len({layer.n_heads for layer in structure.layers}) != 1:
        raise ProbeError(f"layers with different numbers of heads: {tool}'s (layer, head) table needs one",
                         parameter="model")
    return structure


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


def frozen_norm(norm: nn.Module | None, stream: Tensor) -> FrozenNorm:
    """`norm` with its scale frozen at the clean run's `stream` (points, d_model); an epsilon it lacks is 0 (the
    identity's residual shows it). No norm, or an identity, is a scale of 1."""
    if norm is None or isinstance(norm, nn.Identity):
        return FrozenNorm(False, torch.ones(stream.shape[0], dtype=torch.float64),
                          torch.ones(stream.shape[1], dtype=torch.float64), None)
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


def final_read(structure: Structure, recording: Recording) -> tuple[FrozenNorm, Tensor, Tensor]:
    """The final norm frozen at the recorded stream, the score's direction and (points, d_model) what a write is
    dotted with for its share of the score."""
    norm = frozen_norm(structure.norm, recording.final[0].double().cpu())
    direction = recording.targets.direction(structure.head.weight.detach())
    return norm, direction, norm.read(direction)


def _check_close(found: Tensor, expected: Tensor, what: str, magnitude: Tensor, dtype: torch.dtype,
                 tool: str) -> None:
    """Refuse where a write the decomposition assumes is not what the model computed. The tolerance scales with the
    dtype the model runs in: float32's relative STREAM_TOLERANCE, plus 2 eps of that dtype times `magnitude` (each
    element's sum of |terms| the model rounded: a bfloat16 stream of size 100 rounds a block's small write by 0.4)."""
    gap = (found.double() - expected.double()).abs()
    eps = torch.finfo(dtype).eps
    allowed = STREAM_TOLERANCE * max(1.0, float(expected.double().abs().max())) + 2 * eps * magnitude.to(gap.device)
    if bool((gap > allowed).any()):
        worst, name = int((gap - allowed).argmax()), str(dtype).removeprefix("torch.")
        raise ProbeError(f"{what} (off by {float(gap.flatten()[worst]):.3g} where {name} rounding allows "
                         f"{float(allowed.flatten()[worst]):.3g}): {tool} cannot decompose this model",
                         parameter="model")


def check_stream(structure: Structure, recording: Recording, tool: str = "direct logit attribution",
                 blocks: int | None = None) -> None:
    """Each attention output is its heads through the output projection; each block writes attention + MLP (the first
    `blocks` blocks, default all). Sums in float64 from the recorded values, so that only the model's own rounding is
    left to tolerate."""
    blocks = len(structure.blocks) if blocks is None else blocks
    for layer, (matrix, bias) in zip(structure.layers, structure.projections):
        if structure.blocks.of_layer[layer.index] >= blocks:
            continue
        z = recording.heads[layer.index].flatten(1).double()
        made = z @ matrix.to(z.device)
        magnitude = z.abs() @ matrix.to(z.device).abs() + (0 if bias is None else bias.to(z.device).abs())
        _check_close(made + (0 if bias is None else bias.to(made.device)), recording.attention[layer.index],
                     f"attention layer {layer.index}'s output is not its heads through its output projection",
                     magnitude, recording.attention[layer.index].dtype, tool)
    for block in range(blocks):
        attention = [recording.attention[index].double() for index, owner in enumerate(structure.blocks.of_layer)
                     if owner == block]
        written = sum(attention) + recording.mlp[block].double()
        into, out = recording.block_in[block], recording.block_out[block]
        magnitude = into.double().abs() + out.double().abs() + recording.mlp[block].double().abs() + \
            sum(part.abs() for part in attention)
        _check_close(written, out.double() - into.double(),
                     f"block {block} adds more than its attention and MLP outputs to the residual stream (a norm "
                     "after them, as in Gemma 2, or a residual added inside one, as in MPT's MLP)", magnitude,
                     out.dtype, tool)


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


def mlp_shares(structure: Structure, recording: Recording, read: Tensor) -> Tensor:
    """(points, n_blocks): each MLP's write dotted with `read`."""
    return torch.stack([(recording.mlp[block].double().cpu() * read).sum(dim=-1)
                        for block in range(len(structure.blocks))], dim=1)
