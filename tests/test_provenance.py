"""Provenance: every JSON, CSV and HTML file a command writes says what produced it (versions, the model resolved
and hashed, dequantised or not, dtype, device, command line, seed, time), and --resume refuses a results file of
another model, dtype or probe set in one line."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import run_cli, tiny_hf, tiny_loaded
from probe.ablation import sweep
from probe.inputs import repeated_set
from probe.errors import ProbeError
from probe.models import LoadedModel, load_model
from probe.provenance import DISTRIBUTION, file_facts, model_facts, provenance, tensor_hash, version_of
from probe.reports.files import current_stamp, write_json

TESTS = Path(__file__).parent
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"
SMALL = ["--data", "repeated", "--num-seqs", "2", "--repeat-len", "8"]


def test_every_output_of_a_command_carries_the_provenance(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    out = {kind: tmp_path / f"sweep.{kind}" for kind in ("json", "csv", "html")}
    args = ["ablate", "--model", PLANTED, *SMALL, "--seed", "3", *(x for kind, path in out.items()
                                                                   for x in (f"--{kind}", str(path)))]
    code, _, stderr = run_cli(args, capsys, monkeypatch)
    assert code == 0, stderr
    stamp = json.loads(out["json"].read_text(encoding="utf-8"))["provenance"]
    assert stamp["torch"] == torch.__version__ and stamp["transformers"]
    assert stamp["probe"] is not None and stamp["probe"] == version_of(DISTRIBUTION)  # the installed probe-heads
    assert stamp["seed"] == 3 and stamp["dtype"] == "float32" and stamp["device"] == "cpu"
    assert stamp["command"].startswith("probe ablate --model ") and "--seed 3" in stamp["command"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp["timestamp_utc"])
    model = stamp["model"]
    assert model["kind"] == "custom" and model["source"].endswith("planted.py:planted_textbook")
    assert model["sha256"] == tensor_hash(load_model(PLANTED).model) and model["dequantised"] is None
    assert out["csv"].read_text(encoding="utf-8").startswith("name,layer,head,")  # a plain table, header first
    assert json.loads((tmp_path / "sweep.provenance.json").read_text(encoding="utf-8")) == {
        "describes": "sweep.csv", "provenance": stamp}
    page = out["html"].read_text(encoding="utf-8")
    block = re.search(r'<script type="application/json" id="probe-provenance">(.*?)</script>', page, re.S)
    assert json.loads(block.group(1)) == stamp and page.index("probe-provenance") < page.rindex("</body>")
    assert current_stamp() is None  # the command is over: a file written later carries nothing of it
    write_json(tmp_path / "later.json", {"a": 1}, schema={"schema": "probe/test", "schema_version": 1})
    assert "provenance" not in json.loads((tmp_path / "later.json").read_text(encoding="utf-8"))


def test_a_run_that_writes_no_file_never_hashes_the_model(tmp_path: Path, capsys, monkeypatch) -> None:
    """The model's hash costs seconds on a real model: made when the first file asks for it, once, never for a run
    that only prints."""
    import probe.provenance

    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    hashed = []
    real = probe.provenance.model_facts
    monkeypatch.setattr(probe.provenance, "model_facts", lambda loaded: hashed.append(loaded.name) or real(loaded))
    args = ["classify", "--model", PLANTED, "--num-seqs", "2", "--seq-len", "16", "--repeat-len", "8"]
    code, stdout, stderr = run_cli(args, capsys, monkeypatch)
    assert code == 0 and "Head classification" in stdout, stderr
    assert hashed == []
    out = {kind: tmp_path / f"heads.{kind}" for kind in ("json", "csv")}
    code, _, stderr = run_cli([*args, "--json", str(out["json"]), "--csv", str(out["csv"])], capsys, monkeypatch)
    assert code == 0, stderr
    assert len(hashed) == 1  # two files, one hash
    assert json.loads(out["json"].read_text(encoding="utf-8"))["provenance"]["model"]["sha256"]


def test_a_file_is_hashed_once_and_the_hash_is_its_bytes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    weights = tmp_path / "w.bin"
    weights.write_bytes(bytes(range(256)) * 5000)
    assert file_facts(weights)["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert (tmp_path / "cache" / "provenance" / "files.json").is_file()  # cached under path, size and mtime
    weights.write_bytes(b"other")
    assert file_facts(weights)["sha256"] == hashlib.sha256(b"other").hexdigest()


def test_a_model_folder_is_hashed_by_its_weight_files(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    tiny_hf("llama_gqa").save_pretrained(tmp_path / "model")
    facts = model_facts(load_model(str(tmp_path / "model")))
    single = hashlib.sha256((tmp_path / "model" / "model.safetensors").read_bytes()).hexdigest()
    assert facts["kind"] == "folder" and facts["sha256"] == single and facts["dequantised"] is None


def test_a_module_given_to_load_model_is_hashed_by_its_tensors() -> None:
    model = tiny_hf("llama_gqa")
    facts = provenance(load_model(model, name="mine"), seed=1, command="python script.py")
    assert facts["model"]["kind"] == "module" and facts["model"]["name"] == "mine"
    assert facts["model"]["sha256"] == tensor_hash(model) and facts["seed"] == 1
    with torch.no_grad():
        next(model.parameters())[0, 0] += 1
    assert tensor_hash(model) != facts["model"]["sha256"]


def test_the_default_model_says_it_was_dequantised(smollm2: LoadedModel, capsys, monkeypatch) -> None:
    facts = model_facts(smollm2)
    assert facts["kind"] == "gguf" and facts["source"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert facts["dequantised"] == "GGUF Q4_1 weights dequantised to float32"
    assert facts["sha256"] == hashlib.sha256(Path(facts["source"]).read_bytes()).hexdigest()
    code, stdout, _ = run_cli(["models"], capsys, monkeypatch)
    assert code == 0 and "dequantised to float32" in stdout


# ---------------------------------------------------------------------------------------------------------------
# --resume refuses another model, dtype or probe set


def test_resume_refuses_another_model_with_the_same_name(tmp_path: Path) -> None:
    loaded = tiny_loaded("llama_gqa")
    path = tmp_path / "sweep.jsonl"
    sweep(loaded, repeated_set(loaded, repeat_len=8, num_seqs=2), [(0, 0)], results_path=path)
    other = tiny_loaded("llama_gqa")
    with torch.no_grad():
        next(other.model.parameters()).mul_(1.5)
    with pytest.raises(ProbeError, match=r"another model: tiny-llama_gqa \(sha256 \w+\.\.\.\), not tiny-llama_gqa"):
        sweep(other, repeated_set(other, repeat_len=8, num_seqs=2), [(0, 1)], results_path=path, resume=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """Two model folders of one architecture: the second's weights changed."""
    root = tmp_path_factory.mktemp("models")
    model = tiny_hf("llama_gqa")
    model.save_pretrained(root / "a")
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    model.save_pretrained(root / "b")
    return root / "a", root / "b"


@pytest.mark.parametrize("change, expected", [
    ("model", "another model: "),
    (["--dtype", "bfloat16"], "another dtype: float32, not bfloat16"),
    (["--num-seqs", "3"], "another probe set: "),
])
def test_resume_refuses_another_model_dtype_or_probe_set_in_one_line(change, expected: str, folders, tmp_path: Path,
                                                                     capsys, monkeypatch) -> None:
    monkeypatch.setenv("PROBE_CACHE", str(tmp_path / "cache"))
    results = tmp_path / "sweep.jsonl"
    args = ["ablate", *SMALL, "--heads", "0.0", "--results", str(results)]
    code, _, stderr = run_cli([*args, "--model", str(folders[0])], capsys, monkeypatch)
    assert code == 0, stderr
    change = ["--model", str(folders[1])] if change == "model" else ["--model", str(folders[0]), *change]
    code, _, stderr = run_cli([*args, *change, "--resume"], capsys, monkeypatch)
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert stderr.startswith(f"error: cannot continue the sweep in {results}: it holds a sweep of {expected}"), stderr
    assert stderr.rstrip().endswith("(start over without --resume, or with another results file)")
