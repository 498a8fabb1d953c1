"""HeadVis's six metrics (probe.headvis): each against a direct computation from the model's own eager attention
weights on a padded batch, through the CPU backend, the Triton kernel (Triton's interpreter) and the blocked path; the
row moments equal to those of whole rows; the JSON, the Neuronpedia JSON and the HeadVis data tree read back."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first decorated: the Triton path runs on CPU tensors

import jsonschema
import pytest
import torch
from conftest import tiny_loaded
from test_capture import eager_reference

from probe.headvis import METRICS, head_metrics
from probe.headvis.metrics import induction_pairs
from probe.inputs import ProbeSet
from probe.kernels import DEFAULT_CONFIG, AttentionCall, CpuBackend, CudaBackend, using_backend
from probe.kernels.cpu import cpu_statistics
from probe.kernels.moments import row_moments
from probe.reports.files import write_json
from probe.schemas import SCHEMAS, header

LENGTHS = [24, 17, 1, 24, 9]  # one sequence of one token: not counted (HeadVis's sequences have two at least)


def padded_set(vocab: int = 12) -> ProbeSet:
    """Right-padded random text from a small vocabulary, so that tokens repeat (induction pairs)."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        mask[row, :length] = 1
    return ProbeSet("natural", "random tokens", ids.masked_fill(mask == 0, 0), 0, mask)


def direct_metrics(attentions: tuple[torch.Tensor, ...], ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """The six metrics from whole eager weights, one sequence and query at a time, as the definitions read."""
    sums = {name: torch.zeros(len(attentions), attentions[0].shape[1], dtype=torch.float64) for name in METRICS}
    positions = previous = repeated = 0
    for row, length in enumerate(mask.sum(dim=1).tolist()):
        if length < 2:
            continue
        tokens = ids[row, :length].tolist()
        positions, previous = positions + length, previous + length - 1
        repeated += sum(1 for i in range(length) if tokens[i] in tokens[:i])
        for layer, attention in enumerate(attentions):
            a = attention[row, :, :length, :length].double()  # (h, L, L)
            distance = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).abs().double()
            sums["self_attention_score"][layer] += a.diagonal(dim1=-2, dim2=-1).sum(-1)
            sums["prev_token_score"][layer] += a.diagonal(-1, dim1=-2, dim2=-1).sum(-1)
            sums["pattern_entropy"][layer] -= (a * a.clamp_min(torch.finfo(torch.float32).tiny).log()).sum((-2, -1))
            sums["qk_distance"][layer] += (a * distance).sum((-2, -1))
            sums["qk_distance_variance"][layer] += (a * distance ** 2).sum((-2, -1))
            for i in range(length):
                for p in range(i):
                    if tokens[p] == tokens[i]:
                        value = a[:, i, p + 1]
                        sums["induction_score"][layer] += torch.where(value < 0.01, 0.0, value)
    out = {name: value / positions for name, value in sums.items()}
    out["prev_token_score"] = sums["prev_token_score"] / previous
    out["qk_distance_variance"] = out["qk_distance_variance"] - out["qk_distance"] ** 2
    out["induction_score"] = sums["induction_score"] / repeated
    return out


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded("llama_gqa")


@pytest.fixture(scope="module")
def eager(loaded) -> dict:
    probe_set = padded_set()
    output = eager_reference(loaded.model, probe_set.input_ids, probe_set.attention_mask)
    return direct_metrics(output.attentions, probe_set.input_ids, probe_set.attention_mask)


