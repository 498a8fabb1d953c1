"""Probe sets and their one registry: an entry declares its input `kind` and the options it `reads`, so that callers
ask the registry instead of knowing each set."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.reading import is_file
from probe.hooks.layers import attention_layers
from probe.hooks.run import Source
from probe.hooks.stacks import is_encoder_decoder
from probe.models import LoadedModel

ENGLISH = Path(__file__).parent / "english.txt"
DEFAULT_SEQ_LEN = 128
DEFAULT_NUM_SEQS = 8
DEFAULT_REPEAT_LEN = 50
DEFAULT_SEED = 0


@dataclass
class ProbeSet:
    """Token ids (num_seqs, length) with where the content starts: position `offset` is the first token after BOS."""

    name: str  # "natural" or "repeated"
    description: str
    input_ids: Tensor
    offset: int  # the first content position: 1 after a BOS or [CLS], else 0
    attention_mask: Tensor | None = None
    repeat_len: int | None = None  # repeated sets: R
    # which of the metric's values count: a task set's (num_seqs, length - 1) positions whose next tokens it scores; a
    # labelled set's (num_seqs, classes) gold class of each row (probe.inputs.labels)
    scored: Tensor | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source_ids: Tensor | None = None  # encoder-decoders (probe.pairs): the encoder's own input, (num_seqs, length')
    source_mask: Tensor | None = None

    def scored_batches(self, batch_size: int) -> list[Tensor | None]:
        """The rows of `scored` of each batch of `batches(batch_size)` (None each where the set has none)."""
        if self.scored is None:
            return [None] * len(self.batches(batch_size))
        return [self.scored[first:first + batch_size] for first in range(0, self.scored.shape[0], batch_size)]

    def batches(self, batch_size: int) -> list[tuple[Tensor, Tensor | None]]:
        """(ids, mask) per batch of `batch_size` sequences; right padding cut to the batch's longest sequence."""
        if batch_size < 1:
            raise ProbeError(f"batch_size must be at least 1, got {batch_size}", parameter="batch_size")
        return [self.rows(first, batch_size) for first in range(0, self.input_ids.shape[0], batch_size)]

    def rows(self, first: int, count: int) -> tuple[Tensor, Tensor | None]:
        """(ids, mask) of `count` sequences from `first`, cut to their longest (the columns none of them uses)."""
        ids = self.input_ids[first:first + count]  # (batch, positions)
        mask = None if self.attention_mask is None else self.attention_mask[first:first + count]
        if mask is not None:
            length = int(mask.sum(dim=1).max())
            ids, mask = ids[:, :length], mask[:, :length]
        return ids, mask

    def sources(self, batch_size: int) -> list[Source | None]:
        """The encoder input of each batch, right padding cut; None each without sources."""
        if self.source_ids is None:
            return [None] * len(self.batches(batch_size))
        return [(ids, mask) for ids, mask in ProbeSet("source", "", self.source_ids, 0,
                                                      self.source_mask).batches(batch_size)]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "num_seqs": int(self.input_ids.shape[0]),
                "length": int(self.input_ids.shape[1]), **self.meta}


def right_padded(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """(ids, mask) (len(rows), longest), right-padded with `pad`."""
    longest = max(len(row) for row in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row)] = 1
    return ids, mask


def real_tokens(ids: Tensor, mask: Tensor | None) -> Tensor:
    """(batch, positions) booleans: True where a batch holds a token, False on padding."""
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def is_encoder(loaded: LoadedModel) -> bool:
    """A bidirectional model (BERT-like); an encoder-decoder is not one (its output is the causal decoder's)."""
    if is_encoder_decoder(loaded.model):
        return False
    return not all(getattr(layer.module, "is_causal", True) for layer in attention_layers(loaded.model)
                   if layer.kind == "hf")


def random_tokens(loaded: LoadedModel, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Uniform random token ids that are not special tokens (the tokenizer's or the config's)."""
    special: set[int] = set()
    if loaded.tokenizer is not None:
        special.update(int(i) for i in getattr(loaded.tokenizer, "all_special_ids", []) if i is not None)
    config = getattr(loaded.model, "config", None)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id"):
        value = getattr(config, name, None)
        special.update(i for i in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(i, int))
    allowed = torch.ones(loaded.vocab_size, dtype=torch.bool)
    allowed[sorted(i for i in special if 0 <= i < loaded.vocab_size)] = False
    pool = allowed.nonzero().squeeze(1)
    if len(pool) == 0:
        raise ProbeError("the model's vocabulary has no ordinary tokens to sample")
    return pool[torch.randint(len(pool), shape, generator=generator)]


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a text without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def bos_ids(tokenizer: Any) -> list[int]:
    """[BOS] where the tokenizer has one, else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if isinstance(bos, int) else []


def wrapping(tokenizer: Any, encoder: bool) -> tuple[list[int], list[int]]:
    """The ids around a text: [CLS] ... [SEP] for an encoder, else BOS where there is one."""
    cls, sep = getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)
    if encoder and isinstance(cls, int) and isinstance(sep, int):
        return [cls], [sep]
    return bos_ids(tokenizer), []


