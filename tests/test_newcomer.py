"""What a new user meets first: install hints that name this project's distribution, and the hub models
`probe models` lists (marked "needs the hub", loaded by their short name)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from probe.errors import DISTRIBUTION, install_hint
from probe.models import HUB_ALIASES, LoadedModel

ROOT = Path(__file__).resolve().parents[1]
READ = ("probe", "cli", "reports", "docs")  # what a user reads: the package's messages and docstrings, the docs
SUFFIXES = {".py", ".md", ".js", ".txt", ".yml", ".yaml", ".toml", ".sh"}


def read_by_users() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "mkdocs.yml", ROOT / "install.sh"]
    for folder in READ:
        files += [path for path in (ROOT / folder).rglob("*") if path.suffix in SUFFIXES and path.is_file()]
    return [path for path in files if path.exists()]


def test_no_install_hint_names_another_project() -> None:
    """`probe` on PyPI is someone else's project: `pip install 'probe[syntax]'` would install their code."""
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in read_by_users()
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "probe[" in line]
    assert not found, "\n".join(found)
    assert install_hint("syntax") == "pip install 'probe-heads[syntax]'"
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'name = "{DISTRIBUTION}"' in pyproject and re.search(r"^syntax = ", pyproject, re.M)


def test_the_hints_name_extras_that_exist() -> None:
    """Every `probe-heads[EXTRA]` a user reads names an extra pyproject.toml defines."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    defined = set(re.findall(r"^(\w+) = \[", pyproject.split("[project.optional-dependencies]")[1], re.M))
    named = {extra for path in read_by_users() + [ROOT / "README.md"]
             for extra in re.findall(r"probe-heads\[([a-z]+)\]", path.read_text(encoding="utf-8"))}
    assert named and named <= defined, named - defined


def test_the_default_install_has_what_the_readme_tour_runs() -> None:
    """`bash install.sh` (no --test) installs the syntax extra, spaCy and its English pipeline: the README's tour
    runs `probe syntax` on raw text, which spaCy parses; the README says what install.sh installs."""
    script = (ROOT / "install.sh").read_text(encoding="utf-8")
    default = script.split('if [ "${1:-}" = "--test" ]; then', 1)[1].split("else\n", 1)[1].split("fi\n", 1)[0]
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', default)
    assert extras and "syntax" in extras.group(1).split(","), default
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^syntax = \["spacy', pyproject, re.M)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    before, tour = readme.split("## CLI tour", 1)
    assert "\nprobe syntax " in tour and "spaCy for `probe syntax`" in before


def fake_hub_cache(cache: Path, hub_id: str) -> None:
    """A hub cache holding a tiny random GPT-2 under `hub_id`, laid out as huggingface_hub lays out downloads."""
    import transformers as tf

    commit = "0" * 40
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=120, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                             bos_token_id=0, eos_token_id=0))
    model.save_pretrained(repo / "snapshots" / commit)


def test_probe_models_lists_hub_models_as_needing_the_hub(tmp_path: Path, capsys, monkeypatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "250")
    fake_hub_cache(tmp_path, HUB_ALIASES["gpt2"].hub_id)
    code, stdout, _ = run_cli(["models"], capsys, monkeypatch)  # not a terminal: a plain list, an entry per alias
    rows: dict[str, str] = {}
    for line in stdout.splitlines():
        if line and not line.startswith(" ") and ": " in line:
            name = line.split(":")[0].removesuffix(" (default)")
        rows[name] = rows.get(name, "") + line + "\n"
    assert code == 0 and {"gpt2", "pythia-70m", "pythia-160m", "llama-3.2-1b", "qwen2.5-0.5b"} <= set(rows)
    assert max(len(line) for line in stdout.splitlines()) <= 100  # fits where a pipe or a log shows it
    assert "in the hub cache" in rows["gpt2"]
    assert all("needs the hub" in rows[name] for name in HUB_ALIASES if name != "gpt2")
    assert "meta-llama/Llama-3.2-1B" in rows["llama-3.2-1b"] and "gated" in rows["llama-3.2-1b"]


CLI_TWICE = """
import sys
from probe.cli.app import main
for args in (sys.argv[1:-2], ["-q", "classify", "-m", sys.argv[-1]]):
    sys.argv = ["probe", *args]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    print("exit", code, file=sys.stderr)
