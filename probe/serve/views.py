"""What each endpoint of `probe serve` answers, on the worker thread: a text's view is one forward (`View`), recent
views kept, bounded in bytes, so that another head runs no forward."""

from __future__ import annotations

from collections import OrderedDict
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from probe.ablation import METHODS, ablate, head_means
from probe.ablation.heads import Head, check_heads
from probe.ablation.statistics import HeadStatistics
from probe.dla import Attribution, Targets, logits_capped, attribute
from probe.errors import ProbeError
from probe.heads.scores import SCORES, Batch
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import attention_layers
from probe.hooks.run import logits_of, run_model
from probe.hooks.types import HookContext
from probe.inputs import ProbeOptions, ProbeSet, build_probe_set
from probe.inputs.choice import GENERATED
from probe.models import LoadedModel
from probe.patterns import text_ids, token_strings
from probe.provenance import model_dtype
from probe.qk import qk_attribution
from probe.schemas import header
from probe.steering import generations, steer, steerable

FULL_TOKENS = 1024  # longer texts keep (and show) each query's top keys instead of the full matrix
TOP_KEYS = 8
TOP_NEXT = 10
CACHE_BYTES = 512 * 2**20
ABLATIONS = ("zero", "mean")  # methods of METHODS that `ablate` builds from the text's own statistics


@dataclass
class View:
    """One text's forward: what the page draws before and after a head is clicked."""

    ids: Tensor  # (n,) on the CPU
    tokens: list[str]
    loss: Tensor  # (n - 1,) nats: the loss of token t + 1 at position t
    top_ids: Tensor  # (n, TOP_NEXT)
    top_probs: Tensor
    scores: dict[str, Tensor]  # name -> (n_layers, n_heads)
    attention: dict[int, Tensor | tuple[Tensor, Tensor]]  # layer -> (h, n, n) or (values, keys) (h, n, TOP_KEYS)
    means: HeadStatistics | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        parts = [part for value in self.attention.values() for part in (value if isinstance(value, tuple) else
                                                                          (value,))]
        return sum(part.numel() * part.element_size() for part in parts) + 64 * self.ids.numel()


def _round(values: Tensor, decimals: int = 4) -> list[Any]:
    return [round(float(x), decimals) for x in values.tolist()] if values.dim() == 1 else \
        [_round(row, decimals) for row in values]


