"""AtP*'s QK fix measured: attribution patching of query, key and value patches on SmolLM2's IOI pairs, with the QK
fix (probe's `estimate_patches`) and without it (the plain first order in the patched input), each against probe's
exact patches of the same heads.

`python -m bench.patching_qk [--count 32] [--layers 15-23]` (saves bench/results/patching_qk.json; `python -m bench
--render` writes it into RESULTS.md). A key or value patch is a key/value group's (SmolLM2: 3 query heads each).
Forward-equivalents (FE): the estimate's time over one plain forward of the corrupt prompts, timed just before.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

import torch

from bench.common import load_average, machine, now, save_result, spearman
from probe.ablation.statistics import head_outputs
from probe.hooks.capture import attention_hooks
from probe.hooks.run import logits_of, run_model
from probe.inputs import contrast_task
from probe.models import load_model
from probe.patching import contrast_runs, patch_heads
from probe.patching.estimate import estimate_patches

COMPONENTS = ("query", "key", "value")


def plain_first_order(loaded: Any, clean: Any, corrupt: Any, component: str, units: list) -> list[float]:
    """Each unit's LD_corrupt + dLD/dx . (x_clean - x_corrupt), x the patched input itself (no QK fix)."""
    source = head_outputs(loaded, clean, component, batch_size=clean.input_ids.shape[0]).values[0]
    leaves: dict[int, torch.Tensor] = {}

    def make_leaf(inputs: Any, ctx: Any) -> Any:
        leaves[ctx.layer] = getattr(inputs, component).detach().requires_grad_()
        return replace(inputs, **{component: leaves[ctx.layer]})

    ids, mask = corrupt.input_ids, corrupt.attention_mask
    with torch.enable_grad(), attention_hooks(loaded.model, {"inputs": make_leaf}):
        logits = logits_of(run_model(loaded.model, ids, mask))
    rows = torch.arange(ids.shape[0])
    last = corrupt.scored.int().argmax(dim=1)
    diffs = logits[rows, last, ids[rows, last + 1]] - logits[rows, last, ids[rows, last + 2]]
    layers = sorted(leaves)
    grads = dict(zip(layers, torch.autograd.grad(diffs.mean(), [leaves[layer] for layer in layers])))
    base, out = float(diffs.mean().detach()), []
    for unit in units:
        layer, head = unit[0]
        size = loaded.model.config.num_attention_heads // leaves[layer].shape[1]  # query heads per input head
        index = head if component == "query" else head // size
        change = (source[layer][:, index] - leaves[layer].detach()[:, index]) * grads[layer][:, index]
        out.append(base + float(change.double().sum()))
    return out


def forward_seconds(loaded: Any, corrupt: Any) -> float:
    with torch.no_grad():
        loaded.model(input_ids=corrupt.input_ids, attention_mask=corrupt.attention_mask, use_cache=False)
        start = time.perf_counter()
        loaded.model(input_ids=corrupt.input_ids, attention_mask=corrupt.attention_mask, use_cache=False)
    return time.perf_counter() - start


def one_component(loaded: Any, clean: Any, corrupt: Any, heads: list, component: str) -> dict[str, Any]:
    count = clean.input_ids.shape[0]
    exact = patch_heads(loaded, clean, corrupt, heads, component=component, batch_size=count)
    units = [entry.heads for entry in exact.entries]
    exact_values = [entry.logit_diff for entry in exact.entries]
    forward = forward_seconds(loaded, corrupt)
    start = time.perf_counter()
    fixed = estimate_patches(loaded, clean, corrupt, heads, component=component, batch_size=count)
    seconds = time.perf_counter() - start
    fixed_values = {entry.heads: entry.logit_diff for entry in fixed.entries}
    plain = plain_first_order(loaded, clean, corrupt, component, units)
    return {"units": len(units), "exact_seconds": exact.seconds, "estimate_seconds": seconds,
            "forward_seconds": forward, "forward_equivalents": seconds / forward,
            "spearman_qk_fix": spearman([fixed_values[unit] for unit in units], exact_values),
            "spearman_plain": spearman(plain, exact_values),
            "largest_exact_effect": max(abs(entry.patch_effect) for entry in exact.entries)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--layers", default="15-23", help="first-last layer whose heads are patched")
    args = parser.parse_args()
    first, last = (int(x) for x in args.layers.split("-"))
    loaded = load_model("smollm2")
    clean, corrupt = contrast_runs(loaded, contrast_task(loaded, "ioi", count=args.count))
    heads = [(layer, head) for layer in range(first, last + 1) for head in range(9)]
    started, load_before = now(), load_average()
    found = {component: one_component(loaded, clean, corrupt, heads, component) for component in COMPONENTS}
    data = {"benchmark": "patching_qk", "date": started, "machine": machine(), "load_before": load_before,
            "load_after": load_average(), "pairs": args.count, "layers": args.layers, "components": found,
            "command": "python -m bench.patching_qk " + " ".join(sys.argv[1:])}
    save_result("patching_qk", data)
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
