#!/usr/bin/env bash
# The CUDA checks and figures, run on a lent GPU machine (README "CUDA"), in one or two calls:
#
#   bash benchmarks/cuda_run.sh tests soak          # the suite on CUDA, then the soak
#   bash benchmarks/cuda_run.sh coldstart bench     # cold starts, then bench latency
#   bash benchmarks/cuda_run.sh quant               # weight and KV formats: latency and quality
#   bash benchmarks/cuda_run.sh tests spec          # the suite, then speculative decoding
#   bash benchmarks/cuda_run.sh graphs              # Triton kernels + CUDA graphs: checks, then latency (~9 min)
#
# Expects, carried beside the working tree: .whl/ (wheels the GPU image lacks: the server's
# and the test tools'; `bash benchmarks/cuda_wheels.sh` fetches them) and .gpu/shared/ (a copy
# of ../shared/models and tools). Writes logs and JSON under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/ridge-cuda-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 CI=1 RIDGE_SHARED_DIR=$PWD/.gpu/shared RIDGE_CACHE_DIR=/tmp/ridge-cache
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu.txt"

for step in "$@"; do
  case $step in
  tests)  # the whole suite; the engine runs on CUDA (device auto), CPU-kernel tests on the host CPU
    # 12 workers (xdist, on the image: ~3 min on the H100, 2026-11-26); -v names each result as
    # it comes, so a run cut by its limit still says which failed; test_fuzz needs schemathesis
    timeout 420 python3 -m pytest -v -n 12 --timeout 150 -p no:cacheprovider -o addopts="-rf" --tb=short \
      --ignore=tests/server/test_fuzz.py tests > "$OUT/pytest.log" 2>&1
    grep -E " FAILED |^FAILED|^ERROR| passed| failed" "$OUT/pytest.log" | tail -n 40
    ;;
  soak)
    python3 benchmarks/soak.py --model .gpu/shared/models/stories260K --out "$OUT/soak.json" 2>&1 | tail -n 12
    ;;
  coldstart)
    python3 .gpu/shared/tools/inflate_stories.py /tmp/stories-1.1b > /dev/null
    for model in random:tinyllama-1.1b /tmp/stories-1.1b random:llama-3.1-8b; do
      name=$(basename "${model#random:}")
      python3 benchmarks/cold_start.py --model "$model" --runs 2 --json "$OUT/cold-$name.json" > /dev/null \
        2> "$OUT/cold-$name.err" && cat "$OUT/cold-$name.json" | tr -d '\n' && echo || tail -n 5 "$OUT/cold-$name.err"
    done
    ;;
  bench)
    for model in random:tinyllama-1.1b random:llama-3.1-8b; do
      name=${model#random:}
      python3 -m ridge.cli bench latency --model "$model" --dtype bfloat16 --batch 1 --batch 8 --batch 32 \
        --batch 128 --input-len 128 --output-len 64 --rounds 3 > "$OUT/latency-$name.txt" 2> "$OUT/latency-$name.err" \
        && cat "$OUT/latency-$name.txt" || tail -n 20 "$OUT/latency-$name.err"
    done
    ;;
  spec)  # speculative decoding on the inflated stories model, with and without, interleaved
    python3 .gpu/shared/tools/inflate_stories.py /tmp/stories-1.1b > /dev/null
    python3 .gpu/shared/tools/inflate_stories.py /tmp/stories-1.1b-noise0.05 --noise 0.05 > /dev/null
    timeout 500 python3 benchmarks/spec_decode.py --device cuda --rounds 3 \
      --out "$OUT/spec_decode_cuda.json" 2>&1 | grep -v "^ridge:" | grep "^round\|ratio_median"
    ;;
  graphs)  # the GPU decode step (Triton kernels, CUDA graphs): checks, then old path vs new, same call
    timeout 150 python3 -m pytest -q --timeout 120 -p no:cacheprovider -o addopts="-ra" \
      tests/layers/test_triton_kernels.py tests/worker tests/models/test_parity.py \
      > "$OUT/graphs-tests.log" 2>&1
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/graphs-tests.log" | tail -n 12
    common="--dtype bfloat16 --max-model-len 2048 --input-len 128 --output-len 64 --rounds ${GRAPH_ROUNDS:-2}"
    for model in random:tinyllama-1.1b random:llama-3.1-8b; do
      for mode in "--kernels torch --enforce-eager" ""; do  # the path before CUDA graphs, then the default
        echo "== ${model#random:} ${mode:-graphs}"
        timeout 120 python3 -m ridge.cli bench latency --model "$model" $common --batch 1 --batch 32 $mode \
          2> "$OUT/graphs.err" | grep -E "decode|floor|prefill" || tail -n 5 "$OUT/graphs.err"
        grep "CUDA graphs" "$OUT/graphs.err"
      done
    done
    for fmt in "" "--quantization int4" "--quantization int8" "--kv-cache-dtype int8" "--kv-cache-dtype fp8"; do
      for mode in "--kernels torch --enforce-eager" ""; do
        echo "== tinyllama-1.1b ${fmt:-bf16} ${mode:-graphs}"
        timeout 90 python3 -m ridge.cli bench latency --model random:tinyllama-1.1b $common --batch 1 $fmt $mode \
          2> "$OUT/graphs.err" | grep -E "decode" || tail -n 5 "$OUT/graphs.err"
      done
    done
    for mode in "--no-async-scheduling" "" "--no-async-scheduling" ""; do  # the host's work overlapped, alternated
      echo "== tinyllama-1.1b ${mode:-async-scheduling}"
      timeout 90 python3 -m ridge.cli bench latency --model random:tinyllama-1.1b $common --batch 1 --batch 32 $mode \
        2> "$OUT/graphs.err" | grep -E "decode" || tail -n 5 "$OUT/graphs.err"
    done
    for fmt in "--quantization int4" "--quantization int8"; do  # the block formats against bf16's graphs above
      echo "== llama-3.1-8b $fmt graphs"
      timeout 90 python3 -m ridge.cli bench latency --model random:llama-3.1-8b $common --batch 1 --batch 32 $fmt \
        2> "$OUT/graphs.err" | grep -E "decode" || tail -n 5 "$OUT/graphs.err"
    done
    timeout 120 python3 benchmarks/cuda_block_matmul.py --rows 1 --rows 32 --json "$OUT/cuda_block_matmul.json" \
      2>&1 | tail -n 16
    timeout 90 python3 benchmarks/cuda_step.py --model random:tinyllama-1.1b --batch 1 --batch 32 --kernel-lines 14 \
      > "$OUT/cuda_step.txt" 2>&1; grep -E "^==|^--| calls " "$OUT/cuda_step.txt"
    python3 .gpu/shared/tools/inflate_stories.py /tmp/stories-1.1b > /dev/null
    python3 .gpu/shared/tools/inflate_stories.py /tmp/stories-1.1b-noise0.05 --noise 0.05 > /dev/null
    timeout 240 python3 benchmarks/spec_decode.py --device cuda --rounds 2 --only batch-1-ngram,batch-8-ngram,batch-32-ngram,batch-32-draft \
      --out "$OUT/spec_decode_cuda.json" 2>&1 | grep -v "^ridge:" | grep "^round"
    ;;
  quant)  # the formats through the torch fallback (CUDA has no ridge kernel): latency, then quality
    for fmt in "" "--quantization int8" "--quantization int4" "--kv-cache-dtype int8" "--kv-cache-dtype fp8"; do
      name=$(echo "bf16 $fmt" | tr -d '-' | tr ' ' '_')
      python3 -m ridge.cli bench latency --model random:tinyllama-1.1b --dtype bfloat16 $fmt --batch 1 --batch 32 \
        --input-len 128 --output-len 32 --rounds 2 > "$OUT/quant-$name.txt" 2> "$OUT/quant-$name.err" \
        && { echo "== $fmt"; cat "$OUT/quant-$name.txt"; } || tail -n 20 "$OUT/quant-$name.err"
    done
    python3 .gpu/shared/tools/inflate_stories.py /tmp/stories-1.1b > /dev/null
    for fmt in "--quantization int8" "--quantization int4" "--kv-cache-dtype int8" "--kv-cache-dtype fp8"; do
      echo "== quality $fmt"
      python3 -m ridge.cli bench quality --model /tmp/stories-1.1b --dtype bfloat16 $fmt --tokens 480 2>&1 | tail -n 8
    done
    ;;
  esac
done
