#!/usr/bin/env bash
# Train the example classifier (examples/classifier/train.py), then take it apart with probe: head classes,
# head ablation by accuracy on held-out labelled texts, the pruning curve by accuracy, patching between texts whose
# keyword names another topic, and one text's heatmap.
# Usage: examples/classifier/run.sh [OUT]   (default runs/classifier; about a minute on one CPU core)
set -euo pipefail
OUT=${1:-runs/classifier}
PYTHON=${PYTHON:-python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PYTHON" "$(dirname "$0")/train.py" --out "$OUT"
"$PYTHON" -m probe.cli classify --model "$OUT/model" --seq-len 62 --repeat-len 30 --json "$OUT/classify.json" --force
"$PYTHON" -m probe.cli ablate --model "$OUT/model" --labels "$OUT/test.jsonl" --metric accuracy \
    --json "$OUT/ablate.json" --html "$OUT/ablate.html" --force
"$PYTHON" -m probe.cli prune --model "$OUT/model" --labels "$OUT/test.jsonl" --metric accuracy --step 0.25 \
    --json "$OUT/prune.json" --html "$OUT/prune.html" --force
"$PYTHON" -m probe.cli patch --model "$OUT/model" --labels "$OUT/pairs.jsonl" --no-classes \
    --json "$OUT/patch.json" --force
TEXT=$(head -n 1 "$OUT/test.jsonl" | "$PYTHON" -c 'import json, sys; print(json.loads(sys.stdin.read())["text"])')
"$PYTHON" -m probe.cli heatmap --model "$OUT/model" --text "$TEXT" --html "$OUT/heatmap.html" --force
