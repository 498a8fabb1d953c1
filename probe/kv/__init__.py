"""`kv_heads`: which KV heads a long-context cache can shrink to sink + recent keys (streaming, Xiao et al. 2023) and
which need the full cache (retrieval, Wu et al. 2024); a KV head streams only if every query head sharing it can."""

from probe.kv.budget import (DEFAULT_FULL_FRACTION, DEFAULT_MAX_LOSS_INCREASE, Budget, CurveInputs, budget_points,
                             calibrate_budget, curve_steps, full_heads, stream_curve, text_loss)
from probe.kv.order import ORDERS, RETRIEVAL_FLOOR, aggregate, kv_groups, loss_order, query_heads, stream_order
from probe.kv.pipeline import BUDGET_SEED_OFFSET, CURVE_SEED_OFFSET, KV_SINK, kv_heads
from probe.kv.result import KVBudget, KVHeads
from probe.kv.scoring import NeedleRun, accuracy_table, needle_accuracy, score_needles

__all__ = ["BUDGET_SEED_OFFSET", "CURVE_SEED_OFFSET", "DEFAULT_FULL_FRACTION", "DEFAULT_MAX_LOSS_INCREASE", "KV_SINK",
           "ORDERS", "RETRIEVAL_FLOOR", "Budget", "CurveInputs", "KVBudget", "KVHeads", "NeedleRun", "accuracy_table",
           "aggregate", "budget_points", "calibrate_budget", "curve_steps", "full_heads", "kv_groups", "kv_heads",
           "loss_order", "needle_accuracy", "query_heads", "score_needles", "stream_curve", "stream_order", "text_loss"]
