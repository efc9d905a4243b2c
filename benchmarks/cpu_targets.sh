#!/usr/bin/env bash
# Issue 21's CPU figures in one run, on the machine speed is judged on (the 2-core AMD EPYC),
# then every target against them (benchmarks/targets.py). Run from the repository root after
# `make setup`, with nothing else running; the steps run in the order given:
#
#   bash benchmarks/cpu_targets.sh prefetch peers files ik plan rows kv jobs targets   # about 95 minutes
#
#   prefetch prefetch.py: the prefetch tables (csrc/prefetch.cpp: Zen 4's "amd", "zen5",
#            "intel") alternated on the same bytes, the kernels alone (about 3 minutes; on an
#            AMD CPU also this CPU's table with each key that no Zen 4 has measured alone:
#            quant_far_scales, quant_alternate, quant_interleave, quant_far_nta=1 and
#            quant_far_kib=24, about 6 minutes); where another policy wins in every round, put
#            it in this CPU's table (and rebuild) before the steps below.
#   peers    llama-cpp-python 0.3.36 built natively into the venv where it is missing (about 8
#            minutes; AMX off: its AMX kernels fault on the Intel VMs, the AMD has none), and
#            ik_llama.cpp's llama-bench built from $IK_SRC at $IK_COMMIT (about 10 minutes)
#            where $IK_BENCH is not an executable yet. $IK_SRC: a checkout, or the git directory
#            that the `fetch` tool gives for github:ikawrakow/ik_llama.cpp.
#   files    compare.py, batch-1 decode on llama.cpp's own files of every type it makes,
#            interleaved with llama.cpp -> benchmarks/compare_targets_<cpu>.json
#   ik       vs_ik.py: ik's llama-bench tg64 and pp512 alternated with ridge on those files
#   plan     decode_plan.py: the decode plan against op by op on the Q4_K_M and Q8_0 files
#   rows     quant_rows.py: steps of 1-128 rows per format, the kernel alone over a decode
#            step's weights (22 layers; about 7 minutes, 14 where the CPU has AMX: two paths)
#   kv       quantized_decode.py: bf16, int8 and int4 weights' decode steps, and decode attention
#            over a bf16, int8 and fp8 KV cache at 4,096 tokens (about 10 minutes)
#   jobs     decode_attention.py: decode attention's jobs of several KV heads against one head a
#            job, on the same pools (csrc/paged_rows.h's bound; about 6 minutes)
#   targets  benchmarks/targets.py: each target, its figure, met or not
#   policies prefetch.py --steps: prefetch policies alternated over whole batch-1 decode steps
#            of the files (after 'files'; PREFETCH_STEP_POLICIES, default this CPU's table
#            against it with quant_far_scales=1, quant_alternate=1 and both: the two keys no
#            Zen 4 has measured yet; STEP_FORMATS, default q4_0,q4_k_m,q6_k; about 3 minutes a
#            file) -> benchmarks/prefetch_steps.json. Not in the run above: a policy that wins
#            here in every round goes into this CPU's table.
#
# Environment: ROUNDS (default 2), THREADS (2), STEPS (ridge's --num-scheduler-steps in the
# 'files' and 'ik' steps, default 8), FORMATS (the file types, comma-separated),
# PREFETCH_POLICIES (the prefetch step's, ';' between),
# PYTHON (.venv/bin/python), IK_SRC, IK_COMMIT (8337e4cd3, what the README's figures used),
# IK_BENCH (default /tmp/ik_llama.cpp/build/bin/llama-bench), LLAMACPP_CMAKE_ARGS (the
# llama-cpp-python build's flags). Logs go to ${OUT:-/tmp/ridge-cpu-targets}. The steps after
# `files` take the files from its JSON ("files": each type's path), not from a path of their own.
set -uo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-2}
STEPS=${STEPS:-8}
IK_COMMIT=${IK_COMMIT:-8337e4cd3}
IK_BENCH=${IK_BENCH:-/tmp/ik_llama.cpp/build/bin/llama-bench}
# -march=native (GGML_NATIVE) compiles ggml's AMX kernels in where the CPU has AMX whatever the
# GGML_AMX_* switches say, and on the Intel VMs their first ldtilecfg is a general-protection
# fault in libggml-cpu: the compiler's -mno-amx-* keep them out (a no-op on the AMD)
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMACPP_CMAKE_ARGS=${LLAMACPP_CMAKE_ARGS:-"-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF '-DCMAKE_C_FLAGS=$NO_AMX' '-DCMAKE_CXX_FLAGS=$NO_AMX'"}
OUT=${OUT:-/tmp/ridge-cpu-targets}
FORMATS=${FORMATS:-q8_0,q6_k,q5_k_m,q4_0,q4_k_m,iq4_xs,q3_k_m,q2_k}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

case $(lscpu | sed -n 's/^Model name: *//p' | head -n 1) in
  *AMD*) CPU=amd ;;
  *Intel*) CPU=xeon ;;
  *) CPU=cpu ;;
esac
# an AVX2-only CPU (a Zen 3 EPYC) runs other kernels: its figures must not replace the AVX-512 ones
grep -q -w avx512f /proc/cpuinfo || CPU=${CPU}_avx2
COMPARE_JSON=benchmarks/compare_targets_$CPU.json
files_of() {  # the files of the given types that the 'files' step ran, comma-separated
  "$PYTHON" - "$COMPARE_JSON" "$1" <<'EOF'
import json, os, sys
try:
    ran = json.load(open(sys.argv[1])).get("files", {})
except OSError:
    ran = {}
types = sys.argv[2].split(",")
missing = [t for t in types if not os.path.isfile(ran.get(t, ""))]
if missing:
    sys.exit(f"no file of type {', '.join(missing)} in {sys.argv[1]}: run the 'files' step first")
print(",".join(ran[t] for t in types))
EOF
}

