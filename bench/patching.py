"""Activation patching of every SmolLM2 head on IOI pairs: probe's exact sweep against a naive loop.

`python -m bench.patching [--count 32] [--repeats 3] [--layers all|2,7,...]` (saves bench/results/patching.json;
`python -m bench --render` writes it into RESULTS.md).

Both variants start from the same clean and corrupt prompts (probe.inputs.contrast's generated ioi pairs, each
prompt one row) and patch each head's output (its slice of o_proj's input) from the clean run into the corrupt run,
denoising:
- naive (the baseline): plain PyTorch. One forward of the clean prompts keeps every layer's o_proj input; then for
  each head a forward pre-hook on its o_proj puts the clean slice in, one full forward of the corrupt prompts, and
  the mean logit difference at the last prompt position.
- probe: `probe.patching.patch_heads(loaded, clean, corrupt)`, the exact sweep (prefix before the patched layer
  reused, copies of a layer stacked), including its own clean pass and both runs' baselines.
The ratio is the median over repeats of probe / naive in the same repeat; the largest difference of the patched
logit differences is reported.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

from bench.common import interleaved, load_average, machine, now, save_result, spearman
from probe.inputs import contrast_task
from probe.models import load_model
from probe.patching import contrast_runs, patch_heads
from probe.patching.estimate import estimate_patches


def naive_loop(model: Any, clean: Any, corrupt: Any, heads: list[tuple[int, int]], head_dim: int) -> dict:
    """Each head's patched mean logit difference, one hooked forward of the corrupt prompts per head."""
    last = corrupt.scored.int().argmax(dim=1)  # (rows,) the last prompt position
    rows = torch.arange(corrupt.input_ids.shape[0])
    answer, distractor = corrupt.input_ids[rows, last + 1], corrupt.input_ids[rows, last + 2]
    seen: dict[int, torch.Tensor] = {}
    handles = [model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(
        lambda _m, args, layer=layer: seen.__setitem__(layer, args[0].detach())) for layer in {l for l, _ in heads}]
    with torch.no_grad():
        model(input_ids=clean.input_ids, attention_mask=clean.attention_mask, use_cache=False)
    for handle in handles:
        handle.remove()
    out = {}
    with torch.no_grad():
        for layer, head in heads:
            columns = slice(head * head_dim, (head + 1) * head_dim)

            def patch(_module: Any, args: tuple, layer: int = layer, columns: slice = columns) -> tuple:
                x = args[0].clone()
                x[..., columns] = seen[layer][..., columns]
                return (x, *args[1:])

            handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(patch)
            try:
                logits = model(input_ids=corrupt.input_ids, attention_mask=corrupt.attention_mask,
                               use_cache=False).logits[rows, last].double()
            finally:
                handle.remove()
            out[(layer, head)] = float((logits[rows, answer] - logits[rows, distractor]).mean())
    return out


def estimate_quality(loaded: Any, clean: Any, corrupt: Any, heads: list[tuple[int, int]], count: int,
                     exact: dict) -> dict[str, Any]:
    """The attribution-patching estimate: its cost in forward-equivalents (one plain forward of the corrupt prompts,
    timed just before) and its Spearman against the exact patched logit differences."""
    with torch.no_grad():
        loaded.model(input_ids=corrupt.input_ids, attention_mask=corrupt.attention_mask, use_cache=False)  # warm
        start = time.perf_counter()
        loaded.model(input_ids=corrupt.input_ids, attention_mask=corrupt.attention_mask, use_cache=False)
        forward = time.perf_counter() - start
    start = time.perf_counter()
    estimated = estimate_patches(loaded, clean, corrupt, heads, batch_size=count)
    seconds = time.perf_counter() - start
    values = {entry.heads[0]: entry.logit_diff for entry in estimated.entries}
    corrupt = estimated.corrupt_logit_diff
    top = [set(sorted(heads, key=lambda h, found=found: -abs(found[h] - corrupt))[:10]) for found in (values, exact)]
    return {"seconds": seconds, "forward_seconds": forward, "forward_equivalents": seconds / forward,
            "spearman_vs_exact": spearman([values[h] for h in heads], [exact[h] for h in heads]),
            "top10_overlap": len(top[0] & top[1])}


def run(count: int, repeats: int, layers: list[int] | None) -> dict[str, Any]:
    loaded = load_model("smollm2")
    model = loaded.model
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    head_dim = model.config.hidden_size // n_heads
    heads = [(layer, head) for layer in (layers or range(n_layers)) for head in range(n_heads)]
    contrast = contrast_task(loaded, "ioi", count=count)
    clean, corrupt = contrast_runs(loaded, contrast)
    found: dict[str, Any] = {}

    def naive() -> None:
        found["naive"] = naive_loop(model, clean, corrupt, heads, head_dim)

    def probe() -> None:
        result = patch_heads(loaded, clean, corrupt, heads, batch_size=count)
        found["probe"] = {entry.heads[0]: entry.logit_diff for entry in result.entries}
        found["path"], found["result"] = result.path, result

    started, load_before = now(), load_average()
    timings = interleaved({"naive": naive, "probe": probe}, "naive", repeats, warmup=0, log=print)
    result = found["result"]
    estimate = estimate_quality(loaded, clean, corrupt, heads, count, found["probe"])
    top = sorted(result.entries, key=lambda entry: -abs(entry.patch_effect))[:10]
    return {"benchmark": "patching", "date": started, "machine": machine(), "load_before": load_before,
            "load_after": load_average(), "pairs": len(contrast), "batch": list(corrupt.input_ids.shape),
            "n_heads_timed": len(heads), "repeats": repeats, "timings": timings.to_dict(), "probe_path": found["path"],
            "max_abs_logit_diff_difference": max(abs(found["probe"][h] - found["naive"][h]) for h in heads),
            "clean_logit_diff": result.clean_logit_diff, "corrupt_logit_diff": result.corrupt_logit_diff,
            "top_heads": [[f"{entry.heads[0][0]}.{entry.heads[0][1]}", entry.patch_effect] for entry in top],
            "estimate": estimate,
            "command": "python -m bench.patching " + " ".join(sys.argv[1:])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=32, help="IOI pairs (each prompt one row of one batch)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", default="all", help="layers whose heads are patched, e.g. 2,7,12; default all")
    args = parser.parse_args()
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    data = run(args.count, args.repeats, layers)
    print("wrote", save_result("patching", data))


if __name__ == "__main__":
    main()
