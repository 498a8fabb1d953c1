"""What can be checked before the model loads (seconds, minutes from the hub): `Command.invoke` runs
`check_before_loading` on every command's parameters, by name."""

from __future__ import annotations

import difflib
import json
import os
import re
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from probe.errors import ProbeError
from probe.ablation.heads import COLUMN_NAME
from probe.ablation.methods import PATCHES
from probe.ablation.metrics import METRICS
from probe.inputs.choice import GENERATED
from probe.inputs.sets import read_text_file
from probe.models import ALIASES, HUB_ALIASES, alias_path, check_device, resolve_alias
from probe.models.gguf import cached_config
from probe.patching.paths import LOGITS
from probe.qk import KEY_RULES
from probe.selfrepair import SELF_REPAIR_METHODS
from probe.steering import steerable

AT_LEAST = {"num_seqs": 1, "seq_len": 2, "repeat_len": 1, "count": 1, "batch_size": 1, "icl_seqs": 1,
            "max_sentences": 1, "prompts": 1, "curve_texts": 1, "top": 1, "stack": 1,
            "max_new_tokens": 1}
"""Counts every command means the same by, and the least each can be (the library's own limits)."""
TEXT_FILES = {"data": "data file", "eval_data": "data file", "text": "text file", "file": "text file"}
"""Parameters that name a UTF-8 text file (a Path, or `--data`'s str that is no probe set's name)."""
LAYER_PART = re.compile(r"(\d+)(?:-(\d+))?")  # a plain model's layers in --heads / --layers: 5 or 3-5
LAYER_COUNTS = ("num_hidden_layers", "n_layer")  # where a config.json says how many layers (GPT-2: n_layer)
HUB_TIMEOUT = 3.0  # seconds the hub's host has to accept a connection before a first download is given up


def check_before_loading(parameters: dict[str, Any]) -> None:
    """One line for the first parameter the arguments alone show to be wrong, before any model is loaded."""
    for name, least in AT_LEAST.items():
        value = parameters.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ProbeError(f"{name} must be at least {least}, got {value}", parameter=name)
    for name, what in TEXT_FILES.items():
        value = parameters.get(name)
        if isinstance(value, Path) or (name == "data" and isinstance(value, str) and value not in GENERATED):
            read_text_file(value, parameter=name, what=what)
        elif name == "text" and isinstance(value, str) and not value.strip():
            raise ProbeError("text is empty: give the text to look at", parameter="text")
    check_threshold_names(parameters.get("threshold"))
    for name in ("heads", "senders", "receivers"):  # parsed against the model's layers once it loads
        if isinstance(value := parameters.get(name), str) and value != LOGITS:
            check_heads_syntax(value)
    choices = {"metric": list(METRICS), "repair_method": SELF_REPAIR_METHODS, "component": list(PATCHES),
               "path_component": ("query", "key", "value"), "at": list(KEY_RULES), "intervention": steerable()}
    for name, names in choices.items():  # registries, read as the command runs: a plugin may have registered
        value = parameters.get(name)
        if isinstance(value, str) and value not in names:
            raise ProbeError(f"--{name.replace('_', '-')} {value!r}: use one of {', '.join(names)}")
    check_device(parameters.get("device"))
    model = parameters.get("model")
    if isinstance(model, str) and not parameters.get("revisions"):
        check_layers(model, parameters)  # the hub's reachability is asked at load time (cli.options.load), after
        # every command's own argument checks: those need no network


