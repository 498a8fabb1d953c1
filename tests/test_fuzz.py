"""Issue 33: every parser of user input, fuzzed with Hypothesis, through its library function and through the CLI.

The property is the same everywhere: for any input, a valid result or one ProbeError of one line (the CLI: exit 0, or
one `error:` line and exit 2), never a traceback; and valid inputs round-trip. `pytest --hypothesis-profile=long`
runs 10,000 examples of each (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
from pathlib import Path

import huggingface_hub.constants
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_loaded
from families import tiny_encoder_decoder
from fuzzing import (MISSING_MODEL, argument, cli_outcome, file_bytes, inputs, json_variant, valid_or_refused, write)
from planted_syntax import planted_syntax, syntax_tokenizer
from probe.ablation.heads import parse_heads, parse_layers
from probe.ablation.results import HeadResult
from probe.ablation.stream import load_results, read_results, write_stream
from probe.ablation.sweep import sweep
from probe.hooks.layers import attention_layers
from probe.hooks.stacks import layer_names
from probe.cli.app import main
from probe.cli.options import parse_thresholds
from probe.cli.kv_heads import parse_exports
from probe.cli.prune import parse_max_increase
from probe.distributed import shard_paths
from probe.errors import ProbeError
from probe.inputs import (natural_set, read_contrast_pairs, read_labelled, read_pairs, read_task_file,
                          repeated_set, task_set)
from probe.models import LoadedModel, load_model
from probe.models.placement import parse_device_map
from probe.inputs import read_text_file
from probe.syntax import read_conllu

TESTS = Path(__file__).parent
CLI = settings(max_examples=max(30, settings().max_examples))
"""Through the CLI (a command parsed per example, ~20 ms: 10,000 in ~4 min): the profile's count, as the library
function behind each. The properties that load a model or run a sweep per example set a fraction of it."""
PLANTED = f"{TESTS / 'planted.py'}:planted_textbook"
HEADS = ["18.6", "0.1,1.3", "1.*", "0-1.2-3", "all", "*", "enc0-1.*", "x1.0", "dec0.3,enc1.2", "1", "0-1"]
LAYERS = ["0", "0-1", "1,0", "enc0-1", "x1", "dec0,enc1", "*", ""]
WORDS = ["go", "run", "walk", "sing", "now", "fast", "today", "here", "there", "slowly", "home", "school", "work"]


@pytest.fixture(scope="module")
def layer_sets() -> dict[str, list]:
    """The attention layers of a tiny llama (2 x 4 heads) and of a tiny t5 (encoder, decoder, cross: 6 x 4)."""
    return {"llama": attention_layers(tiny_loaded("llama_gqa").model),
            "t5": attention_layers(tiny_encoder_decoder("t5"))}


@pytest.fixture(scope="module")
def worded() -> LoadedModel:
    """The planted syntax model with its word-piece tokenizer: a real tokenizer for files of text."""
    return planted_syntax()


@pytest.fixture(scope="module")
def t5() -> LoadedModel:
    model = tiny_encoder_decoder("t5")
    return LoadedModel(model=model, tokenizer=syntax_tokenizer(), name="tiny-t5", vocab_size=120)


# ---------------------------------------------------------------------------------------------------------------
# head and layer specs


@given(spec=inputs(HEADS), kind=st.sampled_from(["llama", "t5"]))
def test_head_specs_parse_or_refuse(spec: str, kind: str, layer_sets: dict) -> None:
    layers = layer_sets[kind]
    heads = valid_or_refused(lambda: parse_heads(spec, layers))
    if not isinstance(heads, ProbeError):
        assert heads and len(set(heads)) == len(heads)
        assert all(0 <= head < layers[layer].n_heads for layer, head in heads)


@given(data=st.data(), kind=st.sampled_from(["llama", "t5"]))
def test_head_specs_round_trip(data: st.DataObject, kind: str, layer_sets: dict) -> None:
    """Heads printed as probe prints them (`1.3`, `x1.0`) parse to the same heads, in the same order."""
    layers = layer_sets[kind]
    every = [(layer.index, head) for layer in layers for head in range(layer.n_heads)]
    heads = data.draw(st.lists(st.sampled_from(every), min_size=1, max_size=12, unique=True))
    names = layer_names(layers) or [str(layer.index) for layer in layers]
    spec = data.draw(st.sampled_from([",", ", "])).join(f"{names[layer]}.{head}" for layer, head in heads)
    assert parse_heads(spec, layers) == heads


@given(spec=inputs(LAYERS), kind=st.sampled_from(["llama", "t5"]))
def test_layer_specs_parse_or_refuse(spec: str, kind: str, layer_sets: dict) -> None:
    layers = layer_sets[kind]
    chosen = valid_or_refused(lambda: parse_layers(spec, layers))
    assert chosen is None or isinstance(chosen, ProbeError) or chosen <= {layer.index for layer in layers}


@given(data=st.data(), kind=st.sampled_from(["llama", "t5"]))
def test_layer_specs_round_trip(data: st.DataObject, kind: str, layer_sets: dict) -> None:
    layers = layer_sets[kind]
    names = layer_names(layers) or [str(layer.index) for layer in layers]
    chosen = data.draw(st.sets(st.sampled_from(range(len(layers))), min_size=1))
    assert parse_layers(",".join(names[index] for index in chosen), layers) == chosen


@CLI
@given(spec=inputs(HEADS))
def test_head_specs_on_the_command_line(spec: str, capsys, monkeypatch) -> None:
    """--heads is checked before the model loads: a malformed one is its own error, a well-formed one reaches the
    (missing) model."""
    code, _err = cli_outcome(["ablate", "--model", MISSING_MODEL, f"--heads={argument(spec)}"], capsys, monkeypatch)
    assert code == 2


# ---------------------------------------------------------------------------------------------------------------
# thresholds, exports, --max-increase, number lists


@given(items=st.lists(inputs(["induction=0.3", "sink=0.5", "previous_token=1e-3", "positional=-1"]), max_size=4))
def test_thresholds_parse_or_refuse(items: list[str]) -> None:
    parsed = valid_or_refused(lambda: parse_thresholds(items))
    if not isinstance(parsed, ProbeError):
        assert all(math.isfinite(value) for value in parsed.values()) and len(parsed) == len(items)


@given(thresholds=st.dictionaries(st.sampled_from(["induction", "sink", "previous_token", "positional"]),
                                  st.floats(allow_nan=False, allow_infinity=False)))
def test_thresholds_round_trip(thresholds: dict[str, float]) -> None:
    assert parse_thresholds([f"{name}={value!r}" for name, value in thresholds.items()]) == thresholds


@CLI
@given(items=st.lists(inputs(["induction=0.3", "sink=0.5"]), min_size=1, max_size=3))
def test_thresholds_on_the_command_line(items: list[str], capsys, monkeypatch) -> None:
    args = [f"--threshold={argument(item)}" for item in items]
    cli_outcome(["classify", "--model", MISSING_MODEL, *args], capsys, monkeypatch)


@given(items=st.lists(inputs(["duo:maps/x", "razor:r.json", "headkv:h.json"]), max_size=4))
def test_exports_parse_or_refuse(items: list[str]) -> None:
    parsed = valid_or_refused(lambda: parse_exports(items))
    assert isinstance(parsed, ProbeError) or len(parsed) == len(items)


@given(exports=st.dictionaries(st.sampled_from(["duo", "razor", "headkv"]),
                               st.text(min_size=1).filter(lambda text: "\x00" not in text)))
def test_exports_round_trip(exports: dict[str, str]) -> None:
    assert parse_exports([f"{kind}:{path}" for kind, path in exports.items()]) == {
        kind: Path(path) for kind, path in exports.items()}


@CLI
@given(items=st.lists(inputs(["duo:maps/x", "razor:r.json"]), min_size=1, max_size=3),
       lengths=inputs(["1024", "512,2048"]), seeds=inputs(["0,1,2"]))
def test_kv_heads_options_on_the_command_line(items: list[str], lengths: str, seeds: str, capsys,
                                              monkeypatch) -> None:
    args = [f"--export={argument(item)}" for item in items]
    cli_outcome(["kv-heads", "--model", MISSING_MODEL, *args, f"--lengths={argument(lengths)}",
                 f"--random-seeds={argument(seeds)}"], capsys, monkeypatch)


MAX_INCREASES = ["5%", "0.2", "0", "100%"]


@given(text=inputs(MAX_INCREASES))
def test_max_increase_parses_or_refuses(text: str) -> None:
    parsed = valid_or_refused(lambda: parse_max_increase(text))
    if not isinstance(parsed, ProbeError):
        assert math.isfinite(parsed[0]) and parsed[0] >= 0
        assert parse_max_increase(f"{parsed[0] * 100!r}%" if parsed[1] else repr(parsed[0])) == parsed


@CLI
@given(text=inputs(MAX_INCREASES))
def test_max_increase_on_the_command_line(text: str, capsys, monkeypatch) -> None:
    cli_outcome(["prune", "--model", MISSING_MODEL, f"--max-increase={argument(text)}"], capsys, monkeypatch)


# ---------------------------------------------------------------------------------------------------------------
# model specs and device maps


@given(spec=inputs([PLANTED, "smollm2x", "org/name", "model.gguf", "tests", "tests/planted.py",
                    "tests/planted.py:planted_mha", "./folder", "a.py:f"]))
def test_model_specs_load_or_refuse(spec: str, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # a hub id is looked up in the cache
    monkeypatch.chdir(TESTS.parent)
    loaded = valid_or_refused(lambda: load_model(spec))
    assert isinstance(loaded, (ProbeError, LoadedModel))


@CLI
@given(spec=inputs(["org/name", "model.gguf", "a.py:f", "tests", "smollm3"]))
def test_model_specs_on_the_command_line(spec: str, capsys, monkeypatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cli_outcome(["classify", f"--model={argument(spec)}", "--num-seqs", "1", "--seq-len", "8"], capsys, monkeypatch)


DEVICE_MAPS = ['{"": "cpu"}', '{"model.layers.0": 0, "lm_head": "cpu"}', "auto", '{"a": "disk"}', "{}", "[1]"]


DEVICE_MAP_INPUTS = inputs(DEVICE_MAPS) | st.builds(json.dumps, st.dictionaries(st.text(max_size=5), st.integers()
                                                                                 | st.text(max_size=6)))


@given(spec=DEVICE_MAP_INPUTS)
def test_device_maps_parse_or_refuse(spec: str) -> None:
    parsed = valid_or_refused(lambda: parse_device_map(spec))
    if isinstance(parsed, dict):
        assert parse_device_map(json.dumps(parsed)) == parsed  # round trip


@CLI
@given(spec=DEVICE_MAP_INPUTS)
def test_device_maps_on_the_command_line(spec: str, capsys, monkeypatch) -> None:
    cli_outcome(["classify", "--model", MISSING_MODEL, f"--device-map={argument(spec)}"], capsys, monkeypatch)


# ---------------------------------------------------------------------------------------------------------------
# text files, task files, pairs files (encoder-decoder and clean/corrupt), CoNLL-U

TEXT_LINES = ["go home now", "walking slowly", "The cat sat on the mat.", "", " \t ", "é\U0001f600"]


@given(data=file_bytes(inputs(TEXT_LINES)))
def test_text_files_read_or_refuse(data: bytes, tmp_path: Path, worded: LoadedModel) -> None:
    path = write(tmp_path / "text.txt", data)
    text = valid_or_refused(lambda: read_text_file(path, parameter="file"))
    as_read = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")  # universal newlines
    assert isinstance(text, ProbeError) or text == as_read
    valid_or_refused(lambda: natural_set(worded, data=path, seq_len=4, num_seqs=2))


@CLI
@given(data=file_bytes(inputs(TEXT_LINES)))
def test_text_files_on_the_command_line(data: bytes, tmp_path: Path, capsys, monkeypatch) -> None:
    path = write(tmp_path / "text.txt", data)
    cli_outcome(["heatmap", "--model", MISSING_MODEL, "--file", str(path), "--html", str(tmp_path / "out.html"),
                 "--force"], capsys, monkeypatch)


TASK_ROWS = [{"sentence_good": "go home now", "sentence_bad": "go home fast"},
             {"prompt": "go home", "answer": " now", "distractor": " fast"}]
TASK_LINES = st.one_of(st.sampled_from([json.dumps(row) for row in TASK_ROWS]), json_variant(TASK_ROWS))


@given(data=file_bytes(TASK_LINES))
def test_task_files_read_or_refuse(data: bytes, tmp_path: Path, worded: LoadedModel) -> None:
    path = write(tmp_path / "task.jsonl", data)
    items = valid_or_refused(lambda: read_task_file(path))
    if not isinstance(items, ProbeError):
        assert items and all(isinstance(item.good, str) and item.good for item in items)
        probe_set = valid_or_refused(lambda: task_set(worded, path))
        assert isinstance(probe_set, ProbeError) or probe_set.input_ids.shape[0] == 2 * len(items)


@CLI
@given(data=file_bytes(TASK_LINES))
def test_task_files_on_the_command_line(data: bytes, tmp_path: Path, capsys, monkeypatch) -> None:
    path = write(tmp_path / "task.jsonl", data)
    cli_outcome(["ablate", "--model", MISSING_MODEL, "--task", str(path)], capsys, monkeypatch)


PAIR_ROWS = [{"source": "go home now", "target": "run fast"}, {"source": "sing", "target": "walk slowly today"}]


@given(data=file_bytes(st.one_of(st.sampled_from([json.dumps(row) for row in PAIR_ROWS]), json_variant(PAIR_ROWS))))
def test_encoder_decoder_pairs_read_or_refuse(data: bytes, tmp_path: Path, t5: LoadedModel) -> None:
    path = write(tmp_path / "pairs.jsonl", data)
    probe_set = valid_or_refused(lambda: read_pairs(t5, path))
    if not isinstance(probe_set, ProbeError):
        assert probe_set.source_ids.shape[0] == probe_set.input_ids.shape[0] >= 1


CONTRAST_ROWS = [{"clean": "go home", "corrupt": "run home", "answer": " now", "distractor": " fast"},
                 {"clean": "sing slowly", "corrupt": "walk slowly", "answer": " here", "distractor": " there"}]
CONTRAST_LINES = st.one_of(st.sampled_from([json.dumps(row) for row in CONTRAST_ROWS]), json_variant(CONTRAST_ROWS))


@given(data=file_bytes(CONTRAST_LINES))
def test_contrast_pairs_read_or_refuse(data: bytes, tmp_path: Path, worded: LoadedModel) -> None:
    path = write(tmp_path / "contrast.jsonl", data)
    pairs = valid_or_refused(lambda: read_contrast_pairs(worded, path))
    if not isinstance(pairs, ProbeError):
        assert len(pairs) >= 1 and pairs.clean.shape == pairs.corrupt.shape


LABEL_ROWS = [{"text": "go home now", "label": 1}, {"text": "sing", "label": "verb", "text_pair": "walk slowly"}]


@given(data=file_bytes(st.one_of(st.sampled_from([json.dumps(row) for row in LABEL_ROWS]),
                                 json_variant(LABEL_ROWS))))
def test_labels_files_read_or_refuse(data: bytes, tmp_path: Path) -> None:
    path = write(tmp_path / "labels.jsonl", data)
    rows = valid_or_refused(lambda: read_labelled(path))
    assert isinstance(rows, ProbeError) or all(row.text.strip() and not isinstance(row.label, bool) for row in rows)


@given(rows=st.lists(st.fixed_dictionaries({"text": st.text(min_size=1).filter(str.strip),
                                            "label": st.integers() | st.text()}), min_size=1, max_size=5))
def test_labels_files_round_trip(rows: list[dict], tmp_path: Path) -> None:
    lines = "\n".join(json.dumps(row) for row in rows)
    read = read_labelled(write(tmp_path / "labels.jsonl", lines.encode("utf-8", "surrogatepass")))
    assert [(row.text, row.label) for row in read] == [(row["text"], row["label"]) for row in rows]


CONLLU = ["# text = go home now", "1\tgo\tgo\tVERB\t_\t_\t0\troot\t_\t_", "2\thome\thome\tNOUN\t_\t_\t1\tobj\t_\t_",
          "3\tnow\tnow\tADV\t_\t_\t1\tadvmod\t_\tSpaceAfter=No", "1-2\tdon't\t_\t_\t_\t_\t_\t_\t_\t_",
          "2.1\tx\t_\t_\t_\t_\t_\t_\t_\t_", ""]


@given(data=file_bytes(inputs(CONLLU), max_lines=12))
def test_conllu_files_read_or_refuse(data: bytes, tmp_path: Path) -> None:
    path = write(tmp_path / "parses.conllu", data)
    sentences = valid_or_refused(lambda: read_conllu(path))
    if not isinstance(sentences, ProbeError):
        for sentence in sentences:
            assert all(-1 <= head < len(sentence.words) for head in sentence.heads)
            assert all(sentence.text[start:end] == word for word, (start, end) in zip(sentence.words, sentence.spans))


@given(trees=st.lists(st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(["obj", "advmod", "nsubj"]),
                                         st.booleans()), min_size=1, max_size=6), min_size=1, max_size=3),
       data=st.data())
def test_conllu_round_trip(trees: list, data: st.DataObject, tmp_path: Path) -> None:
    """Sentences written as CoNLL-U read back as the same words, heads, relations and text."""
    lines, expected = [], []
    for words in trees:
        heads = [data.draw(st.integers(0, len(words))) for _ in words]
        for index, ((word, relation, space), head) in enumerate(zip(words, heads), start=1):
            lines.append(f"{index}\t{word}\t_\t_\t_\t_\t{head}\t{relation}\t_\t{'_' if space else 'SpaceAfter=No'}")
        lines.append("")
        expected.append(([word for word, _, _ in words], [head - 1 if head else -1 for head in heads],
                         [relation for _, relation, _ in words]))
    sentences = read_conllu(write(tmp_path / "round.conllu", "\n".join(lines).encode()))
    assert [(s.words, s.heads, s.relations) for s in sentences] == expected


@CLI
@given(data=file_bytes(inputs(CONLLU), max_lines=12))
def test_conllu_files_on_the_command_line(data: bytes, tmp_path: Path, capsys, monkeypatch) -> None:
    path = write(tmp_path / "parses.conllu", data)
    cli_outcome(["classify", "--model", MISSING_MODEL, "--conllu", str(path)], capsys, monkeypatch)


# ---------------------------------------------------------------------------------------------------------------
# results streams (--resume), their shards under torchrun, and patching's (the same stream)


@pytest.fixture(scope="module")
def stream_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real results stream: a sweep of a tiny llama's heads alone and two together, as `--results` writes it."""
    loaded = tiny_loaded("llama_gqa")
    path = tmp_path_factory.mktemp("stream") / "sweep.jsonl"
    sweep(loaded, repeated_set(loaded, num_seqs=2, repeat_len=6), [(0, 0), (0, 3), (1, 2)],
          groups=[[(0, 1), (1, 2)]], results_path=path, batch_size=2)
    return path


