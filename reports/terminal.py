"""Terminal reports (rich) of classification and ablation payloads, and the table every report draws."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rich.box import HEAVY_HEAD
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from probe.reports.labels import column_label, layer_label, precision_sentence, short_label

MAX_ROWS = 20  # flagged heads listed per class; the JSON has every head
COMMON = 0.3  # a class labelling more than this share of the heads is drawn light in the overview
PART_LABELS = {"first_repeat": "Δ 1st copy", "second_repeat": "Δ 2nd copy"}
TITLED: dict[str, Any] = {"title_justify": "left", "title_style": "bold", "box": HEAVY_HEAD}  # rules drawn


def print_precision(payload: dict[str, Any], console: Console) -> None:
    """Every report's last line: what its numbers were computed in (none for a payload without `dtype`)."""
    if precision_sentence(payload):
        console.print(Text(precision_sentence(payload), style="dim"))


def table(*columns: str, left: Sequence[str] = (), rows: Iterable[Sequence[Any]] = (), **options: Any) -> Table:
    """A borderless table of right-aligned columns, those named in `left` aligned left, holding `rows`."""
    grid = Table(**{"show_edge": False, "pad_edge": False, "box": None, **options})
    for column in columns:
        grid.add_column(column, justify="left" if column in left else "right")
    for row in rows:
        grid.add_row(*row)
    return grid


def layer_grid(payload: dict[str, Any], cell: Callable[[int, int], Text]) -> Table:
    """Layer x head: a row per layer of the payload, each head's `cell(layer, head)`, a dim dot where it is empty."""
    grid = Table(show_edge=False, pad_edge=False, box=None)
    grid.add_column("layer", justify="right", style="dim")
    for head in range(payload["n_heads"]):
        grid.add_column(str(head), justify="center")
    for layer in range(payload["n_layers"]):
        cells = [cell(layer, head) for head in range(payload["n_heads"])]
        grid.add_row(layer_label(layer, payload.get("layer_names")), *(c or Text("·", style="dim") for c in cells))
    return grid


def classification_report(payload: dict[str, Any], console: Console, *, max_rows: int = MAX_ROWS,
                          also: Sequence[str] = ()) -> None:
    """Each class's flagged heads, the overview of labels, the classes scored and `also`, how to ask for others."""
    console.print(Text(f"Head classification of {payload['model']}", style="bold"),
                  Text(f"({payload['n_layers']} layers x {payload['n_heads']} heads)"))
    for name, info in payload["probe_sets"].items():
        console.print(Text(f"  probe set {info.get('description', name)}", style="dim"))
    if payload.get("not_applicable"):
        console.print(Text(f"  n/a on cross-attention (keys from the encoder): {', '.join(payload['not_applicable'])}",
                           style="dim"))
    for name, flagged in payload["flagged"].items():
        summary = payload["classes"].get(name, {}).get("summary", "")
        console.print()
        console.print(Text(f"{name} heads: {len(flagged)} with score > {payload['thresholds'][name]:g}", style="bold"),
                      Text(f"({summary})", style="dim"))
        if not flagged:
            console.print(Text("  none", style="dim"))
            continue
        grid = table("layer.head", "score")
        grid.add_column("", no_wrap=True)
        for entry in flagged[:max_rows]:
            score = entry["score"]
            grid.add_row(short_label(entry["layer"], entry["head"], payload.get("layer_names")), f"{score:.3f}",
                         Text("█" * round(score * 20), style="cyan"))
        console.print(grid)
        if len(flagged) > max_rows:
            console.print(Text(f"  ... and {len(flagged) - max_rows} more (see --json)", style="dim"))
    console.print()
    console.print(overview(payload))
    console.print(Text(f"Scored: {', '.join(payload['flagged'])}"
                       + (f"; also: {', '.join(also)}" if also else ""), style="dim"))
    print_precision(payload, console)


