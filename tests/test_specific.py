"""Issue 12, "small average, sharp specific": resample ablation, task sets and metrics, per-token effects."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import tiny_loaded
from test_ablate import projection

from probe.ablate import sweep
from probe.ablation.methods import ResampleAblation
from probe.attention import logits_of, run_model
from probe.data import repeated_set


def swapped_loss(model: torch.nn.Module, ids: torch.Tensor, head: tuple[int, int], head_dim: int,
                 donors: torch.Tensor) -> float:
    """Mean next-token loss with `head`'s slice of the output projection's input taken from the donor rows of an
    unablated run: a plain pre-hook, written independently of probe's editor."""
    layer, index = head
    module, _ = projection(model, layer)
    columns = slice(index * head_dim, (index + 1) * head_dim)
    seen: dict[str, torch.Tensor] = {}
    handle = module.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach().clone()))
    with torch.no_grad():
        run_model(model, ids)
    handle.remove()

    def swap(_module, args):
        x = args[0].clone()
        x[..., columns] = seen["x"][donors][..., columns]
        return (x,)

    handle = module.register_forward_pre_hook(swap)
    try:
        with torch.no_grad():
            out = logits_of(run_model(model, ids)).float()
    finally:
        handle.remove()
    return float(F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)))


def test_resample_ablation_equals_a_hand_written_swap() -> None:
    loaded = tiny_loaded("llama_gqa")
    probe_set = repeated_set(loaded, repeat_len=7, num_seqs=4)
    exact = sweep(loaded, probe_set, method="resample", batch_size=4)
    naive = sweep(loaded, probe_set, method="resample", mode="naive", batch_size=4)
    donors = ResampleAblation().donors_of(0, 4)
    assert sorted(donors.tolist()) == [0, 1, 2, 3] and all(int(d) != i for i, d in enumerate(donors))
    assert "donor of each sequence " + " ".join(str(int(d)) for d in donors) in exact.mean
    head_dim = loaded.model.config.hidden_size // loaded.model.config.num_attention_heads
    for mine, reference in zip(exact.results, naive.results):
        expected = swapped_loss(loaded.model, probe_set.input_ids, mine.heads[0], head_dim, donors)
        assert mine.loss == torch.tensor(expected).item() or abs(mine.loss - expected) < 1e-5
        assert abs(reference.loss - expected) < 1e-5
    assert exact.to_dict()["method"] == "resample" and "seed 0" in exact.to_dict()["mean"]
