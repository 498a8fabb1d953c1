"""The needle probe set (Wu et al. 2024; Kamradt): BOS, seeded natural text with a needle sentence holding a random
key inserted at a depth, a question ending with the needle's words before the key, then the key, teacher-forced; the
needle position each key token is copied from is known (`NeedleSet.sources`). Random tokens without a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import Tensor

from probe.inputs.sets import (DEFAULT_SEED, ENGLISH, ProbeOptions, ProbeSet, bos_ids, context_length, encode,
                               random_tokens, register_probe_set, right_padded, tokenize_prefix)
from probe.errors import ProbeError
from probe.models import LoadedModel

DEFAULT_NEEDLE = "The secret number of the day is {key}."
DEFAULT_LENGTHS = (1024,)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
KEY_DIGITS = 6
QUESTION = "\n\nAnswer from the text above. {cue}"


@dataclass(frozen=True)
class NeedleOptions(ProbeOptions):
    """ProbeOptions plus the needle's: prompt lengths in tokens, depths in [0, 1], prompts per (length, depth)."""

    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    prompts: int = 1
    needle: str = DEFAULT_NEEDLE


@dataclass
class NeedleSet(ProbeSet):
    """Needle prompts, right-padded to the longest; per prompt its length, depth and key."""

    # (n, L): see NeedleBatch. The name hides ProbeSet.sources(batch_size) (an encoder's own inputs), which a needle
    # set, for decoders only, never reads
    sources: Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.long))  # type: ignore[assignment]
    cells: list[tuple[int, float]] = field(default_factory=list)  # (length, depth) of each prompt
    keys: list[str] = field(default_factory=list)


@dataclass
class _Parts:
    """Token ids of one prompt's pieces; `key_at`: the key's offset in the needle; `counted`: key tokens scored."""

    needle: list[int]
    question: list[int]
    key: list[int]
    key_at: int
    counted: list[bool]


def _find(sequence: list[int], part: list[int]) -> int:
    for start in range(len(sequence) - len(part) + 1):
        if sequence[start:start + len(part)] == part:
            return start
    return -1


def _text_parts(tokenizer: Any, template: str, key: str) -> _Parts:
    if template.count("{key}") != 1:
        raise ProbeError(f"the needle must hold {{key}} once, e.g. {DEFAULT_NEEDLE!r}; got {template!r}",
                         parameter="needle")
    cue = template.split("{key}")[0].rstrip()
    if not cue:
        raise ProbeError("the needle needs words before {key}: the question repeats them", parameter="needle")

    ids = partial(encode, tokenizer)
    needle, key_ids = ids(" " + template.format(key=key)), ids(" " + key)
    at = _find(needle, key_ids)
    if at < 0 or needle[:at] != ids(" " + cue):
        raise ProbeError(f"the needle {template!r} tokenizes its key differently inside the sentence than alone "
                         "(no space before {key}?): write the needle as words, a space, then {key}",
                         parameter="needle")
    counted = [bool(tokenizer.decode([token]).strip()) for token in key_ids]
    return _Parts(needle, ids(QUESTION.format(cue=cue)), key_ids, at, counted)


def _random_parts(loaded: LoadedModel, generator: torch.Generator) -> _Parts:
    tokens = random_tokens(loaded, (64,), generator)
    distinct = list(dict.fromkeys(int(t) for t in tokens))
    if len(distinct) < 9:
        raise ProbeError("the vocabulary is too small for needle prompts")
    cue, key, question = distinct[:3], distinct[3:7], distinct[7:9]
    return _Parts(cue + key, question + cue, key, 3, [True] * 4)


def _haystack(loaded: LoadedModel, needed: int, generator: torch.Generator, exclude: set[int]) -> list[int]:
    if loaded.tokenizer is None:
        tokens = [int(t) for t in random_tokens(loaded, (needed * 2 + 16,), generator) if int(t) not in exclude]
        if len(tokens) < needed:
            raise ProbeError("the vocabulary is too small for needle prompts")
        return tokens[:needed]
    text = ENGLISH.read_text(encoding="utf-8")
    start = int(torch.randint(max(1, len(text) - needed * 6), (1,), generator=generator))
    start = text.find("\n", start) + 1
    ids = tokenize_prefix(loaded.tokenizer, text[start:], needed)
    if len(ids) < needed:
        ids = tokenize_prefix(loaded.tokenizer, text, needed)
    if len(ids) < needed:
        raise ProbeError(f"the embedded text is too short for prompts of {needed} tokens", parameter="lengths")
    return ids[:needed]


