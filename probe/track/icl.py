"""A checkpoint's loss on the probe text and its in-context learning score (Olsson et al. 2022, section 2): the loss
on the `late`-th token minus the loss on the `early`-th, negative for a model that uses its context."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from probe.ablation.sweep import baseline_metric
from probe.inputs import ProbeSet, context_length, natural_set
from probe.errors import ProbeError
from probe.overflow import NotFiniteError
from probe.models.outputs import logits_of
from probe.hooks.run import run_model
from probe.models import LoadedModel

EARLY, LATE = 50, 500
ICL_SEQS = 128  # texts averaged: one token's loss varies by nats from text to text


@dataclass(frozen=True)
class IclScore:
    """The score, or None and one line saying why it could not be measured."""

    value: float | None
    note: str | None = None


def check_positions(early: int, late: int) -> None:
    if not 2 <= early < late:
        raise ProbeError(f"the in-context learning score compares a late token with an earlier one: need 2 <= early "
                         f"< late, got early {early}, late {late}", parameter="icl_positions")


def _token_losses(loaded: LoadedModel, probe_set: ProbeSet, positions: list[int], batch_size: int) -> torch.Tensor:
    """(sequences, len(positions)) cross-entropy of the token at each position, from the logits one before it."""
    read = torch.tensor([p - 1 for p in positions])
    rows = []
    with torch.no_grad():
        for ids, mask in probe_set.batches(batch_size):
            logits = logits_of(run_model(loaded.model, ids, mask, logits=read)).float()
            picked = logits[:, read.to(logits.device)] if logits.shape[1] == ids.shape[1] else logits
            targets = ids[:, positions].to(picked.device)
            rows.append(F.cross_entropy(picked.transpose(1, 2), targets, reduction="none").cpu())
    return torch.cat(rows)


def icl_score(loaded: LoadedModel, *, early: int = EARLY, late: int = LATE, data: str | Path | None = None,
              num_seqs: int = ICL_SEQS, batch_size: int = 8) -> IclScore:
    """Loss at token `late` minus loss at token `early` (BOS not counted); None, with the reason, where unmeasurable."""
    check_positions(early, late)
    if loaded.tokenizer is None:
        return IclScore(None, "no in-context learning score: the model has no tokenizer to read natural text")
    limit = context_length(loaded)
    if limit is not None and limit < late + 1:
        return IclScore(None, f"no in-context learning score: the model's context ({limit} tokens) is shorter than "
                              f"token {late} needs")
    try:
        probe_set = natural_set(loaded, data=data, seq_len=late, num_seqs=num_seqs)
    except ProbeError as error:
        return IclScore(None, f"no in-context learning score: {error}")
    losses = _token_losses(loaded, probe_set, [probe_set.offset + early - 1, probe_set.offset + late - 1], batch_size)
    early_loss, late_loss = losses.mean(dim=0).tolist()
    return IclScore(late_loss - early_loss)


def probe_loss(loaded: LoadedModel, *, data: str | Path | None = None, seq_len: int = 128, num_seqs: int = 8,
               batch_size: int = 8) -> float | None:
    """Mean next-token cross-entropy on the natural probe set (None without next-token logits)."""
    probe_set = natural_set(loaded, data=data, seq_len=seq_len, num_seqs=num_seqs)
    try:
        return baseline_metric(loaded, probe_set, metric="cross_entropy", batch_size=batch_size)[0]
    except NotFiniteError:
        raise  # a checkpoint whose forward overflows is refused, not tracked as having no loss
    except ProbeError:
        return None
