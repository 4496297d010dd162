#!/usr/bin/env bash
# Nsight Compute on the quantization kernels of one expert-MLP step (DeepSeek-V2-Lite shape):
#   bash bench/suite/ncu_quant.sh
cd "$(dirname "$0")/../.."  # the repository root: the bench scripts run as modules from there
if ! command -v ncu >/dev/null; then
  echo "bash bench/suite/ncu_quant.sh needs Nsight Compute (ncu on PATH), and none was found; nothing was run." >&2
  exit 1
fi
ncu --clock-control none --kernel-name regex:"^kernel$|quantize_weight" --launch-count 8 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 -m bench.suite.profile_mlp --shapes DeepSeek-V2-Lite 2>&1 | grep -E "nothing was run|moegemm|quantize_weight|Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Stall|Warp Cycles|Block Limit|Registers|L1/TEX Hit|DRAM Throughput|Mem Busy|Issued" | head -120
