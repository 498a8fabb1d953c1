"""Every input probe reads, in one package: each module builds one kind and registers it in `PROBE_SETS`.

`natural` and `repeated` (natural.py), `needle` (needle.py), `task` (tasks.py), `seq2seq` (pairs.py: an
encoder-decoder's source/target texts), `contrast` (contrast.py: clean/corrupt pairs) and `labels` (labels.py:
labelled texts for sequence classifiers). `build_probe_set(name,
loaded, ProbeOptions(...))` builds any of them.
"""

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

__all__ = [
                               "CLASS_CONTRAST_LAYOUT",
                               "CONTEXT_ATTRIBUTES",
                               "CONTRAST_TASKS",
                               "DEFAULT_DEPTHS",
                               "DEFAULT_NEEDLE",
                               "DEFAULT_NUM_SEQS",
                               "DEFAULT_REPEAT_LEN",
                               "DEFAULT_SEED",
                               "DEFAULT_SEQ_LEN",
                               "ENGLISH",
                               "LABELS_LAYOUT",
                               "MIN_GAP",
                               "PROBE_SETS",
                               "TASKS",
                               "ContrastPair",
                               "ContrastSet",
                               "LabelledText",
                               "NeedleOptions",
                               "NeedleSet",
                               "ProbeOptions",
                               "ProbeSet",
                               "ProbeSetKind",
                               "TaskItem",
                               "build_probe_set",
                               "check_context",
                               "class_names",
                               "context_length",
                               "contrast_logit_diffs",
                               "contrast_set",
                               "contrast_task",
                               "ioi_items",
                               "ioi_pairs",
                               "is_encoder",
                               "items_set",
                               "label_index",
                               "labelled_set",
                               "logit_diff",
                               "logit_diffs",
                               "natural_set",
                               "needle_set",
                               "normalised_effect",
                               "pairs_set",
                               "random_tokens",
                               "read_class_pairs",
                               "read_contrast_pairs",
                               "read_labelled",
                               "read_labelled_set",
                               "read_pairs",
                               "read_task_file",
                               "read_text_file",
                               "real_tokens",
                               "register_probe_set",
                               "repeated_set",
                               "right_padded",
                               "sva_items",
                               "sva_pairs",
                               "task_items",
                               "task_set",
                               "tokenize_prefix"
]
