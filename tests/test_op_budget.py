"""The operations the CUDA backend's path issues per layer outside its kernels: a fixed budget, the same at every
sequence length. `score_heads` with every default score runs the CUDA backend's code through Triton's interpreter
(TRITON_INTERPRET=1: the kernels on CPU tensors) on a tiny llama, while a TorchDispatchMode counts every aten
operation probe's own code asks for inside the model's forward (views included: each costs a dispatch), except
those inside a Triton launch (the interpreter's copies: on a GPU, the kernel itself) and inside `Batch.memo` (made
once per batch, what every layer then reads). The last forward of a run is counted: the running sums and the labels'
index exist by then, as they do for every forward but the first. On a GPU each operation that is not a view is a
launch, whose fixed cost short inputs pay per layer: their number must not grow with the sequence (row chunks) and
stays small (no per-score additions)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before the kernel is first decorated (probe.kernels.cuda decorates lazily)

import pytest
import torch
from conftest import tiny_loaded
from torch.utils._python_dispatch import TorchDispatchMode

import probe
from probe.heads.classify import score_heads
from probe.heads.scores import SCORES
from probe.inputs import ProbeSet
from probe.kernels import DEFAULT_CONFIG, using_backend
from probe.kernels.cuda import CudaBackend

triton = pytest.importorskip("triton", reason="triton is not installed: the CUDA backend's kernel cannot run")
pytestmark = [pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),  # numpy, on the padding rows
              pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")]  # past n of the interpreter's tiles

PROBE = str(Path(probe.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)
TRITON = str(Path(triton.__file__).resolve().parent)
MEMO = str(Path(PROBE) / "heads" / "scores.py")
DEFAULT = [name for name, score in SCORES.items() if score.by_default]

OPS_PER_LAYER = 64
"""The budget per layer, every default score read from a layer call alone (views included). What it consists of,
measured at 60 (24 of them not views): the attention launch's outputs (3); the label kernel's table of every
diagonal and column the scores declare, and the views of it they read (6); the linear scores (previous token, sink,
induction, duplicate token, next token) in one einsum of that table with the batch's selections (14, mostly views)
and one addition each to their stacked sums and counts (2); sep's column summed over the valid queries (9);
positional's two neighbours counted from the kernel's top keys (6); sep's and positional's sums and counts
reshaped and added (20)."""
PADDED_OPS_PER_LAYER = 72
"""The same with padding, measured at 68.5: besides the above, a second sep column for the batch's second last
position (one more launch of the label kernel). The padding goes to both kernels as each sequence's (kv,) key mask,
read where a key lies: no dense (n, kv) bias is made, nor broadcast per launch."""
PER_LAYER = replace(DEFAULT_CONFIG, group_bytes=0, diagonal_rows=128)  # each layer call read alone, as long inputs
# are; row chunks of 128 where the fast path chunks rows at all (none may be issued per chunk)


class _Count(TorchDispatchMode):
    """Counts the aten operations probe's code asks for inside `model`'s forward, outside Triton and Batch.memo,
    restarting at each forward (the count left is the last forward's)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._counted():
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def _counted(self) -> bool:
        frame, caller, inside = sys._getframe(2), None, False
        while frame is not None:
            name = frame.f_code.co_filename
            if name.startswith(TRITON) or (name == MEMO and frame.f_code.co_name == "memo"):
                return False
            inside = inside or (frame.f_code.co_name == "_call_impl" and frame.f_locals.get("self") is self.model)
            if caller is None and not name.startswith(TORCH) and name != __file__:
                caller = name
            frame = frame.f_back  # type: ignore[assignment]
        return inside and caller is not None and caller.startswith(PROBE)


def _repeated(batch: int, length: int, padded: int) -> ProbeSet:
    """Two batches of `batch` sequences: BOS + R random tokens repeated twice; the last `padded` positions of each
    batch's last sequence are padding."""
    generator = torch.Generator().manual_seed(0)
    half = torch.randint(3, 120, (2 * batch, (length - 1) // 2), generator=generator)
    ids = torch.cat([torch.ones(2 * batch, 1, dtype=torch.long), half, half], dim=1)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[batch - 1::batch, -padded:] = 0
    return ProbeSet("repeated", "random tokens, repeated", ids, 1, attention_mask=mask, repeat_len=half.shape[1])


def _ops_per_layer(batch: int, length: int, padded: int) -> float:
    """The operations per layer of the last forward of score_heads' run (every default score, the CUDA backend)."""
    loaded = tiny_loaded("llama_gqa")
    counting = _Count(loaded.model)
    restart = loaded.model.register_forward_pre_hook(lambda *_: counting.ops.clear())
    try:
        with using_backend(CudaBackend()), counting:
            scores = score_heads(loaded, _repeated(batch, length, padded), DEFAULT, batch_size=batch, path="lse",
                                 config=PER_LAYER)
    finally:
        restart.remove()
    assert scores.path == "cuda"
    return sum(counting.ops.values()) / loaded.model.config.num_hidden_layers


@pytest.mark.slow  # over 10 s on 2 cores
def test_the_cuda_paths_operations_per_layer_are_a_fixed_budget_at_every_length() -> None:
    counts = [_ops_per_layer(1, length, 0) for length in (64, 320)]  # one row chunk, and two and a half
    assert counts[0] == counts[1], counts
    assert counts[0] <= OPS_PER_LAYER, counts


@pytest.mark.slow  # over 10 s on 2 cores
def test_a_padded_batch_costs_a_fixed_budget_too() -> None:
    counts = [_ops_per_layer(2, length, 5) for length in (64, 256)]
    assert counts[0] == counts[1], counts
    assert counts[0] <= PADDED_OPS_PER_LAYER, counts
