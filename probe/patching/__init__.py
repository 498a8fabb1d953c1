"""Which heads carry a behaviour: activation patching between a clean and a corrupted run, built on the ablation
package (a patch is an ablation method; the sweep runs it, exact with prefix reuse)."""

from probe.patching.heads import MIN_LOGIT_DIFF_GAP, PatchEntry, PatchResult, patch_heads

__all__ = ["MIN_LOGIT_DIFF_GAP", "PatchEntry", "PatchResult", "patch_heads"]