{
  lscpu | grep -E "^Model name|^CPU\(s\)"
  echo "SIMD: $(grep -o -w -E 'avx512f|avx512_vnni|avx512_bf16|gfni|amx_int8|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
} | tee "$OUT/machine.txt"
for step in "$@"; do
  echo "== $step ($(date -u +%H:%M:%S))"
  case $step in
  peers)
    if ! "$PYTHON" -c "import llama_cpp" 2>/dev/null; then
      CMAKE_ARGS="$LLAMACPP_CMAKE_ARGS" "$PYTHON" -m pip install --no-cache-dir --no-binary llama-cpp-python \
        llama-cpp-python==0.3.36 > "$OUT/llama_cpp_build.log" 2>&1 || { tail -n 20 "$OUT/llama_cpp_build.log"; exit 1; }
    fi
    "$PYTHON" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
    if [ ! -x "$IK_BENCH" ]; then
      [ -n "${IK_SRC:-}" ] || { echo "set IK_SRC (ik_llama.cpp's source) or IK_BENCH" >&2; exit 1; }
      src=$(dirname "$(dirname "$(dirname "$IK_BENCH")")")  # IK_BENCH's build/bin/.. -> its source tree
      git_dir=$IK_SRC
      [ -d "$IK_SRC/.git" ] && git_dir=$IK_SRC/.git
      # a `fetch` snapshot lacks its largest blobs (web pages, vocabularies): leave those out
      git --git-dir="$git_dir" ls-tree -r "$IK_COMMIT" > "$OUT/ik_tree.txt" || exit 1
      mapfile -t absent < <(cut -f1 "$OUT/ik_tree.txt" | cut -d' ' -f3 | git --git-dir="$git_dir" cat-file --batch-check |
        paste - <(cut -f2 "$OUT/ik_tree.txt") | awk -F'\t' '$1 ~ / missing$/ {print ":(exclude)" $2}')
      mkdir -p "$src" && git --git-dir="$git_dir" archive "$IK_COMMIT" -- . "${absent[@]}" 2> "$OUT/ik_archive.log" |
        tar -x -C "$src" || exit 1
      (cd "$src" && cmake -B build -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_CURL=OFF > "$OUT/ik_build.log" 2>&1 &&
        cmake --build build --target llama-bench -j "$(nproc)" >> "$OUT/ik_build.log" 2>&1) ||
        { tail -n 20 "$OUT/ik_build.log"; exit 1; }
    fi
    echo "ik llama-bench: $IK_BENCH"
    ;;
  files)
    "$PYTHON" benchmarks/compare.py --formats "bf16,$FORMATS" --scenarios batch1 --rounds "$ROUNDS" \
      --threads "$THREADS" --num-scheduler-steps "$STEPS" --skip-transformers --json "$COMPARE_JSON" 2>&1 |
      tee "$OUT/compare.log" | tail -n 40
    ;;
  ik)
    files=$(files_of "$FORMATS") || exit 1
    "$PYTHON" benchmarks/vs_ik.py --llama-bench "$IK_BENCH" --files "$files" --rounds "$ROUNDS" \
      --threads "$THREADS" --num-scheduler-steps "$STEPS" 2>&1 | tee "$OUT/vs_ik.log" | tail -n 12
    ;;
  plan)
    files=$(files_of q4_k_m,q8_0) || exit 1
    for file in ${files//,/ }; do
      "$PYTHON" benchmarks/decode_plan.py --model "$file" --rounds 3 --threads "$THREADS" 2>&1 |
        tee "$OUT/decode_plan_$(basename "$file" .gguf).log" | tail -n 6
    done
    ;;
  prefetch)
    tables="amd;zen5;intel"
    [ "$CPU" = amd ] && for key in quant_far_scales=1 quant_alternate=1 quant_interleave=1 quant_far_kib=24 quant_far_nta=1; do
      tables="$tables;cpu,$key"
    done
    "$PYTHON" benchmarks/prefetch.py --policies "${PREFETCH_POLICIES:-$tables}" \
      --rounds 7 --threads "$THREADS" 2>&1 | tee "$OUT/prefetch.log" | tail -n 40
    ;;
  policies)
    files=$(files_of "${STEP_FORMATS:-q4_0,q4_k_m,q6_k}") || exit 1
    "$PYTHON" benchmarks/prefetch.py --policies "${PREFETCH_STEP_POLICIES:-cpu;cpu,quant_far_scales=1;cpu,quant_alternate=1;cpu,quant_far_scales=1,quant_alternate=1}" \
      --steps "$files" --rounds 7 --threads "$THREADS" --num-scheduler-steps "$STEPS" 2>&1 |
      tee "$OUT/prefetch_steps.log" | grep -v '^ridge: ' | tail -n 8
    ;;
  rows)
    "$PYTHON" benchmarks/quant_rows.py --rounds 3 --threads "$THREADS" 2>&1 | tee "$OUT/quant_rows.log" | tail -n 16
    ;;
  kv)
    "$PYTHON" benchmarks/quantized_decode.py --rounds 3 2>&1 | tee "$OUT/quantized_decode.log" | tail -n 30
    ;;
  jobs)
    "$PYTHON" benchmarks/decode_attention.py --rounds 5 --threads "$THREADS" 2>&1 | tee "$OUT/decode_attention.log" | tail -n 20
    ;;
  targets)
    "$PYTHON" benchmarks/targets.py --compare "$COMPARE_JSON" | tee "$OUT/targets.md"
    ;;
  *)
    echo "unknown step $step (prefetch peers files ik plan rows kv jobs targets policies)" >&2
    exit 2
    ;;
  esac
done