def check_threshold_names(items: Any) -> None:
    """`--threshold NAME=VALUE` items naming no head class are refused before loading, with the closest class."""
    from probe.heads.scores import SCORES

    for item in items if isinstance(items, list) else []:
        name, sep, _ = item.partition("=") if isinstance(item, str) else ("", "", "")
        if sep and name.strip() and name.strip() not in SCORES:
            close = difflib.get_close_matches(name.strip(), list(SCORES), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ProbeError(f"--threshold {item!r}: no head class called {name.strip()!r}; {hint}the classes are "
                             f"{', '.join(SCORES)}")


def _hub_id(source: str) -> bool:
    """org/name that is no file, folder or FILE.py:FUNCTION here (the loader's own rule)."""
    return (source.count("/") == 1 and ":" not in source and not source.startswith((".", "/"))
            and not source.endswith((".gguf", ".py")) and not Path(source).exists())


def check_hub_reachable(spec: str) -> None:
    """A hub model not cached whose host does not answer within HUB_TIMEOUT: one line now, not the client's retries."""
    source = resolve_alias(spec)
    if not _hub_id(source):
        return
    from huggingface_hub import constants, try_to_load_from_cache  # transformers' dependency, loaded late

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    try:
        if isinstance(try_to_load_from_cache(source, "config.json"), str):
            return
    except ValueError:  # no valid hub id (huggingface_hub's own check): the loader says so in its words
        return
    endpoint = urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=HUB_TIMEOUT).close()
    except OSError as error:
        alias = f" ({source} comes from the Hugging Face hub: the first load needs the network)" if (
            spec in HUB_ALIASES) else ""
        reason = error.strerror or str(error) or type(error).__name__
        raise ProbeError(f"cannot load model {spec!r}{alias}: {host} cannot be reached ({reason}) and the model is "
                         "not in the local hub cache; connect, or set HF_HUB_OFFLINE=1 to use cached models only",
                         parameter="spec") from None


def model_config(spec: str) -> dict[str, Any] | None:
    """The model's config.json as read without loading anything, or None where there is none to read."""
    source = resolve_alias(spec)
    path: Any = None
    if source in ALIASES:
        found = alias_path(ALIASES[source])
        path = None if found is None else cached_config(found)
    elif source.endswith(".gguf") and Path(source).is_file():
        path = cached_config(Path(source))
    elif (Path(source) / "config.json").is_file():
        path = Path(source) / "config.json"
    elif _hub_id(source):
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(source, "config.json")
    try:
        return json.loads(Path(path).read_text(encoding="utf-8")) if isinstance(path, (str, Path)) else None
    except (OSError, ValueError):
        return None


def check_layers(spec: str, parameters: dict[str, Any]) -> None:
    """A layer past the model's in --heads or --layers, from its config."""
    named = {name: value for name in ("heads", "layers") if isinstance(value := parameters.get(name), str)}
    config = model_config(spec) if named else None
    counts = [config.get(key) for key in LAYER_COUNTS] if config and not config.get("is_encoder_decoder") else []
    count = next((value for value in counts if isinstance(value, int)), None)
    if not isinstance(count, int) or count < 1:
        return
    for name, value in named.items():
        for item in (part.strip() for part in value.split(",")):
            column = COLUMN_NAME.fullmatch(item)
            layer_part = column[1] if column else item.partition(".")[0]
            numbers = LAYER_PART.fullmatch(layer_part)
            for number in (int(text) for text in (numbers.groups() if numbers else ()) if text is not None):
                if number >= count:
                    raise ProbeError(f"layer {number} in {name} {item!r} is out of range: the model has {count} "
                                     f"layers (0-{count - 1})", parameter=name)


HEAD_ITEM = re.compile(r"^(all|\*|L\d+H\d+|(enc|dec|x)?\d+(-\d+)?(\.(\*|\d+(-\d+)?))?)$", re.IGNORECASE)


def check_heads_syntax(spec: str) -> None:
    """Reject a malformed --heads (enc/dec/x: a stack) before the model is loaded (ranges: against the model later)."""
    for item in (item.strip() for item in spec.split(",")):
        if not HEAD_ITEM.match(item):
            raise ProbeError(f"malformed head {item!r} in --heads: use LAYER.HEAD items separated by commas, "
                             "e.g. 5.1,18.6, or 5.* (every head of layer 5), 3-4.0-2 (ranges), all; "
                             "encoder-decoders name the stack: enc5.1, dec5.1, x5.1 (cross-attention)")
