"""The checkpoints of a training run in step order (the last number of a name), loaded one at a time: folders by
glob, a hub model's revisions, or state-dict files into a custom model; all checked before the first is scored."""

from __future__ import annotations

import glob
import json
import pickle
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError, first_line
from probe.models import LoadedModel, load_model
from probe.models.custom import is_custom_spec

FOLDERS, REVISIONS, STATE_DICTS = "folders", "revisions", "state_dicts"
ARCHITECTURE_KEYS = ("model_type", "num_hidden_layers", "num_attention_heads", "hidden_size", "n_layer", "n_head",
                     "n_embd", "num_key_value_heads", "vocab_size")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint: its name (folder or file name, or revision), its training step, where it is."""

    name: str
    step: int
    location: str  # a folder, a state-dict file, or a revision


@dataclass(frozen=True)
class Run:
    """The checkpoints of one run in step order; `model` is the hub id (revisions) or the factory (state dicts)."""

    kind: str
    checkpoints: tuple[Checkpoint, ...]
    model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "model": self.model, "checkpoints": [asdict(c) for c in self.checkpoints]}


def step_of(name: str) -> int:
    """The training step a checkpoint's name carries: its last number (`step-10`, `step10.pt`, `ckpt_10000`)."""
    numbers = re.findall(r"\d+", Path(name).stem if name.endswith((".pt", ".pth", ".bin")) else name)
    if not numbers:
        raise ProbeError(f"checkpoint {name!r} has no number in its name to order it by (name them step-N)",
                         parameter="checkpoints")
    return int(numbers[-1])


def ordered(checkpoints: Sequence[Checkpoint]) -> tuple[Checkpoint, ...]:
    """By step; two checkpoints at one step refused (the trajectory would hold the step twice)."""
    result = tuple(sorted(checkpoints, key=lambda c: c.step))
    for before, after in zip(result, result[1:]):
        if before.step == after.step:
            raise ProbeError(f"checkpoints {before.name} and {after.name} both have step {before.step}",
                             parameter="checkpoints")
    return result


def find_run(model: str | None = None, *, checkpoints: str | None = None,
             revisions: str | Sequence[str] | None = None) -> Run:
    """The run the arguments name: a glob of model folders or state dicts (with a custom `model`), or hub revisions."""
    if revisions is not None:
        names = [r.strip() for r in revisions.split(",")] if isinstance(revisions, str) else list(revisions)
        if checkpoints is not None or model is None or not [n for n in names if n]:
            raise ProbeError("revisions need a hub model (model=org/name) and no checkpoints glob",
                             parameter="revisions")
        return Run(REVISIONS, ordered([Checkpoint(n, step_of(n), n) for n in names if n]), model)
    if checkpoints is None:
        raise ProbeError("give the checkpoints: a glob of model folders or state-dict files, or a hub model's "
                         "revisions", parameter="checkpoints")
    paths = [Path(path) for path in glob.glob(checkpoints)]
    if not paths:
        raise ProbeError(f"no checkpoint matches {checkpoints!r}", parameter="checkpoints")
    if model is not None and not is_custom_spec(model):
        raise ProbeError(f"state-dict checkpoints load into a custom model (FILE.py:FUNCTION), not {model}; model "
                         "folders need no model", parameter="model")
    files = [p for p in paths if p.is_file()]
    if model is not None:
        if not files:
            raise ProbeError(f"{checkpoints!r} matches no state-dict file", parameter="checkpoints")
        return Run(STATE_DICTS, ordered([Checkpoint(p.name, step_of(p.name), str(p)) for p in files]), model)
    folders = [p for p in paths if (p / "config.json").is_file()]
    if not folders:
        raise ProbeError(f"{checkpoints!r} matches no model folder (with a config.json); state-dict files need "
                         "model=FILE.py:FUNCTION", parameter="checkpoints")
    return Run(FOLDERS, ordered([Checkpoint(p.name, step_of(p.name), str(p)) for p in folders]))


def _config_of(run: Run, checkpoint: Checkpoint) -> dict[str, Any]:
    if run.kind == FOLDERS:
        return dict(json.loads((Path(checkpoint.location) / "config.json").read_text(encoding="utf-8")))
    from transformers import AutoConfig  # the hub's config only: a few kB per revision, cached

    try:
        return AutoConfig.from_pretrained(str(run.model), revision=checkpoint.location).to_dict()
    except (OSError, ValueError) as error:
        raise ProbeError(f"cannot resolve revision {checkpoint.location!r} of {run.model}: "
                         f"{first_line(error) or type(error).__name__}", parameter="revisions") from error


def read_state_dict(path: str | Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """A state dict read with `weights_only=True`: a pickle that needs code or custom classes is refused in one line."""
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # the legacy format maps no memory
    except pickle.UnpicklingError as error:
        raise ProbeError(f"{path} is not a plain state dict: loading it would run code or build objects that "
                         f"weights_only=True refuses ({first_line(error).split('.')[0]}); save model.state_dict() "
                         "instead", parameter="checkpoints") from error
    except (RuntimeError, OSError, EOFError) as error:
        raise ProbeError(f"cannot read checkpoint {path}: {first_line(error)}", parameter="checkpoints") from error
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ProbeError(f"{path} holds no state dict (a dict of tensors)", parameter="checkpoints")
    return state


def _shapes(state: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in state.items()}


def check_run(run: Run, loaded: LoadedModel | None = None) -> None:
    """Before any scoring: every checkpoint can be found and has one architecture."""
    if run.kind == STATE_DICTS:
        expected = _shapes(loaded.model.state_dict()) if loaded is not None else None
        for checkpoint in run.checkpoints:
            shapes = _shapes(read_state_dict(checkpoint.location, mmap=True))
            if shapes != expected:
                raise ProbeError(_mismatch(checkpoint.name, shapes, expected or {}), parameter="checkpoints")
        return
    first = None
    for checkpoint in run.checkpoints:
        config = _config_of(run, checkpoint)
        architecture = {key: config[key] for key in ARCHITECTURE_KEYS if key in config}
        if first is not None and architecture != first[1]:
            changed = sorted(k for k in set(architecture) | set(first[1]) if architecture.get(k) != first[1].get(k))
            raise ProbeError(f"checkpoints {first[0]} and {checkpoint.name} have different architectures "
                             f"({', '.join(changed)} differ): a run's checkpoints share one", parameter="checkpoints")
        first = first or (checkpoint.name, architecture)


def _mismatch(name: str, shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> str:
    missing, extra = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or extra:
        what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
    else:
        key = next(k for k in expected if expected[k] != shapes[k])
        what = f"{key} is {list(shapes[key])}, the model's {list(expected[key])}"
    return f"checkpoint {name} does not fit the model ({what}): a different architecture"


def load_checkpoints(run: Run, base: LoadedModel | None = None, **options: Any
                     ) -> Iterator[tuple[Checkpoint, LoadedModel]]:
    """Each checkpoint loaded in turn, one in memory at a time; state dicts copied into the one `base` model."""
    if run.kind == STATE_DICTS:
        loaded = base or load_model(str(run.model), **options)
        for checkpoint in run.checkpoints:
            state = read_state_dict(checkpoint.location)
            loaded.model.load_state_dict(state)
            del state
            yield checkpoint, loaded
        return
    for checkpoint in run.checkpoints:
        if run.kind == FOLDERS:
            loaded = load_model(checkpoint.location, **options)
        else:
            loaded = load_model(str(run.model), revision=checkpoint.location, **options)
        yield checkpoint, loaded
        del loaded
