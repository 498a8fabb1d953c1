"""Benchmark: the ablation sweep's stacked copies (the heads of one start block run as copies along the batch, one
forward for several heads) against one copy per forward, on SmolLM2 on the CPU.

`probe ablate` and `probe patch` both run through `probe.ablation.sweep`, whose exact mode stacks the ablations of one
start block (`stack=None`: as many as fit its memory budget). This measures whether that batching pays on a CPU:
the heads of an early and a late layer, `stack=1` against the default, interleaved, each result checked equal.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from bench.common import interleaved, load_average, machine, now, save_result
from probe.ablation import sweep
from probe.inputs import natural_set
from probe.models import load_model

LAYERS = (0, 20)  # an ablation at layer 0 reruns every block; at layer 20 the baseline's first 20 are reused
REPEATS = 5


def run(log: Any = print) -> dict[str, Any]:
    loaded = load_model("smollm2")
    probe_set = natural_set(loaded, num_seqs=2)  # `probe ablate --num-seqs 2`, the tour's line
    heads_per_layer = int(loaded.model.config.num_attention_heads)
    rows = []
    before = load_average()
    for layer in LAYERS:
        heads = [(layer, h) for h in range(heads_per_layer)]
        results: dict[str, Any] = {}

        def variant(name: str, stack: int | None, heads: list[tuple[int, int]] = heads) -> Any:
            return lambda: results.__setitem__(name, sweep(loaded, probe_set, heads, stack=stack))

        log(f"bench stacked: the {len(heads)} heads of layer {layer}")
        timings = interleaved({"one per forward": variant("one", 1), "stacked": variant("stacked", None)},
                              baseline="one per forward", repeats=REPEATS, log=log)
        one = torch.tensor([r.delta for r in results["one"].heads], dtype=torch.float64)
        stacked = torch.tensor([r.delta for r in results["stacked"].heads], dtype=torch.float64)
        rows.append({"layer": layer, "heads": len(heads), "timings": timings.to_dict(),
                     "ratio": timings.ratio("stacked"), "max_abs_delta_difference": float((one - stacked).abs().max()),
                     "largest_delta": float(one.abs().max())})
    return {"date": now(), "command": "python -m bench.stacked", "machine": machine(packages=("transformers",)),
            "load_before": before, "load_after": load_average(), "tokens": list(probe_set.input_ids.shape),
            "repeats": REPEATS, "rows": rows}


def main() -> None:
    torch.manual_seed(0)
    path = save_result("stacked", run())
    print(f"wrote {path}", file=sys.stderr)
    from bench import report

    report.write()


if __name__ == "__main__":
    main()
