"""`kv_heads`: which KV heads a long-context cache can shrink to sink + recent keys (streaming) and which need the
full cache (retrieval), per query head and per KV head, with the check that makes such a map trustworthy.

- Scores, one forward per needle prompt (probe.inputs.needle): the retrieval score (Wu et al. 2024) and the
  streaming score
  (StreamingLLM's sink + recent mass, Xiao et al. 2023), both from the score registry (probe.heads.scores).
- A KV head streams only if every query head sharing it can: its retrieval score is the max over its group, its
  streaming score the min.
- Labels, by default from a calibrated budget: the largest number k of KV heads, streamed in the order below, whose
  measured point keeps the needle accuracy at the unablated model's level and the natural-text loss change within
  `max_loss_increase` (+0.03), on needle prompts and texts that neither the scores nor the curve read; found by
  bisection over k (about log2 of the KV heads' count points, each measured), assuming the acceptable k are a
  prefix. A fixed budget on request: the `full_fraction` of KV heads that retrieval needs most stay full (or, with
  thresholds, a head is full when its retrieval score passes `retrieval_threshold` or its streaming score falls
  below `streaming_threshold`). Or the budget of kvpress's DuoAttentionPress at a fraction of the KV cache removed
  (`kvpress_ratio`, at the longest length): the press streams the lowest-scored `head_compression_ratio` of the KV
  heads, and k / n of them, k the nearest that removes the fraction, streams exactly the first k of the order;
  their point is measured as the calibrated budget's.
- Order: retrieval ascending, ties by streaming descending (a streaming-first order would stream retrieval heads
  early: in plain text they too put most of their mass on sink + recent keys).
- The curve: the first k KV heads of that order windowed (WindowAblation), k = 0 .. all, the loss change on natural
  text and the needle accuracy at each k, against random orders; on needle prompts other than the scored ones.
- The cache a streaming head keeps: 64 sink + 256 recent keys by default (KV_SINK, DEFAULT_RECENT), the cache that
  DuoAttention deploys its streaming heads with (Xiao et al. 2024; its evaluations run `--sink_size 64
  --recent_size 256`), since DuoAttention is what the exported map is for. The map is calibrated for that cache:
  a smaller one (StreamingLLM's 4 sink keys, `sink=4`) loses more per streamed head, and its budget is smaller.

Modules, one job each, data flowing one way (scoring -> order -> points -> budget / curve -> result -> pipeline):
`scoring` (the needle prompts' scoring pass and the model's own needle accuracy), `order` (per KV head scores and the
streaming order), `points` (one point of an order measured: loss and needle accuracy with k KV heads streamed),
`budget` (the calibrated or fixed budget, `Budget`, the labels), `curve` (the order against random orders), `result`
(`KVHeads`, its `to_dict` and `to_frame`; `KVBudget`, an export's budget file), `pipeline` (`kv_heads`, the stages
in turn).
"""

from probe.kv.budget import (DEFAULT_FULL_FRACTION, DEFAULT_MAX_LOSS_INCREASE, Budget, budget_points, calibrate_budget,
                             full_heads)
from probe.kv.curve import curve_steps, stream_curve
from probe.kv.order import ORDERS, RETRIEVAL_FLOOR, aggregate, kv_groups, loss_order, query_heads, stream_order
from probe.kv.pipeline import BUDGET_SEED_OFFSET, CURVE_SEED_OFFSET, KV_SINK, kv_heads
from probe.kv.points import CurveInputs, text_loss
from probe.kv.result import KVBudget, KVHeads
from probe.kv.scoring import NeedleRun, accuracy_table, needle_accuracy, score_needles

__all__ = ["BUDGET_SEED_OFFSET", "CURVE_SEED_OFFSET", "DEFAULT_FULL_FRACTION", "DEFAULT_MAX_LOSS_INCREASE", "KV_SINK",
           "ORDERS", "RETRIEVAL_FLOOR", "Budget", "CurveInputs", "KVBudget", "KVHeads", "NeedleRun", "accuracy_table",
           "aggregate", "budget_points", "calibrate_budget", "curve_steps", "full_heads", "kv_groups", "kv_heads",
           "loss_order", "needle_accuracy", "query_heads", "score_needles", "stream_curve", "stream_order", "text_loss"]