def stream_lines(path: Path) -> st.SearchStrategy[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    return st.one_of(st.sampled_from(lines), json_variant(rows))


def comparable(entries: list[HeadResult]) -> list[str]:
    return [json.dumps(entry.to_dict(), sort_keys=True) for entry in entries]  # NaN equals NaN as text


@given(data=st.data())
def test_results_streams_read_or_refuse(data: st.DataObject, stream_file: Path, tmp_path: Path) -> None:
    path = write(tmp_path / "sweep.jsonl", data.draw(file_bytes(stream_lines(stream_file), max_lines=8)))
    read = valid_or_refused(lambda: read_results(path))
    if not isinstance(read, ProbeError):
        header, entries = read
        for entry in entries:
            assert entry.heads and all(0 <= layer < header["n_layers"] and 0 <= head < header["n_heads"]
                                       for layer, head in entry.heads)
            assert isinstance(entry.loss, float) and isinstance(entry.delta, float)
        valid_or_refused(lambda: load_results(path, path))


@given(cut=st.integers(min_value=0))
def test_a_results_stream_cut_anywhere_reads_a_prefix_or_is_refused(cut: int, stream_file: Path,
                                                                     tmp_path: Path) -> None:
    """What a SIGKILL mid-write leaves: any first bytes of a stream read as its header and its first entries, or are
    refused in one line; never other entries, never other numbers."""
    whole = stream_file.read_bytes()
    path = write(tmp_path / "cut.jsonl", whole[:cut % (len(whole) + 1)])
    header, entries = read_results(stream_file)
    read = valid_or_refused(lambda: read_results(path))
    if not isinstance(read, ProbeError):
        assert read[0] == header
        assert comparable(read[1]) == comparable(entries[:len(read[1])])


FLOATS = st.floats(allow_nan=True, allow_infinity=True)


@given(entries=st.lists(st.builds(
    HeadResult, st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3)), min_size=1, max_size=3, unique=True)
    .map(tuple), FLOATS, FLOATS, st.dictionaries(st.sampled_from(["first_repeat", "second_repeat"]), FLOATS)),
    max_size=6))
