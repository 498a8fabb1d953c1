"""Which streaming order lets the calibrated budget stream the most KV heads of SmolLM2 at the same guarantees:
probe's retrieval order (retrieval ascending) against the loss order (each KV head's loss change when it alone
streams, measured by an exact window-ablation sweep; the heads whose retrieval score passes 0.1 last).

`python -m bench.kv_order [--length 1024] [--order-texts 1]` (saves bench/results/kv_order.json). Texts: the curve
reads natural chunks 0-1, the budget 2-3, the loss order 4 on; needle prompts: scores seed 0, budget 2000, check 1000.
Each order's budget is then checked on the curve's inputs (never read by the order or the budget).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


from bench.common import load_average, machine, now, save_result
from probe.ablation.window import WindowAblation
from probe.inputs import DEFAULT_DEPTHS, NeedleOptions, ProbeSet, natural_set
from probe.kv import BUDGET_SEED_OFFSET, CURVE_SEED_OFFSET, calibrate_budget, kv_heads, loss_order
from probe.kv.pipeline import _held_out
from probe.kv.budget import measured_point
from probe.models import load_model
from probe.threads import use_threads


def budget_and_check(loaded: Any, order: list, options: NeedleOptions, window: WindowAblation) -> dict[str, Any]:
    started = time.perf_counter()
    budget = calibrate_budget(loaded, order, _held_out(loaded, options, None, 2, 2, BUDGET_SEED_OFFSET, window))
    check_inputs = _held_out(loaded, options, None, 2, 0, CURVE_SEED_OFFSET, window)
    cache: dict = {}
    base_loss, base_accuracy = measured_point(loaded, check_inputs, [], cache)
    loss, accuracy = measured_point(loaded, check_inputs, order[:budget.streamed], cache)
    return {"streamed": budget.streamed, "points": budget.points, "seconds": time.perf_counter() - started,
            "check": {"loss_change": loss - base_loss, "needle_accuracy": accuracy,
                      "baseline_needle_accuracy": base_accuracy}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--order-texts", type=int, default=1)
    args = parser.parse_args()
    use_threads(1)
    loaded = load_model("smollm2")
    started, load_before = now(), load_average()
    window = WindowAblation()
    options = NeedleOptions(seed=0, lengths=(args.length,), depths=DEFAULT_DEPTHS, prompts=1)
    scored = kv_heads(loaded, lengths=(args.length,), curve=False, full_fraction=0.25)
    texts = natural_set(loaded, seq_len=args.length - 1, num_seqs=4 + args.order_texts)
    order_set = ProbeSet("natural", texts.description + " (chunks 4 on)", texts.input_ids[4:], texts.offset)
    timer = time.perf_counter()
    by_loss, changes = loss_order(loaded, scored.kv_retrieval, order_set, window)
    order_seconds = time.perf_counter() - timer
    found = {"retrieval": budget_and_check(loaded, scored.order, options, window),
             "loss": budget_and_check(loaded, by_loss, options, window) | {"order_seconds": order_seconds,
                                                                         "order_loss_changes": changes}}
    data = {"benchmark": "kv_order", "date": started, "machine": machine(), "load_before": load_before,
            "load_after": load_average(), "length": args.length, "orders": found,
            "command": "python -m bench.kv_order " + " ".join(sys.argv[1:])}
    save_result("kv_order", data)
    print(json.dumps({name: {k: v for k, v in f.items() if k not in ("points", "order_loss_changes")}
                      for name, f in found.items()}, indent=1))


if __name__ == "__main__":
    main()
