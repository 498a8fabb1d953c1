"""The default `probe kv-heads` map on SmolLM2, evaluated independently of probe's window ablation.

    python -m bench.kv_check [--length 1024] [--texts 4] [--prompts 2]

1. The map: `kv_heads(loaded)` with every default (the calibrated budget, sink 64 + recent 256), written as
   `--export duo:DIR` writes it (probe.headmaps.formats.write_map, format duo), into a temporary folder.
2. The evaluation reads only that folder, as DuoAttention does: `np.loadtxt(full_attention_heads.tsv)`, a KV head is
   full where its value is > 0.5, `config.json` gives `sink_size` and `recent_size`. The model then runs through an
   attention function of this file, registered with transformers' AttentionInterface: plain eager attention (q k^T
   scaled, causal mask, softmax, @ v) in which the query heads of every streaming KV head see only the first
   `sink_size` and the `recent_size` latest keys. No probe hook or ablation code runs in the evaluation.
3. On inputs the map never read: natural texts of chunks 10 on (the scores read needle prompts of seed 0, the budget
   chunks 2-3 and seed 2000, the curve chunks 0-1 and seed 1000) and needle prompts of seed 3000. Reported: the loss
   change against the same eager attention without windows, and the needle accuracy (every key token right).

Writes bench/results/kv_check.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface

from bench.common import load_average, machine, now, save_result
from probe.headmaps.formats import duo_config, kv_heads_map, write_map
from probe.inputs import DEFAULT_DEPTHS, NeedleOptions, natural_set, needle_set
from probe.kv import kv_heads, needle_accuracy, text_loss
from probe.models import load_model
from probe.threads import use_threads

STREAMING: dict[str, Any] = {"heads": None, "sink": 0, "recent": 0}  # what the attention function reads


def windowed_eager(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention (b, hq, n, d) -> (b, n, hq, d), causal; the streaming KV heads' query heads see sink + recent
    keys only (STREAMING["heads"]: (layers, kv heads) bool, True = streaming; None = no window anywhere)."""
    b, hq, n, d = query.shape
    group = hq // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * (d ** -0.5 if scaling is None else scaling)
    positions = torch.arange(n)
    allowed = (positions[None, :] <= positions[:, None]).expand(hq, n, n).clone()
    if STREAMING["heads"] is not None:
        streaming = torch.as_tensor(STREAMING["heads"][module.layer_idx]).repeat_interleave(group)  # (hq,)
        window = ((positions[None, :] < STREAMING["sink"])
                  | (positions[None, :] > positions[:, None] - STREAMING["recent"]))
        allowed[streaming] &= window
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def read_duo_map(folder: Path) -> tuple[np.ndarray, int, int]:
    """(streaming (layers, kv heads) bool, sink, recent), as DuoAttention's load_attn_pattern reads the folder."""
    full = np.clip(np.loadtxt(folder / "full_attention_heads.tsv", dtype=float, delimiter="\t"), 0, 1)
    config = json.loads((folder / "config.json").read_text())
    return full <= 0.5, int(config["sink_size"]), int(config["recent_size"])


def evaluate(loaded: Any, texts: torch.Tensor, needles: Any, streaming: np.ndarray | None) -> tuple[float, float]:
    STREAMING["heads"] = streaming
    loss = text_loss(loaded, texts)
    run = needle_accuracy(loaded, needles)
    return loss, sum(run.exact) / max(len(run.exact), 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2)
    args = parser.parse_args()
    use_threads(1)
    loaded = load_model("smollm2")
    started, load_before = now(), load_average()
    texts = natural_set(loaded, seq_len=args.length - 1, num_seqs=10 + args.texts).input_ids[10:]
    needles = needle_set(loaded, NeedleOptions(seed=3000, lengths=(args.length,), depths=DEFAULT_DEPTHS,
                                               prompts=args.prompts))
    plain_loss = text_loss(loaded, texts)  # the model's own attention: the eager function must agree with it
    AttentionInterface.register("kv_check_windowed", windowed_eager)
    original = loaded.model.config._attn_implementation
    loaded.model.set_attn_implementation("kv_check_windowed")
    try:
        base_loss, base_accuracy = evaluate(loaded, texts, needles, None)
    finally:
        loaded.model.set_attn_implementation(original)
    print(f"eager without windows: loss {base_loss:.6f} (the model's own {plain_loss:.6f}), needle {base_accuracy}",
          flush=True)
    timer = time.perf_counter()
    result = kv_heads(loaded, lengths=(args.length,), curve=False)
    map_seconds = time.perf_counter() - timer
    payload = result.to_dict()
    folder = Path(tempfile.mkdtemp(prefix="kv-check-"))
    write_map(kv_heads_map(payload, "duo", "kv_check"), folder, "duo", settings=duo_config(payload))
    streaming, sink, recent = read_duo_map(folder)
    STREAMING.update(sink=sink, recent=recent)
    loaded.model.set_attn_implementation("kv_check_windowed")
    try:
        loss, accuracy = evaluate(loaded, texts, needles, streaming)
    finally:
        loaded.model.set_attn_implementation(original)
    out = {"benchmark": "kv_check", "date": started, "machine": machine(), "load_before": load_before,
           "load_after": load_average(), "command": "python -m bench.kv_check", "length": args.length,
           "map_seconds": round(map_seconds, 1), "budget": payload["budget"], "sink": sink, "recent": recent,
           "streamed": int(streaming.sum()), "total": int(streaming.size),
           "natural_texts": int(texts.shape[0]), "needle_prompts": int(needles.input_ids.shape[0]),
           "plain_loss": round(plain_loss, 6), "baseline_loss": round(base_loss, 6),
           "baseline_needle_accuracy": base_accuracy,
           "loss_change": round(loss - base_loss, 6), "needle_accuracy": accuracy}
    save_result("kv_check", out)
    print(json.dumps({k: v for k, v in out.items() if k not in ("machine", "budget")}, indent=1))


if __name__ == "__main__":
    main()