"""


@pytest.mark.slow  # over 10 s on 2 cores
def test_a_hub_alias_loads_its_hub_id_and_says_so_offline(tmp_path: Path) -> None:
    """`--model gpt2` is openai-community/gpt2 (recorded as such); offline and not cached: one line that says why."""
    cache, out = tmp_path / "hub", tmp_path / "heads.json"
    fake_hub_cache(cache, HUB_ALIASES["gpt2"].hub_id)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PROBE_CACHE": str(tmp_path),
           "OMP_NUM_THREADS": "1"}
    args = ["-q", "classify", "-m", "gpt2", "--seq-len", "16", "--num-seqs", "1", "--repeat-len", "8", "--json",
            str(out), "then", "pythia-70m"]
    done = subprocess.run([sys.executable, "-c", CLI_TWICE, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    _first, second = done.stderr.split("exit 0\n")  # the hub alias in the cache loads; then the one not cached
    provenance = json.loads(out.read_text())["provenance"]
    assert provenance["model"]["source"] == "openai-community/gpt2" and provenance["model"]["kind"] == "hub"
    assert second.splitlines() == ["error: cannot load model 'pythia-70m' (EleutherAI/pythia-70m comes from the "
                                   "Hugging Face hub: the first load needs the network): We couldn't connect to "
                                   "'https://huggingface.co' to load the files, and couldn't find them in the cached "
                                   "files.", "exit 2"]


TWELVE_HEADS = '''
import pytest
import torch
import transformers as tf


def model():
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=120, n_embd=48, n_layer=2, n_head=12, n_positions=64, bos_token_id=0,
                           eos_token_id=0)
    return tf.GPT2LMHeadModel(config).eval()
'''


def twelve_heads(tmp_path: Path) -> str:
    """A tiny model with 12 heads per layer (head 0.1 and head 0.10 both exist), as a FILE.py:FUNCTION spec."""
    (tmp_path / "twelve.py").write_text(TWELVE_HEADS, encoding="utf-8")
    return f"{tmp_path / 'twelve.py'}:model"


def test_head_names_survive_a_pandas_round_trip(tmp_path: Path, capsys, monkeypatch) -> None:
    """pandas reads a column of `0.1`, `0.10` as floats, one value: every head keeps its own name, and integer
    layer and head columns, in a CSV plain `read_csv(path)` reads."""
    import pandas

    out = tmp_path / "t.csv"
    code, _, stderr = run_cli(["-q", "ablate", "-m", twelve_heads(tmp_path), "--data", "repeated", "--repeat-len",
                               "6", "--num-seqs", "2", "--csv", str(out)], capsys, monkeypatch)
    assert code == 0, stderr
    frame = pandas.read_csv(out)
    assert len(frame) == 24 and frame["name"].nunique() == 24
    assert not pandas.api.types.is_numeric_dtype(frame["name"])
    assert not any(_is_number(name) for name in frame["name"])
    assert str(frame["layer"].dtype) == "int64" and str(frame["head"].dtype) == "int64"
    assert sorted(zip(frame["layer"], frame["head"])) == [(layer, head) for layer in range(2) for head in range(12)]
    named = dict(zip(frame["name"], zip(frame["layer"], frame["head"])))
    assert named["L0H1"] == (0, 1) and named["L0H10"] == (0, 10)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def test_every_head_table_names_heads_apart_from_numbers(tmp_path: Path) -> None:
    """Every CSV row function and DataFrame with a head column: integer layer and head, a name pandas keeps as text;
    the name is one --heads takes back."""
    import importlib.util

    import pandas

    from probe.ablation.heads import parse_heads
    from probe import classify
    from probe.hooks.layers import attention_layers
    from probe.reports.circuits import circuit_rows
    from probe.reports.dla import dla_rows
    from probe.reports.files import write_csv
    from probe.reports.patching import patch_rows

    spec = importlib.util.spec_from_file_location("twelve", twelve_heads(tmp_path).rpartition(":")[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.model()
    heads = [(layer, head) for layer in range(2) for head in range(12)]
    assert parse_heads("L0H10,0.1,L1H0", attention_layers(model)) == [(0, 10), (0, 1), (1, 0)]
    loaded = LoadedModel(model=model, tokenizer=None, name="twelve", vocab_size=120)
    frames = {"classify": classify(loaded, num_seqs=1, repeat_len=6, seq_len=8).to_frame()}
    payload_heads = [{"layer": layer, "head": head, "dla": 0.1, "patch_effect": 0.1, "logit_diff": 1.0}
                     for layer, head in heads]
    rows = {"dla": dla_rows({"heads": payload_heads}), "patch": patch_rows({"heads": payload_heads}),
            "circuits": circuit_rows({"induction_heads": [
                {"layer": 1, "head": 10, "induction_score": 0.9, "second_copy_deltas": {}, "checked": None,
                 "feeders": [{"layer": 0, "head": head, "k_composition": 0.5, "rank_in_layer": 1,
                              "previous_token": 0.5} for head in range(12)]}]})}
    for name, table in rows.items():
        frames[name] = pandas.read_csv(write_csv(tmp_path / f"{name}.csv", table))
    for name, frame in frames.items():
        column, layer, head = ("feeder_name", "feeder_layer", "feeder_head") if name == "circuits" else (
            "name", "layer", "head")
        assert frame[column].nunique() == len(frame) and not any(_is_number(text) for text in frame[column]), name
        assert str(frame[layer].dtype) == "int64" and str(frame[head].dtype) == "int64", name
        assert all(parse_heads(text, attention_layers(model)) == [(row_layer, row_head)]
                   for text, row_layer, row_head in zip(frame[column], frame[layer], frame[head])), name


def _never_loads(monkeypatch) -> None:
    import probe.cli.options as options

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(options, "load_model", loaded)


@pytest.mark.parametrize("args, message", [
    (["classify", "--num-seqs", "0"], "error: --num-seqs must be at least 1, got 0"),
    (["ablate", "--seq-len", "1"], "error: --seq-len must be at least 2, got 1"),
    (["dla", "--count", "0"], "error: --count must be at least 1, got 0"),
    (["ablate", "--data", "{empty}"], "error: --data file {empty} is empty"),
    (["classify", "--data", "{empty}"], "error: --data file {empty} is empty"),
    (["prune", "--data", "missing.txt"], "error: --data file not found: missing.txt"),
    (["heatmap", "--text", "", "--html", "{tmp}/h.html"], "error: --text is empty: give the text to look at"),
    (["heatmap", "--text", "  ", "--html", "{tmp}/h.html"], "error: --text is empty: give the text to look at"),
])
def test_arguments_are_checked_before_the_model_loads(args: list[str], message: str, tmp_path: Path, capsys,
                                                      monkeypatch) -> None:
    """A count below its least, an empty --data file or --text: refused in one line without loading anything."""
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n", encoding="utf-8")
    _never_loads(monkeypatch)
    fill = {"empty": str(empty), "tmp": str(tmp_path)}
    code, _, stderr = run_cli([arg.format(**fill) for arg in args], capsys, monkeypatch)
    assert (code, stderr.strip()) == (2, message.format(**fill))


def test_cuda_on_a_cpu_build_of_torch_says_how_to_get_one(capsys, monkeypatch) -> None:
    """`--device cuda` where the installed torch has no CUDA: which torch is installed and how to get a CUDA build."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    _never_loads(monkeypatch)
    code, _, stderr = run_cli(["classify", "--device", "cuda"], capsys, monkeypatch)
    release = torch.__version__.split("+")[0]
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(f"error: --device 'cuda' needs CUDA, but the installed torch {torch.__version__} is a "
                             "CPU-only build")
    assert f"pip install torch=={release} --index-url https://download.pytorch.org/whl/cu128" in stderr
    assert "device='cpu'" not in stderr
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build that sees no GPU: the driver, not the build
    code, _, stderr = run_cli(["classify", "--device", "cuda"], capsys, monkeypatch)
    assert code == 2 and "sees none: check the driver (nvidia-smi)" in stderr and "pip install" not in stderr


