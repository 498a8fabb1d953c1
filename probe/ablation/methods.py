"""Interventions on heads: what stands in for a chosen head's output (or its query, key or value). One class per
method, one signature (`replacement(heads, ctx)`, as pyvene's), so that one object serves `Trace`, the sweep, prune,
self-repair and `probe steer`; callers ask a method what it needs, never its name, and bind it before any forward.
`ablate()` and `ablated()` (stacked copies of a batch, at the method's own hook point) apply one to a model."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from probe.ablation.heads import Ablation, Head, check_heads, heads_by_layer
from probe.ablation.statistics import HeadOutputs, HeadStatistics, head_outputs, head_statistics
from probe.hooks.capture import attention_hooks
from probe.hooks.layers import AttentionLayer, attention_layers
from probe.hooks.points import Writer
from probe.hooks.types import AttentionInputs, BatchContext, Handler, HookContext
from probe.inputs import ProbeSet
from probe.errors import ProbeError
from probe.models import LoadedModel


@dataclass(frozen=True)
class MethodInputs:
    """Everything a caller can hand a registered method; each method's `build` takes what it declares."""

    statistics: HeadStatistics | None = None  # the statistics the method declares, over a reference set
    seed: int = 0  # for methods that draw at random (resample's derangement)
    value: float | None = None  # the method's `parameter` (scale's alpha); None: its default


def batch_index(ctx: HookContext) -> int | None:
    """The index of the probe set's batch that runs (None outside a probe set's run)."""
    return None if ctx.batch is None else ctx.batch.index


