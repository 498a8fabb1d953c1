"""Train the example's attention-only model on bytes where in-context copying pays, save checkpoints, and run
`probe track` over them (docs/track.md describes what it shows and the numbers measured).

    python examples/induction/train.py --out runs/induction        # ~6 minutes on one CPU core, then probe track

Each step reads 8 windows of 255 bytes of the embedded English text (probe/inputs/english.txt) and 32 runs of 8 to
40 random bytes repeated to 95 bytes (Olsson et al.'s repeated random tokens: after the first copy, only in-context
copying predicts anything). Checkpoints are state dicts `OUT/step-N.pt`; `probe track` loads them into
`model.py:model` with `weights_only=True`.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model import BOS, model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXT = (ROOT / "probe" / "inputs" / "english.txt").read_bytes()
LENGTH = 255  # bytes per English training sequence, after BOS
REPEATED = 95  # bytes per repeated random sequence, after BOS


def english(rng: random.Random, size: int) -> torch.Tensor:
    """`size` windows of LENGTH bytes of the English text, each after BOS."""
    starts = [rng.randrange(len(TEXT) - LENGTH) for _ in range(size)]
    return torch.tensor([[BOS, *TEXT[start:start + LENGTH]] for start in starts], dtype=torch.long)


def repeated(rng: random.Random, size: int) -> torch.Tensor:
    """`size` runs of 8 to 40 random bytes repeated to REPEATED bytes, each after BOS: after the first copy, only
    in-context copying predicts the next byte."""
    rows = []
    for _ in range(size):
        span = [rng.randrange(256) for _ in range(rng.randrange(8, 41))]
        rows.append([BOS, *(span * (REPEATED // len(span) + 1))[:REPEATED]])
    return torch.tensor(rows, dtype=torch.long)


def loss_on(net: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(ids[:, :-1]).reshape(-1, net.vocab_size), ids[:, 1:].reshape(-1))


def train(out: Path, steps: int, every: int, batch_size: int, lr: float, seed: int, repeats: int) -> None:
    """AdamW with a short warm-up; a checkpoint at step 0 and every `every` steps."""
    net, _ = model()
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for step in range(steps + 1):
        if step % every == 0:
            torch.save(net.state_dict(), out / f"step-{step}.pt")
        if step == steps:
            break
        text_loss, copy_loss = loss_on(net, english(rng, batch_size)), loss_on(net, repeated(rng, repeats))
        optimizer.zero_grad()
        (text_loss + copy_loss).backward()
        optimizer.step()
        schedule.step()
        if step % every == 0:
            print(f"step {step}: loss {text_loss.item():.3f} on English, {copy_loss.item():.3f} on repeated bytes "
                  f"({time.monotonic() - started:.0f} s)", flush=True)
    print(f"trained {steps} steps in {time.monotonic() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/induction"))
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=30, help="checkpoint every N steps")
    parser.add_argument("--batch-size", type=int, default=8, help="English sequences per step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=32, help="repeated random-byte sequences per step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-track", action="store_true", help="train and save checkpoints only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    train(args.out, args.steps, args.every, args.batch_size, args.lr, args.seed, args.repeats)
    if not args.no_track:
        spec = f"{Path(__file__).resolve().parent / 'model.py'}:model"
        subprocess.run([sys.executable, "-m", "probe.cli", "track", "--model", spec, "--checkpoints",
                        str(args.out / "step-*.pt"), "--icl-positions", "25,250", "--icl-seqs", "512", "--json",
                        str(args.out / "track.json"),
                        "--csv", str(args.out / "track.csv"), "--html", str(args.out / "track.html"), "--force"],
                       check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
