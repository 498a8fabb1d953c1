"""Probe sets: the inputs heads are scored on.

- natural: English prose shipped with probe (`probe/data/english.txt`, an excerpt of CPython's reference
  documentation, the same on every Python version) or the user's text file (`data`), tokenized without special
  tokens and cut into consecutive chunks of `seq_len` tokens; the first `num_seqs` are used, each with BOS
  prepended where the model's tokenizer has one (an encoder gets its usual [CLS] ... [SEP]). A model without a
  tokenizer gets random tokens instead; without a BOS, position 0 plays its role.
- repeated: BOS + `repeat_len` random tokens repeated twice (Olsson et al. 2022), seeded; random tokens avoid
  special tokens.

Every sequence of a set has the same length, so sets need no padding; batches that do are right-padded.
"""

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
from probe.hooks.stacks import decoder_start, is_encoder_decoder
from probe.models import LoadedModel

ENGLISH = Path(__file__).parent / "data" / "english.txt"
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
    scored: Tensor | None = None  # task sets: (num_seqs, length - 1) which positions' next tokens the metric scores
    meta: dict[str, Any] = field(default_factory=dict)
    source_ids: Tensor | None = None  # encoder-decoders (probe.pairs): the encoder's own input, (num_seqs, length')
    source_mask: Tensor | None = None

    def batches(self, batch_size: int) -> list[tuple[Tensor, Tensor | None]]:
        """(ids, mask) per batch of `batch_size` sequences; right padding cut to the batch's longest sequence."""
        if batch_size < 1:
            raise ProbeError(f"batch_size must be at least 1, got {batch_size}", parameter="batch_size")
        out = []
        for first in range(0, self.input_ids.shape[0], batch_size):
            ids = self.input_ids[first:first + batch_size]  # (batch, positions)
            mask = None if self.attention_mask is None else self.attention_mask[first:first + batch_size]
            if mask is not None:  # cut the columns no sequence of this batch uses
                length = int(mask.sum(dim=1).max())
                ids, mask = ids[:, :length], mask[:, :length]
            out.append((ids, mask))
        return out

    def sources(self, batch_size: int) -> list[Source | None]:
        """The encoder input of each batch of `batches(batch_size)`, right padding cut; None each without sources (the
        encoder then reads the batch itself)."""
        if self.source_ids is None:
            return [None] * len(self.batches(batch_size))
        return [(ids, mask) for ids, mask in ProbeSet("source", "", self.source_ids, 0,
                                                      self.source_mask).batches(batch_size)]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "num_seqs": int(self.input_ids.shape[0]),
                "length": int(self.input_ids.shape[1]), **self.meta}


def real_tokens(ids: Tensor, mask: Tensor | None) -> Tensor:
    """(batch, positions) booleans: True where a batch holds a token, False on padding."""
    return torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()


def is_encoder(loaded: LoadedModel) -> bool:
    """A bidirectional model (BERT-like): its attention modules are not causal. An encoder-decoder is not one: its
    output is the decoder's, causal, next-token logits."""
    if is_encoder_decoder(loaded.model):
        return False
    return not all(getattr(layer.module, "is_causal", True) for layer in attention_layers(loaded.model)
                   if layer.kind == "hf")


def _special_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    if loaded.tokenizer is not None:
        ids.update(int(i) for i in getattr(loaded.tokenizer, "all_special_ids", []) if i is not None)
    config = getattr(loaded.model, "config", None)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id", "cls_token_id"):
        value = getattr(config, name, None)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int):
                ids.add(item)
    return ids


