"""The fields many kinds share (a head's layer and index, the model, its dtype, ...), declared once."""

from __future__ import annotations

import math
from typing import Any

from probe.schemas.base import Field

NAME_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"


def rounded(value: Any, places: int = 6) -> float | None:
    """A number as a payload writes it (NUMBER): `places` decimals, None where it is None or not finite."""
    if value is None:
        return None
    value = float(value)
    return round(value, places) if math.isfinite(value) else None


def other_than(columns: dict[str, Field]) -> str:
    """A class (or metric) name as a column: any name but the fixed `columns` beside it."""
    return rf"^(?!({'|'.join(columns)})$)[A-Za-z_][\w:.-]*$"


LAYER = Field("integer", "the head's layer (0 first)")
HEAD = Field("integer", "the head within its layer (a query head)")
NAME = Field("string", "the head's name for a table: L18H6 (x3.1 on an encoder-decoder's cross-attention), which "
                       "pandas never reads as a number")
HEAD_COLUMNS = {"layer": LAYER, "head": HEAD, "name": NAME}
MODEL = Field("string", "the model as given (a path, an alias, a hub id or FILE.py:FUNCTION)")
N_LAYERS = Field("integer", "attention layers of the model")
N_HEADS = Field("integer", "query heads per layer")
DTYPE = Field("string", "the dtype the model ran in (float32, bfloat16, float16): docs/precision.md says how far a "
                        "half-precision result lies")
LAYER_NAMES = Field("array", "encoder-decoders: each layer's name (enc0, dec0, x0 for cross-attention); absent "
                             "otherwise", required=False, items=Field("string", "a layer's name"))
SECONDS = Field("number", "wall time of the run, in seconds")
NUMBER = Field("number", "a number")
SCORE_BY_CLASS = Field("object", "each class's score (null where the class does not apply to the layer)",
                       patterns={NAME_RE: Field("number", "the score")})
THRESHOLDS = Field("object", "each class's threshold: a head is labelled where its score is above it",
                   patterns={NAME_RE: Field("number", "the threshold")})
CLASSES = Field("object", "each class: its summary, letter, probe set and default threshold",
                patterns={NAME_RE: Field("object", "what the class means and how it is scored")})

SELF_REPAIR = Field("object", "the self-repair section (--self-repair): the self-repair kind's payload",
                    required=False, ref="self-repair")
