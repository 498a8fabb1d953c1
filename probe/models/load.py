"""Turn a model spec (an alias, a folder or hub id, a .gguf file, FILE.py:FUNCTION, a module) into a LoadedModel."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from probe.errors import ProbeError, first_line
from probe.models.outputs import logits_of
from probe.models.aliases import ALIASES, DEFAULT_MODEL, HUB_ALIASES, alias_path, resolve_alias
from probe.models.custom import is_custom_spec, load_custom
from probe.models.gguf import cached_config, load_gguf
from probe.models.parts import input_embeddings
from probe.models.hf import from_pretrained, load_tokenizer
from probe.models.placement import DeviceMap, input_device, parse_device_map, placed
from probe.models.wrapped import WRAPPERS, WrapperKind, holds_bridge_components, unbridged, wrapper_of
from probe.threads import use_threads_unless_chosen

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class ModelOrigin:
    """Where a loaded model came from, what provenance records and what `--resume` compares: `kind` gguf, folder,
    hub, custom or module; `weights`: the files whose bytes identify it (none for a hub id, whose commit does, or
    for code-made weights, whose tensors do)."""

    kind: str
    source: str
    revision: str | None = None
    weights: tuple[str, ...] = ()
    dequantised: bool = False  # a GGUF file's quantised weights turned into floats

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "source": self.source, "revision": self.revision}


def origin_of(spec: str, model: Any) -> ModelOrigin:
    """The origin of what `load_model(spec)` loaded (a spec it accepted)."""
    if spec in ALIASES or spec.endswith(".gguf"):
        path = alias_path(ALIASES[spec]) if spec in ALIASES else Path(spec)
        resolved = str(Path(str(path)).resolve())
        return ModelOrigin("gguf", resolved, weights=(resolved,), dequantised=True)
    if is_custom_spec(spec):
        file, _, function = spec.rpartition(":")
        return ModelOrigin("custom", f"{Path(file).resolve()}:{function}")
    folder = Path(spec)
    if folder.is_dir():
        files = sorted(str(path.resolve()) for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES)
        return ModelOrigin("folder", str(folder.resolve()), weights=tuple(files))
    revision = getattr(getattr(model, "config", None), "_commit_hash", None)
    return ModelOrigin("hub", spec, revision=revision if isinstance(revision, str) else None)


@dataclass
class LoadedModel:
    """A model ready to probe. `tokenizer` is None for a custom model that came without one."""

    model: nn.Module
    tokenizer: Any | None
    name: str
    vocab_size: int
    origin: ModelOrigin | None = None  # where it came from: what provenance records (None: made by hand)

    def __repr__(self) -> str:
        """One line (the dataclass' own repr would print the whole module tree and the tokenizer's vocabulary)."""
        first = next(self.model.parameters(), None)
        where = "" if first is None else f", {str(first.dtype).removeprefix('torch.')} on {first.device}"
        parameters = sum(p.numel() for p in self.model.parameters())
        tokenizer = "no tokenizer" if self.tokenizer is None else type(self.tokenizer).__name__
        return (f"LoadedModel({self.name!r}: {type(self.model).__name__}, {parameters / 1e6:.1f}M parameters{where}, "
                f"vocabulary {self.vocab_size}, {tokenizer})")


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ProbeError(f"unknown dtype {dtype!r}: use one of float32, float16, bfloat16", parameter="dtype")
    return DTYPES[dtype]


def check_device(device: str | None) -> None:
    """A device torch knows and this machine has: one line instead of torch's AssertionError without CUDA."""
    if device is None:
        return
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ProbeError(f"device {device!r} is not a device: use cpu, cuda or cuda:N", parameter="device") from error
    if parsed.type == "cuda" and not torch.cuda.is_available() and torch.version.cuda is None:
        release = torch.__version__.split("+")[0]
        raise ProbeError(f"device {device!r} needs CUDA, but the installed torch {torch.__version__} is a CPU-only "
                         f"build: install a CUDA build of torch, e.g. pip install torch=={release} --index-url "
                         "https://download.pytorch.org/whl/cu128 (cu128: CUDA 12.8; pick the one your NVIDIA driver "
                         "supports at https://pytorch.org/get-started/locally/), or run on the CPU (cpu)",
                         parameter="device")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ProbeError(f"device {device!r} asks for a GPU, but torch {torch.__version__} (CUDA {torch.version.cuda}) "
                         "sees none: check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or run on the CPU (cpu)",
                         parameter="device")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ProbeError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered "
                         "from 0", parameter="device")