def test_a_hub_model_offline_fails_at_once_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    """Without the network and not cached: one line within seconds, no retries; the loader is never reached."""
    import socket
    import time

    import huggingface_hub.constants

    def unreachable(address, timeout=None):
        assert timeout is not None and timeout <= 5
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    _never_loads(monkeypatch)
    started = time.monotonic()
    code, _, stderr = run_cli(["classify", "-m", "pythia-70m"], capsys, monkeypatch)
    assert code == 2 and time.monotonic() - started < 5
    assert stderr.strip() == ("error: cannot load model 'pythia-70m' (EleutherAI/pythia-70m comes from the Hugging "
                              "Face hub: the first load needs the network): huggingface.co cannot be reached (Network "
                              "is unreachable) and the model is not in the local hub cache; connect, or set "
                              "HF_HUB_OFFLINE=1 to use cached models only")
    fake_hub_cache(tmp_path, HUB_ALIASES["pythia-70m"].hub_id)  # in the cache: no network needed, none asked
    monkeypatch.setattr(socket, "create_connection", lambda *args, **kwargs: pytest.fail("asked the network"))
    code, _, stderr = run_cli(["classify", "-m", "pythia-70m"], capsys, monkeypatch)
    assert "the model was loaded before" in stderr  # got past the checks to the (refused) load


