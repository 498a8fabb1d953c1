"""Peak resident memory of one forward at a long length, plain or with half the heads windowed (a curve forward of
`probe kv-heads`); run each variant in a fresh process:

    python -m bench.kv_curve_memory plain 8192
    python -m bench.kv_curve_memory curve 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from bench.kv_heads import HALF
from probe import load_model
from probe.ablation.methods import ablated
from probe.ablation.window import WindowAblation
from probe.hooks.run import run_model
from probe.inputs import NeedleOptions, needle_set


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=["plain", "curve"])
    parser.add_argument("length", type=int)
    args = parser.parse_args()
    loaded = load_model("smollm2")
    ids = needle_set(loaded, NeedleOptions(lengths=(args.length,), depths=(0.5,), seed=7)).input_ids
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with torch.no_grad():
        if args.variant == "curve":
            with ablated(loaded.model, [HALF], WindowAblation()):
                run_model(loaded.model, ids, None, logits=False)
        else:
            run_model(loaded.model, ids, None, logits=False)
    print(json.dumps({"variant": args.variant, "length": args.length, "seconds": time.perf_counter() - start,
                      "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      "before_forward_gib": before / 2**20}))


if __name__ == "__main__":
    main()