def _placement(device: str | None, device_map: DeviceMap | None, offload_folder: str | Path | None,
               max_memory: dict[int | str, int | str] | None) -> dict[str, Any] | None:
    """from_pretrained's device_map / offload_folder / max_memory, checked; None without a device map."""
    parsed_map = parse_device_map(device_map)
    if parsed_map is not None and device is not None:
        raise ProbeError("give device or device_map, not both: a device map already says where each module goes",
                         parameter="device")
    if max_memory is not None and parsed_map is None:
        raise ProbeError("max_memory only applies with a device map strategy such as 'auto'", parameter="max_memory")
    if offload_folder is not None:
        try:
            Path(offload_folder).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ProbeError(f"cannot create the offload_folder {offload_folder}: {error.strerror}",
                             parameter="offload_folder") from error
    return None if parsed_map is None else {
        "device_map": parsed_map, "offload_folder": None if offload_folder is None else str(offload_folder),
        "max_memory": max_memory}


def _dispatch(spec: str, dtype: torch.dtype, placement: dict[str, Any] | None,
              trust_remote_code: bool, revision: str | None = None) -> tuple[nn.Module, Any]:
    """The loader that `spec` names, by its form; `revision` (a branch, tag or commit) for hub ids only."""
    if revision is not None and not _is_hub_id(spec):
        raise ProbeError(f"a revision ({revision!r}) names a version of a hub model: {spec} is not a hub id "
                         "(org/name)", parameter="revision")
    if spec in ALIASES:
        path = alias_path(ALIASES[spec])
        if path is None:
            raise ProbeError(f"model '{spec}' is not installed: {ALIASES[spec].install}", parameter="spec")
        return load_gguf(path, dtype, placement)
    if is_custom_spec(spec):
        model, tokenizer = load_custom(spec)
        return placed(model, dtype, placement), tokenizer
    if spec.endswith(".gguf"):
        if not Path(spec).is_file():
            raise ProbeError(f"GGUF file not found: {spec}", parameter="spec")
        return load_gguf(Path(spec), dtype, placement)
    if Path(spec).exists():  # a folder
        if spec.endswith(".py"):
            raise ProbeError(f"{spec} is a Python file: give FILE.py:FUNCTION, where FUNCTION() returns the model "
                             "(an nn.Module, or (nn.Module, tokenizer)); probe imports and runs that file",
                             parameter="spec")
        if not (Path(spec) / "config.json").is_file():
            raise ProbeError(f"{spec} is not a Hugging Face model folder (no config.json); "
                             f"known aliases: {', '.join(ALIASES)}", parameter="spec")
    elif not _is_hub_id(spec):
        if "/" in spec or spec.startswith(".") or spec.endswith(".py"):
            raise ProbeError(f"model path not found: {spec}", parameter="spec")
        raise ProbeError(f"unknown model {spec!r}: use an alias ({', '.join([*ALIASES, *HUB_ALIASES])}), a model "
                         "folder, a .gguf file, a hub id like org/name, or FILE.py:FUNCTION", parameter="spec")
    where = {} if revision is None else {"revision": revision}  # a folder has none
    return (from_pretrained(spec, dtype, placement, trust_remote_code=trust_remote_code, **where),
            load_tokenizer(spec, trust_remote_code=trust_remote_code, **where))


def loading_words(spec: str) -> str:
    """What loading `spec` does, for the line shown while it runs (a GGUF file is dequantised on its first load)."""
    path = alias_path(ALIASES[spec]) if spec in ALIASES else Path(spec) if spec.endswith(".gguf") else None
    if path is None or not path.is_file():
        return f"loading {spec}"
    if cached_config(path) is not None:
        return f"loading {spec} from its dequantised cache"
    return f"loading {spec} (dequantising its GGUF file, once: later runs read the cache)"


def _is_hub_id(spec: str) -> bool:
    """org/name that is no alias, file or folder here."""
    return (spec not in ALIASES and not is_custom_spec(spec) and not spec.endswith((".gguf", ".py"))
            and not Path(spec).exists() and spec.count("/") == 1 and not spec.startswith((".", "/")))


