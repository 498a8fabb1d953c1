"""The natural probe set (English prose or the user's text in chunks of `seq_len` tokens) and the repeated one
(`repeat_len` seeded random tokens, twice: Olsson et al. 2022), BOS first where the tokenizer has one."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from probe.errors import ProbeError
from probe.hooks.stacks import decoder_start
from probe.inputs.sets import (DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN, ENGLISH,
                               ProbeSet, check_context, is_encoder, random_tokens, read_text_file,
                               register_probe_set, tokenize_prefix, wrapping)
from probe.models import LoadedModel


def _wrap(loaded: LoadedModel, chunks: Tensor) -> tuple[Tensor, int, str]:
    """Add BOS (decoders) or [CLS] ... [SEP] (encoders); returns the ids, the first content position and the start."""
    start_id = decoder_start(loaded.model)
    suffix: list[int] = []
    if start_id is not None:  # encoder-decoders: both stacks read the sequence, the decoder's starts as it was trained
        prefix, start = [start_id], "the decoder start token"
    elif loaded.tokenizer is None:
        return chunks, 0, "no BOS (no tokenizer)"
    else:
        prefix, suffix = wrapping(loaded.tokenizer, is_encoder(loaded))
        start = "[CLS] ... [SEP]" if suffix else "BOS" if prefix else "no BOS (the tokenizer has none)"
    around = [torch.tensor(ids, dtype=torch.long).expand(chunks.shape[0], -1) for ids in (prefix, suffix)]
    return torch.cat([around[0], chunks, around[1]], dim=1), len(prefix), start


def natural_set(loaded: LoadedModel, *, data: str | Path | None = None, seq_len: int = DEFAULT_SEQ_LEN,
                num_seqs: int = DEFAULT_NUM_SEQS, seed: int = DEFAULT_SEED) -> ProbeSet:
    """Natural text in consecutive chunks of `seq_len` tokens (see the module docstring)."""
    if seq_len < 2:
        raise ProbeError(f"seq_len must be at least 2, got {seq_len}", parameter="seq_len")
    if num_seqs < 1:
        raise ProbeError(f"num_seqs must be at least 1, got {num_seqs}", parameter="num_seqs")
    generator = torch.Generator().manual_seed(seed)
    source = "embedded English text (probe/inputs/english.txt)"
    if data is not None:
        text = read_text_file(data, parameter="data", what="data file")
        source = f"text file {data}"
    else:
        text = ENGLISH.read_text(encoding="utf-8")
    if loaded.tokenizer is None:
        if data is not None:
            raise ProbeError("this model has no tokenizer, so it cannot read a data text: drop data, or return "
                             "(model, tokenizer) from the factory", parameter="data")
        chunks = random_tokens(loaded, (num_seqs, seq_len), generator)
        source = f"random tokens in place of text (the model has no tokenizer that encodes text), seed {seed}"
    else:
        ids = tokenize_prefix(loaded.tokenizer, text, seq_len * num_seqs)
        available = len(ids) // seq_len
        if available < 1:
            raise ProbeError(f"the text has {len(ids)} tokens, fewer than one chunk of seq_len {seq_len}: "
                             "give a longer text or a smaller seq_len", parameter="seq_len")
        used = min(num_seqs, available)
        chunks = torch.tensor(ids[: used * seq_len], dtype=torch.long).view(used, seq_len)
    input_ids, offset, start = _wrap(loaded, chunks)
    check_context(loaded, input_ids.shape[1])
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
    check_context(loaded, input_ids.shape[1])
    description = f"repeated: {start} + {repeat_len} random tokens repeated twice, {num_seqs} sequences, seed {seed}"
    return ProbeSet("repeated", description, input_ids, offset, repeat_len=repeat_len,
                    meta={"repeat_len": repeat_len, "seed": seed, "start": start})


register_probe_set("natural", lambda loaded, options: natural_set(
    loaded, data=options.data, seq_len=options.seq_len, num_seqs=options.num_seqs, seed=options.seed),
    kind="text", summary="natural text: the embedded English text or a UTF-8 file (data), seq_len x num_seqs tokens")
register_probe_set("repeated", lambda loaded, options: repeated_set(
    loaded, repeat_len=options.repeat_len, num_seqs=options.num_seqs, seed=options.seed),
    kind="text", summary="BOS + repeat_len random tokens repeated twice (Olsson et al. 2022), num_seqs sequences")