def _prompt(loaded: LoadedModel, length: int, depth: float, generator: torch.Generator,
            template: str) -> tuple[list[int], list[int], str]:
    """(ids, sources, key) of one prompt of `length` tokens; sources[i] is the needle position of token i + 1."""
    key = "".join(str(int(d)) for d in torch.randint(10, (KEY_DIGITS,), generator=generator))
    if loaded.tokenizer is None:
        parts = _random_parts(loaded, generator)
        bos: list[int] = []
        key = " ".join(str(t) for t in parts.key)
    else:
        parts = _text_parts(loaded.tokenizer, template, key)
        bos = bos_ids(loaded.tokenizer)
    fixed = len(bos) + len(parts.needle) + len(parts.question) + len(parts.key)
    if length < fixed + 8:
        raise ProbeError(f"needle prompts of {length} tokens leave no room for text: give lengths of at least "
                         f"{fixed + 8}", parameter="lengths")
    hay = _haystack(loaded, length - fixed, generator, set(parts.needle) | set(parts.question))
    cut = round(depth * len(hay))
    ids = bos + hay[:cut] + parts.needle + hay[cut:] + parts.question + parts.key
    sources = [-1] * length
    needle_key = len(bos) + cut + parts.key_at
    answer = length - len(parts.key)
    for t, counted in enumerate(parts.counted):
        if counted:
            sources[answer + t - 1] = needle_key + t
    return ids, sources, key


def needle_set(loaded: LoadedModel, options: ProbeOptions) -> NeedleSet:
    """Needle prompts for every (length, depth) of `options`, `prompts` each, seeded by `options.seed`."""
    lengths = getattr(options, "lengths", (options.seq_len,))
    depths = getattr(options, "depths", DEFAULT_DEPTHS)
    prompts, template = getattr(options, "prompts", 1), getattr(options, "needle", DEFAULT_NEEDLE)
    if not lengths or not depths or prompts < 1:
        raise ProbeError("needle prompts need at least one length, one depth and one prompt each", parameter="lengths")
    bad = [depth for depth in depths if not 0.0 <= depth <= 1.0]
    if bad:
        raise ProbeError(f"needle depths lie in [0, 1] (0: start of the text, 1: its end); got {bad[0]}",
                         parameter="depths")
    limit = context_length(loaded)
    if limit is not None and max(lengths) > limit:
        raise ProbeError(f"needle prompts of {max(lengths)} tokens are longer than the model's context of {limit}: "
                         "give smaller lengths", parameter="lengths")
    generator = torch.Generator().manual_seed(options.seed if options.seed is not None else DEFAULT_SEED)
    rows, cells, keys = [], [], []
    for length in lengths:
        for depth in depths:
            for _ in range(prompts):
                rows.append(_prompt(loaded, length, depth, generator, template))
                cells.append((length, depth))
                keys.append(rows[-1][2])
    width = max(lengths)
    ids, mask = right_padded([prompt for prompt, _, _ in rows], 0)
    sources = right_padded([source for _, source, _ in rows], -1)[0]
    offset = 0 if loaded.tokenizer is None or getattr(loaded.tokenizer, "bos_token_id", None) is None else 1
    description = (f"needle: a {KEY_DIGITS}-digit key in a needle sentence at depths {list(depths)} of natural text, "
                   f"lengths {list(lengths)}, {prompts} prompt(s) each, seed {options.seed}")
    return NeedleSet("needle", description, ids, offset, attention_mask=None if min(lengths) == width else mask,
                     meta={"lengths": list(lengths), "depths": list(depths), "prompts": prompts,
                           "needle": template, "seed": options.seed},
                     sources=sources, cells=cells, keys=keys)


register_probe_set("needle", needle_set, kind="text",
                   summary="needle-in-a-haystack prompts: a key hidden in natural text at chosen depths, then asked "
                           "for (Kamradt; Wu et al. 2024)")
