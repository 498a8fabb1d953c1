"""Real checkpoints of SmolLM2-135M for `probe track` (no training run of SmolLM2 publishes its checkpoints): the
released model saved as a folder (step 0), then fine-tuned on probe's own docs (docs/*.md, in file order) with
AdamW, a folder saved at each of STEPS. Deterministic (seed 0, the text in order), float32, CPU.

`python -m bench.smollm2_checkpoints FOLDER` writes FOLDER/step-0, FOLDER/step-N, ... (about 540 MB each); the
precision bench's optional `track` stage builds them in a temporary folder itself.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import ROOT

STEPS = (0, 4, 12)
"""The optimizer steps after which a folder is saved (0: the released model)."""
LEARNING_RATE = 1e-4
BATCH, TOKENS = 4, 128


def training_batches(tokenizer: Any) -> list[torch.Tensor]:
    """docs/*.md tokenized in file order, cut into batches of BATCH x TOKENS tokens (the docs hold about 40 of them)."""
    text = "\n\n".join(path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md")))
    ids = torch.tensor(tokenizer(text)["input_ids"])
    usable = ids[: len(ids) // (BATCH * TOKENS) * BATCH * TOKENS]
    return list(usable.view(-1, BATCH, TOKENS))


def build(folder: Path, steps: tuple[int, ...] = STEPS, device: str = "cpu", log: Any = print) -> list[Path]:
    """The checkpoint folders (FOLDER/step-N), written; training (float32, on `device`) wraps around the docs if
    STEPS needs more batches than they hold."""
    from probe.models import load_model

    torch.manual_seed(0)
    loaded = load_model("smollm2", dtype="float32", device=device)
    model, tokenizer = loaded.model, loaded.tokenizer
    batches = training_batches(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    saved, started = [], time.perf_counter()
    for step in range(max(steps) + 1):
        if step in steps:
            path = folder / f"step-{step}"
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            saved.append(path)
            log(f"saved {path} ({time.perf_counter() - started:.0f} s)")
        if step == max(steps):
            break
        model.train()
        batch = batches[step % len(batches)].to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        log(f"step {step + 1}: training loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    model.eval()
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    build(parser.parse_args().folder, log=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