@pytest.mark.parametrize("path", ["auto", "blocked"])
def test_each_metric_equals_the_eager_weights(loaded, eager: dict, path: str) -> None:
    with using_backend(CpuBackend()):
        result = head_metrics(loaded, padded_set(), batch_size=2, path=path, samples=0)
    assert result.path == ("cpu" if path == "auto" else "blocked")
    assert result.counts == {"sequences": 4, "queries": 74, "previous": 70,
                             "repeated": result.counts["repeated"]}
    assert result.counts["repeated"] == 36  # 74 tokens, each sequence of at most 12 distinct
    for name in METRICS:
        torch.testing.assert_close(result.metrics[name].double(), eager[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_the_triton_kernel_path_equals_the_eager_weights(loaded, eager: dict) -> None:
    pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernel cannot run")
    with using_backend(CudaBackend()):
        result = head_metrics(loaded, padded_set(), batch_size=5, samples=0)
    assert result.path == "cuda"
    for name in METRICS:
        torch.testing.assert_close(result.metrics[name].double(), eager[name], atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["causal", "key_mask", "window"])
def test_the_kernels_moments_equal_those_rebuilt_from_the_lse(mask: str) -> None:
    pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernel cannot run")
    torch.manual_seed(0)
    query, key, value = torch.randn(2, 4, 70, 16), torch.randn(2, 2, 70, 16), torch.randn(2, 2, 70, 16)
    seen = torch.ones(2, 70, dtype=torch.bool)
    seen[1, 50:] = False
    masks = {"causal": {}, "key_mask": {"key_mask": seen}, "window": {"window": 20}}[mask]
    call = AttentionCall(query, key, value, None, 0.25, True, **masks)
    output, statistics = CudaBackend().run(call, replace(DEFAULT_CONFIG, moments=True))
    rebuilt = row_moments(replace(statistics, moments=None))
    torch.testing.assert_close(statistics.moments[..., :3], rebuilt[..., :3], atol=2e-3, rtol=1e-5)
    torch.testing.assert_close(statistics.moments[..., 1:, 3], rebuilt[..., 1:, 3], atol=1e-5, rtol=1e-5)
    plain_output, plain = CudaBackend().run(call, DEFAULT_CONFIG)
    assert plain.moments is None and torch.equal(plain_output, output)  # asked for only: nothing else changes


def test_induction_read_a_few_queries_at_a_time_is_the_same(loaded, eager: dict, monkeypatch) -> None:
    import probe.headvis.metrics as metrics

    monkeypatch.setattr(metrics, "QUERIES_AT_ONCE", 2)
    with using_backend(CpuBackend()):
        result = head_metrics(loaded, padded_set(), batch_size=5, samples=0)
    torch.testing.assert_close(result.metrics["induction_score"].double(), eager["induction_score"], atol=1e-5,
                               rtol=0)


def test_occurrence_groups_hold_each_repeated_token_once() -> None:
    from probe.headvis.metrics import occurrence_groups

    found = occurrence_groups(torch.tensor([5, 7, 5, 5, 7, 9]))
    rows = sorted(tuple(row[kept].tolist()) for positions, real in found for row, kept in zip(positions, real))
    assert rows == [(0, 2, 3), (1, 4)] and [positions.shape[1] for positions, _ in found] == [2, 4]


def test_fused_equals_blocked(loaded) -> None:
    with using_backend(CpuBackend()):
        fused = head_metrics(loaded, padded_set(), batch_size=3, samples=0)
    blocked = head_metrics(loaded, padded_set(), batch_size=3, path="blocked", samples=0)
    for name in METRICS:
        torch.testing.assert_close(fused.metrics[name], blocked.metrics[name], atol=1e-5, rtol=0, msg=name)
    torch.testing.assert_close(fused.max_activation, blocked.max_activation, atol=1e-6, rtol=0)


def whole_row_moments(query, key, scaling: float) -> torch.Tensor:
    """The moments of causal rows from the whole logits."""
    n = query.shape[2]
    key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    logits = (query @ key.transpose(-1, -2) * scaling).masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    weights = logits.softmax(dim=-1)
    distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().float()
    return torch.stack([torch.where(weights > 0, weights * logits, 0.0).sum(-1), (weights * distance).sum(-1),
                        (weights * distance ** 2).sum(-1), logits[..., 1:].amax(-1)], dim=-1)


def test_row_moments_equal_whole_rows_in_chunks() -> None:
    torch.manual_seed(0)
    query, key = torch.randn(2, 4, 300, 16), torch.randn(2, 2, 300, 16)
    lse = torch.logsumexp((query @ key.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.25).masked_fill(
        torch.ones(300, 300).triu(1).bool(), float("-inf")), dim=-1)
    statistics = cpu_statistics(query, key, None, 0.25, True, lse, replace(DEFAULT_CONFIG, row_chunk=64,
                                                                           row_logits=1))
    moments = row_moments(statistics)
    expected = whole_row_moments(query, key, 0.25)
    torch.testing.assert_close(moments[..., :3], expected[..., :3], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(moments[1:, :, 1:, 3], expected[1:, :, 1:, 3])


def test_moments_are_computed_only_where_asked(loaded) -> None:
    from probe.hooks.capture import attention_hooks

    seen = []
    with torch.no_grad(), using_backend(CpuBackend()), attention_hooks(
            loaded.model, {"lse": lambda statistics, ctx: seen.append(statistics.moments)}):
        loaded.model(torch.tensor([[1, 2, 3, 1, 2]]))
    assert seen and all(moments is None for moments in seen)


def test_induction_pairs_count_every_earlier_occurrence() -> None:
    queries, keys, repeated = induction_pairs([5, 7, 5, 5, 7])
    assert list(zip(queries.tolist(), keys.tolist())) == [(2, 1), (3, 1), (3, 3), (4, 2)]
    assert repeated == 3


def test_the_json_validates_against_its_schema(loaded, tmp_path) -> None:
    with using_backend(CpuBackend()):
        result = head_metrics(loaded, padded_set(), batch_size=5, samples=2)
    payload = result.to_dict()
    written = write_json(tmp_path / "headvis.json", payload, schema=header("headvis"))
    jsonschema.Draft202012Validator(SCHEMAS["headvis"].schema()).validate(json.loads(written.read_text()))
    assert len(payload["heads"]) == 2 * 4 and set(METRICS) <= set(payload["heads"][0])
    assert all(math.isfinite(value) for entry in payload["heads"] for key, value in entry.items() if key in METRICS)
    assert len(result.to_frame()) == 8


FRONTEND_CONFIG = {"model_name", "np_model_id", "dataset_name", "heads", "n_layers", "n_heads", "n_intervals",
                   "metrics", "metric_descriptions", "head_data_pattern", "has_umap", "umap_heads", "custom_plots",
                   "custom_tables", "statistics_display", "pipeline_config"}
"""config.json's keys, as Neuronpedia's pipeline writes them for the HeadVis frontend."""
HEAD_FILE = {"sequences", "qk_distance_histogram", "top_query_tokens", "top_key_tokens", "histogram", "statistics"}
SEQUENCE = {"sequence_id", "interval", "tokens", "attention_indices", "attention_values", "seq_len",
            "max_activation"}


def test_the_command_writes_every_format_and_they_read_back(tmp_path, capsys, monkeypatch) -> None:
    from conftest import run_cli
    from test_precision import WORDS

    from probe.headmaps import read_map
    from probe.headvis.result import UNITS

    paths = {flag: tmp_path / name for flag, name in (("--json", "h.json"), ("--csv", "h.csv"),
                                                      ("--neuronpedia-json", "np.json"), ("--tree", "tree"))}
    code, out, err = run_cli(["headvis", "--model", WORDS, "--num-seqs", "3", "--seq-len", "24", "--samples", "2",
                              *[item for flag, path in paths.items() for item in (flag, str(path))]],
                             capsys, monkeypatch)
    assert code == 0, err
    payload = json.loads(paths["--json"].read_text())
    jsonschema.Draft202012Validator(SCHEMAS["headvis"].schema()).validate(payload)
    for name in METRICS:
        head_map = read_map(paths["--neuronpedia-json"], score=name)
        assert head_map.unit == UNITS[name] and head_map.format == "neuronpedia-headvis"
        written = [entry[name] for entry in payload["heads"]]  # layer by layer, head by head
        assert head_map.values.flatten().tolist() == pytest.approx(written, abs=1e-6)
    tree_reads_as_the_frontend_expects(paths["--tree"], payload)


def tree_reads_as_the_frontend_expects(root, payload: dict) -> None:
    config = json.loads((root / "config.json").read_text())
    assert set(config) == FRONTEND_CONFIG and config["metrics"] == list(METRICS)
    assert config["heads"] == [[entry["layer"], entry["head"]] for entry in payload["heads"]]
    scatter = json.loads((root / "scatter_data.json").read_text())
    assert [(row["layer"], row["head"]) for row in scatter] == [tuple(head) for head in config["heads"]]
    assert json.loads((root / "server_config.json").read_text()) == {}
    for layer, head in config["heads"]:
        data = json.loads((root / "heads" / config["head_data_pattern"].format(layer=layer, head=head)).read_text())
        assert set(data) == HEAD_FILE
        assert sum(data["histogram"]["bin_values"]) == payload["counts"]["sequences"]
        assert data["statistics"]["n_samples"] == len(data["sequences"]) == 2
        for sequence in data["sequences"]:
            assert set(sequence) == SEQUENCE and sequence["seq_len"] == len(sequence["tokens"])
            assert 1 <= sequence["interval"] <= config["n_intervals"]
            flat = sequence["attention_indices"]
            assert flat == sorted(flat) and all(index % sequence["seq_len"] <= index // sequence["seq_len"]
                                                for index in flat)  # causal: the key never after the query
            assert min(sequence["attention_values"]) >= 0.005
        mass = sum(value for sequence in data["sequences"] for value in sequence["attention_values"])
        assert sum(data["qk_distance_histogram"]["bin_values"]) == pytest.approx(mass, abs=1e-3)
        assert sum(item["weight"] for item in data["top_key_tokens"]) <= mass + 1e-3


def test_sampled_rows_are_the_eager_weights(loaded) -> None:
    from probe.headvis.tree import sparse_record

    probe_set = padded_set()
    with using_backend(CpuBackend()):
        result = head_metrics(loaded, probe_set, batch_size=5, samples=3)
    attentions = eager_reference(loaded.model, probe_set.input_ids, probe_set.attention_mask).attentions
    assert [sample.index for sample in result.samples] == [0, 2, 3]  # valid sequences 0, 1, 3 and 4 of the set
    for sample, row in zip(result.samples, [0, 3, 4]):
        record = sparse_record(sample, 1, 2, 0.005)
        length = record["seq_len"]
        for flat, value in zip(record["attention_indices"], record["attention_values"]):
            assert value == pytest.approx(float(attentions[1][row, 2, flat // length, flat % length]), abs=1e-4)