def overview(payload: dict[str, Any]) -> Group:
    """The legend, then the layer x head grid of label letters, a common class's light and last."""
    classes = payload["classes"]
    total = payload["n_layers"] * payload["n_heads"]
    counts = Counter(name for entry in payload["heads"] for name in entry["labels"])
    common = {name: count for name, count in counts.items() if count > COMMON * total}  # sink heads, mostly

    def letter(name: str) -> str:
        known = classes[name]["letter"] if name in classes else name[0].upper()
        return known.lower() if name in common else known

    legend = " ".join(f"{letter(name)}={name}" + (f" (light: on {common[name]} of {total} heads)"
                                                   if name in common else "") for name in classes)
    labels = {(entry["layer"], entry["head"]): entry["labels"] for entry in payload["heads"]}

    def cell(layer: int, head: int) -> Text:
        text = Text()
        for name in sorted(labels.get((layer, head), []), key=lambda name: name in common):
            text.append(letter(name), style="dim" if name in common else "bold")
        return text

    return Group(Text(f"Overview, layer x head: {legend}"), layer_grid(payload, cell))


def _number(value: Any) -> float:
    """A payload number; None (a non-finite value read back from strict JSON) is NaN."""
    return float("nan") if value is None else float(value)


def _signed(value: Any) -> str:
    number = _number(value)
    return f"{number:+.4f}" if math.isfinite(number) else "nan"


def _label(entry: dict[str, Any], names: Any = None) -> str:
    return entry.get("label") or short_label(entry["layer"], entry["head"], names)


def _by_delta(entry: dict[str, Any]) -> tuple[bool, float]:
    """Sort key, largest delta first; NaN last."""
    delta = _number(entry["delta"])
    return (not math.isfinite(delta), -delta if math.isfinite(delta) else 0.0)


def _part_names(payload: dict[str, Any]) -> list[str]:
    """The parts the baseline loss is split into (baseline_first_repeat_loss -> first_repeat), in payload order."""
    return [key[len("baseline_"):-len("_loss")] for key in payload
            if key.startswith("baseline_") and key.endswith("_loss") and key != "baseline_loss"]


def _bar(delta: float, scale: float) -> Text:
    if not math.isfinite(delta) or not delta:
        return Text("")
    return Text("█" * max(1, round(abs(delta) / scale * 20)), style="red" if delta > 0 else "blue")


def _delta_table(payload: dict[str, Any], title: str, rows: list[dict[str, Any]]) -> Table:
    """One row per ablation: loss, delta, the deltas of the parts, (estimate) exact or estimated, and a bar."""
    estimate, parts = payload["mode"] == "estimate", _part_names(payload)
    grid = table("head" if all("layer" in r for r in rows) else "heads", "loss", "delta",
                 *(PART_LABELS.get(name, f"Δ {name}") for name in parts), **TITLED, title=title)
    if estimate:
        grid.add_column("", justify="left")
    grid.add_column("", no_wrap=True)
    deltas = [_number(r["delta"]) for r in rows]
    scale = max((abs(d) for d in deltas if math.isfinite(d)), default=0.0) or 1.0
    for r, delta in zip(rows, deltas):
        cells = [_label(r, payload.get("layer_names")), f"{_number(r['loss']):.4f}", _signed(delta)]
        cells += [_signed(r[f"{name}_delta"]) if r.get(f"{name}_delta") is not None else "" for name in parts]
        if estimate:
            cells.append("exact" if r.get("exact") else "est.")
        grid.add_row(*cells, _bar(delta, scale))
    return grid


def _ablation_header(payload: dict[str, Any], console: Console) -> None:
    """What was run, on which data, with which metric, and the baseline."""
    what = f"{payload['method']} ablation" + (" (estimated)" if payload["mode"] == "estimate" else "")
    console.print(Text(f"Head ablation of {payload['model']}", style="bold"),
                  Text(f"({payload['n_layers']} layers x {payload['n_heads']} heads, {what})"))
    probe_set = payload.get("probe_set")
    console.print(Text(f"  data: {probe_set.get('description', payload['data']) if probe_set else payload['data']}",
                       style="dim"))
    console.print(Text(f"  metric: {payload['metric']}: {payload.get('metric_description', '')}", style="dim"))
    if payload.get("mean"):
        console.print(Text(f"  mean: {payload['mean']}", style="dim"))
    console.print(Text(f"  computed: {payload['path']}", style="dim"))
    named: Mapping[str, Any] = payload  # a part's baseline is named by a pattern: baseline_PART_loss
    parts = "".join(f", {name.replace('_', ' ')} {_number(named[f'baseline_{name}_loss']):.4f}"
                    for name in _part_names(payload))
    console.print(Text("baseline loss: ", style="bold"), Text(f"{_number(payload['baseline_loss']):.4f}{parts}"))
    task = payload.get("baseline_task")
    if task and "margin" in task:
        console.print(Text("task, unablated: ", style="bold"),
                      Text(f"accuracy {_number(task.get('accuracy')):.3f}, "
                           f"mean margin {_number(task.get('margin')):+.3f}"
                           " (log P(good) - log P(bad); loss = minus the margin)"))
    elif task:  # a classifier's accuracy (loss = 1 - accuracy)
        console.print(Text("unablated: ", style="bold"),
                      Text(", ".join(f"{name} {_number(value):.3f}" for name, value in task.items())))
    forwards, seconds = payload.get("forward_equivalents"), payload.get("seconds")
    if seconds is not None:
        run = "estimate" if payload["mode"] == "estimate" else "sweep (baseline and every ablation)"
        cost = f", {forwards:.1f} forward-equivalents" if forwards is not None else ""
        console.print(Text(f"  time of the whole {run}: {seconds:.1f} s{cost}", style="dim"))


