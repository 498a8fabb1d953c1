"""Models spread over devices or partly offloaded to disk through accelerate's device maps: the numbers equal the
run without offloading, and the model is left exactly as it was placed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from probe.hooks.capture import attention_hooks
from probe.hooks.run import logits_of, run_model
from probe.errors import ProbeError
from probe.heads.classify import classify
from probe.hooks.hf import SEAT
from probe.models import input_device, load_model, parse_device_map

PLANTED = str(Path(__file__).parent / "planted.py")
# the embedding and two of four layers on disk: the first parameter of the model is an offloaded placeholder
LLAMA_MAP = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
             "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
             "lm_head": "cpu"}
SMALL = dict(num_seqs=3, seq_len=24, repeat_len=10)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (4 layers, grouped-query attention) saved as a Hugging Face folder."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    folder = tmp_path_factory.mktemp("tiny-llama")
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def offloaded(model: torch.nn.Module) -> list[str]:
    return [name for name, parameter in model.named_parameters() if parameter.device.type == "meta"]


def assert_same_scores(a, b) -> None:
    assert a.scores.keys() == b.scores.keys()
    for name in a.scores:
        assert torch.equal(a.scores[name], b.scores[name]), name


def test_hf_offloaded_to_disk_scores_equal(llama_dir: Path, tmp_path: Path) -> None:
    plain = load_model(str(llama_dir))
    placed = load_model(str(llama_dir), device_map=LLAMA_MAP, offload_folder=tmp_path / "offload")
    assert placed.model.hf_device_map == LLAMA_MAP
    assert "model.embed_tokens.weight" in offloaded(placed.model)  # really on disk, not silently loaded
    assert any(name.startswith("model.layers.1.self_attn") for name in offloaded(placed.model))
    assert input_device(placed.model) == torch.device("cpu")
    assert_same_scores(classify(plain, **SMALL), classify(placed, **SMALL))


def test_hf_offloaded_model_is_restored(llama_dir: Path, tmp_path: Path) -> None:
    placed = load_model(str(llama_dir), device_map=LLAMA_MAP, offload_folder=tmp_path / "offload")
    model = placed.model
    ids = torch.randint(1, 120, (2, 9))
    with torch.no_grad():
        before = logits_of(run_model(model, ids))
    implementation = model.config._attn_implementation
    wrapped = {name: module.forward for name, module in model.named_modules() if "_hf_hook" in module.__dict__}
    assert wrapped  # accelerate's hooks are there to be kept
    seen: list[tuple[int, str]] = []

    def halve(heads: torch.Tensor, ctx) -> torch.Tensor:
        seen.append((ctx.layer, heads.device.type))
        return heads * 0.5

    with torch.no_grad(), attention_hooks(model, {"pattern": lambda *a: None, "z": halve}):
        edited = logits_of(run_model(model, ids))
    assert sorted(seen) == [(layer, "cpu") for layer in range(4)]  # offloaded layers ran on the execution device
    assert not torch.equal(edited, before)
    with torch.no_grad():
        after = logits_of(run_model(model, ids))
    assert torch.equal(after, before)
    assert model.config._attn_implementation == implementation
    assert not any(SEAT in module.__dict__ for module in model.modules())
    assert {name: module.forward for name, module in model.named_modules()
            if "_hf_hook" in module.__dict__} == wrapped
    assert "model.embed_tokens.weight" in offloaded(model)


def test_hf_auto_with_memory_cap_offloads_and_scores_equal(llama_dir: Path, tmp_path: Path) -> None:
    plain = load_model(str(llama_dir))
    placed = load_model(str(llama_dir), device_map="auto", max_memory={"cpu": 60_000},
                        offload_folder=tmp_path / "offload")
    assert "disk" in placed.model.hf_device_map.values()
    assert offloaded(placed.model)
    assert_same_scores(classify(plain, **SMALL), classify(placed, **SMALL))


@pytest.mark.parametrize("factory", ["planted_textbook", "planted_mha"])
def test_custom_model_offloaded_scores_equal_and_restored(factory: str, tmp_path: Path) -> None:
    spec = f"{PLANTED}:{factory}"
    plain = load_model(spec)
    placed = load_model(spec, device_map={"layers.0": "cpu", "layers.1": "disk"}, offload_folder=tmp_path)
    assert any(name.startswith("layers.1.") for name in offloaded(placed.model))
    attention = placed.model.layers[1].attn if factory == "planted_mha" else placed.model.layers[1]
    forward, old_forward = attention.forward, attention.__dict__["_old_forward"]
    assert_same_scores(classify(plain, **SMALL), classify(placed, **SMALL))
    assert attention.forward is forward and attention.__dict__["_old_forward"] is old_forward
    assert not hasattr(attention, "_probe_hooks")
    ids = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(placed.model, ids)), logits_of(run_model(plain.model, ids)))


def test_custom_model_offload_folder_is_not_reused_across_models(tmp_path: Path) -> None:
    """accelerate would read another model's index.json from a shared folder; each model gets its own."""
    device_map = {"layers.0": "cpu", "layers.1": "disk"}
    first = load_model(f"{PLANTED}:planted_textbook", device_map=device_map, offload_folder=tmp_path)
    second = load_model(f"{PLANTED}:planted_mha", device_map=device_map, offload_folder=tmp_path)
    plain = load_model(f"{PLANTED}:planted_mha")
    ids = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        assert torch.equal(logits_of(run_model(second.model, ids)), logits_of(run_model(plain.model, ids)))
    assert len(list(tmp_path.iterdir())) == 2
    del first


