"""Whether probe's scoring passes wait for the GPU inside a forward: `torch.cuda.set_sync_debug_mode("error")` while
the model's forward runs, on a second run after a warm-up (Triton compiles). Used by bench/gpu_points.py's sync
point; off CUDA each check says it did not run."""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

@contextmanager
def _sync_errors_inside(model: torch.nn.Module) -> Iterator[None]:
    """`torch.cuda.set_sync_debug_mode("error")` while the model's forward runs (its pre-hook turns it on, an
    always-called forward hook off): what runs after a forward (its one transfer of the results) may wait."""
    def on(*_: Any) -> None:
        torch.cuda.set_sync_debug_mode("error")

    def off(*_: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")

    handles = [model.register_forward_pre_hook(on), model.register_forward_hook(off, always_call=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        off()


def _synchronised(error: BaseException) -> dict[str, Any]:
    """What the sync check says of a forward that waited: the error and where in probe it was asked for."""
    cause = error.__cause__ or error  # the forward's wrapper makes the RuntimeError a ProbeError: read its cause
    frames = [f"{frame.filename.split('/probe/')[-1]}:{frame.lineno} {frame.name}"
              for frame in traceback.extract_tb(cause.__traceback__) if "/probe/" in frame.filename]
    return {"result": "synchronised", "error": str(cause).splitlines()[0], "probe_frames": frames[-4:],
            "last_frame": str(traceback.extract_tb(cause.__traceback__)[-1])}


def sync_check(loaded: Any, probe_set: Any, names: list[str], device: str) -> dict[str, Any]:
    """classify's scoring pass (`score_heads` with the scores `names`, one sequence per batch) once to warm up, then
    again with set_sync_debug_mode("error") inside each forward (a batch's memos are made there and copied to the
    device without waiting; its one transfer of results comes after): "none" and the path the scores took, or the
    first synchronising operation and where in probe it was asked for."""
    if device != "cuda":
        return {"result": "not run: no CUDA device"}
    from probe.heads.classify import score_heads

    score_heads(loaded, probe_set, names, batch_size=1)
    torch.cuda.synchronize()
    try:
        with _sync_errors_inside(loaded.model):
            scores = score_heads(loaded, probe_set, names, batch_size=1)
    except Exception as error:
        return _synchronised(error)
    return {"result": "none", "path": scores.path}


def kv_sync_check(loaded: Any, length: int, device: str) -> dict[str, Any]:
    """kv-heads' scoring pass (`score_needles`, 64 sink + 256 recent keys) on one needle prompt of token ids, once to
    warm up, then with set_sync_debug_mode("error") inside each forward: "none" or where it waited (its one transfer
    of predictions, streaming sums and top keys after the forward may)."""
    if device != "cuda":
        return {"result": "not run: no CUDA device"}
    from probe.inputs import NeedleOptions, needle_set
    from probe.kv import KV_SINK, score_needles

    needles = needle_set(loaded, NeedleOptions(lengths=(length,), depths=(0.5,), seed=7))
    score_needles(loaded, needles, sink=KV_SINK)
    torch.cuda.synchronize()
    try:
        with _sync_errors_inside(loaded.model):
            score_needles(loaded, needles, sink=KV_SINK)
    except Exception as error:
        return _synchronised(error)
    return {"result": "none"}
