#!/usr/bin/env bash
# pip against uv on the same lock: each into a fresh venv that already holds torch, timed from
# the moment torch is in. Prints a table and writes bench/results/install.json.
#   bash bench/bench_install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-torch==2.13.0}
UV=${UV:-uv==0.13.9}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
declare -A took
for tool in pip uv; do
  python3 -m venv "$scratch/$tool"
  "$scratch/$tool/bin/pip" install -q "$UV" "$TORCH"
  start=$(date +%s.%N)
  if [ "$tool" = pip ]; then
    "$scratch/$tool/bin/pip" install -q -r requirements/lock.txt
  else
    "$scratch/$tool/bin/uv" pip install -q --python "$scratch/$tool/bin/python" \
      -r requirements/lock.txt
  fi
  took[$tool]=$(echo "$(date +%s.%N) - $start" | bc)
done
packages=$(grep -c '==' requirements/lock.txt)
printf '%-10s %12s\n' installer "seconds ($packages packages)"
for tool in pip uv; do printf '%-10s %12.2f\n' "$tool" "${took[$tool]}"; done
mkdir -p bench/results
printf '{"packages": %s, "pip_s": %.3f, "uv_s": %.3f, "torch": "%s", "uv": "%s"}\n' \
  "$packages" "${took[pip]}" "${took[uv]}" "$TORCH" "$UV" > bench/results/install.json
