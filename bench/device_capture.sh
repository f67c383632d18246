#!/usr/bin/env bash
# Capture while generating, on one GPU, in one go (< 10 minutes): bench/bench_capture.py with
# an 8B-Llama-shaped bf16 model with random weights, built on the device, on a CUDA vLLM
# (VLLM_PY, default .venv-vllm-cuda/bin/python: vLLM's CUDA wheel is not carried by a device
# call, so a machine without one says so and stops). Measures, side by side: generation
# tokens/s with capture on against a server without it, vLLM's KV-cache capacity on against
# off, and the run end to end (captured against the `vllm` backend's extraction; no `hf`).
# Results: $OUT/capture_h200.json. Not run yet: no GPU was lent to the session that wrote it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
VLLM_PY=${VLLM_PY:-.venv-vllm-cuda/bin/python}
if ! { [ -x "$VLLM_PY" ] && "$VLLM_PY" -c "import vllm" 2>/dev/null; }; then
    echo "capture bench skipped: no CUDA vLLM at $VLLM_PY on this machine"
    exit 0
fi
timeout 560 "$PY" bench/bench_capture.py --hidden 4096 --layers 32 --heads 32 --vocab 128256 \
    --dtype bfloat16 --blocks 2 --prompts 256 --concurrency 128 --e2e-prompts 128 \
    --min-prompt 512 --max-prompt 2048 --output-len 512 --max-model-len 4096 --no-hf \
    --vllm-python "$VLLM_PY" --out "$OUT/capture_h200.json"
