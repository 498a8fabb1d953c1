"""What a head writes (its OV circuit through the unembedding) and its composition partners (Elhage et al. 2021)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from probe.circuits.composition import Composition
from probe.circuits.composition import embedding_matrices, layer_weights
from probe.heads.evidence import TOP_PARTNERS, Partner
from probe.hooks.layers import attention_layers

PROMOTED = 6  # tokens listed per attended token


def partners(composition: Composition, layer: int, head: int) -> tuple[list[Partner], list[Partner]]:
    """(feeders, readers): the TOP_PARTNERS strongest heads composing into this head, and those it composes into."""
    feeders: list[Partner] = []
    readers: list[Partner] = []
    for kind in composition.scores:
        table = composition.scores[kind]
        into = table[:layer, :, layer, head].nan_to_num(-1.0).flatten()  # (earlier layers * heads)
        for index in into.argsort(descending=True)[:TOP_PARTNERS].tolist():
            if float(into[index]) > 0:
                earlier, its_head = divmod(index, table.shape[1])
                feeders.append(Partner(earlier, its_head, kind, float(into[index])))
        out = table[layer, head, layer + 1:].nan_to_num(-1.0).flatten()
        for index in out.argsort(descending=True)[:TOP_PARTNERS].tolist():
            if float(out[index]) > 0:
                later, other = divmod(index, table.shape[3])
                readers.append(Partner(layer + 1 + later, other, kind, float(out[index])))
    readers.sort(key=lambda p: -p.score)
    return feeders, readers[:TOP_PARTNERS]


class OVReader:
    """Each layer's OV matrices and the embedding and unembedding, read once."""

    def __init__(self, model: nn.Module, tokens: Any) -> None:
        self.W_E, self.W_U = embedding_matrices(model)
        self.layers = [layer_weights(model, layer) for layer in attention_layers(model)]
        self.tokens = tokens  # ids -> visible strings

    def writes(self, layer: int, head: int, attended: list[int]) -> list[dict[str, Any]]:
        """For each attended id, the tokens whose logits the head's output raises most when it copies that id."""
        weights = self.layers[layer]
        out = []
        for token in attended:
            direction: Tensor = (self.W_E[token].double() @ weights.W_V[head] @ weights.W_O[head]).float()
            logits = direction @ self.W_U
            top = logits.topk(min(PROMOTED, logits.numel()))
            out.append({"token": self.tokens([token])[0], "promotes": [
                {"token": text, "logit": round(float(value), 4)}
                for text, value in zip(self.tokens(top.indices.tolist()), top.values)]})
        return out

