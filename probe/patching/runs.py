"""Patching on clean/corrupt pairs (probe.inputs.contrast): the two runs as task sets, and `patch_contrast`, which
patches every head between them and adds each head's direct logit attribution on the clean run (probe.dla)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from probe.ablation.heads import Head
from probe.ablation.metrics import CONTRAST_LAYOUT
from probe.inputs import CLASS_CONTRAST_LAYOUT, ContrastSet, ProbeSet
from probe.dla import logit_attribution
from probe.errors import ProbeError
from probe.models import LoadedModel
from probe.patching.estimate import estimate_patches
from probe.patching.heads import PatchResult, patch_heads


def _run(contrast: ContrastSet, prompts: torch.Tensor, which: str, offset: int) -> ProbeSet:
    """One side's prompts as a logit_diff probe set: prompt, answer, distractor (CONTRAST_LAYOUT)."""
    pairs, last = len(contrast), contrast.last
    length = int(last.max()) + 3
    ids = torch.zeros(pairs, length, dtype=torch.long)
    mask = torch.zeros(pairs, length, dtype=torch.long)
    scored = torch.zeros(pairs, length - 1, dtype=torch.bool)
    for pair in range(pairs):
        end = int(last[pair]) + 1
        ids[pair, :end] = prompts[pair, :end]
        ids[pair, end], ids[pair, end + 1] = contrast.answer[pair], contrast.distractor[pair]
        mask[pair, :end + 2] = 1
        scored[pair, end - 1] = True
    return ProbeSet(f"task:{contrast.name}", f"{contrast.description} ({which} prompts)", ids, offset,
                    attention_mask=mask, scored=scored, meta={"task": contrast.name, "items": pairs,
                                                              "layout": CONTRAST_LAYOUT, "side": which})


def _class_run(contrast: ContrastSet, texts: torch.Tensor, which: str, classes: list[str]) -> ProbeSet:
    """One side's texts as a class_logit_diff probe set, `scored` holding the answer and distractor classes."""
    rows, count = torch.arange(len(contrast)), len(classes)
    scored = torch.zeros(len(contrast), 2 * count, dtype=torch.bool)
    scored[rows, contrast.answer], scored[rows, count + contrast.distractor] = True, True
    return ProbeSet(f"task:{contrast.name}", f"{contrast.description} ({which} texts)", texts, 1,
                    attention_mask=contrast.mask, scored=scored,
                    meta={"task": contrast.name, "items": len(contrast), "classes": classes,
                          "layout": CLASS_CONTRAST_LAYOUT, "side": which})


def contrast_runs(loaded: LoadedModel, contrast: ContrastSet) -> tuple[ProbeSet, ProbeSet]:
    """(clean, corrupt) task sets of one shape, row for row: prompts with answer and distractor, or classifier texts."""
    if contrast.classes is not None:
        return tuple(_class_run(contrast, texts, which, contrast.classes)  # type: ignore[return-value]
                     for texts, which in ((contrast.clean, "clean"), (contrast.corrupt, "corrupt")))
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    offset = int(isinstance(bos, int) and bool((contrast.clean[:, 0] == bos).all()))
    return _run(contrast, contrast.clean, "clean", offset), _run(contrast, contrast.corrupt, "corrupt", offset)


def patch_contrast(loaded: LoadedModel, contrast: ContrastSet, heads: Sequence[Head] | None = None, *,
                   attribution: bool = True, estimate: bool = False, batch_size: int = 8,
                   **options: Any) -> PatchResult | None:
    """`patch_heads` between the contrast set's clean and corrupt prompts (or with `estimate` its estimate), each
    head with its DLA on the clean run (`attribution`, else the reason in `dla_note`)."""
    clean, corrupt = contrast_runs(loaded, contrast)
    if estimate:
        result: PatchResult | None = estimate_patches(loaded, clean, corrupt, heads, batch_size=batch_size,
                                                      data=contrast.description, **options)
    else:
        result = patch_heads(loaded, clean, corrupt, heads, batch_size=batch_size, data=contrast.description,
                             **options)
    if result is None or not attribution:
        return result
    if contrast.classes is not None:
        result.dla_note = ("direct logit attribution reads a language model's unembedding; a classifier's pooler and "
                           "head are not decomposed")
        return result
    try:
        result.dla = logit_attribution(loaded, contrast, batch_size=batch_size, per_position=False).per_head.tolist()
    except ProbeError as error:
        result.dla_note = str(error)
    return result
