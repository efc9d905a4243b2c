#!/usr/bin/env bash
# The CUDA checks and figures, in one call on a lent GPU machine (see README "CUDA").
#
#   bash benchmarks/cuda_run.sh [tests] [bench] [coldstart]     (default: all three)
#
# Expects, carried beside the working tree: .whl/ (the server's wheels that the GPU image
# lacks) and .gpu/shared/ (a copy of ../shared/models). Writes logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ridge-cuda-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 RIDGE_SHARED_DIR=$PWD/.gpu/shared RIDGE_CACHE_DIR=/tmp/ridge-cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
steps=${*:-tests bench coldstart}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

for step in $steps; do
  case $step in
  tests)
    # The whole suite with the engine on CUDA (device auto); CPU-kernel tests run on the host CPU.
    timeout 420 python3 -m pytest -q -x --timeout 300 -p no:cacheprovider -o addopts="-ra" tests \
      2>&1 | tee "$OUT/pytest.log" | tail -n 40
    ;;
  bench)
    for model in ${BENCH_MODELS:-random:tinyllama-1.1b}; do
      name=${model#random:}
      python3 -m ridge.cli bench latency --model "$model" --dtype bfloat16 --batch 1 --batch 8 --batch 32 \
        --batch 128 --input-len 128 --output-len 64 --rounds 3 --json > "$OUT/latency-$name.json" \
        2> "$OUT/latency-$name.err" || tail -n 20 "$OUT/latency-$name.err"
      python3 - "$OUT/latency-$name.json" <<'EOF'
import json, sys
data = json.load(open(sys.argv[1]))
print(json.dumps(data)[:3000])
EOF
    done
    ;;
  coldstart)
    for i in 1 2; do
      /usr/bin/time -f "wall %e s" python3 -m ridge.cli generate --model random:tinyllama-1.1b --dtype bfloat16 \
        --max-tokens 1 --prompt "Once upon a time" 2>&1 | tail -n 3
    done
    ;;
  esac
done