def tokenize_prefix(tokenizer: Any, text: str, needed: int) -> list[int]:
    """Token ids of the text, tokenizing only as much of it as `needed` tokens take (the text can be long)."""
    chars = max(needed * 8, 4096)
    while True:
        if chars >= len(text):
            return encode(tokenizer, text)
        cut = text.rfind("\n", 0, chars)
        cut = chars if cut <= 0 else cut
        ids = encode(tokenizer, text[:cut])
        if len(ids) >= needed + 64:  # the margin keeps the cut from changing the tokens used
            return ids
        chars *= 2


def read_text_file(path: str | Path, *, parameter: str, what: str = "text file") -> str:
    """A UTF-8 text file, with one clear error (naming `parameter`) when it is missing, binary or empty."""
    path = Path(path)
    if not is_file(path):
        raise ProbeError(f"{what} not found: {path}", parameter=parameter)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ProbeError(f"{what} {path} is not UTF-8 text: {error.reason}", parameter=parameter) from error
    if not text.strip():
        raise ProbeError(f"{what} {path} is empty", parameter=parameter)
    return text


CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "block_size", "max_seq_len", "max_len")


def context_length(loaded: LoadedModel) -> int | None:
    """The longest input the model takes, from its config or (custom models) a usual attribute name."""
    for owner in (getattr(loaded.model, "config", None), loaded.model):
        for name in CONTEXT_ATTRIBUTES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def check_context(loaded: LoadedModel, length: int) -> None:
    """Refuse sequences longer than the model's context (`context_length`), naming seq_len."""
    limit = context_length(loaded)
    if limit is not None and length > limit:
        raise ProbeError(f"sequences of {length} tokens are longer than the model's context of {limit}: "
                         "use a smaller seq_len", parameter="seq_len")


@dataclass(frozen=True)
class ProbeOptions:
    """Everything a probe-set builder may read; each builder takes what it needs and ignores the rest."""

    data: str | Path | None = None  # natural: a UTF-8 text file (None: the embedded English text)
    seq_len: int = DEFAULT_SEQ_LEN
    num_seqs: int = DEFAULT_NUM_SEQS  # also: items of a generated task or contrast task
    repeat_len: int = DEFAULT_REPEAT_LEN
    seed: int = DEFAULT_SEED
    task: str | Path | None = None  # task / contrast: a generated task's name, or (task) a JSON-lines file
    pairs: str | Path | None = None  # contrast: clean/corrupt pairs (a JSON-lines file)
    seq2seq: str | Path | None = None  # seq2seq: an encoder-decoder's source/target texts (a JSON-lines file)
    labels: str | Path | None = None  # labels: labelled texts for a sequence classifier (a JSON-lines file)


ProbeSetBuilder = Callable[[LoadedModel, ProbeOptions], Any]  # a ProbeSet; a ContrastSet for kind "contrast"


@dataclass(frozen=True)
class ProbeSetKind:
    """One registered probe set: how it is built, what kind of input it is, and the options it reads a source from."""

    name: str
    build: ProbeSetBuilder
    kind: str = "text"  # text, task, contrast or labels: the input kinds of probe.ablation.metrics.KINDS
    summary: str = ""
    reads: tuple[str, ...] = ()  # ProbeOptions fields it needs one of (e.g. "task", "seq2seq"); () builds from defaults


PROBE_SETS: dict[str, ProbeSetKind] = {}
"""Every probe set by name, filled by the modules of probe.inputs as they are imported."""


def register_probe_set(name: str, builder: ProbeSetBuilder, *, kind: str = "text", summary: str = "",
                       reads: tuple[str, ...] = ()) -> ProbeSetBuilder:
    """Add a probe set under `name` (a new one; replacing a set would change every score computed on it)."""
    if name in PROBE_SETS:
        raise ProbeError(f"a probe set named {name!r} exists already")
    PROBE_SETS[name] = ProbeSetKind(name, builder, kind, summary, reads)
    return builder


def given(value: str | Path | None) -> str | Path:
    """A builder's source option (`reads`), which `build_probe_set` has checked is there."""
    if value is None:
        raise ProbeError("this probe set reads a source that was not given")
    return value


def build_probe_set(name: str, loaded: LoadedModel, options: ProbeOptions | None = None) -> Any:
    """The probe set `name` for this model, built with `options` (defaults where not given)."""
    entry = PROBE_SETS.get(name)
    if entry is None:
        raise ProbeError(f"unknown probe set {name!r}: choose from {', '.join(PROBE_SETS)}")
    options = options or ProbeOptions()
    if entry.reads and all(getattr(options, field_name) is None for field_name in entry.reads):
        raise ProbeError(f"the {name} probe set reads {' or '.join(entry.reads)}: give one")
    return entry.build(loaded, options)
