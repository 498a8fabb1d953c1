"""Direct logit attribution (DLA; docs/patching.md): what each head, MLP, the embeddings and the biases write into
the residual stream, read off by the unembedding through the final norm frozen at the clean run (Elhage et al. 2021;
Wang et al. 2022). The shares sum to the model's own score (`Attribution.residual`: how far not). Soft-capped logits
are attributed before capping (`capped`); blocks writing more than attention + MLP, and encoders, are refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from probe.frames import frame, record_rows
from probe.hooks.capture import attention_hooks
from probe.hooks.run import logits_of, run_model
from probe.inputs import ContrastSet, logit_diffs
from probe.errors import ProbeError
from probe.overflow import forwards, require_finite
from probe.models import LoadedModel
from probe.patterns import token_strings
from probe.provenance import model_dtype
from probe.residual import (Recording, Structure, Targets, check_stream, final_read, head_shares, mlp_shares,
                            model_structure, record_writes, one_head_count)
from probe.schemas.common import DTYPE, HEAD, HEAD_COLUMNS, LAYER, MODEL, N_HEADS, N_LAYERS, NUMBER, SELF_REPAIR
from probe.schemas.declare import Payload, columns, payload, published, schema_field


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


def _shares(structure: Structure, recording: Recording, logits: Tensor | None) -> Shares:
    """Every component's share of the score at each read point, and the model's own score."""
    targets = recording.targets
    norm, direction, read = final_read(structure, recording)

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
                   mlp_shares(structure, recording, read), final_bias, targets.scored(logits.double().cpu()), positions,
                   _rounding(recording, read, recording.final[1].double().cpu(), direction, logits))


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
    recording = Recording(targets)
    with torch.no_grad():
        with record_writes(structure, recording), attention_hooks(loaded.model, points={
                "z": recording.edit_heads,
                **({"pattern": recording.on_weights, "v": recording.read_values} if per_position else {})}):
            output = run_model(loaded.model, ids, mask)
        check_stream(structure, recording)
        return _shares(structure, recording, None if logits_capped(loaded.model) else recording.at(logits_of(output)))


def attribute(loaded: LoadedModel, ids: Tensor, targets: Targets, *, mask: Tensor | None = None,
              per_position: bool = False, batch_size: int = 8) -> Shares:
    """Every component's direct share of the score at each read point of `targets` (module docstring), rows of `ids`
    run `batch_size` at a time. `per_position`: heads' shares by source position too, where the model's attention
    goes through transformers' interface (else None)."""
    if batch_size < 1:
        raise ProbeError(f"batch_size must be at least 1, got {batch_size}", parameter="batch_size")
    structure = one_head_count(model_structure(loaded.model), "DLA")
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

    def joined(name: str) -> Tensor | None:  # the batches' shares end to end, a part None where a batch lacks it
        values = [getattr(part, name) for part in parts]
        return None if any(value is None for value in values) else torch.cat(values)

    shares = Shares(*(joined(item.name) for item in dataclasses.fields(Shares)))  # type: ignore[arg-type]
    require_finite(shares.model_score, "the logit difference DLA decomposes", loaded.model,
                   forwards(loaded.model, ids, mask, batch_size))
    return shares


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
    shares = attribute(loaded, contrast.clean, Targets.of_contrast(contrast), mask=contrast.mask,
                       per_position=per_position, batch_size=batch_size)
    corrupt = logit_diffs(loaded, contrast, contrast.corrupt, batch_size=batch_size)
    tokens = [token_strings(loaded, contrast.clean[row, :int(contrast.last[row]) + 1]) for row in range(len(contrast))]
    return Attribution(loaded.name, contrast.description, "logit difference", shares, tokens, corrupt,
                       logits_capped(loaded.model), model_dtype(loaded))


def next_token_attribution(loaded: LoadedModel, ids: Tensor, mask: Tensor | None = None, *,
                           batch_size: int = 8) -> Attribution:
    """The direct effect of each component on the logit of the correct next token, at every position of natural
    text (`ids` (rows, positions), right-padded under `mask`) whose next token is a token."""
    targets = Targets.next_tokens(ids, mask)
    rows, positions = targets.rows, targets.positions
    shares = attribute(loaded, ids, targets, mask=mask, batch_size=batch_size)
    tokens = [[token] for token in token_strings(loaded, ids[rows, positions])]
    return Attribution(loaded.name, f"natural text, {ids.shape[0]} sequences, {len(rows)} positions",
                       "logit of the next token", shares, tokens, capped=logits_capped(loaded.model),
                       dtype=model_dtype(loaded))
