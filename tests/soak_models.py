"""Models for the soak test (tests/test_soak.py) as `FILE.py:FUNCTION` specs: a tiny random llama with the word-piece
tokenizer of tests/planted_syntax.py, whose words it reads as tokens 0-18."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from conftest import tiny_hf
from planted_syntax import syntax_tokenizer


def tiny_llama_words() -> tuple[Any, Any]:
    """Seeded: every process builds the same weights."""
    return tiny_hf("llama_gqa"), syntax_tokenizer()