def _vocab_size(model: nn.Module) -> int:
    """`vocab_size` of the model or config, else the input embedding's, else the logits' width (a custom model)."""
    for owner in (model, getattr(model, "config", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    size = getattr(input_embeddings(model), "num_embeddings", None)
    if size:
        return size
    try:
        with torch.no_grad():
            return int(logits_of(model(torch.zeros(1, 2, dtype=torch.long, device=input_device(model)))).shape[-1])
    except Exception as error:
        raise ProbeError(f"the model's forward failed on token ids (1, 2): {type(error).__name__}: {error}") from error


def _given_module(model: nn.Module, tokenizer: Any | None, name: str | None, dtype: str | torch.dtype | None,
                  device: str | None) -> LoadedModel:
    """A model already in memory: used as it is (moved or cast only when `device` or `dtype` is given); a model a
    TransformerBridge has booted (its `original_model`) is run through its own modules, as the bridge itself is."""
    if holds_bridge_components(model):
        model = unbridged(model)
    if dtype is not None:
        model = model.to(_parse_dtype(dtype))
    if device is not None:
        check_device(device)
        model = model.to(device)
    model.eval()
    origin = ModelOrigin("module", f"{type(model).__module__}.{type(model).__qualname__}")  # its tensors identify it
    name = name or getattr(getattr(model, "config", None), "name_or_path", None) or type(model).__name__
    return LoadedModel(model=model, tokenizer=tokenizer, name=str(name),
                       vocab_size=_vocab_size(model), origin=origin)


def _given_wrapper(kind: WrapperKind, wrapper: Any, tokenizer: Any | None, name: str | None,
                   placement: dict[str, Any]) -> LoadedModel:
    """The Hugging Face module inside a wrapper, probed where it is (casting or moving it here would leave the
    wrapper's own state behind), with the wrapper's tokenizer unless `tokenizer` is given."""
    given = [key for key, value in placement.items() if value is not None]
    if given:
        raise ProbeError(f"a model wrapped by {kind.library} is probed where it is, in its own dtype: cast or move "
                         f"the wrapper itself before passing it (e.g. .to('cuda')), without {', '.join(given)}",
                         parameter=given[0])
    model = kind.model(wrapper)
    own = kind.tokenizer(wrapper) if tokenizer is None else tokenizer
    return _given_module(model, own, name or kind.name(wrapper), None, None)


def load_model(spec: str | nn.Module = DEFAULT_MODEL, *, tokenizer: Any | None = None, name: str | None = None,
               dtype: str | torch.dtype | None = None,
               device: str | None = None, device_map: DeviceMap | None = None,
               offload_folder: str | Path | None = None, max_memory: dict[int | str, int | str] | None = None,
               trust_remote_code: bool = False, revision: str | None = None) -> LoadedModel:
    """Load what `spec` names, in eval mode; raise ProbeError with one readable line when it cannot.

    `spec` may also be an `nn.Module` already loaded, used as it is (cast or moved only for `dtype` or `device`), or
    a model wrapped by TransformerLens 4 or nnsight, whose Hugging Face model probe runs where it is (docs/models.md).
    `device_map` (a strategy such as "auto", or {module: GPU index | "cpu" | "disk"}, or that as JSON) spreads a model
    over devices through accelerate, with `offload_folder` and `max_memory`. A folder's or hub model's own code runs
    only with `trust_remote_code=True`; `revision` loads a branch, tag or commit of a hub id (Pythia's `step1000`).
    """
    use_threads_unless_chosen()  # torch's threads from the CPUs free now, as the CLI picks them
    kind = wrapper_of(spec)
    if kind is not None:
        return _given_wrapper(kind, spec, tokenizer, name, {"dtype": dtype, "device": device, "device_map": device_map,
                                                            "offload_folder": offload_folder, "max_memory": max_memory})
    if isinstance(spec, nn.Module):
        if device_map is not None or offload_folder is not None or max_memory is not None:
            raise ProbeError("a model given as a module is used where it is: device_map, offload_folder and "
                             "max_memory apply to a model probe loads", parameter="device_map")
        return _given_module(spec, tokenizer, name, dtype, device)
    if not isinstance(spec, str):
        wrappers = " or ".join(kind.library for kind in WRAPPERS)
        raise ProbeError(f"spec must be a model name or path, an nn.Module, or a model wrapped by {wrappers}, "
                         f"got {type(spec).__name__}", parameter="spec")
    torch_dtype = _parse_dtype(dtype)
    check_device(device)
    placement = _placement(device, device_map, offload_folder, max_memory)
    source = resolve_alias(spec)  # a hub alias (gpt2) loads its hub id (openai-community/gpt2)
    try:
        model, own_tokenizer = _dispatch(source, torch_dtype, placement, trust_remote_code, revision)
    except ProbeError:
        raise
    except OSError as error:
        hub = f" ({source} comes from the Hugging Face hub: the first load needs the network)" if (
            spec in HUB_ALIASES) else ""
        raise ProbeError(f"cannot load model {spec!r}{hub}: {first_line(error) or type(error).__name__}") from error
    except Exception as error:
        raise ProbeError(f"cannot load model {spec!r}: {type(error).__name__}: {first_line(error)}") from error
    if device is not None:
        model = model.to(device)
    model.eval()
    vocab_size = _vocab_size(model)
    logging.getLogger("probe.models").info("loaded %s (%s)", spec, type(model).__name__)
    return LoadedModel(model=model, tokenizer=tokenizer or own_tokenizer, name=name or spec, vocab_size=vocab_size,
                       origin=origin_of(source, model))
