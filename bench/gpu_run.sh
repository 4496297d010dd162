#!/usr/bin/env bash
# One call on the GPU machine: install carried wheels, build the extension, run the GPU tests and the
# quick benchmark; logs under $OUT (default, as bench/outputs.py: ~/.cache/moegemm-bench/gpu_run), a short
# table last. From the repository root:
#   bash bench/gpu_run.sh [pytest args...]
# TRAIN_LM=1 adds the small LM example, TITAN=1 torchtitan's MoE layer (eager; needs torchtitan 0.3.0),
# SANITIZE=1 the compute-sanitizer drivers (tests/sanitize/), SKIP_BENCH=1 leaves the benchmark out, SKIP_TESTS=1 the
# tests, TEST_SHARDS=3 runs them in three parallel pytest processes (bench/pytest_shards.py; the whole suite on an
# H100 takes longer than 600 s in one) and the sanitizers beside them; GEMM_TABLES=1 the FP8 GEMM tables with every
# tiling and DeepGEMM (its source in .peers/DeepGEMM), CONTENTION=1 the contention tables, both written as
# bench/results names them (ragged_rows_<gpu>.md/.json, ...) under $OUT;
# COMPARE_BASE=<folder> the quick suite of an earlier build against this one: the folder holds that build's source
# tree (e.g. `git archive <commit> | tar -x -C <folder>`, carried), built into its own extensions folder; COMPARE_RUNS
# runs of each (default 2) in turns, COMPARE_ARGS the suite's options, compared by bench.suite.compare (compare.md).
set -uo pipefail
OUT=${OUT:-${XDG_CACHE_HOME:-$HOME/.cache}/moegemm-bench/gpu_run}; mkdir -p "$OUT"
cd "$(dirname "$0")/.."  # the repository root: the bench scripts run as modules from there
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=9.0a
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # moegemm and bench from this checkout, for every script
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
start=$(date +%s)
python3 -m moegemm.build 2>&1 | tee "$OUT/build.log" | tail -30 || exit 1
echo "build: $(( $(date +%s) - start )) s"
# compute-sanitizer's memcheck and racecheck over every kernel, and memcheck over the adversarial inputs (invalid device
# m_splits, misaligned views, E = 1024, raw-op misuse): three processes at once
sanitize() {
  for tool in memcheck racecheck; do
    ( compute-sanitizer --tool $tool --error-exitcode 9 python3 tests/sanitize/every_kernel.py > "$OUT/sanitize_$tool.log" 2>&1
      echo "compute-sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)" ) &
  done
  ( compute-sanitizer --tool memcheck --error-exitcode 9 python3 tests/sanitize/adversarial.py > "$OUT/sanitize_adversarial_memcheck.log" 2>&1
    echo "compute-sanitizer memcheck (adversarial): rc=$? $(grep -E 'ERROR SUMMARY|sanitize adversarial:' "$OUT/sanitize_adversarial_memcheck.log" | tail -2 | tr '\n' ' ')" ) &
  wait
}
sanitized=
if [ -z "${SKIP_TESTS:-}" ] && [ "${TEST_SHARDS:-1}" -gt 1 ]; then  # parallel pytest processes (bench/pytest_shards.py)
  if [ -n "${SANITIZE:-}" ]; then sanitize > "$OUT/sanitize.txt" & sanitizer=$! sanitized=1; fi  # beside the tests
  python3 -m bench.pytest_shards --shards "$TEST_SHARDS" --log-dir "$OUT" ${@:-tests} 2>&1 | tee "$OUT/pytest.log"
  grep -h -E '^(FAILED|ERROR) ' "$OUT"/pytest_shard*.log | head -40
  [ -n "$sanitized" ] && { wait "$sanitizer"; cat "$OUT/sanitize.txt"; }
else
  ${SKIP_TESTS:+true} python3 -m pytest -q -x ${@:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'h100|h200' | tr 'A-Z' 'a-z')
gpu=${gpu:-gpu}
if [ -n "${GEMM_TABLES:-}" ]; then  # DeepGEMM's JIT needs the system libstdc++ preloaded (bench/peers/deepgemm.py)
  preload=$(g++ -print-file-name=libstdc++.so.6)
  LD_PRELOAD=$preload python3 -m bench.gemm.ragged_rows --quick --tilings 6 --deepgemm --md "$OUT/ragged_rows_$gpu.md" \
    --json "$OUT/ragged_rows_$gpu.json" 2>&1 | tee "$OUT/ragged_rows.log" | tail -12
  LD_PRELOAD=$preload python3 -m bench.gemm.ragged_reduction --quick --tilings --deepgemm \
    --md "$OUT/ragged_reduction_$gpu.md" --json "$OUT/ragged_reduction_$gpu.json" 2>&1 | tee "$OUT/ragged_reduction.log" | tail -12
fi
[ -n "${CONTENTION:-}" ] && python3 -m bench.gemm.contention --reps 10 --md "$OUT/contention_$gpu.md" \
  --json "$OUT/contention_$gpu.json" 2>&1 | tee "$OUT/contention.log" | tail -12
[ -n "${TRAIN_LM:-}" ] && python3 -m bench.examples.train_lm --out "$OUT" 2>&1 | tee "$OUT/train_lm.log" | tail -12
[ -n "${TITAN:-}" ] && python3 -m bench.examples.torchtitan_layer --modes eager --out "$OUT" 2>&1 | tee "$OUT/torchtitan_layer.log" | tail -16
${SKIP_BENCH:+true} python3 -m bench.suite --quick --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -20
if [ -n "${COMPARE_BASE:-}" ]; then
  base=$(cd "$COMPARE_BASE" && pwd) runs=/tmp/moegemm-compare
  suite_args=${COMPARE_ARGS:---quick --variants moegemm,torch_bf16 --splits zipf,balanced --no-probe --no-sweep --no-jitter --no-plots}
  in_base() { (cd "$base" && TORCH_EXTENSIONS_DIR=/tmp/moegemm-base-extensions PYTHONPATH=/tmp/site:$base \
               MOEGEMM_COMMIT=${COMPARE_BASE_COMMIT:-base} "$@"); }
  mkdir -p "$runs"
  in_base python3 -m moegemm.build > "$runs-build.log" 2>&1 || { tail -20 "$runs-build.log"; exit 1; }
  for i in $(seq "${COMPARE_RUNS:-2}"); do
    in_base python3 -m bench.suite $suite_args --out "$runs/base$i" > "$runs/base$i.log" 2>&1
    python3 -m bench.suite $suite_args --out "$runs/head$i" > "$runs/head$i.log" 2>&1
  done
  python3 -m bench.suite.compare --base "$runs"/base*/results.json --head "$runs"/head*/results.json --md "$OUT/compare.md" | tail -40
fi
if [ -n "${SANITIZE:-}" ] && [ -z "$sanitized" ]; then sanitize; fi
