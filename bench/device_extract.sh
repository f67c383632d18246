#!/usr/bin/env bash
# Extraction on one H200, in one go (< 8 minutes): an 8B-Llama-shaped bf16 model with random
# weights (built on the device, nothing downloaded or installed), then
#   1. backend hf: forward alone vs the pipeline with files written (goal: pipeline >= 0.9x
#      forward alone, >= 30,000 tokens/s)
#   2. backend hf-tp with one rank (the replica path: process group, row announcements)
#   3. backend vllm against hf on the same samples (bench/bench_vllm_extract.py), where the
#      machine has a CUDA vLLM (VLLM_PY, default .venv-vllm-cuda/bin/python): vLLM's CUDA wheel
#      is ~0.5 GB with its torch several GB more, over what a device call can carry, so a lent
#      machine without one skips it with that line
# Results: $OUT/extract_h200_hf.json, $OUT/extract_h200_hf_tp1.json, $OUT/extract_h200.json
# (summary). Not run yet: no GPU was lent to the session that wrote it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"

timeout 200 "$PY" -m bench.bench_extract --n-samples 32 --naive-samples 2 \
    --out "$OUT/extract_h200_hf.json"
# the replica path saves the random model (16 GB) to local scratch and loads it with tp_plan
timeout 280 "$PY" -m bench.bench_extract --n-samples 32 --backend hf-tp --ranks 1 \
    --work-dir "${WORK:-/tmp}" --out "$OUT/extract_h200_hf_tp1.json"

VLLM_PY=${VLLM_PY:-.venv-vllm-cuda/bin/python}
if [ -x "$VLLM_PY" ] && "$VLLM_PY" -c "import vllm" 2>/dev/null; then
    timeout 400 "$PY" bench/bench_vllm_extract.py --hidden 4096 --layers 32 --heads 32 \
        --vocab 128256 --n-samples 64 --min-len 2048 --max-len 4096 --vllm-python "$VLLM_PY" \
        --vllm-args "" --inflight 64 --out "$OUT/extract_h200_vllm.json"
else
    echo "vllm backend skipped: no CUDA vLLM at $VLLM_PY on this machine"
fi

"$PY" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
hf = json.loads((out / "extract_h200_hf.json").read_text())["phases"]
tp = json.loads((out / "extract_h200_hf_tp1.json").read_text())["phases"]
summary = {
    "hf_forward_tokens_per_s": hf["forward"]["tokens_per_s"],
    "hf_pipeline_tokens_per_s": hf["pipeline"]["tokens_per_s"],
    "hf_pipeline_over_forward": round(hf["pipeline"]["tokens_per_s"]
                                      / hf["forward"]["tokens_per_s"], 3),
    "hf_tp1_forward_tokens_per_s": tp["forward"]["tokens_per_s"],
    "hf_tp1_pipeline_tokens_per_s": tp["pipeline"]["tokens_per_s"],
    "goal_ratio_0_9_met": hf["pipeline"]["tokens_per_s"] >= 0.9 * hf["forward"]["tokens_per_s"],
    "goal_30k_met": hf["pipeline"]["tokens_per_s"] >= 30000,
}
(out / "extract_h200.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
