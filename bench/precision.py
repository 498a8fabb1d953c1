"""How far a bfloat16 or float16 run of SmolLM2 lies from its float32 run, command by command, on the CPU: the numbers
docs/precision.md quotes as the precision contract.

`python -m bench.precision [--dtypes bfloat16,float16] [--commands classify,ablate,patch,dla,kv-heads,estimate]
[--folder DIR]` (saves bench/results/precision.json; `python -m bench --render` writes it into RESULTS.md; --folder
keeps each run's JSON and terminal report, and a run found there is read instead of repeated).

Each command runs as a user runs it (`probe CMD --dtype DTYPE --json FILE`, a fresh process), once per dtype, with
the same inputs; its JSON is then compared with float32's head by head:
- classify: per class, the largest |score difference|, and the heads whose labels differ, with their scores (a label
  that flips is a score within the difference of its threshold: borderline).
Patching and ablation sweep every fifth layer's heads and the last layer's (SAMPLED: 63 of 270, on 2 shared CPU
cores); classify, dla and kv-heads every head. Optional stages (named in --commands): patch-all and ablate-all over
all 270 heads; track over three real checkpoints of SmolLM2 (bench/smollm2_checkpoints.py), compared score by score
per checkpoint, with each checkpoint's loss and ICL score and the phase changes found.
- ablate (zero ablation, cross-entropy, exact sweep): the largest |delta difference|, relative to the largest
  |delta|, the Spearman of the deltas, and the top-10 heads shared.
- patch (IOI, every head): the largest |patch effect difference| (effects are normalised: 0 = corrupt, 1 = clean),
  the clean and corrupt logit differences, the Spearman and the top-10 heads shared.
- dla (IOI): the largest |head share difference|, the logit difference, the identity's residual and its rounding
  bound.
- estimate (`ablate --method estimate`: first-order gradients of the loss over all 270 heads, 8 x 64 tokens): as
  ablate; float16's gradients of a mean are scaled into its range (probe.ablation.estimate.scaled_gradients).
- kv-heads (scores and the fixed budget, no curve): the largest |retrieval| and |streaming| score differences and how
  many KV heads are streamed in both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, load_average, load_result, machine, now, save_result, spearman
from bench.smollm2_checkpoints import build


SAMPLED = "0.*,5.*,10.*,15.*,20.*,25.*,29.*"  # every fifth layer and the last: 63 of SmolLM2's 270 heads
COMMANDS: dict[str, list[str]] = {
    "classify": ["classify"],
    "dla": ["dla", "--task", "ioi", "--count", "16"],
    "patch": ["patch", "--task", "ioi", "--count", "8", "--heads", SAMPLED],
    "ablate": ["ablate", "--data", "natural", "--num-seqs", "2", "--seq-len", "64", "--heads", SAMPLED],
    "kv-heads": ["kv-heads", "--lengths", "512", "--depths", "0.5", "--no-curve", "--full-fraction", "0.5"],
    "estimate": ["ablate", "--method", "estimate", "--data", "natural", "--num-seqs", "8", "--seq-len", "64"],
}
"""What each command runs with (the model is SmolLM2, the alias every command defaults to)."""
OPTIONAL: dict[str, list[str]] = {  # run only when --commands names them (minutes each on 2 CPU cores)
    "patch-all": ["patch", "--task", "ioi", "--count", "8"],
    "ablate-all": ["ablate", "--data", "natural", "--num-seqs", "2", "--seq-len", "64"],
    "track": ["track", "--checkpoints", "{checkpoints}/step-*", "--icl-seqs", "8"],
}
"""patch and ablate over all 270 heads (the default stages sweep the 63 SAMPLED heads); track over three real
checkpoints of SmolLM2 (bench/smollm2_checkpoints.py: the released model and two fine-tuned from it, built in the
run's temporary folder first, about 540 MB each)."""


def run_command(args: list[str], dtype: str, folder: Path, name: str = "") -> tuple[dict[str, Any], float | None]:
    """One run in a fresh process: its JSON payload and wall seconds; its terminal report kept beside the JSON
    (FOLDER/NAME-DTYPE.txt). A JSON already in `folder` (a --folder run cut short) is read, not run again (seconds
    None)."""
    path = folder / f"{name or args[0]}-{dtype}.json"
    if path.exists():
        return json.loads(path.read_text()), None
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "probe.cli", *args, "--dtype", dtype, "--json", str(path), "-q"],
                          cwd=ROOT, env=environment, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"probe {' '.join(args)} --dtype {dtype} failed ({done.returncode}): {done.stderr[-600:]}")
    path.with_suffix(".txt").write_text(done.stdout)
    return json.loads(path.read_text()), seconds


