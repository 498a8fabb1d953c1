#!/usr/bin/env bash
# Run every benchmark and rewrite bench/RESULTS.md: bash bench/run.sh [python -m bench options]
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m bench "$@"
