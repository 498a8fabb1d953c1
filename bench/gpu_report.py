"""RESULTS.md's section for `python -m bench gpu` (bench/gpu.py): every row of bench/results/gpu.json with the
backend that made it, the device, dtype and versions, the backend choice, and every point that did not finish."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.gpu import KV_TARGET, TARGETS, choice_lines, choose


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _peak_ratio(peaks: dict[str, int | None]) -> str:
    plain, probe = peaks.get("plain"), peaks.get("probe")
    return "-" if not plain or probe is None else f"{probe / plain:.2f}x"


def _verdict(ratio: float, target: float | None, dry: bool) -> str:
    if target is None or dry:
        return "-"
    return f"met (<= {target}x)" if ratio <= target else f"**not met** (<= {target}x: {ratio / target - 1:+.0%})"


def _timed_table(rows: list[dict[str, Any]], targets: dict[str, float], dry: bool, scores: bool) -> list[str]:
    """classify's or kv-heads' rows: seconds, ratio against the plain forward, target, peak memory."""
    lines = ["| layout | tokens | backend | plain | probe | ratio | target | peak plain GiB | peak probe GiB "
             "| peak ratio | repeats |" + (" path | scores vs first backend |" if scores else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if scores else "")]
    for row in rows:
        peaks = row.get("peak_bytes", {})
        line = (f"| {row['layout']} | {row['tokens']} | {row['backend']} | {row['seconds']['plain']:.3f} s | "
                f"{row['seconds']['probe']:.3f} s | {row['ratio']:.3f}x | "
                f"{_verdict(row['ratio'], targets.get(row['layout']), dry)} | {_gib(peaks.get('plain'))} | "
                f"{_gib(peaks.get('probe'))} | {_peak_ratio(peaks)} | {row['repeats']} |")
        if scores:
            first = row["difference_to_first"]
            line += f" {row['path']} | {first['largest']:.1e} ({first['backend']}) |"
        lines.append(line)
    return lines


def _table(header: list[str], rows: list[dict[str, Any]], cells: Callable[[dict[str, Any]], list[str]]) -> list[str]:
    """A markdown table: the header, then one line of cells per row."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cells(row)) + " |" for row in rows]


def _kernel_cells(row: dict[str, Any]) -> list[str]:
    error = row["largest_error"]
    return [row["layout"], str(row["tokens"]), row["backend"], f"{row['ratio']:.3f}x", f"{error['output']:.1e}",
            f"{row['sdpa_error']:.1e}", f"{error.get('lse', float('nan')):.1e}",
            f"{error.get('top_key_gap', float('nan')):.1e}"]


def _agreement_cells(row: dict[str, Any]) -> list[str]:
    differences = row["largest_difference"]
    five = max(value for name, value in differences.items() if name != "positional")
    return [row["backend"], row["dtype"], f"{row['layout']}, {row['tokens']}", row["path"], f"{five:.1e}",
            f"{differences['positional']:.1e}", f"{row['bound']:.0e}", "yes" if row["agrees"] else "**no**"]


KERNEL_HEADER = ["layout", "tokens", "backend", "backend / sdpa", "output error", "sdpa's error", "lse error",
                 "top-key gap"]
AGREEMENT_HEADER = ["backend", "dtype", "layout, tokens", "path", "five scores", "positional", "bound", "agrees"]


def section(data: dict[str, Any]) -> str:
    """The markdown section of RESULTS.md for one run."""
    dry = bool(data.get("dry_run"))
    rows = data.get("rows", [])
    done = [row for row in rows if row.get("outcome") == "ok"]
    versions = ", ".join(f"{name} {value}" for name, value in data.get("versions", {}).items())
    where = "dry run (tiny layouts, CPU, float32: not a measurement)" if dry else \
        f"{data['machine'].get('gpu')}, {data.get('dtype')}"
    lines = ["## GPU: which backend first (classify and kv-heads against the sdpa forward)", "",
             f"{data['date']}, {where}; {versions}; `{data.get('command', 'python -m bench gpu')}`; "
             f"{data.get('seconds', 0):.0f} s of a {data.get('budget_seconds', 0):.0f} s budget. Every backend "
             "registered in probe.kernels that served the layer's call, random-init llama layouts (one sequence of "
             "BOS and random tokens repeated), medians of interleaved repeats; peak memory is "
             "torch.cuda.max_memory_allocated.", ""]
    lines += [line.strip() for line in choice_lines(choose(rows))]  # from the rows: a run cut short has no choice
    lines += ["", "classify's scoring pass (six default scores) against `run_model(..., logits=False)`:", ""]
    lines += _timed_table([row for row in done if row["kind"] == "classify"], TARGETS, dry, True)
    lines += ["", f"kv-heads' scoring pass (`score_needles`, one needle prompt of token ids) against the forward "
              f"kv-heads runs (target <= {KV_TARGET}x on the 8B layout):", ""]
    lines += _timed_table([row for row in done if row["kind"] == "kv"], {"8B": KV_TARGET}, dry, False)
    lines += ["", "One layer's causal attention per backend against torch's sdpa; largest errors against a float32 "
              "reference of the last rows (count x n per head, never n x n):", ""]
    lines += _table(KERNEL_HEADER, [row for row in done if row["kind"] == "kernel"], _kernel_cells)
    lines += ["", "The six scores with each backend forced against the blocked path (in bfloat16 positional may "
              "differ by whole rows whose two largest logits are closer than the blocked path's rounding):", ""]
    lines += _table(AGREEMENT_HEADER, [row for row in done if row["kind"] == "agreement"], _agreement_cells)
    lines += ["", "Host synchronisation inside a forward (`set_sync_debug_mode(\"error\")`):"]
    lines += [f"- {row['pass']}: {row.get('result')}" + (f": {row['error']} at {', '.join(row['probe_frames'])}"
                                                         if row.get("error") else "")
              for row in done if row["kind"] == "sync"]
    unfinished = [row for row in rows if row.get("outcome") != "ok"]
    if unfinished:
        lines += ["", "Points that did not finish (their outcome):"]
        lines += [f"- {row['point']}" + (f" ({row['backend']})" if row.get("backend") else "") + f": "
                  f"{row['outcome']}: {row.get('where') or row.get('error') or row.get('why', '')}"
                  + (f" ({row['ratio']:.3f}x over {row['repeats']} finished repeat(s))" if "ratio" in row else "")
                  for row in unfinished]
    return "\n".join(lines) + "\n"
