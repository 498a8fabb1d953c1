"""The planted textbook model, with a process that can die mid-sweep: for testing that a sharded sweep that loses a
process keeps what it finished and a --resume completes the rest.

Environment (read at every forward, so the same model spec serves the dying run and the rerun):
- PROBE_TEST_DIE_RANK=r, PROBE_TEST_DIE_AT=n: the process whose RANK is r exits (os._exit(3), as a crash would:
  no cleanup, no flush of anything not yet written) when the model's n-th forward starts.
- PROBE_TEST_FORWARD_LOG=path: every forward appends one line "RANK" to path, to count the work a run did.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from planted import PlantedModel, planted_textbook

_calls = [0]


def _on_forward(_module: Any, _args: Any) -> None:
    _calls[0] += 1
    rank = os.environ.get("RANK", "0")
    log = os.environ.get("PROBE_TEST_FORWARD_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as file:
            file.write(f"{rank}\n")
    if os.environ.get("PROBE_TEST_DIE_RANK") == rank and _calls[0] >= int(os.environ.get("PROBE_TEST_DIE_AT", "0")):
        os._exit(3)


def planted_mortal() -> PlantedModel:
    model = planted_textbook()
    model.register_forward_pre_hook(_on_forward)
    return model
