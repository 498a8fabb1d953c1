"""The default `probe kv-heads` on SmolLM2, end to end, as a user runs it (the target: within 5 minutes on 2
CPU cores): the command in a fresh process (every default: scores, calibrated budget, curve; JSON, HTML and a duo
export written), its wall time and peak RSS, and the time per stage the result itself records.

    python -m bench.kv_default [--every-random-point]

Merges into bench/results/kv_default.json under "default" (or "every_random_point").
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.common import load_average, load_result, machine, now, run_measured, save_result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every-random-point", action="store_true", help="measure every point of the random orders")
    args = parser.parse_args()
    probe = str(Path(sys.executable).with_name("probe"))
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        command = [probe, "kv-heads", "--json", str(out / "kv.json"), "--html", str(out / "kv.html"),
                   "--export", f"duo:{out / 'duo'}", *(["--every-random-point"] if args.every_random_point else [])]
        before, started = load_average(), now()
        done = run_measured(command, timeout=3600)
        if done.returncode != 0:
            raise SystemExit(f"probe kv-heads failed ({done.returncode}):\n{done.stderr[-3000:]}")
        payload = json.loads((out / "kv.json").read_text())
    run = {"date": started, "command": " ".join(["probe", *command[1:]]).replace(folder, "OUT"),
           "load_before": before, "load_after": load_average(), "wall_seconds": round(done.seconds, 1),
           "peak_rss": done.peak_rss, "stage_seconds": payload["seconds"],
           "streamed": payload["budget"]["streamed"], "total": payload["budget"]["total"],
           "budget_points": payload["budget"]["points"], "curve_stopped": payload["curve"].get("stopped"),
           "curve_points": sum(value is not None for order in payload["curve"]["orders"].values()
                               for value in order["loss_change"])}
    data = load_result("kv_default") or {}
    data.update(machine=machine(), date=run["date"], command="python -m bench.kv_default" + (
        " --every-random-point" if args.every_random_point else ""))
    data["every_random_point" if args.every_random_point else "default"] = run
    save_result("kv_default", data)
    print(json.dumps(run))


if __name__ == "__main__":
    main()