def test_results_streams_round_trip(entries: list[HeadResult], stream_file: Path, tmp_path: Path) -> None:
    """A stream written and read back gives the same ablations and numbers (NaN and infinity included)."""
    for entry in entries:
        entry.part_deltas = {name: value - 1 for name, value in entry.parts.items()}
    header, _ = read_results(stream_file)
    write_stream(tmp_path / "round.jsonl", header, entries)
    read_header, read = read_results(tmp_path / "round.jsonl")
    assert read_header == header and comparable(read) == comparable(entries)


@given(suffixes=st.lists(inputs(["0", "1", "12"]).filter(lambda text: "/" not in text and "\x00" not in text
                                                         and len(text.encode("utf-8", "surrogatepass")) < 200
                                                         and text not in (".", "..")), max_size=4))
def test_shard_files_are_found_by_their_rank_only(suffixes: list[str], tmp_path: Path) -> None:
    """A shard is `<results>.shard-<rank>`, rank in ASCII digits: `.shard-²` (str.isdigit, not int) and
    `.shard-١` (an Arabic-Indic one, int() reads 1) are other files."""
    folder = Path(tempfile.mkdtemp(dir=tmp_path))
    results = folder / "sweep.jsonl"
    for suffix in suffixes:
        with contextlib.suppress(OSError, UnicodeEncodeError):  # a name this file system refuses is no shard
            (folder / f"sweep.jsonl.shard-{suffix}").write_text("")
    found = shard_paths(results)
    assert all(path.name.rpartition(".shard-")[2].isascii() for path in found)
    assert [int(path.name.rpartition(".shard-")[2]) for path in found] == sorted(
        int(path.name.rpartition(".shard-")[2]) for path in found)


