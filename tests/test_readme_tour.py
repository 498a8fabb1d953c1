"""The README's CLI tour runs as written: every command of its first bash block, in a fresh folder, on the default
model (slow: SmolLM2, loaded once for the session), with flags that shrink the inputs where the command has them.
The inputs the tour names (a classifier folder and its labelled texts, a training run's checkpoints) are made here
first, the way a user would have them."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import torch

from conftest import run_cli
from probe.models import LoadedModel

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
SMALL = {  # flags that shrink a command's inputs (appended: the last occurrence of a flag wins)
    "classify": ["--num-seqs", "1", "--seq-len", "24", "--repeat-len", "12"],
    "ablate": ["--num-seqs", "1", "--seq-len", "16", "--heads", "0-1.*,17.3"],
    "syntax": ["--max-sentences", "4", "--min-count", "1"],
    "circuits": ["--num-seqs", "1", "--seq-len", "24", "--repeat-len", "12"],
    "prune": ["--num-seqs", "1", "--seq-len", "16", "--seeds", "1", "--step", "0.25"],
    "dla": ["--count", "2"],
    "qk": ["--num-seqs", "1", "--repeat-len", "12"],
    "patch": ["--count", "2", "--heads", "0-1.*,17.3"],
    "kv-heads": ["--lengths", "160", "--depths", "0.5", "--sink", "4", "--recent", "32", "--steps", "2",
                 "--random-seeds", "0", "--curve-texts", "1"],
    "atlas": ["--num-seqs", "1", "--seq-len", "24", "--repeat-len", "12"],
    "track": ["--num-seqs", "1", "--seq-len", "24", "--repeat-len", "12", "--icl-seqs", "2", "--icl-positions",
              "2,20"],
}
RUN_PY = f"""
import sys
import torch
sys.path.insert(0, {str(ROOT / 'examples' / 'induction')!r})
from model import AttentionOnly, ByteTokenizer


def model():
    return AttentionOnly(n_layers=2, d_model=32, n_heads=4, max_len=256), ByteTokenizer()
"""


def tour() -> list[str]:
    """The commands of the README's `## CLI tour` bash block, comments dropped."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## CLI tour\s+```bash\n(.*?)```", readme, re.S)
    assert block, "README.md has no CLI tour block"
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def make_inputs(folder: Path) -> None:
    """What the tour's commands name: `my-classifier` and `dev.jsonl`, `run.py` and `ckpt/step-*.pt`."""
    sys.path.insert(0, str(ROOT / "tests"))
    from classifiers import tiny_bert_classifier, word_tokenizer

    words = ["the", "film", "was", "good", "bad", "fine", "plot", "acting",
             "quick", "brown", "fox", "jumps"]  # the loader's check encodes a fox
    tokenizer = word_tokenizer(words)
    tiny_bert_classifier(len(tokenizer)).save_pretrained(folder / "my-classifier")
    tokenizer.save_pretrained(folder / "my-classifier")
    rows = [{"text": f"the {noun} was {word}", "label": label} for noun in ("film", "plot", "acting")
            for word, label in (("good", "positive"), ("bad", "negative"), ("fine", "neutral"))]
    (folder / "dev.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    (folder / "run.py").write_text(RUN_PY, encoding="utf-8")
    (folder / "ckpt").mkdir()
    namespace: dict = {}
    exec(compile(RUN_PY, "run.py", "exec"), namespace)
    for step in (10, 20):
        torch.manual_seed(step)
        torch.save(namespace["model"]()[0].state_dict(), folder / "ckpt" / f"step-{step}.pt")


def test_the_readme_cli_tour_runs_as_written(tmp_path: Path, capsys, monkeypatch, smollm2: LoadedModel) -> None:
    import probe.cli.options as options

    real = options.load_model
    monkeypatch.setattr(options, "load_model", lambda spec, **kwargs: smollm2 if spec == "smollm2" and not any(
        kwargs.get(name) for name in ("device", "device_map")) and kwargs.get("dtype") == "float32"
        else real(spec, **kwargs))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "160")
    make_inputs(tmp_path)
    commands = tour()
    assert len(commands) >= 12 and all(command.startswith("probe ") for command in commands)
    for command in commands:
        args = shlex.split(command)[1:]
        small = SMALL.get(args[0], []) if not {"--model", "-m"} & set(args) else []
        code, _, stderr = run_cli([*args, *small], capsys, monkeypatch)
        assert code == 0, f"{command}\n{stderr}"
        for flag in ("--json", "--csv", "--html"):
            if flag in args:
                assert (tmp_path / args[args.index(flag) + 1]).is_file(), f"{command}: no {flag} file"
    assert (tmp_path / "maps" / "smollm2" / "full_attention_heads.tsv").is_file()
    pages = sorted(tmp_path.glob("*.html"))
    written = {shlex.split(command)[index + 1] for command in commands
               for index, arg in enumerate(shlex.split(command)) if arg == "--html"}
    assert len(written) >= 7 and {page.name for page in pages} == written  # every --html the tour names, no other
    if CHROMIUM.exists():  # every page the tour wrote, laid out at both widths without a fault
        assert layout_faults(pages) == []


def layout_faults(pages: list[Path]) -> list[str]:
    """docs/_build/screenshots.py's measures (text past the right edge, an empty section, an axis label cut by its
    plot) of each page at 1000 and 1400 px in Chromium, and any script error; one line per fault."""
    import importlib.util

    from playwright.sync_api import sync_playwright

    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "_build" / "screenshots.py")
    assert spec is not None and spec.loader is not None
    screenshots = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screenshots)
    faults: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        for path in pages:
            for width in screenshots.WIDTHS:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.on("pageerror", lambda error, name=path.name: faults.append(f"{name}: {error}"))
                page.goto(path.resolve().as_uri())
                faults += [f"{path.name} at {width} px: {fault}"  # the page's CSP refuses wait_for_function's eval
                           for fault in screenshots.layout_faults(page, path.stem)]
                page.close()
        browser.close()
    return faults