def _by_head(payload: dict[str, Any], key: str = "heads") -> dict[tuple[int, int], dict[str, Any]]:
    return {(entry["layer"], entry.get("head", entry.get("kv_head"))): entry for entry in payload[key]}


def _largest(ours: dict, theirs: dict, value: Any) -> tuple[float, str]:
    """(largest |difference| of value(entry) over the heads both have, the head where it is)."""
    worst, where = 0.0, ""
    for head, entry in ours.items():
        difference = abs(value(entry) - value(theirs[head]))
        if difference > worst:
            worst, where = difference, f"{head[0]}.{head[1]}"
    return worst, where


def _top(entries: dict, value: Any, count: int = 10) -> set:
    return set(sorted(entries, key=lambda head: -abs(value(entries[head])))[:count])


def compare_classify(half: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    ours, theirs = _by_head(half), _by_head(full)
    classes = {name: round(_largest(ours, theirs, lambda entry, name=name: entry["scores"][name] or 0.0)[0], 6)
               for name in full["classes"]}
    flipped = [{"head": f"{head[0]}.{head[1]}", "float32": theirs[head]["labels"], "half": entry["labels"],
                "scores": {name: [theirs[head]["scores"][name], entry["scores"][name]]
                           for name in set(entry["labels"]) ^ set(theirs[head]["labels"])}}
               for head, entry in ours.items() if set(entry["labels"]) != set(theirs[head]["labels"])]
    return {"max_abs_score_difference": classes, "labels_differ": flipped, "heads": len(ours)}


def _ranked(half: dict[str, Any], full: dict[str, Any], field: str) -> dict[str, Any]:
    ours, theirs = _by_head(half), _by_head(full)
    value = (lambda entry: entry[field])  # noqa: E731
    worst, where = _largest(ours, theirs, value)
    scale = max(abs(value(entry)) for entry in theirs.values())
    heads = sorted(theirs)
    return {f"max_abs_{field}_difference": round(worst, 6), "at": where, f"max_abs_{field}_float32": round(scale, 6),
            "relative": round(worst / scale, 4) if scale else None,
            "spearman": round(spearman([value(ours[h]) for h in heads], [value(theirs[h]) for h in heads]), 4),
            "top10_shared": len(_top(ours, value) & _top(theirs, value))}


def compare_ablate(half: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    return {**_ranked(half, full, "delta"), "baseline_loss": [full["baseline_loss"], half["baseline_loss"]]}


def compare_patch(half: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    return {**_ranked(half, full, "patch_effect"), "clean_logit_diff": [full["clean_logit_diff"],
                                                                        half["clean_logit_diff"]],
            "corrupt_logit_diff": [full["corrupt_logit_diff"], half["corrupt_logit_diff"]]}


def compare_dla(half: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    return {**_ranked(half, full, "dla"), "logit_diff": [full["logit_diff"], half["logit_diff"]],
            "max_residual": [full["identity"]["max_residual"], half["identity"]["max_residual"]],
            "rounding_bound": [full["identity"].get("rounding_bound"), half["identity"].get("rounding_bound")]}


def compare_kv_heads(half: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    ours, theirs = _by_head(half, "kv_heads"), _by_head(full, "kv_heads")
    streamed = {head for head, entry in theirs.items() if entry["label"] == "streaming"}
    streamed_half = {head for head, entry in ours.items() if entry["label"] == "streaming"}
    return {"max_abs_retrieval_difference": round(_largest(ours, theirs, lambda entry: entry["retrieval"])[0], 6),
            "max_abs_streaming_difference": round(_largest(ours, theirs, lambda entry: entry["streaming"])[0], 6),
            "streamed": [len(streamed), len(streamed_half)], "streamed_in_both": len(streamed & streamed_half),
            "kv_heads": len(theirs), "needle_accuracy": [full["needle_accuracy"], half["needle_accuracy"]]}


def _track_scores(payload: dict[str, Any]) -> dict[tuple[str, int, int, str], float]:
    """(checkpoint, layer, head, class) -> score, every score of a track payload (None read as 0)."""
    return {(checkpoint["name"], entry["layer"], entry["head"], name): score or 0.0
            for checkpoint in payload["checkpoints"] for entry in checkpoint["heads"]
            for name, score in entry["scores"].items()}


def compare_track(half: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """Per class, the largest |score difference| over every checkpoint and head; the scores on the other side of
    their class's threshold in one run only (with both values); each checkpoint's loss and ICL score; the phase
    changes of both."""
    ours, theirs = _track_scores(half), _track_scores(full)
    classes = {name: round(max(abs(ours[key] - theirs[key]) for key in theirs if key[3] == name), 6)
               for name in full["classes"]}
    thresholds = full["thresholds"]
    differ = [{"checkpoint": key[0], "head": f"{key[1]}.{key[2]}", "class": key[3], "threshold": thresholds[key[3]],
               "scores": [theirs[key], ours[key]]} for key in sorted(theirs) if key[3] in thresholds
              and (theirs[key] >= thresholds[key[3]]) != (ours[key] >= thresholds[key[3]])]
    phases = [[(p["class"], p["from_step"], p["to_step"]) for p in run["phase_changes"]] for run in (full, half)]
    return {"max_abs_score_difference": classes, "labels_differ": differ,
            "scores": len(theirs), "checkpoints": [c["name"] for c in full["checkpoints"]],
            "loss": [[c["loss"] for c in run["checkpoints"]] for run in (full, half)],
            "icl_score": [[c["icl_score"] for c in run["checkpoints"]] for run in (full, half)],
            "phase_changes": phases, "phase_changes_equal": phases[0] == phases[1]}


COMPARE = {"classify": compare_classify, "ablate": compare_ablate, "patch": compare_patch, "dla": compare_dla,
           "kv-heads": compare_kv_heads, "track": compare_track}
"""Keyed by the probe command (a stage's first argument)."""


def _arguments(command: str, folder: Path, checkpoints: Path | None, log: Any) -> list[str]:
    """The stage's arguments; a {checkpoints} glob points at `checkpoints`, or at ones built into `folder` now."""
    args = {**COMMANDS, **OPTIONAL}[command]
    if any("{checkpoints}" in arg for arg in args):
        if checkpoints is None:
            checkpoints = folder / "checkpoints"
            if not checkpoints.exists():
                build(checkpoints, log=log)
        args = [arg.replace("{checkpoints}", str(checkpoints)) for arg in args]
    return args


def _measure(command: str, dtypes: list[str], folder: Path, log: Any,
             checkpoints: Path | None = None) -> dict[str, Any]:
    """One command in float32 and each dtype, compared; a run that fails is recorded as its error."""
    found: dict[str, Any] = {"command": "probe " + " ".join({**COMMANDS, **OPTIONAL}[command]) + " --dtype DTYPE",
                             "seconds": {}}
    args = _arguments(command, folder, checkpoints, log)
    try:
        halves = {dtype: run_command(args, dtype, folder, command) for dtype in dtypes}
        full, found["seconds"]["float32"] = run_command(args, "float32", folder, command)
        for dtype, (half, found["seconds"][dtype]) in halves.items():
            assert half["provenance"]["dtype"] == dtype, half["provenance"]["dtype"]
            found[dtype] = COMPARE[args[0]](half, full)
            log(f"{command} {dtype}: {json.dumps(found[dtype])[:400]}")
    except RuntimeError as error:
        found["error"] = str(error)
        log(str(error))
    found["seconds"] = {dtype: None if seconds is None else round(seconds, 1)
                        for dtype, seconds in found["seconds"].items()}
    return found


def run(dtypes: list[str], commands: list[str], log: Any = print, checkpoints: Path | None = None,
        folder: Path | None = None) -> dict[str, Any]:
    """Every command's comparison, saved after each command (a long run keeps what finished); each run's JSON and
    terminal report are kept in `folder` where given (the same command again reads them), else in a temporary one."""
    result = {"benchmark": "precision", "date": now(), "machine": machine(), "load_before": load_average(),
              "model": "smollm2", "device": "cpu", "results": {},
              "command": "python -m bench.precision " + " ".join(sys.argv[1:])}
    with tempfile.TemporaryDirectory() as temporary:
        where = folder or Path(temporary)
        where.mkdir(parents=True, exist_ok=True)
        for command in commands:
            result["results"][command] = _measure(command, dtypes, where, log, checkpoints)
            result["load_after"] = load_average()
            save(result)
    return result


def save(result: dict[str, Any]) -> None:
    """Into bench/results/precision.json, keeping the commands this run did not measure."""
    kept = (load_result("precision") or {}).get("results", {})
    save_result("precision", {**result, "results": {**kept, **result["results"]}})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--commands", default=",".join(COMMANDS),
                        help=f"of {', '.join(COMMANDS)} (the default) and {', '.join(OPTIONAL)}")
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="track: a folder of step-N checkpoint folders (default: bench/smollm2_checkpoints.py "
                             "builds them in a temporary folder)")
    parser.add_argument("--folder", type=Path, default=None,
                        help="keep every run's JSON and terminal report here (a run found here is not repeated)")
    args = parser.parse_args()
    run(args.dtypes.split(","), args.commands.split(","), lambda line: print(line, flush=True), args.checkpoints,
        args.folder)
    print("saved bench/results/precision.json")


if __name__ == "__main__":
    main()
