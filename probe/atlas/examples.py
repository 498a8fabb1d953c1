"""Each head's examples: the query positions where its output is largest, and a few from lower deciles (as
Neuronpedia's HeadVis), from two passes: output norms and top keys, then the chosen queries' attention to shade."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from probe.circuits.composition import layer_weights
from probe.inputs import ProbeSet, real_tokens
from probe.heads.classify import forward
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.types import HookContext
from probe.models import LoadedModel
from probe.patterns import token_strings

TOP_EXAMPLES = 5  # the largest outputs of a head
LOWER = (0.5, 0.75, 0.95)  # and one example at each of these fractions of its positions, largest first
CONTEXT = 12  # tokens before the query shown with an example
KEY_CONTEXT = 3  # tokens either side of the top key, where it lies before the context

Step = Callable[[], None]


@dataclass
class Example:
    """One query position of one head: output norm, decile, the tokens before it with its attention, its top key."""

    sequence: int
    position: int
    norm: float
    decile: int  # 1: the top 10% of the head's positions by output norm
    nonfirst: float  # its largest attention to a key after the first
    spans: list[dict[str, Any]] = field(default_factory=list)  # {"first", "weights", "tokens"}: shown stretches
    top_key: int = -1
    top_weight: float = 0.0
    top_token: int = -1  # the id at top_key

    def to_dict(self) -> dict[str, Any]:
        return {"sequence": self.sequence, "position": self.position, "norm": round(self.norm, 5),
                "decile": self.decile, "nonfirst": round(self.nonfirst, 4),
                "spans": [{"first": span["first"], "tokens": span["tokens"],
                           "weights": [round(w, 3) for w in span["weights"]]} for span in self.spans],
                "top_key": self.top_key,
                "top_weight": round(self.top_weight, 4)}


@dataclass
class Activity:
    """Per (row, position, layer, head): output norm and largest attention to a non-first key; valid positions."""

    norms: Tensor
    nonfirst: Tensor
    valid: Tensor  # (rows, positions) bool: real tokens after the offset (BOS excluded)

    def mean_norms(self) -> Tensor:
        """(layers, heads) mean output norm over valid positions."""
        mask = self.valid[:, :, None, None].float()
        return (self.norms * mask).sum(dim=(0, 1)) / mask.sum().clamp(min=1)


def activity(loaded: LoadedModel, probe_set: ProbeSet, batch_size: int = 8, step: Step | None = None) -> Activity:
    """The first pass: every head's output norm and largest non-first attention at every position."""
    layers = attention_layers(loaded.model)
    rows, length = probe_set.input_ids.shape
    heads = max(layer.n_heads for layer in layers)
    norms = torch.zeros(rows, length, len(layers), heads)
    nonfirst = torch.zeros(rows, length, len(layers), heads)
    outputs = [layer_weights(loaded.model, layer).W_O.float() for layer in layers]  # (heads, head_dim, d_model) each
    at = [0]

    def on_weights(weights: Tensor, ctx: HookContext) -> None:
        b, h, block, _ = weights.shape
        top = weights[..., 1:].amax(dim=-1) if weights.shape[-1] > 1 else torch.zeros(b, h, block)
        nonfirst[at[0]:at[0] + b, ctx.start:ctx.start + block, ctx.layer, :h] = top.permute(0, 2, 1).float().cpu()

    def read_heads(values: Tensor, ctx: HookContext) -> None:
        b, n, h, _ = values.shape
        written = torch.einsum("bnhd,hdm->bnhm", values.float(), outputs[ctx.layer].to(values.device))
        norms[at[0]:at[0] + b, :n, ctx.layer, :h] = written.norm(dim=-1).cpu()

    valid = torch.zeros(rows, length, dtype=torch.bool)
    with torch.no_grad(), attention_hooks(loaded.model, {"pattern": on_weights, "z": read_heads}):
        for ids, mask in probe_set.batches(batch_size):
            valid[at[0]:at[0] + ids.shape[0], :ids.shape[1]] = real_tokens(ids, mask)
            forward(loaded.model, ids, mask)
            at[0] += ids.shape[0]
            if step is not None:
                step()
    valid[:, :max(1, probe_set.offset)] = False  # the first position attends to itself alone
    return Activity(norms, nonfirst, valid)


