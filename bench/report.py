"""Render bench/results/*.json into bench/RESULTS.md. Every number in it comes from those files."""

from __future__ import annotations

import json
from typing import Any

from bench import kernel_compile, kvpress_report
from bench.common import GIB, RESULTS_DIR, RESULTS_MD, TOUR_DOCS, load_result, tour_result

TARGETS = {"classification": 1.15, "ablation_naive": 0.65, "ablation_tl": 0.57, "long_context_4096": 1.5}

MARGIN = 0.5  # bench.tour: a stated time holds on a machine half as fast as the one that measured it

def _machine(data: dict[str, Any]) -> str:
    m = data["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    load = data.get("load_before"), data.get("load_after")
    load_text = ""
    if load[0] is not None:
        load_text = f"; load average (1 min) {load[0][0]:.2f} before" + (
            f", {load[1][0]:.2f} after" if load[1] is not None else "")
    return (f"- Date: {data['date']}; command: `{data.get('command', '?')}`\n"
            f"- Machine: {m['cpu']}, {m['cores']} cores (torch threads: {m['torch_threads']}), "
            f"{m['memory_gib']} GiB RAM, "
            f"GPU: {m['gpu']}; {m['os']}\n- Versions: {versions}{load_text}\n")


def _verdict(value: float, target: float) -> str:
    return f"**met** ({value:.2f}x <= {target}x)" if value <= target else f"**not met** ({value:.2f}x > {target}x)"


def classification(data: dict[str, Any]) -> str:
    t = data["timings"]
    labels = {
        "plain": "plain sdpa forward, `model(input_ids)` (baseline)",
        "plain_no_logits": "decoder only, `model.model(input_ids)` (no LM head), for reference",
        "probe": "**probe**: previous-token + duplicate-token + induction scores of all 270 heads",
        "probe_all6": "probe, all six scores (adds sink, next-token, positional)",
        "tl_fastest": "TransformerLens fastest: 1 batched `run_with_cache` (pattern hooks) + `detect_head` x 3 x 8",
        "tl_documented": "TransformerLens documented: `detect_head(model, [8 prompts], name)` x 3",
    }
    lines = [f"## 1. Classification of every head, 8 x {data['batch'][1]} tokens (BOS + 50 random tokens x 2)\n",
             _machine(data), f"- {data['repeats']} repeats, variants interleaved (order rotated each repeat); "
             "ratio = median over repeats of (variant time / baseline time of the same repeat)\n",
             "| variant | median time (s) | ratio vs plain forward | ratio range |", "|---|---:|---:|---:|"]
    for name in t["seconds"]:
        low, high = t["ratio_range"][name]
        lines.append(f"| {labels.get(name, name)} | {t['median_seconds'][name]:.3f} | "
                     f"{t['ratio_vs_baseline'][name]:.2f}x | {low:.2f}-{high:.2f} |")
    lines.append("")
    lines.append(f"Target probe <= {TARGETS['classification']}x a plain forward: "
                 f"{_verdict(t['ratio_vs_baseline']['probe'], TARGETS['classification'])}.")
    if "tl_fastest" in t["seconds"] and "paired_ratios" in t:
        pairs = t["paired_ratios"]
        d = pairs.get("probe/tl_documented")
        lines.append(f"probe takes {pairs['probe/tl_fastest']:.2f}x the time of TransformerLens' fastest variant"
                     + (f" and {d:.2f}x that of its documented usage" if d else "")
                     + " (medians of per-repeat ratios).")
    if data.get("spearman_probe_vs_tl"):
        agreement = ", ".join(f"{k} {v:.3f}" for k, v in data["spearman_probe_vs_tl"].items())
        lines.append(f"Sanity check: Spearman rank correlation of probe's and TransformerLens' scores over the 270 "
                     f"heads (the definitions differ: TransformerLens averages over every query, probe over the "
                     f"queries where the pattern is defined): {agreement}.")
    if data.get("note"):
        lines.append(f"Note: {data['note']}")
    return "\n".join(lines) + "\n"


def ablation(data: dict[str, Any]) -> str:
    t = data["timings"]
    labels = {"naive": "naive hook loop: one full forward per head (baseline)",
              "tl": "TransformerLens `run_with_hooks` on `hook_z`, one per head",
              "probe_exact": "**probe** `sweep(mode=\"exact\")`"}
    timed, total = data["n_heads_timed"], data["n_heads_total"]
    scope = "all heads" if timed == total else (
        f"{timed} of {total} heads: every head of layers {', '.join(map(str, data['layers']))} (the middle layer "
        f"of each sixth of the model, a representative subset: probe's exact mode costs less for later layers, and "
        f"these layers average as all 30 do)")
    lines = [f"## 2. Zero-ablation sweep, 4 x {data['batch'][1]} tokens of natural text\n", _machine(data),
             f"- Timed: {scope}; {data['repeats']} repeats, interleaved; ratio = median of per-repeat ratios\n",
             "| variant | median time (s) | per head (s) | ratio vs naive | ratio range |", "|---|---:|---:|---:|---:|"]
    for name in t["seconds"]:
        low, high = t["ratio_range"][name]
        lines.append(f"| {labels.get(name, name)} | {t['median_seconds'][name]:.1f} | "
                     f"{t['median_seconds'][name] / timed:.3f} | {t['ratio_vs_baseline'][name]:.2f}x | "
                     f"{low:.2f}-{high:.2f} |")
    lines.append("")
    if timed != total:
        lines.append(f"Full-sweep times extrapolated from the subset (x {total / timed:.0f}), an **estimate**: " +
                     ", ".join(f"{name} ~{t['median_seconds'][name] * total / timed:.0f} s" for name in t["seconds"])
                     + ".")
    if "probe_exact" in t["seconds"]:
        r = t["ratio_vs_baseline"]["probe_exact"]
        lines.append(f"Target probe <= {TARGETS['ablation_naive']}x naive: {_verdict(r, TARGETS['ablation_naive'])}.")
        if "tl" in t["seconds"]:
            rt = t["paired_ratios"]["probe_exact/tl"] if "paired_ratios" in t else \
                t["median_seconds"]["probe_exact"] / t["median_seconds"]["tl"]
            lines.append(f"Target probe <= {TARGETS['ablation_tl']}x TransformerLens (median of per-repeat ratios): "
                         f"{_verdict(rt, TARGETS['ablation_tl'])}; TransformerLens / naive = "
                         f"{t['ratio_vs_baseline']['tl']:.2f}x.")
        lines.append(f"probe's path: {data.get('probe_path')}")
    diffs = data.get("max_abs_loss_difference_vs_naive") or {}
    if diffs:
        lines.append("Same numbers: largest |loss difference| against the naive loop over the timed heads: " +
                     ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()) + ".")
    est = data.get("estimate")
    if est:
        lines.append("")
        if "exact_all_heads_seconds" in est:
            full_naive = t["median_seconds"]["naive"] * total / timed
            lines.append(f"Exact sweep of all {total} heads, run once (the reference for estimate mode): "
                         f"{est['exact_all_heads_seconds']:.0f} s, against the naive loop's extrapolated "
                         f"~{full_naive:.0f} s: ~{est['exact_all_heads_seconds'] / full_naive:.2f}x, an **estimate** "
                         f"(one run, extrapolated baseline).")
        else:
            lines.append(f"Reference for estimate mode: {est.get('reference')}.")
        if "spearman" in est:
            lines += [
                "",
                f"One plain forward of the batch (no loss): {est['forward_seconds']:.3f} s, the unit of "
                "forward-equivalents (FE) below. Target for estimate mode: Spearman >= 0.9 against the exact sweep "
                "within 10 FE (probe's count); the top-10 overlap is reported, not a target.",
                "",
                "| method | time (s) | FE measured | FE probe counts | Spearman vs exact | top-10 overlap |",
                "|---|---:|---:|---:|---:|---:|",
                f"| probe estimate mode (default: first + second order, {est.get('exact_heads', '?')} top heads "
                f"ablated exactly) | {est['estimate_seconds']:.1f} | "
                f"{est['estimate_forward_equivalents_measured']:.1f} | "
                f"{est.get('estimate_forward_equivalents_reported') or float('nan'):.1f} | {est['spearman']:.3f} | "
                f"{est['top10_overlap']}/10 |",
            ]
            if "atp_spearman" in est:
                lines.append(f"| attribution patching alone (`samples=0, refine=0`) | {est['atp_seconds']:.1f} | "
                             f"{est['atp_forward_equivalents_measured']:.1f} | | {est['atp_spearman']:.3f} | "
                             f"{est['atp_top10_overlap']}/10 |")
            counted = est.get("estimate_forward_equivalents_reported") or float("inf")
            met = est["spearman"] >= 0.9 and counted <= 10
            lines += ["", f"Estimate target (Spearman >= 0.9 within 10 FE): {'met' if met else '**not met**'} "
                      f"(Spearman {est['spearman']:.3f} in {counted:.1f} FE counted, "
                      f"{est['estimate_forward_equivalents_measured']:.1f} in measured time); top-10 overlap "
                      f"{est['top10_overlap']}/10, reported, not promised."]
        else:
            lines.append(f"Estimate mode: {est.get('estimate')}.")
    return "\n".join(lines) + "\n"


