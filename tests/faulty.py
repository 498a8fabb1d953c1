"""Planted models that misbehave, as `tests/faulty.py:FUNCTION` model specs for command-line tests.

- `planted_slow`: every attention layer call sleeps PROBE_TEST_SLEEP seconds (default 0.5) after appending a line
  to PROBE_TEST_FORWARD_LOG (when set), so a test can interrupt a run while it is working.
- `planted_nan`: head 1.3's queries are NaN, so its attention, and every logit after it, is NaN: what a half-precision
  overflow does to a large model.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))

from planted import HEAD_DIM, PlantedModel, planted_textbook


def _slow(_module: Any, _args: Any) -> None:
    log = os.environ.get("PROBE_TEST_FORWARD_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as file:
            file.write("forward\n")
    time.sleep(float(os.environ.get("PROBE_TEST_SLEEP", "0.5")))


def planted_slow() -> PlantedModel:
    model = planted_textbook()
    for layer in model.layers:
        layer.register_forward_pre_hook(_slow)
    return model


def planted_nan() -> PlantedModel:
    model = planted_textbook()
    with torch.no_grad():
        model.layers[1].W_q.weight[3 * HEAD_DIM:4 * HEAD_DIM] = float("nan")
    return model