def choose(found: Activity) -> dict[tuple[int, int], list[Example]]:
    """Per head, the TOP_EXAMPLES positions of largest output norm and one at each fraction of LOWER."""
    _rows, length, n_layers, n_heads = found.norms.shape
    where = found.valid.flatten().nonzero().squeeze(1)  # flat (row * length + position) of valid positions
    chosen: dict[tuple[int, int], list[Example]] = {}
    for layer in range(n_layers):
        for head in range(n_heads):
            values = found.norms[:, :, layer, head].flatten()[where]
            order = values.argsort(descending=True)
            ranks = list(range(min(TOP_EXAMPLES, len(order))))
            ranks += sorted({min(len(order) - 1, int(f * len(order))) for f in LOWER} - set(ranks))
            examples = []
            for rank in ranks:
                flat = int(where[order[rank]])
                row, position = divmod(flat, length)
                examples.append(Example(row, position, float(values[order[rank]]), 1 + 10 * rank // len(order),
                                        float(found.nonfirst[row, position, layer, head])))
            chosen[(layer, head)] = examples
    return chosen


def attend(loaded: LoadedModel, probe_set: ProbeSet, chosen: dict[tuple[int, int], list[Example]],
           batch_size: int = 8, step: Step | None = None) -> None:
    """The second pass: each chosen query's attention over the CONTEXT tokens before it, and its top key."""
    by_layer: dict[int, list[tuple[int, Example]]] = {}
    for (layer, head), examples in chosen.items():
        by_layer.setdefault(layer, []).extend((head, example) for example in examples)
    at = [0]

    def on_weights(weights: Tensor, ctx: HookContext) -> None:
        b, _, block, _ = weights.shape
        for head, example in by_layer.get(ctx.layer, []):
            row, query = example.sequence - at[0], example.position - ctx.start
            if 0 <= row < b and 0 <= query < block:
                _shade(example, weights[row, head, query, :example.position + 1].float().cpu())

    with torch.no_grad(), attention_hooks(loaded.model, {"pattern": on_weights}, layers=set(by_layer)):
        for ids, mask in probe_set.batches(batch_size):
            forward(loaded.model, ids, mask)
            at[0] += ids.shape[0]
            if step is not None:
                step()
    ids = probe_set.input_ids
    for examples in chosen.values():
        for example in examples:
            row = ids[example.sequence]
            for span in example.spans:
                span["tokens"] = token_strings(loaded, row[span["first"]:span["first"] + len(span["weights"])])
            example.top_token = int(row[example.top_key]) if example.top_key >= 0 else -1


def _shade(example: Example, line: Tensor) -> None:
    """The query's weights over the CONTEXT tokens before it, and around its top key where that lies further back."""
    example.top_key = int(line.argmax())
    example.top_weight = float(line[example.top_key])
    first = max(0, example.position - CONTEXT)
    example.spans = []
    if example.top_key < first - KEY_CONTEXT:
        start = max(0, example.top_key - KEY_CONTEXT)
        example.spans.append({"first": start, "weights": line[start:example.top_key + KEY_CONTEXT + 1].tolist()})
    else:
        first = min(first, example.top_key)
    example.spans.append({"first": first, "weights": line[first:].tolist()})


def head_examples(loaded: LoadedModel, probe_set: ProbeSet, batch_size: int = 8,
                  step: Step | None = None) -> tuple[Activity, dict[tuple[int, int], list[Example]]]:
    """Both passes: the activity of every head and its chosen examples, shaded."""
    found = activity(loaded, probe_set, batch_size, step)
    chosen = choose(found)
    attend(loaded, probe_set, chosen, batch_size, step)
    return found, chosen


def attended_tokens(examples: list[Example], count: int = 3) -> list[int]:
    """The ids a head attends to most in its top examples (the first key left out where another exists)."""
    tokens: list[int] = []
    for example in examples[:TOP_EXAMPLES]:
        if example.top_token >= 0 and example.top_key > 0 and example.top_token not in tokens:
            tokens.append(example.top_token)
    return tokens[:count]