class AblationMethod:
    """An intervention: what chosen heads output instead of their own output (see the module docstring)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # what replaces the head's output, for help texts
    statistics: ClassVar[tuple[str, ...]] = ()  # statistics of the heads' outputs the replacement reads
    per_copy: ClassVar[bool] = False  # the replacement depends on each stacked copy's own values (resample)
    across_sequences: ClassVar[bool] = False  # reads other sequences' values at the same positions
    estimable: ClassVar[bool] = False  # the attribution-patching estimate linearises it
    point: ClassVar[str] = "z"  # the hook point it writes: "z" (outputs), "inputs" (patching), "recompute" (window)
    parameter: ClassVar[str | None] = None  # the one number it is made with (`MethodInputs.value`), e.g. "alpha"
    identity: ClassVar[float | None] = None  # the parameter's value that leaves the model as it is (scale: 1)

    @classmethod
    def build(cls, inputs: MethodInputs) -> AblationMethod:
        """The method, made from what a caller has: what of `inputs` its constructor takes (a None value: its default;
        `inputs.statistics` holds what `statistics` names)."""
        taken = inspect.signature(cls).parameters
        given = {"statistics": inputs.statistics, "seed": inputs.seed, "value": inputs.value}
        return cls(**{name: value for name, value in given.items() if name in taken and value is not None})

    def bind(self, batches: Sequence[BatchContext]) -> None:
        """Called once with every batch a run runs: what it fixes per batch is fixed before any forward."""

    def bound_to(self, batches: Sequence[BatchContext]) -> AblationMethod:
        """A copy bound to `batches` (`bind`), so that one object serves runs over different probe sets."""
        method = copy.copy(self)
        method.bind(batches)
        return method

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        """Values broadcastable to `heads` (batch, positions, n_heads, head_dim); only the chosen heads' are used."""
        raise NotImplementedError

    def replaced(self, tensor: Tensor, ctx: HookContext, chosen: Tensor) -> Tensor:
        """`tensor` with the `chosen` slices replaced: each copy's own where `per_copy`, else the first's."""
        copies = chosen.shape[0]
        stacked = tensor.reshape(copies, tensor.shape[0] // copies, *tensor.shape[1:])  # (copies, batch, ...)
        if self.per_copy:  # each copy's own values (copies differ once an earlier layer is ablated)
            replacement = torch.stack([self.replacement(each, ctx) for each in stacked])
        else:
            replacement = self.replacement(stacked[0], ctx)
        return torch.where(chosen.to(tensor.device), replacement, stacked).reshape(tensor.shape)

    def writer(self, heads: int | Iterable[int], rows: Iterable[int] | None = None) -> Writer:
        """A `Trace` writer of `z`, `q`, `k` or `v`: the chosen heads (of `rows` alone; None: all) replaced."""
        wanted, only = heads, None if rows is None else list(rows)

        def write(tensor: Tensor, ctx: HookContext) -> Tensor:
            chosen, n_heads = [wanted] if isinstance(wanted, int) else list(wanted), tensor.shape[2]
            bad = [head for head in chosen if not 0 <= head < n_heads]
            if bad:
                raise ProbeError(f"layer {ctx.layer} has heads 0 to {n_heads - 1}, not {bad[0]}", parameter="heads")
            by_head = torch.zeros(n_heads, dtype=torch.bool)
            by_head[chosen] = True
            by_row = torch.ones(tensor.shape[0] if only else 1, dtype=torch.bool)
            if only:
                by_row[:] = False
                by_row[only] = True
            return self.replaced(tensor, ctx, (by_row[:, None, None, None] & by_head[:, None])[None])

        return write

    def handler(self, ablations: Sequence[Ablation]) -> tuple[Handler, set[int]]:
        """The `point` handler for stacked copies of a batch (copy i: ablations[i]), and the layers it edits."""
        copies, by_layer = len(ablations), heads_by_layer(ablations)
        masks: dict[tuple[int, torch.device], Tensor] = {}  # made once per layer on the heads' device

        def edit(heads: Tensor, ctx: HookContext) -> Tensor:  # heads: (copies * batch, positions, n_heads, head_dim)
            entries = by_layer.get(ctx.layer)
            if not entries:
                return heads
            key = (ctx.layer, heads.device)
            if key not in masks:
                mask = torch.zeros(copies, 1, 1, heads.shape[2], 1, dtype=torch.bool)
                for each, heads_of_copy in entries.items():
                    mask[each, 0, 0, heads_of_copy, 0] = True
                masks[key] = mask.to(heads.device)
            return self.replaced(heads, ctx, masks[key])

        return edit, set(by_layer)

    def check(self, layers: Sequence[AttentionLayer], edited: set[int]) -> None:
        """Refuse (ProbeError, one line) layers the method cannot act on; every layer by default."""

    def describe(self) -> str | None:
        """What the replacement was taken over, for reports (None: nothing to say)."""
        return None

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        """Feed what the replacement depends on to a results stream's fingerprint (resume tells two sweeps apart)."""


def chained(writers: Sequence[Writer]) -> Writer:
    """One writer running `writers` in turn (several interventions on one layer)."""
    def write(tensor: Tensor, ctx: HookContext) -> Tensor:
        for each in writers:
            tensor = each(tensor, ctx)
        return tensor

    return write


METHODS: dict[str, type[AblationMethod]] = {}
"""Ablation methods by name; a new method is one class registered here (`register_method`)."""


def register_method(method: type[AblationMethod]) -> type[AblationMethod]:
    """Register a method class under its name (usable as a class decorator)."""
    METHODS[method.name] = method
    return method


@register_method
class ZeroAblation(AblationMethod):
    name = "zero"
    summary = "set the head's output to 0"
    estimable = True

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        return torch.zeros((), dtype=heads.dtype, device=heads.device)


class ValueIntervention(AblationMethod):
    """Made with one finite number, its `parameter` (`probe steer --values`); at `zero` it is zero ablation."""

    per_copy = True  # it changes each stacked copy's own values
    parameter = "value"
    minimum: ClassVar[float] = -math.inf
    zero: ClassVar[float | None] = 0.0

    def __init__(self, value: float = 0.0) -> None:
        value = float(value)
        if not (math.isfinite(value) and value >= self.minimum):
            floor = "" if self.minimum == -math.inf else f" >= {self.minimum:g}"
            raise ProbeError(f"{self.parameter} must be a finite number{floor}, got {value}", parameter=self.parameter)
        self.value = value

    def change(self, heads: Tensor) -> Tensor:
        """The heads' outputs changed by the value (other than `zero`)."""
        raise NotImplementedError

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        if self.value == self.zero:  # zero ablation exactly (0 * inf would be nan, 0 * -1 is -0)
            return torch.zeros_like(heads)
        return self.change(heads)

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        digest.update(f"{self.name} {self.value!r}".encode())


@register_method
class ScaleAblation(ValueIntervention):
    """The head's output times `alpha` (steering through single heads: SAMD, 2025); 0 is zero ablation exactly."""

    name = "scale"
    summary = "multiply the head's output by alpha (probe steer's default intervention; 0 is zero ablation)"
    parameter, identity = "alpha", 1.0

    @property
    def alpha(self) -> float:
        return self.value

    def change(self, heads: Tensor) -> Tensor:
        return heads * self.value

    def describe(self) -> str | None:
        return f"head outputs multiplied by {self.alpha:g}"


class AddIntervention(AblationMethod):
    """A vector (head_dim,) added to the head's output at every position; not in METHODS (`add_to_head`)."""

    name = "add"
    summary = "add a vector to the head's output at every position"

    def __init__(self, vector: Tensor) -> None:
        self.vector = vector

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        return heads + self.vector.to(heads.device, heads.dtype)

    def describe(self) -> str | None:
        return f"a vector of norm {float(self.vector.float().norm()):.4g} added to the head outputs"

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        digest.update(self.vector.detach().cpu().double().numpy().tobytes())


def scale_head(heads: int | Iterable[int], alpha: float) -> Writer:
    """A `Trace` writer multiplying the chosen heads' slices by `alpha` (0: zero ablation); for `z`, `q`, `k` or `v`."""
    return ScaleAblation(alpha).writer(heads)


def add_to_head(heads: int | Iterable[int], vector: Tensor) -> Writer:
    """A `Trace` writer adding `vector` (head_dim,) to the chosen heads at every position; for `z`, `q`, `k`, `v`."""
    return AddIntervention(vector).writer(heads)


class StatisticAblation(AblationMethod):
    """A method whose replacement reads statistics of the heads' outputs over a reference set."""

    def __init__(self, statistics: HeadStatistics | None = None) -> None:
        if statistics is None:
            raise ProbeError(f"{self.name} ablation reads the heads' {', '.join(self.statistics)} over a reference set "
                             "(head_statistics)", parameter="statistics")
        statistics.check_holds(self.statistics, self.name)
        self.reference = statistics

    def describe(self) -> str | None:
        return self.reference.describe(self.statistics)

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        self.reference.add_to_fingerprint(digest, self.statistics)


@register_method
class MeanAblation(StatisticAblation):
    name = "mean"
    summary = "set the head's output to its mean over the probe data"
    statistics = ("mean",)
    across_sequences = True

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        return self.reference.at("mean", ctx.layer, heads)  # (n_heads, head_dim), or (positions, n_heads, head_dim)


@register_method
class NoiseAblation(StatisticAblation):
    """The head's mean output plus Gaussian noise of its std (Meng et al. 2022), seeded by seed, layer and batch."""

    name = "noise"
    summary = "set the head's output to its mean plus seeded Gaussian noise of its standard deviation"
    statistics = ("mean", "std")
    across_sequences = True

    def __init__(self, statistics: HeadStatistics | None = None, seed: int = 0) -> None:
        super().__init__(statistics)
        self.seed = seed

    def noise(self, layer: int, shape: torch.Size, batch: int | None) -> Tensor:
        """Standard normal draws of `shape` (batch, positions, n_heads, head_dim), fixed by seed, layer and batch."""
        seed = (self.seed * 1_000_003 + layer) * 1_000_003 + (0 if batch is None else batch + 1)
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        noise = self.noise(ctx.layer, heads.shape, batch_index(ctx)).to(device=heads.device, dtype=heads.dtype)
        return self.reference.at("mean", ctx.layer, heads) + self.reference.at("std", ctx.layer, heads) * noise

    def describe(self) -> str | None:
        return f"{super().describe()}, noise seed {self.seed}"

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        super().add_to_fingerprint(digest)
        digest.update(f"noise seed {self.seed}".encode())


class PatchAblation(AblationMethod):
    """Activation patching: a head's output taken from the same row of a source run (not in METHODS: `probe patch`)."""

    name = "patch"
    summary = "set the head's output to its output on the same row of a source run (activation patching)"
    across_sequences = True
    what: ClassVar[str] = "output"  # what of the head it patches: "output", or the AttentionInputs field
    per_kv_group: ClassVar[bool] = False  # one patch changes a key/value group's query heads together (keys, values)

    positions_axis: ClassVar[int] = 1  # of what it patches: heads (batch, positions, n_heads, head_dim)

    def __init__(self, source: HeadOutputs, position: int | None = None) -> None:
        """`position`: patch that position alone (None: every one); the others keep each copy's own values."""
        self.source, self.position = source, position
        self.per_copy = position is not None  # type: ignore[misc]

    def at(self, position: int) -> PatchAblation:
        """The same patch at `position` alone (the source's values are shared, not taken again)."""
        return type(self)(self.source, position)

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        patched = self.source.at(ctx.layer, heads, batch_index(ctx))
        if self.position is None:
            return patched
        shape = [1] * heads.dim()
        shape[self.positions_axis] = heads.shape[self.positions_axis]
        at = (torch.arange(heads.shape[self.positions_axis], device=heads.device) == self.position).view(shape)
        return torch.where(at, patched, heads)

    def describe(self) -> str | None:
        where = "" if self.position is None else f" at position {self.position}"
        return f"{self.what} patched from {self.source.source}{where}"

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        digest.update(f"{self.name} at {self.position}".encode())
        self.source.add_to_fingerprint(digest)


class InputPatch(PatchAblation):
    """Patching a head's query, key or value; a key or value patches every query head of its key/value group."""

    point = "inputs"
    positions_axis = 2  # queries (batch, heads, positions, head_dim), keys and values per key/value head

    def handler(self, ablations: Sequence[Ablation]) -> tuple[Handler, set[int]]:
        """An `inputs` handler for stacked copies (a key or value: its heads' key/value groups), and its layers."""
        copies, by_layer = len(ablations), heads_by_layer(ablations)

        def edit(inputs: AttentionInputs, ctx: HookContext) -> AttentionInputs:
            entries = by_layer.get(ctx.layer)
            if not entries:
                return inputs
            tensor = getattr(inputs, self.what)  # (copies * batch, heads of this input, positions, head_dim)
            group = inputs.query.shape[1] // tensor.shape[1]  # query heads per key/value head (1 for the query)
            mask = torch.zeros(copies, 1, tensor.shape[1], 1, 1, dtype=torch.bool)
            for each, heads_of_copy in entries.items():
                mask[each, 0, sorted({head // group for head in heads_of_copy}), 0, 0] = True
            return dataclasses.replace(inputs, **{self.what: self.replaced(tensor, ctx, mask)})  # type: ignore[arg-type]

        return edit, set(by_layer)


class QueryPatch(InputPatch):
    name, what = "patch_query", "query"


class KeyPatch(InputPatch):
    name, what = "patch_key", "key"
    per_kv_group = True


class ValuePatch(InputPatch):
    name, what = "patch_value", "value"
    per_kv_group = True


PATCHES: dict[str, type[PatchAblation]] = {c.what: c for c in (PatchAblation, QueryPatch, KeyPatch, ValuePatch)}
"""What of a head activation patching replaces: its output, or one of its attention's inputs."""


def patch_method(loaded: LoadedModel, source: ProbeSet, component: str = "output", *,
                 batch_size: int = 8) -> PatchAblation:
    """The patching method of `component` (of PATCHES), holding the source run's values; `at(position)` for one."""
    chosen = patch_class(component)
    return chosen(head_outputs(loaded, source, chosen.what, batch_size=batch_size))


def patch_class(component: str) -> type[PatchAblation]:
    """The patching method class of `component` (a key of PATCHES), an unknown one refused."""
    if component not in PATCHES:
        raise ProbeError(f"unknown component {component!r}: use one of {', '.join(PATCHES)}", parameter="component")
    return PATCHES[component]


def derangement(rows: int, generator: torch.Generator) -> Tensor:
    """(rows,) donor of each row, never itself: a random permutation read as one cycle (a derangement for rows >= 2)."""
    order = torch.randperm(rows, generator=generator)
    donors = torch.empty(rows, dtype=torch.long)
    donors[order] = order.roll(-1)
    return donors


@register_method
class ResampleAblation(AblationMethod):
    """Each sequence's head output taken from another sequence of its batch, by a derangement seeded per batch."""

    name = "resample"
    summary = "set the head's output to its output on another sequence of the batch (a seeded derangement)"
    per_copy = True
    across_sequences = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.donors: dict[int | None, Tensor] = {}  # batch index -> (rows,) donor rows in that batch

    def donors_of(self, batch: int | None, rows: int) -> Tensor:
        if rows < 2:
            raise ProbeError("resample ablation takes a head's output from another sequence of the same batch: "
                             "a batch with one sequence has none; use more sequences or another batch_size",
                             parameter="batch_size")
        if batch not in self.donors or len(self.donors[batch]) != rows:
            seed = self.seed * 1_000_003 + (0 if batch is None else batch + 1)
            self.donors[batch] = derangement(rows, torch.Generator().manual_seed(seed))
        return self.donors[batch]

    def bind(self, batches: Sequence[BatchContext]) -> None:
        self.donors = {}  # a binding of its own (a bound copy never shares its donors with the method)
        for batch in batches:
            self.donors_of(batch.index, len(batch.rows))

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        return heads[self.donors_of(batch_index(ctx), heads.shape[0]).to(heads.device)]

    def describe(self) -> str | None:
        """The donors (set-wide row numbers, batch by batch), so that a result says exactly what was swapped."""
        start, batches = 0, []
        for index in sorted(key for key in self.donors if key is not None):
            donors = self.donors[index]
            batches.append(" ".join(str(start + int(d)) for d in donors))
            start += len(donors)
        where = f": donor of each sequence {' | '.join(batches)}" if batches else ""
        return f"resample: another sequence of the batch, seeded derangement (seed {self.seed}){where}"

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        digest.update(str(self.seed).encode())
        for index in sorted(key for key in self.donors if key is not None):
            digest.update(self.donors[index].numpy().tobytes())


@register_method
class ShuffleAblation(AblationMethod):
    """Each sequence's head output permuted over its own positions (a seeded derangement, padding never a donor): the
    head keeps what it wrote but loses where."""

    name = "shuffle"
    summary = "permute the head's output over its sequence's own positions (seeded; padding never a donor)"
    per_copy = True

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.orders: dict[tuple[bytes, bytes, torch.device], Tensor] = {}  # rows and mask -> order, on a device

    def order_on(self, batch: BatchContext | None, positions: int, device: torch.device) -> Tensor:
        """`order` on `device`, made once per batch and device (every layer and stacked copy reads the same)."""
        tokens = None if batch is None else batch.tokens(positions).cpu()
        key = (b"" if batch is None else batch.rows.cpu().numpy().tobytes(),
               b"" if tokens is None else tokens.numpy().tobytes() + bytes(str(tokens.shape), "ascii"), device)
        if key not in self.orders:
            self.orders[key] = self.order(batch, positions).to(device)
        return self.orders[key]

    def order(self, batch: BatchContext | None, positions: int) -> Tensor:
        """(rows, positions) long: the position each position takes its value from."""
        if batch is None:
            raise ProbeError("shuffle ablation permutes a sequence's own token positions and reads the batch's padding "
                             "for it: run it in a sweep, or give ablate() or Trace the batch (BatchContext.of(ids, "
                             "mask))", parameter="method")
        tokens = batch.tokens(positions).cpu()
        if tokens.shape[1] != positions:
            raise ProbeError(f"the batch's mask has {tokens.shape[1]} positions, the heads' outputs {positions}: give "
                             "the mask of the ids that run", parameter="batch")
        order = torch.arange(positions).repeat(len(batch.rows), 1)
        for row, number in enumerate(batch.rows.tolist()):
            real = tokens[row].nonzero().flatten()
            donors = derangement(len(real), torch.Generator().manual_seed(self.seed * 1_000_003 + number))
            order[row, real] = real[donors]
        return order

    def replacement(self, heads: Tensor, ctx: HookContext) -> Tensor:
        order = self.order_on(ctx.batch, heads.shape[1], heads.device)
        return heads.gather(1, order[:, :, None, None].expand_as(heads))

    def describe(self) -> str | None:
        return f"shuffle: each sequence's own token positions, a seeded derangement (seed {self.seed})"

    def add_to_fingerprint(self, digest: hashlib._Hash) -> None:
        digest.update(f"shuffle {self.seed}".encode())


@register_method
class ClampIntervention(ValueIntervention):
    """Every element of the head's output limited to [-bound, bound] (0 is zero ablation exactly)."""

    name = "clamp"
    summary = "limit every element of the head's output to [-bound, bound] (0 is zero ablation)"
    parameter, minimum = "bound", 0.0

    def change(self, heads: Tensor) -> Tensor:
        return heads.clamp(min=-self.value, max=self.value)

    def describe(self) -> str | None:
        return f"head outputs clamped to [-{self.value:g}, {self.value:g}]"


def method_class(method: str | AblationMethod) -> type[AblationMethod]:
    """The class of a method given by name (of METHODS) or as an object, to ask what it declares."""
    if isinstance(method, AblationMethod):
        return type(method)
    if method not in METHODS:
        raise ProbeError(f"unknown ablation method {method!r}: use one of {', '.join(METHODS)}", parameter="method")
    return METHODS[method]


def build_method(method: str | AblationMethod, loaded: LoadedModel | None = None, reference: ProbeSet | None = None,
                 *, statistics: HeadStatistics | None = None, per_position: bool = False, seed: int = 0,
                 batch_size: int = 8, value: float | None = None) -> AblationMethod:
    """The method given, or built by name with what it declares (statistics taken over `reference` if not given)."""
    if isinstance(method, AblationMethod):
        return method
    chosen = method_class(method)
    if chosen.statistics and statistics is None and loaded is not None and reference is not None:
        statistics = head_statistics(loaded, reference, chosen.statistics, per_position=per_position,
                                     batch_size=batch_size)
    return chosen.build(MethodInputs(statistics, seed, value))


def ablated(model: nn.Module, ablations: Sequence[Ablation], method: AblationMethod,
            batch: BatchContext | None = None) -> AbstractContextManager[list[AttentionLayer]]:
    """Stacked copies of a batch, copy i's ablations[i] replaced by `method` while the `with` runs; then restored."""
    handler, layers = method.handler(ablations)
    method.check(attention_layers(model), layers)
    return attention_hooks(model, {method.point: handler}, layers=layers, batch=batch)


@contextmanager
def ablate(model: nn.Module, heads: Iterable[Head], *, method: str | AblationMethod = "zero",
           statistics: HeadStatistics | None = None, batch: BatchContext | None = None) -> Iterator[None]:
    """Ablate `heads` together for the body of the `with` (a method of METHODS, or a method object); `batch`: the
    batch the body runs (`BatchContext.of(ids, mask)`), which the method is bound to. Restored on exit."""
    chosen = build_method(method, statistics=statistics).bound_to([] if batch is None else [batch])
    heads = tuple(heads)
    check_heads(attention_layers(model), heads)
    with ablated(model, [heads], chosen, batch):
        yield