def taylor(data: dict[str, Any]) -> str:
    lines = ["## 2b. How far a Taylor expansion takes estimate mode\n", _machine(data),
             f"- f_h(a): the change of the mean loss with head h scaled by 1 - a; f_h(1) is the exact zero-ablation "
             f"delta (probe's exact sweep, all {data['heads']} heads), f_h''(0) the exact second derivative by "
             f"central differences at a = +-0.1 ({2 * data['heads']} forwards). Baseline loss "
             f"{data['baseline_loss']:.5f} (the sweep's: {data['sweep_baseline_loss']:.5f}). The gradient's "
             f"f_h'(0) against the central difference: median |difference| "
             f"{data['first_order_difference_median']:.1e}, largest {data['first_order_difference_max']:.1e} (the "
             f"difference holds a third-order term; largest first-order term {data['first_order_scale']:.3f}).\n",
             "| estimate of every head's delta | Spearman vs exact | top-10 overlap |", "|---|---:|---:|"]
    lines += [f"| {row['estimate']} | {row['spearman']:.3f} | {row['top10_overlap']}/10 |" for row in data["rows"]]
    if data["paths"]:
        steps = list(data["paths"][0]["path"])
        lines += ["", "Heads on which the exact second-order Taylor value and the exact delta disagree about the top "
                  "10, and the measured loss along each one's ablation:", "",
                  "| head | in exact top 10 | f'(0) | Gauss-Newton f''/2 | exact f''(0)/2 | Taylor | "
                  + " | ".join(f"f({a})" for a in steps) + " | f(1) exact |",
                  "|---|---|---:|---:|---:|---:|" + "---:|" * (len(steps) + 1)]
    for row in data["paths"]:
        lines.append(f"| {row['head']} | {'yes' if row['in_exact_top10'] else 'no'} | {row['first_order']:.4f} | "
                     f"{row['gauss_newton']:.4f} | {row['half_second_derivative']:.4f} | {row['taylor']:.4f} | "
                     + " | ".join(f"{v:.4f}" for v in row["path"].values()) + f" | {row['exact']:.4f} |")
    return "\n".join(lines) + "\n"