@pytest.mark.parametrize("args, message", [
    (["ablate", "--heads", "0.1,9.0"], "error: layer 9 in --heads '9.0' is out of range"),
    (["patch", "--task", "ioi", "--heads", "L2H1"], "layer 2 in --heads 'L2H1' is out of range"),
    (["heatmap", "--text", "hi", "--html", "{tmp}/h.html", "--layers", "0-5"], "layer 5 in --layers '0-5' is out"),
])
def test_a_layer_past_the_models_is_refused_from_its_config(args: list[str], message: str, tmp_path: Path, capsys,
                                                            monkeypatch) -> None:
    """The layer count is in the model's config.json: read before loading anything."""
    fake_hub_cache(tmp_path, "tiny/gpt2")  # a 2-layer GPT-2 saved with save_pretrained
    folder = next((tmp_path / "models--tiny--gpt2" / "snapshots").iterdir())
    capsys.readouterr()
    _never_loads(monkeypatch)
    code, _, stderr = run_cli([*[arg.format(tmp=tmp_path) for arg in args], "-m", str(folder)], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert message in stderr and "the model has 2 layers (0-1)" in stderr


def test_the_duo_export_makes_its_folder_with_its_parents(tmp_path: Path) -> None:
    """`--export duo:maps/smollm2` as the README writes it, in a folder without `maps`: accepted (written by
    mkdir -p; tests/test_readme_tour.py runs it); a file in the way is refused before any work."""
    from probe.cli.kv_heads import _export_files
    from probe.errors import ProbeError

    assert _export_files({"duo": tmp_path / "maps" / "smollm2"}) == {}  # nothing there to overwrite
    (tmp_path / "file").write_text("x")
    with pytest.raises(ProbeError, match="is a file"):
        _export_files({"duo": tmp_path / "file" / "smollm2"})


def test_pruning_progress_ends_at_its_total_when_curves_stop_early() -> None:
    """Curves that pass the loss limit after a step skip the rest of their planned steps: the count says so, and the
    last report is (total, total), never 3/120 at the end."""
    from conftest import tiny_loaded
    from probe.ablation.prune import prune
    from probe.inputs import repeated_set

    loaded = tiny_loaded("llama_gqa")
    reports: list[tuple[int, int]] = []
    result = prune(loaded, repeated_set(loaded, repeat_len=6, num_seqs=2), step=0.25, seeds=(0,), max_increase=0.0,
                   relative=False, progress=lambda done, total: reports.append((done, total)))
    assert any(len(curve.steps) < 5 for curve in result.curves)  # at least one curve stopped at the limit
    assert reports[-1][0] == reports[-1][1] and [done for done, _ in reports] == sorted(done for done, _ in reports)


def test_terminal_reports_read_as_a_newcomer_reads_them(tmp_path: Path, capsys, monkeypatch) -> None:
    """One table per question (no two glued by a `│` column); the ablated feeder named; a head in a cell reads as a
    head; hub ids whole at 80 columns; a loaded model's repr one line."""
    import io

    from rich.console import Console

    from conftest import tiny_loaded
    from probe.reports.circuits import circuits_report
    from probe.reports.terminal import ablation_report
    from probe.reports.track import track_report

    def printed(report, payload) -> str:
        out = io.StringIO()
        report(payload, Console(file=out, width=160))
        return out.getvalue()

    effects = {"max_token_delta": 2.0, "p99_token_delta": 0.5, "specificity": 0.4, "top_tokens": [{"context": "a b"}]}
    heads = [{"layer": 0, "head": head, "loss": 2.0, "delta": 0.1 * head, "effects": effects} for head in range(3)]
    text = printed(ablation_report, {"model": "m", "method": "zero", "mode": "exact", "data": "d", "metric": "ce",
                                     "path": "p", "n_layers": 1, "n_heads": 3, "baseline_loss": 1.0, "heads": heads})
    assert "Heads with the sharpest specific effect" in text and "│ │" not in text and "| sharpest" not in text
    pair = {"layer": 1, "head": 2, "feeders": [{"layer": 0, "head": 3, "k_composition": 0.5, "previous_token": True}],
            "checked": {"layer": 0, "head": 3}, "second_copy_deltas": {"feeder": 0.1, "induction": 0.2,
                                                                         "together": 0.5}, "interaction": 0.2}
    text = printed(circuits_report, {"model": "m", "random_baseline": 0.1, "induction_heads": [pair],
                                     "previous_token_pairs": {"pairs": 1, "ranked_first_in_layer": 1,
                                                              "above_baseline": 1}})
    row = next(line for line in text.splitlines() if line.lstrip().startswith("1.2"))
    assert "ablated feeder" in text and row.split()[:5] == ["1.2", "0.3", "P", "0.500", "0.3"]
    checkpoint = {"name": "step-1", "step": 1, "loss": 2.0, "icl_score": None,
                  "heads": [{"layer": 0, "head": 3, "scores": {"induction": 0.03}}]}
    text = printed(track_report, {"model": "m", "kind": "files", "n_layers": 1, "n_heads": 4,
                                  "thresholds": {"induction": 0.4}, "checkpoints": [checkpoint], "phase_changes": [],
                                  "min_rise": 0.1, "icl_change": None})
    assert "0.03 (head 0.3)" in text
    monkeypatch.setenv("COLUMNS", "80")
    code, stdout, _ = run_cli(["models"], capsys, monkeypatch)
    assert code == 0 and all(hub.hub_id in stdout for hub in HUB_ALIASES.values())
    loaded = tiny_loaded("gpt2")
    assert repr(loaded).startswith("LoadedModel('tiny-gpt2': GPT2LMHeadModel, ") and "\n" not in repr(loaded)


def test_the_outputs_people_expect(tmp_path: Path, capsys, monkeypatch) -> None:
    """`probe heatmap --json` (the shown heads' weights), `probe circuits --html`, `probe classify --csv`."""
    import math

    import pandas

    planted = f"{ROOT / 'tests' / 'planted.py'}:planted_textbook"
    weights = tmp_path / "w.json"
    words = f"{ROOT / 'tests' / 'words.py'}:tiny_with_words"  # a model with a tokenizer
    code, _, stderr = run_cli(["heatmap", "-m", words, "--text", "the keys to the cabinet are here", "--layers", "1",
                               "--json", str(weights)], capsys, monkeypatch)
    assert code == 0, stderr
    data = json.loads(weights.read_text())
    n = len(data["tokens"])
    assert [(h["layer"], h["head"], h["name"]) for h in data["heads"]] == [(1, head, f"L1H{head}") for head in range(4)]
    for entry in data["heads"]:
        rows = entry["weights"]
        assert len(rows) == n and all(len(row) == n for row in rows)
        assert all(row[key] is None for query, row in enumerate(rows) for key in range(query + 1, n))  # causal
        assert all(math.isclose(sum(row[:query + 1]), 1.0, abs_tol=0.01) for query, row in enumerate(rows))
    page, table = tmp_path / "c.html", tmp_path / "heads.csv"
    code, _, stderr = run_cli(["circuits", "-m", planted, "--num-seqs", "2", "--seq-len", "16", "--repeat-len", "8",
                               "--html", str(page)], capsys, monkeypatch)
    assert code == 0, stderr
    html = page.read_text()
    assert "Induction circuits of" in html and "<td>1.1</td>" in html and 'start("circuits"' in html
    code, _, stderr = run_cli(["classify", "-m", planted, "--num-seqs", "2", "--seq-len", "16", "--repeat-len", "8",
                               "--csv", str(table)], capsys, monkeypatch)
    assert code == 0, stderr
    frame = pandas.read_csv(table)
    assert list(frame.columns[:3]) == ["layer", "head", "name"] and len(frame) == 8
    induction = frame[frame["name"] == "L1H1"].iloc[0]
    assert induction["induction"] > 0.8 and "induction" in induction["labels"]


def test_kv_heads_options_read_as_words_not_json() -> None:
    from probe.reports.kv_heads import options_text

    text = options_text({"lengths": [1024, 2048], "depths": [0.1, 0.5], "order_by": "retrieval", "seed": 0,
                         "data": None})
    assert text == "lengths 1024, 2048; depths 0.1, 0.5; order by retrieval; seed 0; data none"
    assert "{" not in text and '"' not in text and options_text({}) == "defaults"


def test_every_page_kind_has_its_picture_in_the_docs() -> None:
    """docs/_build/screenshots.py shoots each kind of page it lists; each picture is in docs/images and shown by a
    docs page, and the docs name the script."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "_build" / "screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    docs = "".join(path.read_text(encoding="utf-8") for path in (ROOT / "docs").glob("*.md"))
    assert "docs/_build/screenshots.py" in docs and module.WIDTHS == (1000, 1400)
    assert {"heatmap", "classify", "ablate", "syntax", "circuits", "prune", "patch", "kv-heads", "atlas"} <= set(
        module.PAGES)
    for kind in module.PAGES:
        picture = ROOT / "docs" / "images" / f"page-{kind}.png"
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size < 300_000, kind
        assert f"(images/page-{kind}.png)" in docs, kind
