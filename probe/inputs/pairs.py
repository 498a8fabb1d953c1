"""Source/target pairs for encoder-decoders (the `seq2seq` probe set), from a JSON-lines file of source and target."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


from probe.inputs.sets import ProbeSet, context_length, encode, given, register_probe_set, right_padded
from probe.inputs.tasks import json_lines
from probe.errors import ProbeError
from probe.hooks.stacks import decoder_start
from probe.models import LoadedModel


def pairs_set(loaded: LoadedModel, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              description: str = "pairs of token ids") -> ProbeSet:
    """A probe set of (source ids, target ids) pairs: targets get the decoder start token first (offset 1)."""
    start = decoder_start(loaded.model)
    if start is None:
        raise ProbeError("source/target pairs are for encoder-decoders (t5, bart): this model reads one sequence",
                         parameter="seq2seq")
    if not pairs or any(len(source) < 1 or len(target) < 1 for source, target in pairs):
        raise ProbeError("give at least one pair, each with a non-empty source and target", parameter="seq2seq")
    pad = getattr(loaded.model.config, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else 0
    target_ids, target_mask = right_padded([[start, *target] for _, target in pairs], pad)
    source_ids, source_mask = right_padded([list(source) for source, _ in pairs], pad)
    limit, longest = context_length(loaded), max(target_ids.shape[1], source_ids.shape[1])
    if limit is not None and longest > limit:
        raise ProbeError(f"a pair has {longest} tokens, more than the model's context of {limit}: shorten it",
                         parameter="seq2seq")
    text = f"{description}: {len(pairs)} pairs, the decoder start token before each target"
    return ProbeSet("seq2seq", text, target_ids, 1, target_mask, source_ids=source_ids, source_mask=source_mask,
                    meta={"source": description, "pairs": len(pairs), "start": "the decoder start token"})


def read_pairs(loaded: LoadedModel, path: str | Path) -> ProbeSet:
    """The pairs of a JSON-lines file, tokenized without special tokens (the target behind the start token)."""
    if loaded.tokenizer is None:
        raise ProbeError("this model has no tokenizer, so it cannot read pairs of texts", parameter="seq2seq")
    texts = []
    for where, item in json_lines(path, "seq2seq file", "give a .jsonl file of source/target rows", "seq2seq"):
        if not isinstance(item, dict) or not all(isinstance(item.get(key), str) for key in ("source", "target")):
            raise ProbeError(f"{where}: expected an object with string \"source\" and \"target\"",
                             parameter="seq2seq")
        texts.append((item["source"], item["target"]))
    tokenizer = loaded.tokenizer
    return pairs_set(loaded, [(encode(tokenizer, source), encode(tokenizer, target)) for source, target in texts],
                     description=f"seq2seq file {path}")


register_probe_set("seq2seq", lambda loaded, options: read_pairs(loaded, given(options.seq2seq)), kind="text",
                   reads=("seq2seq",),
                   summary="encoder-decoders: a JSON-lines file of source/target texts; the encoder reads the source, "
                           "the decoder the target")