def random_tokens(loaded: LoadedModel, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Uniform random token ids that are not special tokens."""
    special = sorted(i for i in _special_ids(loaded) if 0 <= i < loaded.vocab_size)
    allowed = torch.ones(loaded.vocab_size, dtype=torch.bool)
    allowed[special] = False
    pool = allowed.nonzero().squeeze(1)
    if len(pool) == 0:
        raise ProbeError("the model's vocabulary has no ordinary tokens to sample")
    return pool[torch.randint(len(pool), shape, generator=generator)]


def _wrap(loaded: LoadedModel, chunks: Tensor) -> tuple[Tensor, int, str]:
    """Add BOS (decoders whose tokenizer has one) or [CLS] ... [SEP] (encoders); else nothing, and position 0 plays
    the BOS role. Returns the ids, the first content position and what starts each sequence."""
    tokenizer = loaded.tokenizer
    n = chunks.shape[0]
    start_id = decoder_start(loaded.model)
    if start_id is not None:  # encoder-decoders: both stacks read the sequence, the decoder's starts as it was trained
        return torch.cat([torch.full((n, 1), start_id), chunks], dim=1), 1, "the decoder start token"
    if tokenizer is None:
        return chunks, 0, "no BOS (no tokenizer)"
    if is_encoder(loaded):
        cls_id, sep_id = getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)
        if cls_id is not None and sep_id is not None:
            return (torch.cat([torch.full((n, 1), cls_id), chunks, torch.full((n, 1), sep_id)], dim=1), 1,
                    "[CLS] ... [SEP]")
    bos = getattr(tokenizer, "bos_token_id", None)
    if isinstance(bos, int):
        return torch.cat([torch.full((n, 1), bos), chunks], dim=1), 1, "BOS"
    return chunks, 0, "no BOS (the tokenizer has none)"


def _tokenize_prefix(tokenizer: Any, text: str, needed: int) -> list[int]:
    """Token ids of the text, tokenizing only as much of it as `needed` tokens take (the text can be long)."""
    chars = max(needed * 8, 4096)
    while True:
        if chars >= len(text):
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        cut = text.rfind("\n", 0, chars)
        cut = chars if cut <= 0 else cut
        ids = list(tokenizer(text[:cut], add_special_tokens=False)["input_ids"])
        if len(ids) >= needed + 64:  # the margin keeps the cut from changing the tokens used
            return ids
        chars *= 2


def natural_set(loaded: LoadedModel, *, data: str | Path | None = None, seq_len: int = DEFAULT_SEQ_LEN,
                num_seqs: int = DEFAULT_NUM_SEQS, seed: int = DEFAULT_SEED) -> ProbeSet:
    """Natural text in consecutive chunks of `seq_len` tokens (see the module docstring)."""
    if seq_len < 2:
        raise ProbeError(f"seq_len must be at least 2, got {seq_len}", parameter="seq_len")
    if num_seqs < 1:
        raise ProbeError(f"num_seqs must be at least 1, got {num_seqs}", parameter="num_seqs")
    generator = torch.Generator().manual_seed(seed)
    source = "embedded English text (probe/data/english.txt)"
    if data is not None:
        path = Path(data)
        if not is_file(path):
            raise ProbeError(f"data file not found: {path}", parameter="data")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as error:
            raise ProbeError(f"data file {path} is not UTF-8 text: {error.reason}", parameter="data") from error
        source = f"text file {path}"
        if not text.strip():
            raise ProbeError(f"data file {path} is empty", parameter="data")
    else:
        text = ENGLISH.read_text(encoding="utf-8")
    if loaded.tokenizer is None:
        if data is not None:
            raise ProbeError("this model has no tokenizer, so it cannot read a data text: drop data, or return "
                             "(model, tokenizer) from the factory", parameter="data")
        chunks = random_tokens(loaded, (num_seqs, seq_len), generator)
        source = f"random tokens in place of text (the model has no tokenizer that encodes text), seed {seed}"
    else:
        ids = _tokenize_prefix(loaded.tokenizer, text, seq_len * num_seqs)
        available = len(ids) // seq_len
        if available < 1:
            raise ProbeError(f"the text has {len(ids)} tokens, fewer than one chunk of seq_len {seq_len}: "
                             "give a longer text or a smaller seq_len", parameter="seq_len")
        used = min(num_seqs, available)
        chunks = torch.tensor(ids[: used * seq_len], dtype=torch.long).view(used, seq_len)
    input_ids, offset, start = _wrap(loaded, chunks)
    _check_context(loaded, input_ids.shape[1])
    description = f"natural: {source}, {chunks.shape[0]} x {seq_len} tokens, {start} first"
    return ProbeSet("natural", description, input_ids, offset,
                    meta={"source": source, "seq_len": seq_len, "start": start})


def repeated_set(loaded: LoadedModel, *, repeat_len: int = DEFAULT_REPEAT_LEN, num_seqs: int = DEFAULT_NUM_SEQS,
                 seed: int = DEFAULT_SEED) -> ProbeSet:
    """BOS + `repeat_len` random tokens, repeated twice: the second copy can be predicted by induction."""
    if repeat_len < 2:
        raise ProbeError(f"repeat_len must be at least 2 (the repeated sequence's tokens), got {repeat_len}",
                         parameter="repeat_len")
    generator = torch.Generator().manual_seed(seed)
    half = random_tokens(loaded, (num_seqs, repeat_len), generator)
    input_ids, offset, start = _wrap(loaded, torch.cat([half, half], dim=1))
    _check_context(loaded, input_ids.shape[1])
    description = f"repeated: {start} + {repeat_len} random tokens repeated twice, {num_seqs} sequences, seed {seed}"
    return ProbeSet("repeated", description, input_ids, offset, repeat_len=repeat_len,
                    meta={"repeat_len": repeat_len, "seed": seed, "start": start})


CONTEXT_ATTRIBUTES = ("max_position_embeddings", "n_positions", "n_ctx", "block_size", "max_seq_len", "max_len")


def context_length(loaded: LoadedModel) -> int | None:
    """The longest input the model takes, from its config or (custom models) a usual attribute name."""
    for owner in (getattr(loaded.model, "config", None), loaded.model):
        for name in CONTEXT_ATTRIBUTES:
            value = getattr(owner, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _check_context(loaded: LoadedModel, length: int) -> None:
    limit = context_length(loaded)
    if limit is not None and length > limit:
        raise ProbeError(f"sequences of {length} tokens are longer than the model's context of {limit}: "
                         "use a smaller seq_len", parameter="seq_len")


@dataclass(frozen=True)
class ProbeOptions:
    """Everything a probe-set builder may read; each builder takes what it needs and ignores the rest."""

    data: str | Path | None = None
    seq_len: int = DEFAULT_SEQ_LEN
    num_seqs: int = DEFAULT_NUM_SEQS
    repeat_len: int = DEFAULT_REPEAT_LEN
    seed: int = DEFAULT_SEED


ProbeSetBuilder = Callable[[LoadedModel, ProbeOptions], ProbeSet]

PROBE_SETS: dict[str, ProbeSetBuilder] = {
    "natural": lambda loaded, options: natural_set(loaded, data=options.data, seq_len=options.seq_len,
                                                   num_seqs=options.num_seqs, seed=options.seed),
    "repeated": lambda loaded, options: repeated_set(loaded, repeat_len=options.repeat_len,
                                                     num_seqs=options.num_seqs, seed=options.seed),
}
"""Every probe set by name: a head class names the set its score is computed on (Score.probe)."""


def register_probe_set(name: str, builder: ProbeSetBuilder) -> ProbeSetBuilder:
    """Add a probe set under `name` (a new one; replacing a set would change every score computed on it)."""
    if name in PROBE_SETS:
        raise ProbeError(f"a probe set named {name!r} exists already")
    PROBE_SETS[name] = builder
    return builder


def build_probe_set(name: str, loaded: LoadedModel, options: ProbeOptions | None = None) -> ProbeSet:
    """The probe set `name` for this model, built with `options` (defaults where not given)."""
    builder = PROBE_SETS.get(name)
    if builder is None:
        raise ProbeError(f"unknown probe set {name!r}: choose from {', '.join(PROBE_SETS)}")
    return builder(loaded, options or ProbeOptions())
