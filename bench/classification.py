"""Benchmark 1: classify every head (previous-token, duplicate-token, induction) on 8 x (BOS + 50 random tokens x 2).

Variants, all on the same (8, 101) batch of token ids, timed interleaved in one loop:
- plain: one ordinary forward of the HF model (sdpa attention, logits included): `model(input_ids, use_cache=False)`.
  The baseline every ratio is taken against.
- plain_no_logits: the decoder only (`model.model`), for reference: what a forward costs without the LM head.
- probe: `score_heads` with previous_token, duplicate_token and induction (what `probe classify` runs per set).
- probe_all6: every score probe has (adds sink, next_token, positional) on the same batch.
- tl_fastest: TransformerLens, one batched `run_with_cache` filtered to the `hook_pattern` hooks, then
  `head_detector.detect_head` for the 3 head types and each sequence, given that sequence's slice of the cache.
- tl_documented: `detect_head(model, [8 sequences], name)` for the 3 head types, as its docs show: every call runs
  the model with a full cache, once per sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from bench.common import (have_transformer_lens, interleaved, load_average, machine, now, spearman,
                          transformer_lens_bridge)

NAMES = ["previous_token", "duplicate_token", "induction"]
TL_NAMES = {"previous_token": "previous_token_head", "duplicate_token": "duplicate_token_head",
            "induction": "induction_head"}


def run(repeats: int = 7, log: Any = print, with_tl: bool = True, device: str | None = None,
        dtype: str = "float32") -> dict[str, Any]:
    from probe.inputs import repeated_set
    from probe.heads.classify import score_heads
    from probe.heads.scores import SCORES
    from probe.models import load_model

    loaded = load_model("smollm2", device=device, dtype=dtype)
    model = loaded.model
    probe_set = repeated_set(loaded, repeat_len=50, num_seqs=8, seed=0)
    ids = probe_set.input_ids.to(model.device)
    on_gpu = model.device.type == "cuda"
    if on_gpu:  # TransformerLens' bridge is built on the CPU here; the GPU comparison is probe vs plain only
        with_tl = False

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()
    log(f"bench 1: batch {tuple(ids.shape)}, attention implementation {model.config._attn_implementation}")

    def plain() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        sync()

    def plain_no_logits() -> None:
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
        sync()

    results: dict[str, Any] = {}

    def probe() -> None:
        results["probe"] = score_heads(loaded, probe_set, NAMES, batch_size=8)
        sync()

    def probe_all6() -> None:
        score_heads(loaded, probe_set, [name for name, score in SCORES.items() if score.by_default], batch_size=8)
        sync()

    variants = {"plain": plain, "plain_no_logits": plain_no_logits, "probe": probe, "probe_all6": probe_all6}
    tl_note = None
    if with_tl and have_transformer_lens():
        from transformer_lens.ActivationCache import ActivationCache
        from transformer_lens.head_detector import detect_head

        bridge = transformer_lens_bridge(loaded)
        rows = [ids[i:i + 1] for i in range(ids.shape[0])]

        def tl_fastest() -> None:
            with torch.no_grad():
                _, cache = bridge.run_with_cache(ids, names_filter=lambda name: name.endswith("hook_pattern"))
                scores = {name: [] for name in NAMES}
                for i, row in enumerate(rows):
                    one = ActivationCache({key: value[i] for key, value in cache.items()}, bridge,
                                          has_batch_dim=False)
                    for name in NAMES:
                        scores[name].append(detect_head(bridge, row, TL_NAMES[name], cache=one))
                results["tl"] = {name: torch.stack(values).mean(0) for name, values in scores.items()}

        def tl_documented() -> None:
            with torch.no_grad():
                for name in NAMES:
                    detect_head(bridge, rows, TL_NAMES[name])

        variants["tl_fastest"] = tl_fastest
        variants["tl_documented"] = tl_documented
    else:
        tl_note = "TransformerLens not installed (pip install -e '.[bench]'): its variants were skipped"
    started, load_before = now(), load_average()
    timings = interleaved(variants, "plain", repeats, log=log)
    agreement = {}
    if "tl" in results:  # probe's and TransformerLens' scores rank the heads alike (different definitions)
        for name in NAMES:
            mine = results["probe"][name].flatten().tolist()
            theirs = results["tl"][name].flatten().tolist()
            agreement[name] = spearman(mine, theirs)
    return {
        "benchmark": "classification",
        "date": started,
        "machine": machine(),
        "load_before": load_before,
        "load_after": load_average(),
        "batch": list(ids.shape),
        "device": str(model.device),
        "dtype": str(next(model.parameters()).dtype),
        "repeats": repeats,
        "timings": timings.to_dict(),
        "spearman_probe_vs_tl": agreement,
        "note": tl_note,
    }