def test_cli_classify_with_device_map_equals_plain(llama_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    common = ["classify", "--model", str(llama_dir), "--num-seqs", "2", "--seq-len", "16", "--repeat-len", "8"]
    code, _, stderr = run_cli([*common, "--json", str(tmp_path / "plain.json")], capsys, monkeypatch)
    assert code == 0, stderr
    map_file = tmp_path / "map.json"
    map_file.write_text(json.dumps(LLAMA_MAP))
    code, _, stderr = run_cli([*common, "--json", str(tmp_path / "placed.json"), "--device-map", str(map_file),
                               "--offload-folder", str(tmp_path / "offload")], capsys, monkeypatch)
    assert code == 0, stderr
    plain = json.loads((tmp_path / "plain.json").read_text())
    placed = json.loads((tmp_path / "placed.json").read_text())
    assert placed["heads"] == plain["heads"]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(device_map={**LLAMA_MAP, "model.layers.9": "cpu"}), "'model.layers.9', which is not a module"),
    (dict(device_map={k: v for k, v in LLAMA_MAP.items() if k != "lm_head"}), "no device to parameter 'lm_head"),
    (dict(device_map="auto", device="cpu"), "device or device_map, not both"),
    (dict(device_map="everywhere"), "use one of auto"),
    (dict(device_map='{"model.layers.0": '), "not valid JSON"),
    (dict(device_map={"": "gpu7"}), "is not a device"),
    (dict(max_memory={"cpu": 1000}), "max_memory only applies"),
])
def test_bad_device_maps_are_one_clear_line(llama_dir: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ProbeError, match=message.replace("(", r"\(").replace("[", r"\[")) as raised:
        load_model(str(llama_dir), **kwargs)
    assert "\n" not in str(raised.value)


def test_custom_disk_map_needs_an_offload_folder() -> None:
    with pytest.raises(ProbeError, match="offload_folder") as raised:
        load_model(f"{PLANTED}:planted_textbook", device_map={"layers.0": "cpu", "layers.1": "disk"})
    assert raised.value.parameter == "offload_folder"
    with pytest.raises(ProbeError, match="'layers.2', which is not a module"):
        load_model(f"{PLANTED}:planted_textbook", device_map={"layers.0": "cpu", "layers.2": "disk"})


def test_cli_bad_device_map(llama_dir: Path, capsys, monkeypatch) -> None:
    code, _, stderr = run_cli(["classify", "--model", str(llama_dir), "--device-map", '{"model.layerz": 0}'],
                              capsys, monkeypatch)
    assert code == 2
    assert stderr.strip().startswith("error: ") and "names 'model.layerz', which is not a module" in stderr
    assert len(stderr.strip().splitlines()) == 1