class Views:
    """The model, its recent texts' views, and one answer per endpoint (each a plain dict)."""

    def __init__(self, loaded: LoadedModel, *, max_tokens: int = 2048, cache_bytes: int = CACHE_BYTES) -> None:
        self.loaded, self.max_tokens, self.cache_bytes = loaded, max_tokens, cache_bytes
        self.layers = attention_layers(loaded.model)
        self.device = next(loaded.model.parameters()).device
        self.cache: OrderedDict[str, View] = OrderedDict()
        self.forwards = 0  # every forward the views ran (the benchmark reads it)

    def info(self) -> dict[str, Any]:
        return {"model": self.loaded.name, "dtype": model_dtype(self.loaded), "n_layers": len(self.layers),
                "n_heads": max(layer.n_heads for layer in self.layers), "max_tokens": self.max_tokens,
                "scores": {name: score.summary for name, score in SCORES.items() if score.probe == "natural"},
                "ablations": [name for name in ABLATIONS if name in METHODS], "steering": steerable(),
                "presets": self.presets}

    @cached_property
    def presets(self) -> dict[str, str]:
        """The embedded probe sets' first rows as texts (none without a tokenizer to decode them)."""
        tokenizer = self.loaded.tokenizer
        if tokenizer is None:
            return {}
        out = {}
        for name in GENERATED:  # the embedded probe sets, offered as texts
            probe_set = build_probe_set(name, self.loaded, ProbeOptions(num_seqs=1, seq_len=128, repeat_len=30))
            row = probe_set.input_ids[0, probe_set.offset:]
            out[name] = str(tokenizer.decode(row.tolist()))
        return out

    def view(self, text: str) -> tuple[View, bool]:
        """The text's view, and whether it was kept from an earlier request (no forward run)."""
        if text in self.cache:
            self.cache.move_to_end(text)
            return self.cache[text], True
        ids = torch.tensor(text_ids(self.loaded, text), dtype=torch.long)
        if ids.numel() > self.max_tokens:
            raise ProbeError(f"the text has {ids.numel():,} tokens; this server reads at most {self.max_tokens:,}",
                             parameter="text")
        if ids.numel() < 2:
            raise ProbeError("the text gives one token: give at least two", parameter="text")
        found = self._forward(ids)
        self.cache[text] = found
        while sum(view.nbytes for view in self.cache.values()) > self.cache_bytes and len(self.cache) > 1:
            self.cache.popitem(last=False)
        return found, False

    def _forward(self, ids: Tensor) -> View:
        n, names = ids.numel(), [name for name, score in SCORES.items() if score.probe == "natural"]
        bos = self.loaded.tokenizer is not None and int(ids[0]) == getattr(self.loaded.tokenizer, "bos_token_id", -1)
        batch = Batch(valid=torch.ones(1, n, dtype=torch.bool, device=self.device), offset=int(bos), repeat_len=None)
        sums: dict[tuple[str, int], list[Tensor]] = {}
        kept: dict[int, list[Any]] = {}
        heads = sum(layer.n_heads for layer in self.layers)
        full = n <= FULL_TOKENS and 2 * heads * n * n <= self.cache_bytes // 2  # float16 matrices, half the cache

        def keep(weights: Tensor, ctx: HookContext) -> None:  # (1, heads, block, keys)
            for name in names:
                total, count = SCORES[name].reduce(weights, ctx.start, batch)
                sums.setdefault((name, ctx.layer), []).extend((total.double().cpu(), count.double().cpu()))
            block = weights[0].detach()
            kept.setdefault(ctx.layer, []).append(block.half().cpu() if full else
                                                  tuple(part.cpu() for part in block.topk(min(TOP_KEYS, n), -1)))

        with torch.no_grad(), attention_hooks(self.loaded.model, {"pattern": keep}):
            logits = logits_of(run_model(self.loaded.model, ids[None].to(self.device)))[0].float().cpu()
        self.forwards += 1
        return View(ids, token_strings(self.loaded, ids), *self._losses(ids, logits), self._scores(names, sums),
                    {layer: torch.cat(parts, 1) if full else
                     (torch.cat([v for v, _ in parts], 1).half(), torch.cat([k for _, k in parts], 1).int())
                     for layer, parts in kept.items()})

    @staticmethod
    def _losses(ids: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lse = logits.logsumexp(-1)  # (n,): no (n, vocab) log-probabilities made, only the top ones
        loss = lse[:-1] - logits[:-1].gather(1, ids[1:, None])[:, 0]
        top_logits, top = logits.topk(min(TOP_NEXT, logits.shape[-1]), -1)
        return loss, top, (top_logits - lse[:, None]).exp()

    def _scores(self, names: list[str], sums: dict[tuple[str, int], list[Tensor]]) -> dict[str, Tensor]:
        out = {}
        for name in names:
            parts = [sums[(name, layer.index)] for layer in self.layers]
            totals = torch.stack([sum(part[0::2], torch.zeros_like(part[0])) for part in parts])
            counts = torch.stack([sum(part[1::2], torch.zeros_like(part[1])) for part in parts])
            out[name] = SCORES[name].finish(totals, counts).float()
        return out

    def _next(self, view: View, position: int, probs: Tensor | None = None,
              strings: dict[int, str] | None = None) -> list[dict[str, Any]]:
        """The top next tokens at `position` (and their probability in `probs`); `strings`: those already decoded."""
        ids = view.top_ids[position].tolist()
        names = [strings[i] for i in ids] if strings else token_strings(self.loaded, ids)
        rows: list[dict[str, Any]] = [{"id": token, "token": name, "p": round(float(p), 6)}
                                      for token, name, p in zip(ids, names, view.top_probs[position])]
        if probs is not None:
            for row, token in zip(rows, ids):
                row["p_after"] = round(float(probs[token]), 6)
        return rows

    def text(self, text: str) -> dict[str, Any]:
        view, cached = self.view(text)
        unique = sorted(set(view.top_ids.flatten().tolist()))  # the top tokens repeat: each decoded once
        strings = dict(zip(unique, token_strings(self.loaded, unique)))
        return {"tokens": view.tokens, "ids": view.ids.tolist(), "loss": _round(view.loss), "cached": cached,
                "mean_loss": round(float(view.loss.mean()), 6),
                "scores": {name: _round(values) for name, values in view.scores.items()},
                "next": [self._next(view, position, strings=strings) for position in range(view.ids.numel())]}

    def _position(self, view: View, position: int, what: str = "position") -> int:
        if not 0 <= position < view.ids.numel():
            raise ProbeError(f"{what} {position} is not a position of the text (0-{view.ids.numel() - 1})",
                             parameter=what)
        return position

    def head(self, text: str, head: Head) -> dict[str, Any]:
        """The head's attention on the text (full rows, or each query's top keys), and the keys it reads most."""
        view, cached = self.view(text)
        check_heads(self.layers, [head])
        layer, index = head
        stored = view.attention[layer]
        out: dict[str, Any] = {"layer": layer, "head": index, "tokens": view.tokens, "cached": cached}
        if isinstance(stored, tuple):
            values, keys = stored[0][index].float(), stored[1][index]
            kept = [row > 0 for row in values]  # a query with fewer keys than TOP_KEYS: not its masked ones
            out["top_keys_per_query"] = {"keys": [row[keep].tolist() for row, keep in zip(keys, kept)],
                                         "weights": [_round(row[keep], 3) for row, keep in zip(values, kept)]}
            received = torch.zeros(view.ids.numel()).index_add_(0, keys.reshape(-1).long(), values.reshape(-1))
        else:
            weights = stored[index].float()
            out["weights"] = _round(weights, 3)
            received = weights.sum(0)
        mass, top = (received / view.ids.numel()).topk(min(TOP_KEYS, view.ids.numel()))
        out["top_keys"] = [{"position": int(k), "token": view.tokens[int(k)], "mean_weight": round(float(m), 4)}
                           for k, m in zip(top, mass)]
        return out

    def qk(self, text: str, head: Head, query: int, key: int) -> dict[str, Any]:
        view, _ = self.view(text)
        self._position(view, query, "query")
        self._position(view, key, "key")
        check_heads(self.layers, [head])
        result = qk_attribution(self.loaded, view.ids[None].to(self.device), head, query=query, key=key,
                                source="the text")
        self.forwards += 1
        return {**header("qk"), **result.to_dict()}

    def dla(self, text: str, position: int, token: int) -> dict[str, Any]:
        view, _ = self.view(text)
        self._position(view, position)
        if not 0 <= token < self.loaded.vocab_size:
            raise ProbeError(f"token {token} is not in the vocabulary (0-{self.loaded.vocab_size - 1})",
                             parameter="token")
        targets = Targets(torch.tensor([0]), torch.tensor([position]), torch.tensor([token]))
        shares = attribute(self.loaded, view.ids[None].to(self.device), targets, per_position=True)
        self.forwards += 1
        name = token_strings(self.loaded, [token])[0]
        result = Attribution(self.loaded.name, f"the text at position {position}", f"logit of {name}", shares,
                             [[name]], capped=logits_capped(self.loaded.model), dtype=model_dtype(self.loaded))
        return {**header("dla"), **result.to_dict()}

    def ablate(self, text: str, heads: list[Head], method: str, factor: float, position: int) -> dict[str, Any]:
        """Per-token loss and next tokens at `position` with `heads` ablated or steered by `factor`, and without."""
        view, _ = self.view(text)
        self._position(view, position)
        if not heads:
            raise ProbeError("give at least one head", parameter="heads")
        check_heads(self.layers, heads)
        context: AbstractContextManager[Any]
        if method == "mean" and view.means is None:  # the text's own means, kept with its view
            view.means = head_means(self.loaded, ProbeSet("text", "the text", view.ids[None], 0))
            self.forwards += 1
        if method in ABLATIONS:
            context = ablate(self.loaded.model, heads, method=method,
                             statistics=view.means if method == "mean" else None)
        elif method in steerable():
            context = steer(self.loaded.model, {head: factor for head in heads}, intervention=method)
        else:
            raise ProbeError(f"method {method!r}: use one of {', '.join([*ABLATIONS, *steerable()])}",
                             parameter="method")
        with torch.no_grad(), context:
            logits = logits_of(run_model(self.loaded.model, view.ids[None].to(self.device)))[0].float().cpu()
        self.forwards += 1
        loss, top, probs = self._losses(view.ids, logits)
        after = View(view.ids, view.tokens, loss, top, probs, {}, {})
        return {"heads": [list(head) for head in heads], "method": method, "factor": factor, "position": position,
                "loss_before": _round(view.loss), "loss_after": _round(loss), "delta": _round(loss - view.loss),
                "mean_delta": round(float((loss - view.loss).mean()), 6),
                "next_before": self._next(view, position, logits[position].softmax(-1)),
                "next_after": self._next(after, position)}

    def generate(self, text: str, heads: list[Head], factor: float, max_new_tokens: int) -> dict[str, Any]:
        """Greedy continuations of the text: the model as it is and each head alone scaled by `factor`."""
        self.view(text)  # the size check
        check_heads(self.layers, heads)
        if not heads:
            raise ProbeError("give at least one head", parameter="heads")
        return generations(self.loaded, text, heads, [factor], max_new_tokens=max_new_tokens)