@pytest.fixture(scope="module")
def cli_stream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stream that `probe ablate` below writes for the planted model, finished."""
    path = tmp_path_factory.mktemp("cli") / "sweep.jsonl"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.argv", ["probe", "-q", "ablate", *RESUMED, "--results", str(path)])
        with contextlib.suppress(SystemExit):
            main()
    return path


RESUMED = ["--model", PLANTED, "--data", "repeated", "--num-seqs", "1", "--repeat-len", "4", "--heads", "0.*,1.1"]


@settings(max_examples=max(5, settings().max_examples // 20))  # a sweep of the planted model each (10,000: 500)
@given(data=st.data())
def test_results_streams_on_the_command_line(data: st.DataObject, cli_stream: Path, tmp_path: Path, capsys,
                                             monkeypatch) -> None:
    """`--resume` on a damaged stream of the same sweep: it continues (exit 0, every head reported) or refuses in
    one line."""
    path = write(tmp_path / "sweep.jsonl", data.draw(file_bytes(stream_lines(cli_stream), max_lines=8)))
    code, _ = cli_outcome(["ablate", *RESUMED, "--results", str(path), "--resume", "--json",
                           str(tmp_path / "out.json"), "--force"], capsys, monkeypatch)
    if code == 0:
        assert len(json.loads((tmp_path / "out.json").read_text())["heads"]) == 5


@settings(max_examples=max(5, settings().max_examples // 20))  # the t5 folder loads on each
@given(data=file_bytes(st.one_of(st.sampled_from([json.dumps(row) for row in PAIR_ROWS]), json_variant(PAIR_ROWS))))
def test_encoder_decoder_pairs_on_the_command_line(data: bytes, t5_folder: Path, tmp_path: Path, capsys,
                                                   monkeypatch) -> None:
    path = write(tmp_path / "pairs.jsonl", data)
    cli_outcome(["ablate", "--model", str(t5_folder), "--seq2seq", str(path), "--heads", "x0.1", "--results",
                 str(tmp_path / "r.jsonl"), "--force"], capsys, monkeypatch)


@settings(max_examples=max(5, settings().max_examples // 5))
@given(data=file_bytes(CONTRAST_LINES))
def test_contrast_pairs_on_the_command_line(data: bytes, tmp_path: Path, capsys, monkeypatch) -> None:
    path = write(tmp_path / "contrast.jsonl", data)
    cli_outcome(["patch", "--model", f"{TESTS / 'soak_models.py'}:tiny_llama_words", "--pairs", str(path),
                 "--no-classes", "--results", str(tmp_path / "r.jsonl"), "--force"], capsys, monkeypatch)


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny t5 saved as a Hugging Face folder with a word-level tokenizer, as `--model FOLDER` reads it."""
    folder = tmp_path_factory.mktemp("t5") / "model"
    tiny_encoder_decoder("t5").save_pretrained(folder)
    syntax_tokenizer().save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# what the fuzzing found, each failing example kept


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("row", [
    '{"prompt": "go home", "answer": " now", "distractor": ' + deep(100_000) + "}",  # RecursionError
    '{"prompt": "go home", "answer": " now", "distractor": ' + "9" * 5000 + "}",  # ValueError: int too long
    '{"prompt": "go home", "answer": " now", "distractor": " fast", "answer": " here"}',  # the last answer kept
])
def test_found_task_rows_that_are_refused_in_one_line(row: str, tmp_path: Path, worded: LoadedModel) -> None:
    path = write(tmp_path / "task.jsonl", row.encode())
    for read in (lambda: read_task_file(path), lambda: read_contrast_pairs(worded, path),
                 lambda: read_pairs(worded, path)):
        with pytest.raises(ProbeError, match=r"line 1"):
            read()