def test_parse_device_map_forms(tmp_path: Path) -> None:
    assert parse_device_map("balanced") == "balanced"
    assert parse_device_map('{"": 0}') == {"": 0}
    (tmp_path / "map.json").write_text('{"model": "cpu", "lm_head": "disk"}')
    assert parse_device_map(str(tmp_path / "map.json")) == {"model": "cpu", "lm_head": "disk"}
    assert parse_device_map(None) is None


def test_default_model_from_gguf_cache_offloaded(smollm2, tmp_path: Path) -> None:
    """SmolLM2 from its cached GGUF folder, layers 10-19 on disk: the same scores as the model in memory."""
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if 10 <= i < 20 else "cpu" for i in range(30)})
    placed = load_model("smollm2", device_map=device_map, offload_folder=tmp_path)
    assert any(name.startswith("model.layers.15.") for name in offloaded(placed.model))
    options = dict(num_seqs=2, seq_len=32, repeat_len=16, scores=["previous_token", "induction"])
    assert_same_scores(classify(smollm2, **options), classify(placed, **options))


@pytest.mark.parametrize("method", ["zero", "mean"])
def test_ablation_deltas_with_offloading_equal(llama_dir: Path, tmp_path: Path, method: str) -> None:
    from probe.ablation import sweep
    from probe.inputs import repeated_set

    plain = load_model(str(llama_dir))
    placed = load_model(str(llama_dir), device_map=LLAMA_MAP, offload_folder=tmp_path / "offload")
    wrapped = {name: module.forward for name, module in placed.model.named_modules()
               if "_hf_hook" in module.__dict__}
    results = []
    for loaded in (plain, placed):
        probe_set = repeated_set(loaded, repeat_len=8, num_seqs=2, seed=0)
        results.append(sweep(loaded, probe_set, method=method, stack=3))
    one, two = results
    assert two.path.startswith("exact") and one.path == two.path  # the prefix reuse works on offloaded blocks
    assert two.baseline_loss == one.baseline_loss
    assert [(r.heads, r.loss, r.delta, r.parts) for r in two.results] == \
        [(r.heads, r.loss, r.delta, r.parts) for r in one.results]
    assert any(r.delta != 0 for r in two.results)
    assert {name: module.forward for name, module in placed.model.named_modules()
            if "_hf_hook" in module.__dict__} == wrapped
    assert "model.embed_tokens.weight" in offloaded(placed.model)


def test_cli_ablate_custom_model_offloaded_equals_plain(tmp_path: Path, capsys, monkeypatch) -> None:
    common = ["ablate", "--model", f"{PLANTED}:planted_mha", "--data", "repeated", "--num-seqs", "2",
              "--repeat-len", "8"]
    code, _, stderr = run_cli([*common, "--json", str(tmp_path / "plain.json")], capsys, monkeypatch)
    assert code == 0, stderr
    code, _, stderr = run_cli([*common, "--json", str(tmp_path / "placed.json"), "--device-map",
                               '{"layers.0": "disk", "layers.1": "cpu"}', "--offload-folder", str(tmp_path / "off")],
                              capsys, monkeypatch)
    assert code == 0, stderr
    plain = json.loads((tmp_path / "plain.json").read_text())
    placed = json.loads((tmp_path / "placed.json").read_text())
    assert placed["heads"] == plain["heads"] and placed["baseline_loss"] == plain["baseline_loss"]
    assert placed["path"] == plain["path"]


def test_encoder_offloaded_scores_equal(tmp_path: Path) -> None:
    """An encoder loads as AutoModel: the device map is checked against the same module names."""
    import transformers as tf

    torch.manual_seed(0)
    tf.BertModel(tf.BertConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, max_position_embeddings=256)).save_pretrained(tmp_path / "bert")
    device_map = {"embeddings": "cpu", "encoder.layer.0": "disk", "encoder.layer.1": "cpu", "pooler": "cpu"}
    plain = load_model(str(tmp_path / "bert"))
    placed = load_model(str(tmp_path / "bert"), device_map=device_map, offload_folder=tmp_path / "offload")
    assert any(name.startswith("encoder.layer.0.") for name in offloaded(placed.model))
    assert_same_scores(classify(plain, **SMALL), classify(placed, **SMALL))
