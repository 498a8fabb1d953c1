"""Memory of `probe track` over many checkpoints: the resident set after each checkpoint, which stays flat when one
model is in memory at a time (docs/track.md has the numbers).

    python -m bench.track_memory 'runs/induction/step-*.pt'           # the example's own checkpoints
    python -m bench.track_memory --wide 512 --count 20 /tmp/wide      # 20 random checkpoints of a wider example model

`--wide D` writes `--count` random state dicts of the example model at d_model D into the folder first (a leak of
one model per checkpoint would then show as D-sized steps). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from probe.track import TrackOptions, find_run, track
from probe.threads import use_threads

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "induction"
sys.path.insert(0, str(EXAMPLE))


def rss() -> int:
    """The resident set now, in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def write_wide(folder: Path, width: int, count: int) -> str:
    """`count` random state dicts of the example model at d_model `width`, and a factory file for them."""
    from model import AttentionOnly

    folder.mkdir(parents=True, exist_ok=True)
    for step in range(count):
        torch.manual_seed(step)
        torch.save(AttentionOnly(d_model=width).state_dict(), folder / f"step-{step}.pt")
    factory = folder / "wide.py"
    factory.write_text(f"import sys\nsys.path.insert(0, {str(EXAMPLE)!r})\nfrom model import AttentionOnly, "
                       f"ByteTokenizer\n\ndef model():\n    return AttentionOnly(d_model={width}), ByteTokenizer()\n")
    return f"{factory}:model"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("where", help="a glob of state dicts, or with --wide the folder to write them into")
    parser.add_argument("--wide", type=int, default=0)
    parser.add_argument("--count", type=int, default=20)
    args = parser.parse_args()
    use_threads(1)
    spec, pattern = f"{EXAMPLE / 'model.py'}:model", args.where
    if args.wide:
        spec, pattern = write_wide(Path(args.where), args.wide, args.count), str(Path(args.where) / "step-*.pt")
    run = find_run(spec, checkpoints=pattern)
    after: list[int] = []
    start = rss()
    result = track(run, TrackOptions(icl_seqs=16), results_path=Path("/tmp") / "track-memory.jsonl",
                   on_result=lambda _: after.append(rss()))
    size = sum(t.numel() * t.element_size() for t in torch.load(run.checkpoints[0].location,
                                                                weights_only=True).values())
    print(json.dumps({"checkpoints": len(result.checkpoints) if result else 0, "model_bytes": size,
                      "rss_before": start, "rss_after_first": after[0], "rss_after_last": after[-1],
                      "rss_max": max(after), "growth_first_to_last": after[-1] - after[0]}))


if __name__ == "__main__":
    main()