def ablation_report(payload: dict[str, Any], console: Console, *, top: int = 15) -> None:
    """What was run, the baseline, the heads whose removal hurts and helps most, the non-finite, the groups."""
    _ablation_header(payload, console)
    if payload["mode"] == "estimate":  # which values are estimated, and how (the payload's `path`)
        console.print(Text(f"est. marks an estimated value, not an ablation ({payload['path']}); exact marks a head "
                           "ablated for real.", style="dim"))
    estimated = "estimated " if payload["mode"] == "estimate" else ""
    singles = sorted(payload["heads"], key=lambda r: (*_by_delta(r), r["layer"], r["head"]))
    deltas = [_number(r["delta"]) for r in singles]
    hurting = [r for r, d in zip(singles, deltas) if math.isfinite(d) and d > 0][:top]
    helping = [r for r, d in zip(reversed(singles), reversed(deltas)) if math.isfinite(d) and d < 0][:top]
    broken = [r for r, d in zip(singles, deltas) if not math.isfinite(d)][:top]
    tables = [
        (hurting, f"Heads whose removal hurts most (largest {estimated}delta, {len(hurting)} of {len(singles)})",
         "No head raises the loss when removed."),
        (helping, f"Heads whose removal helps (most negative {estimated}delta, {len(helping)} of {len(singles)})",
         "No head lowers the loss when removed."),
        (broken, "Heads whose delta is not a finite number", None),
    ]
    for rows, title, empty in tables if singles else []:
        if rows or empty:
            console.print()
            console.print(_delta_table(payload, title, rows) if rows else Text(empty or "", style="dim"))
    if payload.get("groups"):
        console.print()
        console.print(_delta_table(payload, "Heads ablated together", sorted(payload["groups"], key=_by_delta)))
    if any(entry.get("effects") for entry in singles):
        console.print()
        console.print(_specific_table(singles, top, payload.get("layer_names")))
    print_precision(payload, console)


def _specific_table(singles: list[dict[str, Any]], top: int, names: Any = None) -> Table:
    """The heads of largest per-token delta, with their specificity, mean delta and most affected token."""
    with_effects = [r for r in singles if r.get("effects")]
    sharp = sorted(with_effects, key=lambda r: -_number(r["effects"].get("max_token_delta")))[:top]
    grid = table("head", "max token Δ", "p99 Δ", "specificity", "mean Δ", "most affected token",
                 left=("most affected token",), **TITLED, title=f"Heads with the sharpest specific effect (largest "
                 f"per-token delta, {len(sharp)} of {len(singles)})")
    for r in sharp:
        effects = r["effects"]
        token = (effects.get("top_tokens") or [{}])[0]
        grid.add_row(_label(r, names), _signed(effects.get("max_token_delta")), _signed(effects.get("p99_token_delta")),
                     f"{_number(effects.get('specificity')):.3f}", _signed(r["delta"]),
                     Text(str(token.get("context", "")).replace("\n", "⏎")[-60:]))
    return grid


def classification_rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """`probe classify --csv`: one row per head, in `Classification.to_frame`'s columns."""
    names = payload.get("layer_names")
    return [{"layer": entry["layer"], "head": entry["head"], "name": column_label(entry["layer"], entry["head"], names),
             **{name: "" if score is None else score for name, score in entry["scores"].items()},
             "labels": ",".join(entry["labels"])} for entry in payload["heads"]]