def memory(data: dict[str, Any]) -> str:
    points = data["points"]
    tools = [t for t in ("probe", "probe_ablate", "hf", "tl", "tl_patterns") if t in points]
    names = {"probe": "probe classify (CLI)", "probe_ablate": "probe ablate (CLI, 3 heads, 2 stacked)",
             "hf": "HF output_attentions=True",
             "tl": "TransformerLens run_with_cache", "tl_patterns": "TL run_with_cache, pattern hooks only"}
    lengths = sorted({int(n) for t in tools for n in points[t]})
    lines = ["## 3. Peak memory (RSS, GiB) against sequence length, one sequence, fresh process per point\n",
             _machine(data),
             f"- Cap per process: {data['cap_bytes'] / GIB:.0f} GiB (shared machine); points predicted above 90% "
             "of it were not run: *italic ~N* marks an estimate from a least-squares fit a + bN + cN^2 to the "
             "points measured for the same tool\n"]
    if data.get("tool_runs"):
        by_run: dict[str, list[str]] = {}
        for tool, run in data["tool_runs"].items():
            by_run.setdefault(f"{run['date']}, `{run['command']}`", []).append(tool)
        lines.append("- Columns measured in separate runs: " + "; ".join(
            f"{', '.join(tools)}: {when}" for when, tools in by_run.items()) + "\n")
    if "load_only" in points:
        floor = next(iter(points["load_only"].values()))
        lines.append(f"- Floor: Python + torch + SmolLM2 (float32) loaded, nothing run: "
                     f"{floor['peak_rss'] / GIB:.2f} GiB\n")
    lines.append("| tokens | " + " | ".join(names[t] for t in tools) + " |")
    lines.append("|---:|" + "---:|" * len(tools))
    for n in lengths:
        cells = []
        for tool in tools:
            row = points[tool].get(str(n))
            if row is None:
                cells.append("")
            elif row["status"] == "measured":
                cells.append(f"{row['peak_rss'] / GIB:.2f}")
            elif "estimate" in row:
                note = " (stopped at cap)" if row["status"] == "stopped at cap" else ""
                cells.append(f"*~{row['estimate'] / GIB:.1f}*{note}")
            else:
                cells.append(row["status"])
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines.append("")
    if "probe" in points:
        times = ", ".join(f"{n}: {row['wall_seconds']:.0f} s" for n, row in points["probe"].items()
                          if row["status"] == "measured")
        lines.append(f"probe classify wall time per point (model load included): {times}.")
    for tool, label in (("probe", "probe classify"), ("probe_ablate", "probe ablate")):
        top = points.get(tool, {}).get("8192")
        if top and top["status"] == "measured":
            verdict = "**met**" if top["peak_rss"] < 4 * GIB else "**not met**"
            lines.append(f"Long-context target, `{label}` at 8192 tokens under 4 GiB: {verdict} "
                         f"({top['peak_rss'] / GIB:.2f} GiB peak RSS, {top['wall_seconds']:.0f} s).")
    return "\n".join(lines) + "\n"


def profile(data: dict[str, Any]) -> str:
    lines = ["## Where the time goes (torch.profiler, pyinstrument)\n", _machine(data)]
    for name in ("short", "long"):
        part = data.get(name)
        if not part:
            continue
        s = part["seconds"]
        lines.append(f"### {name}: {part['shape'][0]} x {part['shape'][1]} tokens, scores "
                     f"{', '.join(part['scores'])}\n")
        lines.append(f"One run each (not a benchmark, see above for those): plain forward {s['plain']:.3f} s, "
                     f"probe {s['probe']:.3f} s. Self time by op inside probe's run "
                     f"({part['profiled_self_seconds']:.2f} s of op time under the profiler):\n")
        if part.get("probe_ops_by_name"):
            lines.append("| op (all shapes) | calls | self ms | share |")
            lines.append("|---|---:|---:|---:|")
            for op in part["probe_ops_by_name"]:
                lines.append(f"| {op['op']} | {op['calls']} | {op['self_ms']:.0f} | {op['share']:.0%} |")
            lines.append("")
        lines.append("| op | input shapes | calls | self ms | share |")
        lines.append("|---|---|---:|---:|---:|")
        for op in part["probe_ops"]:
            lines.append(f"| {op['op']} | `{op['shapes']}` | {op['calls']} | {op['self_ms']:.0f} | "
                         f"{op['share']:.0%} |")
        py = part.get("python") or {}
        if py.get("by_file"):
            lines.append(f"\npyinstrument, wall time by the source file of the running Python frame (a torch op counts "
                         f"for its caller), {py['total_seconds']:.2f} s in all: " +
                         ", ".join(f"`{row['file']}` {row['share']:.0%}" for row in py["by_file"][:8]) + ".")
        lines.append("")
    return "\n".join(lines) + "\n"


