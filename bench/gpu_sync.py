"""Whether probe's scoring passes wait for the GPU inside a forward: `torch.cuda.set_sync_debug_mode("error")` while
the model's forward runs, after a warm-up (Triton compiles), on a fresh batch. Used by bench/gpu_points.py's sync
point; off CUDA each check says it did not run."""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

class _Reader:
    """An LseHook that hands each layer's statistics to the accumulator (as score_heads' reader does)."""

    def __init__(self, accumulator: Any) -> None:
        self.accumulator, self.config = accumulator, accumulator.config

    def __call__(self, layer: int, attention: Any) -> None:
        self.accumulator(layer, attention)

    def blocked(self, layer: int, reason: str) -> None:
        self.accumulator.blocked(layer, reason)


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


def sync_check(loaded: Any, ids: torch.Tensor, names: list[str], device: str) -> dict[str, Any]:
    """A batch's forward (`ids`: BOS and a half repeated) with the accumulator reading every layer (the scores
    `names`, as score_heads does: the batch's tokens on the host), once to warm up, then with a fresh batch (its
    per-batch memos made inside the forward, copied to the device without waiting) under
    set_sync_debug_mode("error"): "none" or the first synchronising operation and where in probe it was asked for."""
    if device != "cuda":
        return {"result": "not run: no CUDA device"}
    from probe.heads.accumulate import ScoreAccumulator
    from probe.heads.classify import forward
    from probe.heads.scores import Batch
    from probe.hooks.capture import attention_hooks
    from probe.hooks.layers import attention_layers

    length = ids.shape[1]
    layers = attention_layers(loaded.model)
    accumulator = ScoreAccumulator(names, len(layers), max(layer.n_heads for layer in layers))
    with torch.no_grad(), attention_hooks(loaded.model, on_lse=_Reader(accumulator)):
        for attempt in range(2):
            accumulator.batch = Batch(valid=torch.ones_like(ids, dtype=torch.bool), offset=1,
                                      repeat_len=(length - 1) // 2)
            torch.cuda.synchronize()
            try:
                with _sync_errors_inside(loaded.model) if attempt else contextlib.nullcontext():
                    forward(loaded.model, ids, None)
            except Exception as error:
                return _synchronised(error)
    return {"result": "none", "path": accumulator.path()}


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