@pytest.mark.parametrize("line, message", [
    ('{"layer": 1.5, "head": 0, "loss": 1.0, "delta": 0.0}', "malformed value"),  # read as layer 1 before
    ('{"layer": true, "head": 0, "loss": 1.0, "delta": 0.0}', "malformed value"),
    ('{"layer": 0, "head": 0, "loss": "2", "delta": 0.0}', "malformed value"),
    ('{"heads": [], "loss": 1.0, "delta": 0.0}', "names no head"),
    ('{"layer": 7, "head": 0, "loss": 1.0, "delta": 0.0}', "not one of the sweep's"),
    ('{"layer": 0, "head": 0, "loss": 1.0, "delta": 0.0, "first_repeat_loss": "x"}', "malformed value"),
    ('{"layer": 0, "head": 0, "loss": 1.0, "delta": 0.0, "layer": 1}', "line 2 is not JSON"),
])
def test_found_results_entries_that_are_refused(line: str, message: str, stream_file: Path, tmp_path: Path) -> None:
    header = stream_file.read_text().splitlines()[0]
    path = write(tmp_path / "sweep.jsonl", f"{header}\n{line}\n{header}\n".encode())
    with pytest.raises(ProbeError, match=message):
        read_results(path)


@pytest.mark.parametrize("change", [{"probe_ablation": True}, {"baseline_loss": None}, {"fingerprint": 3},
                                    {"n_heads": 0}])