def long_context(data: dict[str, Any]) -> str:
    lines = ["## 5. Long context: classification against a plain forward, and 32k tokens in memory\n", _machine(data),
             "- Speed: SmolLM2, one sequence of BOS + R random tokens repeated twice, all six scores (`score_heads`, "
             "what `probe classify` runs per probe set) against one plain sdpa forward with logits "
             "(`model(input_ids)`) of the same ids, interleaved, order rotated each repeat; ratio = median of "
             f"per-repeat ratios. `before` is the blocked attention and score functions of {data['before_commit']} "
             "(before the long-context rewrite), swapped in and timed in the same run. Rows can come from separate "
             "runs (`--long-lengths`); NOTES.md names each row's run and load.\n",
             "| tokens | repeats | plain (s) | probe (s) | probe / plain | range | before (s) | before / plain | "
             "probe / before |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for length, part in sorted(data["speed"].items(), key=lambda kv: int(kv[0])):
        t = part["timings"]
        median, ratio, spread = t["median_seconds"], t["ratio_vs_baseline"], t["ratio_range"]["probe"]
        before = ("probe_before" in median and
                  f"{median['probe_before']:.2f} | {ratio['probe_before']:.2f}x | "
                  f"{t['paired_ratios']['probe/probe_before']:.2f}x") or " | | "
        lines.append(f"| {part['tokens']} | {len(t['seconds']['plain'])} | {median['plain']:.2f} | "
                     f"{median['probe']:.2f} | **{ratio['probe']:.2f}x** | {spread[0]:.2f}-{spread[1]:.2f} | "
                     f"{before} |")
    lines.append("")
    for length, part in sorted(data["speed"].items(), key=lambda kv: int(kv[0])):
        if "largest_difference_before_after" in part:
            worst = max(part["largest_difference_before_after"].values())
            lines.append(f"- {part['tokens']} tokens: largest |score difference| before vs after over the six "
                         f"scores and 270 heads: {worst:.1e}.")
    target = data["speed"].get("4096")
    if target:
        lines.append(f"- Target `probe classify` at 4096 tokens <= {TARGETS['long_context_4096']}x a plain "
                     f"forward: "
                     f"{_verdict(target['timings']['ratio_vs_baseline']['probe'], TARGETS['long_context_4096'])}.")
    layer = data.get("layer_profile")
    if layer:
        lines.append(f"\n- Profile of one attention layer (SmolLM2's sizes, random q/k/v, {layer['length']} positions, "
                     "causal): blocked attention with the six scores reduced from its blocks, before and after; "
                     f"plain sdpa attention of the same tensors {layer['sdpa_seconds']:.3f} s (min of 3).\n")
        lines.append("| code | seconds (min of 3) | vs sdpa | top ops by self time (share of the profiled run) |")
        lines.append("|---|---:|---:|---|")
        for label in ("before", "after"):
            part = layer[label]
            ops = ", ".join(f"{op['op'].replace('aten::', '')} {op['share']:.0%}" for op in part["ops"][:6])
            lines.append(f"| {label} | {part['seconds']:.3f} | {part['seconds'] / layer['sdpa_seconds']:.2f}x | "
                         f"{ops} |")
    memory = data.get("memory")
    if memory:
        lines.append("\n- Memory: fresh processes (`python -m bench.long_context_point TOOL N`), a random llama with "
                     "SmolLM2's layer sizes (576 hidden, 9/3 heads of 64, MLP 1536, vocabulary 49,152), 2 layers, "
                     "32,768-token context; peak RSS from the kernel, 8 GiB watchdog.\n")
        lines.append("| point | tokens | peak RSS (GiB) | wall (s) | |")
        lines.append("|---|---:|---:|---:|---|")
        labels = {"load_only": "floor: model built, nothing run", "classify": "`classify`, all six scores (both sets)",
                  "heatmap": "`attention_patterns`, last 512 positions", "equal": "scores blocked vs unblocked"}
        for key, point in memory.items():
            tool = key.split(":")[0]
            extra = ""
            if "largest_difference" in point:
                extra = "largest difference " + f"{max(point['largest_difference'].values()):.1e}"
            if point.get("returncode"):
                extra = "stopped at the cap" if point.get("killed") else "failed"
            lines.append(f"| {labels.get(tool, tool)} | {point['length']} | {point['peak_rss'] / GIB:.2f} | "
                         f"{point['seconds']:.0f} | {extra} |")
        sources = sorted({point["source"] for point in memory.values() if point.get("source")})
        if sources:
            lines.append("\nPoints measured outside this section's run: " + "; ".join(sources) + ".")
        ok = all(memory[k]["peak_rss"] < 8 * GIB and not memory[k].get("returncode")
                 for k in ("classify:32768", "heatmap:32768") if k in memory)
        lines.append(f"\nTarget 32,768 tokens under 8 GiB for classify and a heatmap window: "
                     f"{'**met**' if ok else '**not met**'}.")
    return "\n".join(lines) + "\n"


HEADER = """# probe benchmarks

Run them all with `python -m bench` (or `bash bench/run.sh`); one at a time with `python -m bench classification`,
`ablation`, `taylor`, `memory`, `profile`, `long_context`. TransformerLens comes with the `bench` extra: \
`pip install -e '.[bench]'`
(install `torch` first, pinned to the version you have, so that the resolver keeps it). Each benchmark writes
`bench/results/NAME.json`; this file is rendered from those files, so every number below was measured in the run
whose date and command head its section. Ratios are against a baseline timed in the same run.

GPU: no GPU was lent to the machine these numbers come from, so no CUDA (bf16 / fp32) runs were made. The code is
device-agnostic (`probe classify --device cuda --dtype bfloat16`); `python -m bench classification --device cuda
--dtype bfloat16` runs benchmark 1 on a GPU and saves it as a separate result.
"""


def kv_heads(data: dict[str, Any]) -> str:
    """bench/kv_heads.py: the scoring pass and a curve forward against a plain forward, and the curve's ends."""
    kv, curve = data["kv_heads"], data["kv_heads"]["curve"]
    timings = data["timings"]
    lines = [f"## kv-heads: scoring pass and curve forwards, SmolLM2 at {kv['options']['lengths'][-1]} tokens",
             "", f"- Date: {data['date']}; command: `{data['command']}` (timing: {timings[0]['repeats']} repeats, "
             "variants interleaved, median of per-repeat ratios; see docs/kv-heads.md)"]
    for part, what in (("timing_from", "timings"), ("curve_from", "map and curve")):
        if part in data:
            lines.append(f"- The {what} are those of an earlier run: {data[part]['date']}, `{data[part]['command']}`")
    lines += ["",
              "| tokens | plain forward (s, baseline) | scoring pass (retrieval + streaming, one needle prompt; "
              "target <= 1.5x) | curve forward (half the heads windowed; target <= 1.3x) | curve forward (every head "
              "windowed; target <= 1.3x) |", "|---:|---:|---:|---:|---:|"]
    for timing in timings:
        ratio = timing["ratio_vs_plain"]
        every = _verdict(ratio["curve_forward_all"], 1.3) if "curve_forward_all" in ratio else "not measured"
        lines.append(f"| {timing['length']} | {timing['seconds']['plain']:.2f} | {_verdict(ratio['scoring'], 1.5)} | "
                     f"{_verdict(ratio['curve_forward'], 1.3)} | {every} |")
    lines += ["",
              f"Curve (k of {len(kv['order'])} KV heads streamed, sink {kv['sink']} + recent {kv['recent']}): "
              f"baseline loss {curve['baseline_loss']:.4f}, needle accuracy {curve['baseline_needle_accuracy']:.2f}.",
              "", "| k | " + " | ".join(f"{name}: Δ loss, needle" for name in curve["orders"]) + " |",
              "|---:|" + "---:|" * len(curve["orders"])]
    for index, k in enumerate(curve["k"]):
        cells = [f"{order['loss_change'][index]:+.4f}, {order['needle_accuracy'][index]:.2f}"
                 for order in curve["orders"].values()]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def patching(data: dict[str, Any]) -> str:
    """bench/patching.py: the exact all-heads patching sweep against a naive loop of hooked forwards."""
    timings = data["timings"]
    ratio, (low, high) = timings["ratio_vs_baseline"]["probe"], timings["ratio_range"]["probe"]
    lines = [f"## Activation patching of every head, SmolLM2, {data['pairs']} IOI pairs", "", _machine(data),
             f"- {data['repeats']} repeats, interleaved; ratio = median of per-repeat ratios", "",
             "| variant | median time (s) | ratio vs naive | ratio range |", "|---|---:|---:|---:|",
             f"| naive: one hooked forward of the corrupt prompts per head (baseline) | "
             f"{timings['median_seconds']['naive']:.2f} | 1.00x | |",
             f"| **probe** `patch_heads` (exact) | {timings['median_seconds']['probe']:.2f} | {ratio:.2f}x | "
             f"{low:.2f}-{high:.2f} |", "",
             f"Target probe <= 0.65x naive: {_verdict(ratio, 0.65)}. {data['n_heads_timed']} heads; path: "
             f"{data['probe_path']}. Largest |patched logit difference - naive's|: "
             f"{data['max_abs_logit_diff_difference']:.2e}.",
             f"Logit difference: clean {data['clean_logit_diff']:+.3f}, corrupt {data['corrupt_logit_diff']:+.3f}; "
             "top heads by |patch effect|: " + ", ".join(f"{name} {effect:+.3f}" for name, effect in
                                                          data["top_heads"]) + "."]
    estimate = data.get("estimate")
    if estimate:
        lines.append(f"\nAttribution-patching estimate (`probe patch --estimate`, first order): "
                     f"{estimate['forward_equivalents']:.1f} forward-equivalents ({estimate['seconds']:.1f} s; one "
                     f"plain forward of the corrupt prompts {estimate['forward_seconds']:.2f} s), Spearman "
                     f"{estimate['spearman_vs_exact']:.3f} against the exact patches, top-10 overlap "
                     f"{estimate['top10_overlap']}/10 (aim: Spearman >= 0.9 within 3 FE).")
    return "\n".join(lines) + "\n"


def _atlas_build(name: str, entry: dict[str, Any], limit: float) -> list[str]:
    load = entry.get("load_before"), entry.get("load_after")
    stages = " | ".join(f"{stage['name']} {stage['seconds']:.1f}" for stage in entry["stages"])
    notes = "; ".join(f"{stage['name']}: {stage['note']}" for stage in entry["stages"] if stage["note"])
    verdict = "**met**" if entry["seconds"] <= limit else "**not met**"
    browser, mib = entry["browser"], entry["page_bytes"] / 2**20
    summary = entry["summary"]
    loads = (f"load average (1 min) {load[0][0]:.2f} before, {load[1][0]:.2f} after" if load[0] is not None
             else "load not recorded (a shared machine: 2 cores, other jobs running)")
    return [f"### {name}", "", f"- Date: {entry['date']}; command: `{entry.get('command', '?')}`; {loads}", "",
            f"Total {entry['seconds']:.1f} s (target {limit:.0f} s on 2 CPU cores: {verdict}). Seconds per stage: "
            f"{stages}.", f"Notes: {notes}." if notes else "",
            f"Page: {mib:.1f} MiB (target < 15 MiB); head finder ready {browser['ready_seconds']:.2f} s after "
            f"opening in headless Chromium (target < 3 s; load average {browser['load'][0]:.2f}); "
            f"{browser['dashboards_opened']} of "
            f"{browser['heads']} dashboards opened in {browser['dashboards_seconds']:.0f} s, "
            f"{browser['n_console_errors']} console errors, {browser['requests']} request(s), "
            f"{len(browser['external_requests'])} external.",
            f"Labels: {summary['labels']}; by class and evidence: " + "; ".join(
                f"{cls} " + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
                for cls, counts in summary["by_class"].items()) + ".", ""]


def atlas(data: dict[str, Any]) -> str:
    """bench/atlas.py: the time per stage of `probe atlas` on SmolLM2 (default and --fast) and its page."""
    lines = ["## probe atlas on SmolLM2: time per stage, page size, head finder in Chromium", "", _machine(
        {"machine": data["machine"], "date": "see each build", "command": "python -m bench.atlas [--fast]"})]
    for kind, title, limit in (("exact", "Default build (exact sweep)", 600.0), ("fast", "--fast", 180.0)):
        if kind in data:
            lines += _atlas_build(title, data[kind], limit)
    return "\n".join(lines) + "\n"


def patching_qk(data: dict[str, Any]) -> str:
    """bench/patching_qk.py: attribution patching of query, key and value patches, with and without the QK fix."""
    lines = [f"## Attribution patching of queries, keys and values (AtP*'s QK fix), SmolLM2, {data['pairs']} IOI pairs",
             "", _machine(data), f"- heads of layers {data['layers']}; keys and values per key/value group; each "
             "estimate's Spearman against probe's exact patches of the same units", "",
             "| component | units | Spearman, QK fix (probe) | Spearman, plain first order | estimate FE | "
             "estimate (s) | exact (s) | largest exact abs(patch effect) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for component, found in data["components"].items():
        lines.append(f"| {component} | {found['units']} | {found['spearman_qk_fix']:.3f} | "
                     f"{found['spearman_plain']:.3f} | {found['forward_equivalents']:.1f} | "
                     f"{found['estimate_seconds']:.1f} | {found['exact_seconds']:.1f} | "
                     f"{found['largest_exact_effect']:.3f} |")
    return "\n".join(lines) + "\n"


def kv_order(data: dict[str, Any]) -> str:
    """bench/kv_order.py: the calibrated budget each streaming order earns, checked on inputs neither read."""
    lines = [f"## kv-heads: the calibrated budget by order, SmolLM2, {data['length']} tokens", "", _machine(data), "",
             "| order | KV heads streamed (of 90) | check: loss change | check: needle accuracy | budget (s) | "
             "order (s) |", "|---|---:|---:|---:|---:|---:|"]
    for name, found in data["orders"].items():
        check = found["check"]
        lines.append(f"| {name} | {found['streamed']} | {check['loss_change']:+.4f} | {check['needle_accuracy']:.2f} | "
                     f"{found['seconds']:.0f} | {found.get('order_seconds', 0):.0f} |")
    return "\n".join(lines) + "\n"


def kv_default(data: dict[str, Any]) -> str:
    """bench/kv_default.py: the default `probe kv-heads` on SmolLM2, end to end, in a fresh process."""
    lines = ["## kv-heads: the default run on SmolLM2, end to end (target: within 5 minutes on 2 CPU cores)", "",
             _machine(data), "", "| run | date | load before / after | wall | peak RSS (GiB) | scores | budget | curve "
             "| budget points; curve values | KV heads streamed |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for name in ("default", "every_random_point"):
        run = data.get(name)
        if run is None:
            continue
        stage = run["stage_seconds"]
        minutes, seconds = divmod(round(run["wall_seconds"]), 60)
        lines.append(f"| `{run['command']}` | {run['date']} | {run['load_before'][0]:.1f} / {run['load_after'][0]:.1f} "
                     f"| {'**met**' if run['wall_seconds'] <= 300 else '**not met**'}, "
                     f"{minutes}:{seconds:02d} | {run['peak_rss'] / 2**30:.2f} | {stage.get('scores', 0):.0f} s | "
                     f"{stage.get('budget', 0):.0f} s | {stage.get('curve', 0):.0f} s | "
                     f"{len(run['budget_points'])}; {run['curve_points']} | {run['streamed']} of {run['total']} |")
    return "\n".join(lines) + "\n"


def serve(data: dict[str, Any]) -> str:
    """bench/serve.py: `probe serve` under load (serve-load.json) and its speed on SmolLM2 (serve-speed.json)."""
    lines = ["## probe serve: a load test on loopback and its speed", "",
             _machine(data), f"Load: {data['clients']} clients x {data['requests_per_client']} mixed requests a "
             f"round on `{data['model']}`; the model bit-identical afterwards: "
             f"**{'yes' if data['identical_after'] else 'no'}**.", "",
             "| round | requests | failed | seconds | p50 (ms) | p95 (ms) | peak RSS (GiB) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for index, run in enumerate(data["rounds"], 1):
        lines.append(f"| {index} | {run['requests']} | {run['failed']} | {run['seconds']} | {run['p50_s'] * 1000:.0f} "
                     f"| {run['p95_s'] * 1000:.0f} | {run['peak_rss_gib']} |")
    speed = load_result("serve-speed") or {"runs": {}}
    if speed["runs"]:
        lines += ["", "Speed, SmolLM2 on the CPU, a text of the embedded English (targets: first view <= 1.5x a "
                  "plain forward; a head click on a seen text under 100 ms, no forward; an ablation in at most two "
                  "forwards):",
                  "", "| dtype | tokens | date; load before | first view / plain forward (range) | head click | zero "
                  "| mean (first, again) | scale |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for dtype, run in speed["runs"].items():
        low, high = run["timing"]["ratio_range"]["first view"]
        forwards = {name: ", ".join(str(a["forwards"]) for a in answers) for name, answers in run["ablation"].items()}
        lines.append(f"| {dtype} | {run['tokens']} | {run['date']}; {run['load_before'][0]:.1f} | "
                     f"{run['first_view_over_plain']:.2f}x "
                     f"({low:.2f}-{high:.2f}) | {run['head_click_seconds'] * 1000:.0f} ms, "
                     f"{run['head_click_forwards']} forwards | {forwards.get('zero')} | {forwards.get('mean')} | "
                     f"{forwards.get('scale')} |")
    return "\n".join(lines) + "\n"


LSE_TARGET = 1.05


def _ratio_cell(timings: dict[str, Any], name: str) -> str:
    if name not in timings["ratio_vs_baseline"]:
        return "-"
    low, high = timings["ratio_range"][name]
    return f"{timings['ratio_vs_baseline'][name]:.2f}x ({low:.2f}-{high:.2f})"


def lse(data: dict[str, Any]) -> str:
    """bench/lse.py: scores from the log-sum-exp against a plain sdpa forward, and memory at 32k."""
    threads = data["threads"]
    lines = [f"## Head scores from the attention's log-sum-exp, SmolLM2, one sequence, {threads} "
             f"thread{'s' if threads != 1 else ''}", "", _machine(data),
             f"- torch threads: {data['threads']}; variants interleaved, order rotated every repeat; ratio = median "
             "over repeats of (variant / plain of the same repeat), range in brackets. Baseline `plain`: the sdpa "
             "forward classify runs (`run_model(..., logits=False)`: logits at one position)."
             + ("" if not any("reference_timings" in row for row in data.get("classify", {}).values()) else
                " The target ratio (probe) comes from plain and probe alone, in alternation; the blocked path and "
                "the forward with logits were timed against plain in a loop of their own (`reference_timings`).")
             + " Allocator: " + ("freed buffers kept in the C heap, as the `probe` command sets (cli/allocator.py)."
                                 if data["allocator"] == "cli" else "glibc's own thresholds."), "",
             "| tokens | repeats | plain (s) | probe, log-sum-exp path (six scores; target <= 1.05x) | probe, blocked "
             "path | plain with logits at every position | path | largest difference lse vs blocked |",
             "|---:|---:|---:|---|---|---|---|---:|"]
    for tokens, row in data.get("classify", {}).items():
        t = row["timings"]
        reference = row.get("reference_timings", t)
        difference = row.get("largest_difference_lse_blocked")
        ratio = t["ratio_vs_baseline"]["probe"]
        lines.append(f"| {tokens} | {len(t['seconds']['plain'])} | {t['median_seconds']['plain']:.2f} | "
                     f"{'**met**' if ratio <= LSE_TARGET else '**not met**'} ({ratio:.3f}x), range "
                     f"{t['ratio_range']['probe'][0]:.3f}-{t['ratio_range']['probe'][1]:.3f} | "
                     f"{_ratio_cell(reference, 'probe_blocked')} | {_ratio_cell(reference, 'plain_logits')} | "
                     f"{row['path']} | "
                     f"{'-' if difference is None else f'{max(difference.values()):.1e}'} |")
    lines += [] if not data.get("kv") else [
              "", "kv-heads scoring pass (`score_needles`, retrieval + streaming, one needle prompt; baseline "
              "`run_model(ids)`, logits at every position, as in bench/kv_heads.py):", "",
              "| tokens | repeats | plain (s) | scoring, log-sum-exp (target <= 1.05x) | scoring, blocked | forward "
              "without logits | scoring lse / forward without logits | largest difference lse vs blocked |",
              "|---:|---:|---:|---|---|---|---:|---:|"]
    for tokens, row in data.get("kv", {}).items():
        t = row["timings"]
        lines.append(f"| {tokens} | {len(t['seconds']['plain'])} | {t['median_seconds']['plain']:.2f} | "
                     f"{_verdict(t['ratio_vs_baseline']['scoring'], LSE_TARGET)} | "
                     f"{_ratio_cell(t, 'scoring_blocked')} | "
                     f"{_ratio_cell(t, 'plain_no_logits')} | {t['paired_ratios']['scoring/plain_no_logits']:.2f}x | "
                     f"{max(row['largest_difference_lse_blocked'].values()):.1e} |")
    memory = data.get("memory") or {}
    if memory:
        lines += ["", "Peak RSS at 32,768 tokens, fresh processes (`python -m bench.long_context_point TOOL 32768`, a "
                  "random llama with SmolLM2's layer sizes, 2 layers):", "",
                  "| tool | peak RSS (GiB) | seconds of work (the child's own timer) |", "|---|---:|---:|"]
        lines += [f"| {tool} | {point['peak_rss'] / GIB:.2f} | {point['seconds']:.0f} |"
                  for tool, point in memory.items()]
        if "plain" in memory and "classify" in memory:
            ratio = memory["classify"]["peak_rss"] / memory["plain"]["peak_rss"]
            lines.append(f"\nTarget classify's peak within 10% of a plain forward's: "
                         f"{'**met**' if ratio <= 1.1 else '**not met**'} ({ratio:.3f}x).")
    return "\n".join(lines) + "\n"


def precision(data: dict[str, Any]) -> str:
    """bench/precision.py: how far bfloat16 and float16 runs of SmolLM2 lie from float32's, command by command."""
    lines = ["## Precision: bfloat16 and float16 against float32, SmolLM2, CPU", "", _machine(data),
             "Each command run as a user runs it, once per dtype; every figure compares its JSON with float32's "
             "(docs/precision.md quotes them as the precision contract).", "",
             "| command | dtype | seconds | comparison with float32 |", "| --- | --- | ---: | --- |"]
    for name, found in data["results"].items():
        for dtype, seconds in found["seconds"].items():
            compared = found.get(dtype)
            text = "(the reference)" if compared is None else "; ".join(
                f"{key}: {json.dumps(value)}" for key, value in compared.items())
            lines.append(f"| `{found['command']}` | {dtype} | {seconds} | {text} |")
    return "\n".join(lines) + "\n"


def headvis(data: dict[str, Any]) -> str:
    """bench/headvis.py: probe's HeadVis metrics against Neuronpedia HeadVis's own pipeline, and their cost."""
    lines = ["## HeadVis metrics: probe against Neuronpedia HeadVis's pipeline", "", _machine(data),
             "Same tokens (BOS + 511 English tokens; padded: a second sequence right-padded to 400): max |probe - "
             "HeadVis| per metric, and relative to max(|HeadVis|, 1).", "",
             "| model | dtype | tokens | path | metric | max abs | max relative | measured |",
             "| --- | --- | --- | --- | --- | ---: | ---: | --- |"]
    for row in data["equality"]:
        for metric, gap in row["max_abs_difference"].items():
            relative = row.get("max_relative_difference", {}).get(metric)
            lines.append(f"| {row['model']} | {row['dtype']} | {row['tokens']} | {row['path']} | {metric} | "
                         f"{gap:.3g} | "
                         f"{'' if relative is None else f'{relative:.3g}'} | {row.get('date', data['date'])} |")
    if data.get("cost"):
        lines += ["", f"Measured {data.get('cost_date', data['date'])}. One sequence, each variant a fresh process "
                  "(peak RSS the kernel's): plain = the sdpa forward, probe = head_metrics, headvis = the peer's "
                  "eager pipeline.", "",
                  "| model | tokens | variant | seconds | x plain | peak RSS GiB | the call's own GiB |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
        plain = {row["length"]: row.get("seconds") for row in data["cost"] if row["variant"] == "plain"}
        for row in data["cost"]:
            seconds, base = row.get("seconds"), plain.get(row["length"])
            ratio = f"{seconds / base:.2f}" if seconds and base else ""
            shown = f"{seconds:.2f}" if seconds is not None else row.get("stopped", "")
            lines.append(f"| {row['model']} | {row['length']} | {row['variant']} | {shown} | {ratio} | "
                         f"{row['peak_rss_gib']} | {row.get('call_gib', '')} |")
    return "\n".join(lines) + "\n"


GAP_LIMIT = 30.0  # seconds: the docs' promise of a line at least this often


def _minutes(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def tour(data: dict[str, Any], busy: dict[str, Any] | None = None) -> str:
    """bench/tour.py: one row per step run (the README's tour, or a document's `probe` lines), with `busy`'s
    seconds and silence (its run beside busy processes) where there is one, then the steps skipped and why."""
    host = data["machine"]
    doc = data.get("doc")
    title = ("## The README tour, as written (`python -m bench.tour`)" if doc is None else
             f"## {doc}'s commands, as written (`python -m bench.tour --doc {doc}`)")
    lines = [title, "",
             f"{data['date']}, {host['cpu']}, {host['cores']} cores, torch threads {host['torch_threads']}, load "
             f"before {', '.join(f'{value:.1f}' for value in data['load_before'])}"
             + (" (--quick: small inputs, not a timing)" if data.get("quick") else "") + ". Stated: the "
             f"{'README' if doc is None else 'document'}'s time; CPU seconds: user + system of the step's processes "
             "(other work on the host inflates it less than the wall time; a CPU-bound step's quiet wall time is at "
             "most its CPU time); silence: the longest gap between two stderr lines "
             f"(the docs promise at most {GAP_LIMIT:.0f} s). Within: at most {MARGIN:.0%} of the stated time, so that "
             "the stated time holds on a laptop half as fast as this machine. A server (`probe serve`) is timed to "
             "the line with its address, then stopped with Ctrl-C.", ""]
    busy_rows = {} if busy is None else {row["line"]: row for row in busy["rows"]}
    if busy is not None:
        lines += [f"Busy: the same steps on {busy['date']}, beside {busy['busy']} busy processes (`python3 -c "
                  "'while True: pass'`), load before "
                  f"{', '.join(f'{value:.1f}' for value in busy['load_before'])}.", ""]
    lines += ["| command | exit | seconds | CPU seconds | stated | within | longest silence (s) | load after |"
              + (" busy: exit | seconds | longest silence (s) | load after |" if busy is not None else ""),
              "|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if busy is not None else "")]
    lines += [_tour_row(row) + ("" if busy is None else _busy_cells(busy_rows.get(row["line"])))
              for row in data["rows"]]
    if data.get("skipped"):
        lines += ["", "Not run here, and why:", ""]
        lines += [f"- `{entry['line']}`: {entry['reason']}" for entry in data["skipped"]]
    return "\n".join(lines) + "\n"


def _tour_row(row: dict[str, Any]) -> str:
    label = "the README Python block" if row["name"] == "python" else row["line"]
    exit_text = "timeout" if row["timed_out"] else str(row["code"])
    within = "-" if row["stated"] is None else ("yes" if row["seconds"] <= MARGIN * row["stated"]
                                                and not row["timed_out"] else "**no**")
    label = label.replace("|", "\\|")
    cpu = f"{row['cpu_seconds']:.0f}" if "cpu_seconds" in row else "-"
    return (f"| `{label}` | {exit_text} | {row['seconds']:.0f} | {cpu} | {_minutes(row['stated'])} | {within} | "
            f"{row['gap']:.0f} | {row['load'][0]:.1f} |")


def _busy_cells(row: dict[str, Any] | None) -> str:
    if row is None:
        return " - | - | - | - |"
    exit_text = "timeout" if row["timed_out"] else str(row["code"])
    return f" {exit_text} | {row['seconds']:.0f} | {row['gap']:.0f} | {row['load'][0]:.1f} |"


def gpu_section() -> str:
    """The GPU section, from bench/results/gpu.json where a GPU run saved one (bench/gpu_report.py)."""
    data = load_result("gpu")
    if data is None or "rows" not in data:  # a gpu.json of an earlier layout has no rows
        return ""
    from bench import gpu_report

    return gpu_report.section(data)


def stacked(data: dict[str, Any]) -> str:
    """bench/stacked.py: the sweep's stacked copies against one copy per forward."""
    lines = ["## Stacked ablations: the heads of one layer in one forward\n", _machine(data),
             f"- `probe.ablation.sweep` on {data['tokens'][0]} x {data['tokens'][1]} tokens (`probe ablate "
             f"--num-seqs 2`); `stack=1` (one forward per head) against the default (the heads of one start block "
             f"stacked along the batch), interleaved, median of {data['repeats']} per-repeat ratios.\n",
             "| layer | heads | one per forward | stacked | stacked / one | max abs difference of deltas |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in data["rows"]:
        seconds = row["timings"]["median_seconds"]
        lines.append(f"| {row['layer']} | {row['heads']} | {seconds['one per forward']:.2f} s | "
                     f"{seconds['stacked']:.2f} s | {row['ratio']:.2f}x | {row['max_abs_delta_difference']:.1e} "
                     f"(largest delta {row['largest_delta']:.3f}) |")
    return "\n".join(lines) + "\n"


def interrupt(data: dict[str, Any]) -> str:
    """bench/interrupt.py: seconds from Ctrl-C to the suite's exit."""
    lines = ["## Ctrl-C during the test suite\n", _machine(data),
             f"- `{data['test_command']}` in a process group of its own; SIGINT to the group (as a terminal's Ctrl-C "
             "sends it) at each moment below, then the seconds until pytest exited.\n",
             "| Ctrl-C after | running | stopped in | exit code |", "|---:|---|---:|---:|"]
    lines += [f"| {row['offset_s']} s | {row.get('last_test', row.get('last_test_file'))} | "
              f"{'**not stopped** in 120 s' if row['stop_s'] is None else format(row['stop_s'], '.1f') + ' s'} | "
              f"{row['exit_code']} |" for row in data["rows"]]
    return "\n".join(lines) + "\n"


SECTIONS = (  # (result file, its section, a key the section needs: kv_heads.json may hold the timings alone)
    ("kv_heads", kv_heads, "kv_heads"), ("lse", lse, None), ("patching", patching, None), ("kv_order", kv_order, None),
    ("patching_qk", patching_qk, None), ("atlas", atlas, None), ("kv_default", kv_default, None),
    ("precision", precision, None), ("kvpress", kvpress_report.section, "cells"),
    ("kernel_compile", kernel_compile.section, None), ("serve-load", serve, None), ("headvis", headvis, "equality"),
    ("stacked", stacked, None), ("interrupt", interrupt, None))


def render() -> str:
    """RESULTS.md's text from every saved result."""
    parts = [HEADER]
    for name, fn in (("classification", classification), ("ablation", ablation), ("taylor", taylor),
                     ("memory", memory), ("profile", profile), ("long_context", long_context)):
        data = load_result(name)
        parts.append(fn(data) if data is not None else f"## {name}\n\nNot run yet: `python -m bench {name}`.\n")
    for path in sorted(RESULTS_DIR.glob("classification-*.json")):  # GPU runs of benchmark 1
        data = load_result(path.stem)
        if data is not None:
            parts.append(classification(data).replace("## 1. Classification",
                                                      f"## 1b. On {data.get('device')}, {data.get('dtype')}: "
                                                      "classification", 1))
    for name, section, needs in SECTIONS:
        data = load_result(name)
        if data is not None and (needs is None or needs in data):
            parts.append(section(data))
    for doc in (None, *TOUR_DOCS):  # python -m bench.tour [--doc DOC]: the README's tour, each document's commands
        toured = load_result(tour_result(doc))
        if toured is not None:
            parts.append(tour(toured, load_result(tour_result(doc) + "-busy")))
    if gpu := gpu_section():
        parts.append(gpu)
    return "\n".join(parts)


def write() -> None:
    """RESULTS.md: the rendered results and a pointer to bench/NOTES.md (how to rerun each, what it compares)."""
    pointer = "How each benchmark runs, what it compares against and what to trust: [NOTES.md](NOTES.md).\n"
    RESULTS_MD.write_text(render() + "\n" + pointer, encoding="utf-8")
