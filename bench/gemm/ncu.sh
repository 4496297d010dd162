#!/usr/bin/env bash
# Nsight Compute on single production FP8 GEMMs (the CUTLASS kernel after 3 warm-up calls), one report
# each: where a GEMM's time goes. Run on the GPU machine with the extension built:
#   bash bench/gemm/ncu.sh "DeepSeek-V2-Lite zipf:fc1 wgrad bf16" "DeepSeek-V2-Lite zipf:fc2 fprop" ...
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root: the bench scripts run as modules from there
if [ $# -eq 0 ]; then
  echo "usage: bash bench/gemm/ncu.sh \"SHAPE SPLITS:GEMM\" ...   (e.g. \"DeepSeek-V2-Lite zipf:fc1 wgrad bf16\")" >&2
  exit 2
fi
if ! command -v ncu >/dev/null; then
  echo "bash bench/gemm/ncu.sh needs Nsight Compute (ncu on PATH), and none was found; nothing was run." >&2
  exit 1
fi
for case in "$@"; do
  shape=${case%%:*}; gemm=${case#*:}
  echo "== $shape / $gemm"
  ncu --clock-control none -k regex:device_kernel -s 3 -c 1 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
      --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      python3 -m bench.gemm.breakdown --no-ceilings --iters 1 --shapes "$shape" --gemms "$gemm" 2>&1 \
    | grep -vE "^==PROF==|^\s*$" | grep -E "nothing was run|==|Duration|Throughput|Busy|Pipe|Issue|Eligible|Active Warps|No Eligible|Stall|Registers|Shared Memory|Waves|Block Size|Grid Size|Hit Rate|L2|DRAM|Executed Ipc|One or More|Theoretical|Achieved|Cluster|gemm" 
done
