"""moegemm's production FP8 grouped GEMMs on the splits DeepGEMM was timed on (the JSON of
``python -m bench.peers.deepgemm``: 128-aligned token counts per expert), side by side: fprop (bf16 out)
against DeepGEMM's m-grouped contiguous GEMM, wgrad with fp32 accumulation against its k-grouped GEMM
(which accumulates into fp32). Same timing method as the peer (CUDA events per call, median). Operand
preparation is outside the timing on both sides (DeepGEMM's per-expert transposes and scale layouts;
moegemm's quantize_act/quantize_weight).

    python -m bench.gemm.vs_deepgemm PEER_JSON [--iters 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.preflight import require_cuda_gpu

PROG = "python -m bench.gemm.vs_deepgemm"

# DeepGEMM peer GEMM name -> mlp_problems.problems() name
OURS = {"fc1_fprop": "fc1 fprop", "fc2_fprop": "fc2 fprop", "fc1_wgrad": "fc1 wgrad f32+=", "fc2_wgrad": "fc2 wgrad f32+="}


def main():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peer_json", help="the --json of python -m bench.peers.deepgemm")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per GEMM (median)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    require_cuda_gpu(PROG, hopper=True)
    import torch

    from bench.gemm.mlp_problems import problems, time_ms

    doc = json.loads(Path(args.peer_json).read_text())
    rows = []
    print(f"{'shape':20s} {'gemm':10s} {'DeepGEMM ms':>11s} {'moegemm ms':>10s} {'moegemm/DG':>10s}")
    for shape, s in doc["splits"].items():
        recs = {r["gemm"]: r for r in doc["results"] if r["shape"] == shape and r.get("ms")}
        if not recs:
            continue
        ours = {p.name: p for p in problems(s["E"], s["hidden"], s["ffn"], s["tokens_per_expert"])}
        for g, r in recs.items():
            p = ours[OURS[g]]
            ms = time_ms(p.run_production, args.iters)
            rows.append({"shape": shape, "gemm": g, "deepgemm_ms": r["ms"], "moegemm_ms": ms, "speedup": r["ms"] / ms,
                         "tflops_moegemm": p.flops / ms / 1e9, "tflops_deepgemm": p.flops / r["ms"] / 1e9})
            print(f"{shape:20s} {g:10s} {r['ms']:11.3f} {ms:10.3f} {r['ms'] / ms:9.2f}x", flush=True)
        ours = None
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