def test_found_results_headers_that_are_refused(change: dict, stream_file: Path, tmp_path: Path) -> None:
    """A header without what resuming reads was a KeyError (exit 1) at resume; now one line before."""
    lines = stream_file.read_text().splitlines()
    path = write(tmp_path / "sweep.jsonl", "\n".join([json.dumps({**json.loads(lines[0]), **change}),
                                                      *lines[1:]]).encode())
    with pytest.raises(ProbeError, match="results"):
        load_results(path)


def test_found_inputs_given_twice_are_refused() -> None:
    with pytest.raises(ProbeError, match="given twice"):
        parse_thresholds(["induction=0.3", "induction=0.5"])
    with pytest.raises(ProbeError, match="NAME=VALUE"):
        parse_thresholds(["=0"])
    with pytest.raises(ProbeError, match="given twice"):
        parse_exports(["duo:a", "duo:b"])


def test_found_names_too_long_and_files_not_utf8(tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match="device_map"):
        parse_device_map("0" * 256)  # OSError: File name too long, from Path.is_file
    with pytest.raises(ProbeError, match="not found"):
        read_task_file("x" * 300)
    (tmp_path / "map.json").write_bytes(b'{"": "cpu\xff"}')
    with pytest.raises(ProbeError, match="UTF-8"):
        parse_device_map(str(tmp_path / "map.json"))


