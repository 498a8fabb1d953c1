"""Which heads carry a behaviour: activation patching between a clean and a corrupted run, built on the ablation
package (a patch is an ablation method; the sweep runs it, exact with prefix reuse)."""

from probe.patching.heads import PatchEntry, PatchResult, patch_heads
from probe.patching.runs import contrast_runs, patch_contrast

__all__ = ["PatchEntry", "PatchResult", "contrast_runs", "patch_contrast", "patch_heads"]
