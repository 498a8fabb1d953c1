"""Every kind of page probe writes, made by its own command (`probe <command> --html`) on tiny models in a few
seconds: the pages tests/test_page_layout.py lays out in Chromium."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).parent
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"
PLANTED_LM = f"{TESTS / 'planted.py'}:planted_lm"
WORDS = f"{TESTS / 'words.py'}:tiny_with_words"
TRACK = f"{TESTS / 'track_models.py'}:tiny"
SMALL = ["--seq-len", "24", "--num-seqs", "2", "--repeat-len", "8"]
COMMANDS = {  # kind -> its command (its --html added); {folder} is where the inputs are
    "heatmap": ["heatmap", "--model", WORDS, "--text", "When Mary and John went to the store , John gave a drink to "
                "Mary"],
    "classify": ["classify", "--model", PLANTED_LM, *SMALL],
    "ablate": ["ablate", "--model", PLANTED, "--data", "repeated", "--num-seqs", "2", "--repeat-len", "12"],
    "syntax": ["syntax", "--model", f"{TESTS / 'planted_syntax.py'}:planted_pair", "--conllu", "{folder}/c.conllu",
               "--min-count", "5"],
    "circuits": ["circuits", "--model", PLANTED, *SMALL],
    "prune": ["prune", "--model", PLANTED, "--data", "repeated", "--seq-len", "24", "--num-seqs", "2", "--step",
              "0.125", "--seeds", "2", "--max-increase", "5%"],
    "patch": ["patch", "--model", WORDS, "--task", "ioi", "--count", "6", "--by-position"],
    "dla": ["dla", "--model", WORDS, "--task", "ioi", "--count", "6", "--self-repair"],
    "qk": ["qk", "--model", f"{TESTS / 'planted.py'}:planted_gpt2", "--head", "1.1", "--at", "induction", "--num-seqs",
           "2", "--repeat-len", "8"],
    "kv-heads": ["kv-heads", "--model", WORDS, "--lengths", "120", "--depths", "0.5", "--sink", "1", "--recent", "8",
                 "--steps", "2", "--random-seeds", "0", "--curve-texts", "1",
                 "--needle", "the keys to the cabinet are {key}"],  # words the tiny tokenizer knows
    "atlas": ["atlas", "--model", PLANTED_LM, *SMALL, "--json", "{folder}/atlas.json"],
    "track": ["track", "--model", TRACK, "--checkpoints", "{folder}/ckpt/step-*.pt", *SMALL, "--icl-seqs", "2"],
    "steer": ["steer", "--model", WORDS, "--heads", "1.2,0.1", "--alpha", "0,2", "--task", "ioi", "--num-seqs", "6",
              "--generate", "the keys to the", "--max-new-tokens", "4"],
    "compare": ["compare", "{folder}/query.npy", "{folder}/duo", "--group", "max", "--threshold", "0.6"],
}
TABLES = ("classify", "ablate", "syntax", "circuits", "prune", "patch", "dla", "track", "compare", "qk")
"""The kinds whose command also writes a `--csv` table."""


def make_inputs(folder: Path) -> None:
    """What the commands read: a small CoNLL-U corpus, three checkpoints of the tiny training run, and two head
    maps of one model to compare, per query head (.npy) and per KV head (a DuoAttention folder)."""
    import numpy as np
    from planted_syntax import conllu_corpus
    from track_models import tiny

    from probe.headmaps import KV, HeadMap, write_map

    (folder / "c.conllu").write_text(conllu_corpus(16), encoding="utf-8")
    (folder / "ckpt").mkdir(exist_ok=True)
    for step in (0, 5, 10):
        torch.manual_seed(step + 1)
        torch.save(tiny()[0].state_dict(), folder / "ckpt" / f"step-{step}.pt")
    rng = np.random.default_rng(0)  # 6 layers x 8 query heads reading 2 KV heads
    np.save(folder / "query.npy", rng.random((6, 8)))
    write_map(HeadMap(rng.random((6, 2)), KV, "duo", "duo", "full_attention", n_heads=8), folder / "duo", "duo")


def run(args: list[str]) -> tuple[int, str]:
    """The `probe` entry point in-process: (exit code, what it wrote to stderr)."""
    from probe.cli.app import main

    argv, err = sys.argv, io.StringIO()
    sys.argv = ["probe", "-q", *args]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
    return code, err.getvalue()


def write_pages(folder: Path, kinds: list[str] | None = None, tables: tuple[str, ...] = ()) -> dict[str, Path]:
    """Each kind's page, written by its command into `folder` (a command that fails raises, with its stderr); the
    kinds in `tables` write their `--csv` table beside it in the same run (`KIND.csv`)."""
    import probe.inputs.contrast as contrast

    make_inputs(folder)
    pages, gap = {}, contrast.MIN_GAP
    contrast.MIN_GAP = 1e-4  # a random tiny model's corruption changes little
    try:
        for kind in kinds or list(COMMANDS):
            path = folder / f"{kind}.html"
            args = [arg.replace("{folder}", str(folder)) for arg in COMMANDS[kind]]
            table = ["--csv", str(folder / f"{kind}.csv")] if kind in tables else []
            code, err = run([*args, "--html", str(path), *table, "--force"])
            assert code == 0 and path.is_file(), f"{kind}: {' '.join(args)}\n{err}"
            pages[kind] = path
    finally:
        contrast.MIN_GAP = gap
    return pages