def test_found_a_shard_suffix_int_cannot_read(tmp_path: Path) -> None:
    for suffix in ("²", "١", "3"):
        (tmp_path / f"sweep.jsonl.shard-{suffix}").write_text("")
    assert [path.name for path in shard_paths(tmp_path / "sweep.jsonl")] == ["sweep.jsonl.shard-3"]


def test_found_a_newline_in_a_spec_makes_one_error_line(capsys, monkeypatch) -> None:
    code, err = cli_outcome(["classify", "--model", "a\nb.py:f"], capsys, monkeypatch)
    assert code == 2 and "a\\nb.py" in err and len(err.strip().splitlines()) == 1


def test_found_argv_bytes_not_utf8_quoted_in_an_error_make_one_error_line(capsys, monkeypatch) -> None:
    """The hub's error quotes the repo id as it is: its lone surrogate raised UnicodeEncodeError on a stream of strict
    UTF-8 (pytest's), and the line rich kept raised again at every later command (the long profile, 10,000)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, err = cli_outcome(["classify", "--model=org/na\udc80me", "--num-seqs", "1", "--seq-len", "8"], capsys,
                            monkeypatch)
    assert code == 2 and "'org/na\\udc80me'" in err and len(err.strip().splitlines()) == 1
    code, err = cli_outcome(["classify", "--model=smollm3"], capsys, monkeypatch)
    assert code == 2 and err.startswith("error: unknown model 'smollm3'") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("line, message", [
    ("²\tgo\t_\t_\t_\t_\t0\troot\t_\t_", "word ID '²'"),  # str.isdigit: True; int(): ValueError
    ("1\tgo\t_\t_\t_\t_\t²\troot\t_\t_", "HEAD must be"),
])
def test_found_conllu_numbers_int_cannot_read(line: str, message: str, tmp_path: Path) -> None:
    with pytest.raises(ProbeError, match=message):
        read_conllu(write(tmp_path / "parses.conllu", f"{line}\n\n".encode()))


def test_found_a_conllu_form_ending_in_a_space_keeps_its_span(tmp_path: Path) -> None:
    """The text was stripped of trailing spaces, so the last word's span ran past the text."""
    path = write(tmp_path / "parses.conllu", b"1\tgo\t_\t_\t_\t_\t0\troot\t_\t_\n2\tx \t_\t_\t_\t_\t1\tobj\t_\t_\n\n")
    sentence = read_conllu(path)[0]
    assert sentence.text == "go x " and [sentence.text[a:b] for a, b in sentence.spans] == ["go", "x "]
