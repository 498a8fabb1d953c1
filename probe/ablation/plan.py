"""The plan of a sweep: batches, chunks of ablations (one start block each), copies to stack, chunks per process."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from probe.ablation.heads import Ablation
from probe.ablation.methods import METHODS, AblationMethod
from probe.inputs import ProbeSet
from probe.errors import ProbeError
from probe.progress import Progress

STACK_BYTES = 1 << 30  # activations (and logits, where whole) of one stacked forward: how many copies to stack
CACHE_BYTES = 4 << 30  # kept block outputs of the baseline; beyond this they are recomputed per layer


@dataclass
class Work:
    """Progress counted in what a run costs (`scale` per unit; the sweep's and the estimate's: forward_costs), so that
    the time left follows the work left: `total` is an upper bound until what runs is known."""

    total: float
    progress: Progress | None
    scale: float = 1.0
    done: float = 0.0

    def advance(self, amount: float) -> None:
        self.done += amount
        self.report()

    def report(self) -> None:
        if self.progress is not None:
            total = max(1, round(self.total * self.scale))
            self.progress(min(round(self.done * self.scale), total), total)


def check_probe_set(probe_set: ProbeSet) -> None:
    """A next token to predict: at least one sequence of at least 2 tokens."""
    ids = probe_set.input_ids
    if ids.dim() != 2 or ids.shape[1] < 2 or ids.shape[0] < 1:
        raise ProbeError("the probe data needs at least one sequence of at least 2 tokens (a next token to predict)")


def check_sources(probe_set: ProbeSet, method: type[AblationMethod]) -> None:
    """A probe set whose encoder reads its own sources runs no method that reads other sequences' values."""
    if probe_set.source_ids is not None and method.across_sequences:
        usable = [name for name, entry in METHODS.items() if not entry.across_sequences]
        raise ProbeError(f"source/target pairs are swept with method {' or '.join(usable)}, not {method.name}: their "
                         "encoder reads positions of its own", parameter="method")


def refuse_sources(probe_set: ProbeSet, what: str) -> None:
    """Prune and the estimate do not pass an encoder's own sources."""
    if probe_set.source_ids is not None:
        raise ProbeError(f"source/target pairs are swept (zero or window ablation), not run through {what}: its "
                         "passes do not give the encoder its own sources", parameter="method")


def data_name(probe_set: ProbeSet, data: str | Path | None) -> str:
    """What a result names its data: repeated, natural, the text file, the seq2seq or the labels file."""
    if probe_set.name in ("seq2seq", "labels"):
        return str(probe_set.meta.get("source", probe_set.name))
    if probe_set.name == "repeated" or probe_set.name.startswith("task:"):
        return probe_set.name
    return "natural" if data is None else str(data)


def chunks(ablations: Sequence[Ablation], start_of: Callable[[Ablation], int], stack: int) -> list[list[Ablation]]:
    """Ablations that start in the same block, in groups of at most `stack`, split evenly."""
    groups: dict[int, list[Ablation]] = {}
    for ablation in ablations:
        groups.setdefault(start_of(ablation), []).append(ablation)
    out: list[list[Ablation]] = []
    for start in sorted(groups):
        items = groups[start]
        n = math.ceil(len(items) / stack)
        size = math.ceil(len(items) / n)
        out.extend(items[i:i + size] for i in range(0, len(items), size))
    return out


def default_stack(model: nn.Module, inputs: Sequence[Tensor], vocab_size: int, chunked: bool, lean: bool,
                  logits_bytes: int) -> int:
    """As many copies as fit in STACK_BYTES, the logits counted unless `chunked`; long inputs (`lean`) one copy each."""
    if chunked and lean:
        return 1
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or 1024
    # a copy's activations (about 24 hidden-size vectors a token), and its logits
    per_copy = max(int(ids.numel()) * 4 * (vocab_size * (not chunked) + 24 * hidden) for ids in inputs)
    logits_per_copy = 0 if chunked else max(int(ids.numel()) * 4 * vocab_size for ids in inputs)
    return max(1, min(STACK_BYTES // max(per_copy, 1), logits_bytes // max(logits_per_copy, 1)))


def assign_chunks(costs: Sequence[float], world_size: int) -> list[int]:
    """The rank of each chunk, largest first to the least-loaded rank: every process computes the same split."""
    if world_size < 1:
        raise ProbeError(f"world size must be at least 1, got {world_size}")
    load = [0.0] * world_size
    owner = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[index] = rank
        load[rank] += costs[index]
    return owner
