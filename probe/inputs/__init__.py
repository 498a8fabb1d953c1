"""Every input probe reads: each module registers its kind in `PROBE_SETS`, and `build_probe_set` builds any."""

# ruff: noqa: F401 (every import is re-exported through __all__)
from types import ModuleType as _ModuleType

from probe.inputs.sets import (CONTEXT_ATTRIBUTES, DEFAULT_NUM_SEQS, DEFAULT_REPEAT_LEN, DEFAULT_SEED, DEFAULT_SEQ_LEN,
                               ENGLISH, PROBE_SETS, ProbeOptions, ProbeSet, ProbeSetKind, build_probe_set,
                               check_context, context_length, is_encoder, random_tokens, read_text_file, real_tokens,
                               register_probe_set, right_padded, tokenize_prefix)
from probe.inputs.natural import natural_set, repeated_set
from probe.inputs.needle import DEFAULT_DEPTHS, DEFAULT_NEEDLE, NeedleOptions, NeedleSet, needle_set
from probe.inputs.tasks import TASKS, TaskItem, ioi_items, items_set, read_task_file, sva_items, task_items, task_set
from probe.inputs.pairs import pairs_set, read_pairs
from probe.inputs.contrast import (CONTRAST_TASKS, MIN_GAP, ContrastPair, ContrastSet, contrast_logit_diffs,
                                   contrast_set, contrast_task, ioi_pairs, logit_diff, logit_diffs, normalised_effect,
                                   read_contrast_pairs, sva_pairs)
from probe.inputs.labels import (CLASS_CONTRAST_LAYOUT, LABELS_LAYOUT, LabelledText, class_names, label_index,
                                 labelled_set, read_class_pairs, read_labelled, read_labelled_set)

__all__ = sorted(name for name, value in globals().items() if not name.startswith("_")
                 and not isinstance(value, _ModuleType))
"""The names imported above (no second list to keep)."""
