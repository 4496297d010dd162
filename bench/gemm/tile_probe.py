"""Where an FP8 GEMM's cycles go, tile by tile (a diagnostic, not a benchmark): the ragged-row GEMM (fprop,
dgrad) or, with --wgrad, the ragged-reduction GEMM (wgrad).

Builds an instrumented copy of the extension in a temporary directory: the copy's kernel
(csrc/kernels/gemm/sm90/fp8_ragged_rows.cuh or fp8_ragged_reduction.cuh) gets a probe in which lane 0 of each math
warpgroup records, for every tile, clock64 at the tile's start, when its first stage is full, after its fourth K
block (ragged rows) or when its first epilogue buffer is free of the last tile's stores (wgrad), at
the end of its K loop and of its epilogue, the cycles its K loop spent waiting on full barriers, and its rows (or
tokens), expert and SM, and (ragged rows) the global timer when its first stage is full; moegemm's own sources are
not changed. Then it runs each chosen problem of the GEMM table (bench/gemm/ragged_rows.py,
bench/gemm/ragged_reduction.py) once per tiling with the copy and prints, per problem and warpgroup, the shares of a
CTA's time and the cycles per 128-deep K block, and (ragged rows) how far apart in time the tiles that read the same
weight tile or the same activation rows got their first stage (the global timer is common to all SMs; identical
reads that arrive close together can be merged in L2). Cycles, not time: the FP8 GEMMs run at the board's power cap,
where a kernel that saves cycles gets a lower clock back (python -m bench.gemm.power shows both).

With --stages (ragged rows), the probe instead follows each CTA's first STAGES pipeline stages through the roles
that fill and drain them: when the TMA warp waited for the stage to be empty and issued its copies, when the scale warp
stored its weight scales and arrived, when math warpgroup 0 started the K block, saw the stage full and released it, and
when warpgroup 1 saw it full; it prints how often and how long the math waited for a stage, and how far ahead of the
math the copies and the scales were (a stage the math waits for, whose copies went out long before while the scales
arrived just in time, waits on the scale warp).

    python -m bench.gemm.tile_probe "Small experts E=64 zipf fc1 fprop,DeepSeek-V3-EP8 zipf fc1 fprop" [--tilings=-1,1]
    python -m bench.gemm.tile_probe --stages "DeepSeek-V3-EP8 zipf fc1 fprop" [--tilings=4,1]
    python -m bench.gemm.tile_probe --wgrad "DeepSeek-V2-Lite zipf fc1 wgrad" [--bf16] [--tilings=-1,2]

The probe is inserted at text anchors of the kernel source; when the kernel changes so that one is missing,
the tool stops and names it. (The --stages probe's anchors predate the ragged-row kernel's specialized K loop and
deferred epilogue: it stops so.) The ragged-row kernel's deferred epilogue (a tile's epilogue run inside the next
tile's first K block) is timed apart and counted as epilogue.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.preflight import require_cuda_gpu

PROG = "python -m bench.gemm.tile_probe"
ROOT = Path(__file__).resolve().parents[2]
KERNEL = "csrc/kernels/gemm/sm90/fp8_ragged_rows.cuh"
LAUNCHER = "csrc/kernels/gemm/sm90/fp8_ragged_rows.cu"
WGRAD_KERNEL = "csrc/kernels/gemm/sm90/fp8_ragged_reduction.cuh"
WGRAD_LAUNCHER = "csrc/kernels/gemm/sm90/fp8_ragged_reduction.cu"
RECORD = 9  # uint64 values per tile and warpgroup; the eighth non-zero for a tile that wrote its record

# (anchor, replacement) pairs, applied in order to the copy's kernel and launcher
KERNEL_EDITS = [
    ("  bool bias_f32;\n  int E, T, N, K;",
     "  bool bias_f32;\n  int E, T, N, K;\n  unsigned long long* probe;"),
    ("        Barrier::wait(&full[stage], phase);\n        const RowTile t = smem_tile[stage];",
     "        c_start = clock64();\n        Barrier::wait(&full[stage], phase);\n        c_ready = clock64();\n"
     "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(g_ready));\n"
     "        const RowTile t = smem_tile[stage];"),
    ("      int rows, parts, lo_chunks, row0, n0, expert;",
     "      int rows, parts, lo_chunks, row0, n0, expert;\n      long long c_start, c_ready, c_kb4 = 0, w_loop = 0, c_epi = 0;\n"
     "      int kbs = 0;\n      unsigned long long g_ready;"),
    ("          if (!full_next) Barrier::wait(&full[s], ph);",
     "          if (++kbs == 5) c_kb4 = clock64();\n"
     "          if (!full_next) { const long long c0 = clock64(); Barrier::wait(&full[s], ph); w_loop += clock64() - c0; }"),
    # the previous tile's deferred epilogue, run inside this tile's K loop: timed apart
    ("          issue_chain(stage, 0);\n          epilogue(finished);\n",
     "          issue_chain(stage, 0);\n          { const long long e0 = clock64(); epilogue(finished); c_epi += clock64() - e0; }\n"),
    ("        if constexpr (Cfg::kDeferEpilogue) epilogue(finished);\n        for (int kb = 0; kb < Kb; ++kb) {",
     "        if constexpr (Cfg::kDeferEpilogue) { const long long e0 = clock64(); epilogue(finished); c_epi += clock64() - e0; }\n"
     "        for (int kb = 0; kb < Kb; ++kb) {"),
    ("      // ---- this tile's epilogue: now, or deferred",
     "      const long long c_loop = clock64();\n      if (c_kb4 == 0) c_kb4 = c_loop;\n"
     "      // ---- this tile's epilogue: now, or deferred"),
    ("      else epilogue(done);\n    }\n",
     "      else epilogue(done);\n"
     "      if (p.probe != nullptr && tid == 0) {\n"
     "        unsigned smid;\n"
     "        asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     f"        unsigned long long* q = p.probe + ((int64_t(g) * kCluster + rank) * 2 + warpgroup) * {RECORD};\n"
     "        q[0] = c_start, q[1] = c_ready, q[2] = c_kb4, q[3] = c_loop, q[4] = clock64(), q[5] = w_loop;\n"
     "        q[6] = (unsigned long long)rows | ((unsigned long long)expert << 8) | ((unsigned long long)smid << 40);\n"
     "        q[7] = g_ready, q[8] = c_epi;\n"
     "      }\n    }\n"),
]
# --stages: per CTA (blockIdx.x) and stage (the order every role walks the same), STAGE_RECORD values: the TMA warp
# before its empty wait and at its issue, the scale warp before its empty wait and at its arrival, math warpgroup 0 at
# the K block's start, when the stage is full and after its release, warpgroup 1 when the stage is full.
STAGES = 512  # stages recorded per CTA
STAGE_RECORD = 8
FILL_STAGES = 8  # each CTA's first stages, the launch's fill: left out of the summary


def _stage_store(slots: str) -> str:
    return (f"if (p.probe != nullptr && si < {STAGES}) {{ unsigned long long* q = p.probe + (int64_t(blockIdx.x) * {STAGES} + si) "
            f"* {STAGE_RECORD}; {slots} }}")


STAGE_KERNEL_EDITS = [
    KERNEL_EDITS[0],
    ("      walk(cluster, next, next_shared);\n", "      walk(cluster, next, next_shared);\n      int si = 0;\n"),
    ("          Barrier::wait(&empty[stage], phase ^ 1);\n          if (lane == 0) {\n            smem_tile[stage] = t;",
     "          const long long q0 = clock64();\n          Barrier::wait(&empty[stage], phase ^ 1);\n"
     f"          if (lane == 0) {_stage_store('q[0] = q0; q[1] = clock64();')}\n"
     "          if (lane == 0) {\n            smem_tile[stage] = t;"),
    ("          if (kb == 0) walk(g + clusters, next, next_shared);\n", "          if (kb == 0) walk(g + clusters, next, next_shared);\n          ++si;\n"),
    ("      for (int i = 0; i < kRing - 1; ++i) load_next(ring[i]);\n",
     "      for (int i = 0; i < kRing - 1; ++i) load_next(ring[i]);\n      int si = 0;\n"),
    ("          load_next(ring[(r + kRing - 1) % kRing]);\n          Barrier::wait(&empty[stage], phase ^ 1);\n",
     "          load_next(ring[(r + kRing - 1) % kRing]);\n          const long long q2 = clock64();\n          Barrier::wait(&empty[stage], phase ^ 1);\n"),
    ("            Barrier::arrive(&full[stage]);  // each storing lane releases its own store\n          }\n",
     f"            if (lane == 0) {_stage_store('q[2] = q2; q[3] = clock64();')}\n"
     "            Barrier::arrive(&full[stage]);  // each storing lane releases its own store\n          }\n          ++si;\n"),
    ("    int stage = 0;\n    uint32_t phase = 0;\n    uint8_t* smem_d_wg", "    int si = 0;\n    int stage = 0;\n    uint32_t phase = 0;\n    uint8_t* smem_d_wg"),
    ("          if (!full_next) Barrier::wait(&full[stage], phase);\n",
     "          const long long m0 = clock64();\n          if (!full_next) Barrier::wait(&full[stage], phase);\n          const long long m1 = clock64();\n"),
    ("              release(stage);\n              full_next = next_stage_full<kStages>(full, stage, phase);\n",
     "              release(stage);\n              full_next = next_stage_full<kStages>(full, stage, phase);\n"
     f"              if (tid == 0) {_stage_store('if (warpgroup == 0) q[4] = m0, q[5] = m1, q[6] = clock64(); else q[7] = m1;')}\n"),
    ("          if (++stage == kStages) stage = 0, phase ^= 1;\n        }\n      } else {",
     "          if (++stage == kStages) stage = 0, phase ^= 1;\n          ++si;\n        }\n      } else {"),
    ("          release(stage);\n          if (++stage == kStages) stage = 0, phase ^= 1;\n        }\n",
     "          release(stage);\n          if (++stage == kStages) stage = 0, phase ^= 1;\n          ++si;\n        }\n"),
]
# The wgrad kernel's record: start, first stage full, K loop end, first epilogue buffer free (the last tile's store
# from it done), epilogue end, K loop waits, tokens | expert << 32 | SM << 44, 1.
WGRAD_KERNEL_EDITS = [
    ("  int64_t cols, blocks;\n};", "  int64_t cols, blocks;\n  unsigned long long* probe;\n};"),
    ("      const int m = __shfl_sync(0xffffffff, cur.m, 0);\n",
     "      const int m = __shfl_sync(0xffffffff, cur.m, 0);\n      long long c_start = clock64(), c_ready = c_start, w_loop = 0;\n"),
    ("        if (!full_next) Barrier::wait(&full[stage], phase);\n        full_next = false;",
     "        if (!full_next) { const long long c0 = clock64(); Barrier::wait(&full[stage], phase); if (k0 > 0) w_loop += clock64() - c0; }\n"
     "        if (k0 == 0) c_ready = clock64();\n        full_next = false;"),
    ("      // ---- epilogue: this warpgroup's 64 rows of the tile, slab by slab\n",
     "      const long long c_loop = clock64();\n      long long c_buffer = c_loop;\n"
     "      // ---- epilogue: this warpgroup's 64 rows of the tile, slab by slab\n"),
    ("          cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + warpgroup);\n          constexpr int kChunks",
     "          cutlass::arch::NamedBarrier::sync(128, kEpilogueBarrier + warpgroup);\n"
     "          if (h == 0 && s == 0) c_buffer = clock64();\n          constexpr int kChunks"),
    ("            cute::tma_store_arrive();\n          }\n        }\n      }\n    }\n    if (Cfg::kTakeTurns && warpgroup == 0)",
     "            cute::tma_store_arrive();\n          }\n        }\n      }\n"
     "      if (p.probe != nullptr && tid == 0) {\n"
     "        unsigned smid;\n"
     "        asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid));\n"
     f"        unsigned long long* q = p.probe + (int64_t(id) * 2 + warpgroup) * {RECORD};\n"
     "        q[0] = c_start, q[1] = c_ready, q[2] = c_loop, q[3] = c_buffer, q[4] = clock64(), q[5] = w_loop;\n"
     "        q[6] = (unsigned long long)m | ((unsigned long long)t.expert << 32) | ((unsigned long long)smid << 44);\n"
     "        q[7] = 1;\n"
     "      }\n"
     "    }\n    if (Cfg::kTakeTurns && warpgroup == 0)"),
]
WGRAD_LAUNCHER_EDITS = [
    ("#include <algorithm>", "#include <algorithm>\n#include <cstdlib>"),
    ("  k.cols = p.cols, k.blocks = p.blocks;\n",
     "  k.cols = p.cols, k.blocks = p.blocks;\n"
     "  if (const char* v = std::getenv(\"MOEGEMM_TILE_PROBE\")) k.probe = reinterpret_cast<unsigned long long*>(std::strtoull(v, nullptr, 10));\n"),
]
LAUNCHER_EDITS = [
    ("#include <array>", "#include <array>\n#include <cstdlib>"),
    ("  k.E = p.E, k.T = int(p.T), k.N = int(p.N), k.K = int(p.K);\n",
     "  k.E = p.E, k.T = int(p.T), k.N = int(p.N), k.K = int(p.K);\n"
     "  if (const char* v = std::getenv(\"MOEGEMM_TILE_PROBE\")) k.probe = reinterpret_cast<unsigned long long*>(std::strtoull(v, nullptr, 10));\n"),
]


def parse_args():
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("problems", help="comma-separated labels of bench.gemm.ragged_rows' problems (with --wgrad, "
                    "bench.gemm.ragged_reduction's; balanced splits included)")
    ap.add_argument("--wgrad", action="store_true", help="the ragged-reduction (wgrad) kernel, accumulating into fp32")
    ap.add_argument("--stages", action="store_true", help="ragged rows: follow each CTA's first stages through the producer's "
                    "warps and the math warpgroups instead of timing tiles")
    ap.add_argument("--bf16", action="store_true", help="with --wgrad: bf16 output instead of the fp32 accumulation")
    ap.add_argument("--tilings", default="-1", help="comma-separated tilings, heuristics.h's indices, -1 the heuristic's (write --tilings=-1,1)")
    ap.add_argument("--keep", default=None, help="build the instrumented copy in this directory and keep it")
    args = ap.parse_args()
    if args.stages and args.wgrad:
        ap.error("--stages follows the ragged-row kernel's stages; it does not go with --wgrad")
    return args


def patch(path: Path, edits: list) -> None:
    text = path.read_text()
    for anchor, replacement in edits:
        if text.count(anchor) != 1:
            raise SystemExit(f"{PROG}: {path.relative_to(path.parents[4])}: the probe's anchor is gone or not unique "
                             f"(the kernel changed; update bench/gemm/tile_probe.py):\n{anchor}")
        text = text.replace(anchor, replacement)
    path.write_text(text)


def instrumented_copy(dest: Path, stages: bool, wgrad: bool) -> None:
    """The copy with the probe in the kernel it follows only (the other kernel is built as it is)."""
    for d in ("moegemm", "csrc", "bench", "third_party"):
        # (not a prebuilt extension: the copy must build and load its own, instrumented one)
        shutil.copytree(ROOT / d, dest / d, ignore=shutil.ignore_patterns("__pycache__", "results", "_C*.so", "_csrc"),
                        dirs_exist_ok=True)
    if wgrad:
        patch(dest / WGRAD_KERNEL, WGRAD_KERNEL_EDITS)
        patch(dest / WGRAD_LAUNCHER, WGRAD_LAUNCHER_EDITS)
    else:
        patch(dest / KERNEL, STAGE_KERNEL_EDITS if stages else KERNEL_EDITS)
        patch(dest / LAUNCHER, LAUNCHER_EDITS)


def per_sm(rs):
    """A warpgroup's records grouped by SM, and the sum over SMs of first start to last end (records' fields 2, 6, 8)."""
    by_sm = {}
    for r in rs:
        by_sm.setdefault(r[8], []).append(r)
    return by_sm, sum(max(x[6] for x in lst) - min(x[2] for x in lst) for lst in by_sm.values())


def print_shares(wg: int, rs, by_sm, span: int, share: dict) -> None:
    line = ", ".join(f"{k} {100 * v / span:.1f} %" for k, v in share.items())
    print(f"  warpgroup {wg}: {len(rs)} tiles on {len(by_sm)} SMs; of a CTA's time: {line}")


def summarize(label: str, T: int, N: int, K: int, records, ms: float) -> None:
    """records: (id, warpgroup, start, ready, after four K blocks, K loop end, end, K loop waits, SM, rows, first
    stage's arrival on the global timer, cycles of the previous tile's deferred epilogue run inside this tile's K
    loop). A deferred epilogue counts as epilogue, not as the K loop it ran in."""
    kb = -(-K // 128)
    print(f"== {label}: T {T}, N {N}, K {K}; {ms * 1e3:.1f} us with the probe")
    for wg in (0, 1):
        rs = [r for r in records if r[1] == wg]
        if not rs:
            continue
        by_sm, span = per_sm(rs)
        share = dict(start_wait=0, loop_full=0, loop_partial=0, loop_idle=0, epilogue=0)
        full = []
        for _, _, start, ready, kb4, loop, end, wait, _, rows, _, deferred in rs:
            share["start_wait"] += ready - start
            key = "loop_full" if rows == 64 else "loop_partial" if rows > 0 else "loop_idle"
            share[key] += loop - ready - deferred
            share["epilogue"] += end - loop + deferred
            if rows == 64:
                full.append((ready, kb4 - deferred, loop - deferred, wait))  # (the deferred epilogue runs in the first block)
        print_shares(wg, rs, by_sm, span, share)
        if full and kb > 4:
            first = sum(k4 - rd for rd, k4, _, _ in full) / len(full) / 4
            later = sum(lp - k4 for _, k4, lp, _ in full) / len(full) / (kb - 4)
            wait = sum(w for *_, w in full) / sum(lp - rd for rd, _, lp, _ in full)
            print(f"    full tiles: cycles per K block {first:.0f} (first four), {later:.0f} (later); full-barrier waits "
                  f"{100 * wait:.1f} % of their K loops")


def tile_coordinates(splits: list, n_blocks: int, band: int) -> list:
    """(expert, row block, column tile, band) of every tile id of the ragged-row walk (scheduler.cuh: experts in
    turn, each in bands of `band` row blocks walked column by column)."""
    out = []
    for e, m in enumerate(splits):
        blocks = -(-m // 128)
        for local in range(blocks * n_blocks):
            b = local // (band * n_blocks)
            band_rows = min(band, blocks - b * band)
            in_band = local - b * band * n_blocks
            out.append((e, b * band + in_band % band_rows, in_band // band_rows, b))
    return out


def print_skew(splits: list, N: int, records) -> None:
    """How far apart in time the tiles that read the same weight tile (an expert's column tile, within one band) or
    the same activation rows (a row block at two neighbouring column tiles) got their first stage: the spread of
    the global timer over each such group, against a tile's time on its SM."""
    import statistics

    rs = {r[0]: r for r in records if r[1] == 0}  # warpgroup 0: every tile has its record
    row_blocks = sum(-(-m // 128) for m in splits)
    # the tiling's width: the one whose tile count the ids fill (a cluster's repeated last tile may add one id)
    widths = [w for w in (128, 192, 256) if sum(1 for i in rs if i < row_blocks * -(-N // w)) == row_blocks * -(-N // w)
              and max(rs) <= row_blocks * -(-N // w)]
    if not widths:
        return
    coords = tile_coordinates(splits, -(-N // widths[0]), 16)  # scheduler.cuh kBandRows
    groups_b, groups_a = {}, {}
    for i, (e, m, n, b) in enumerate(coords):  # (the width check above: every id of the walk has its record)
        groups_b.setdefault((e, n, b), []).append(rs[i][10])
        groups_a.setdefault((e, m, n // 2), []).append(rs[i][10])
    by_sm = {}
    for i, r in rs.items():
        if i < len(coords):
            by_sm.setdefault(r[8], []).append(r[10])
    gaps = [b - a for ts in by_sm.values() for a, b in zip(sorted(ts), sorted(ts)[1:])]

    def spread(groups):
        s = sorted(max(ts) - min(ts) for ts in groups.values() if len(ts) > 1)
        return (statistics.median(s), s[int(0.9 * (len(s) - 1))]) if s else (0, 0)

    (bm, b90), (am, a90) = spread(groups_b), spread(groups_a)
    print(f"    first-stage skew (global timer): tiles sharing a weight tile {bm / 1e3:.1f} us median, {b90 / 1e3:.1f} p90; "
          f"sharing activation rows {am / 1e3:.1f} / {a90 / 1e3:.1f}; a tile on its SM takes {statistics.median(gaps) / 1e3:.1f} us")


def summarize_stages(label: str, records) -> None:
    """records: per stage (STAGE_RECORD values, see STAGE_KERNEL_EDITS) of every CTA past its first FILL_STAGES; only
    the stages that every role recorded count."""

    def pct(xs, ps=(50, 90, 99)):
        xs = sorted(xs)
        return " / ".join(str(xs[int(p / 100 * (len(xs) - 1))]) for p in ps) if xs else "-"

    rows = [r for r in records if r[1] and r[3] and r[5] and r[7]]
    if not rows:
        print(f"== {label}: no stage recorded")
        return
    waited = [r for r in rows if r[5] - r[4] > 60]  # (a wait that found the stage full takes ~60 cycles)
    span = sum(r[6] - r[4] for r in rows)
    print(f"== {label}: {len(rows)} stages; warpgroup 0 waited for {len(waited)} ({100 * len(waited) / len(rows):.1f} %), "
          f"{100 * sum(max(r[5] - r[4], 0) for r in rows) / max(span, 1):.1f} % of its K blocks' time")
    print(f"    cycles p50 / p90 / p99: copies issued before the math needed the stage {pct([r[4] - r[1] for r in rows])}; "
          f"weight scales stored before {pct([r[4] - r[3] for r in rows])}")
    print(f"    the TMA warp's empty wait {pct([r[1] - r[0] for r in rows])}; the scale warp's {pct([r[3] - r[2] for r in rows])}; "
          f"a K block from its start to its release {pct([r[6] - r[4] for r in rows])}; warpgroup 1 saw the stage full "
          f"{pct([r[7] - r[5] for r in rows], (10, 50, 90))} (p10 / p50 / p90) after warpgroup 0")
    if waited:
        print(f"    stages waited for: the wait {pct([r[5] - r[4] for r in waited])}; copies issued "
              f"{pct([r[5] - r[1] for r in waited])} and scales stored {pct([r[5] - r[3] for r in waited])} before the "
              f"stage was seen full; scales stored within 300 cycles of it on {sum(1 for r in waited if r[5] - r[3] < 300)}")


def summarize_wgrad(label: str, T: int, N: int, K: int, records, ms: float) -> None:
    """records: (id, warpgroup, start, ready, loop end, first epilogue buffer free, end, K loop waits, SM, tokens, 1)."""
    print(f"== {label}: T {T}, gradient {N} x {K} per expert; {ms * 1e3:.1f} us with the probe")
    for wg in (0, 1):
        rs = [r for r in records if r[1] == wg]
        if not rs:
            continue
        by_sm, span = per_sm(rs)
        share = dict(start_wait=0, loop=0, buffer_wait=0, epilogue=0)
        boxes = wait = 0
        for _, _, start, ready, end_loop, buffer, end, w, _, tokens, _, _ in rs:
            share["start_wait"] += ready - start
            share["loop"] += end_loop - ready
            share["buffer_wait"] += buffer - end_loop
            share["epilogue"] += end - buffer
            boxes += -(-tokens // 128)
            wait += w
        print_shares(wg, rs, by_sm, span, share)
        if boxes:
            print(f"    K loop: {share['loop'] / boxes:.0f} cycles per 128-token box, full-barrier waits "
                  f"{100 * wait / max(share['loop'], 1):.1f} % of it; epilogue {share['epilogue'] / len(rs):.0f} cycles per tile")


def chosen_problems(args, table: list, tool: str) -> list:
    """(label, splits, N, K) of the requested labels of a GEMM table, in the order asked."""
    found = {label: (label, s, N, K) for label, s, N, K in table}
    wanted = [p.strip() for p in args.problems.split(",")]
    missing = [w for w in wanted if w not in found]
    if missing:
        raise SystemExit(f"{PROG}: no such problem: {missing} (see python -m {tool})")
    return [found[w] for w in wanted]


def probed_run(call, probe) -> float:
    """Runs `call` three times, then once writing its records into `probe` (the instrumented launchers read its
    address from MOEGEMM_TILE_PROBE); the milliseconds of the probed call."""
    import torch

    for _ in range(3):
        call()
    os.environ["MOEGEMM_TILE_PROBE"] = str(probe.data_ptr())
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    call()
    b.record()
    b.synchronize()
    del os.environ["MOEGEMM_TILE_PROBE"]
    return a.elapsed_time(b)


def probe_call(call, ids: int, unpack) -> tuple:
    """The records (id, warpgroup, the six clocks, then unpack(meta)..., the last two slots) of the tiles that wrote one
    in a probed run of `call` with a buffer for `ids` tile ids, and the milliseconds of that run."""
    import torch

    probe = torch.zeros(ids * 2 * RECORD, dtype=torch.int64, device="cuda")
    ms = probed_run(call, probe)
    records = [(i, wg, *v[:6], *unpack(v[6]), v[7], v[8]) for i, pair in enumerate(probe.view(-1, 2, RECORD).cpu().tolist())
               for wg, v in enumerate(pair) if v[7] != 0]
    if not records:
        raise SystemExit(f"{PROG}: the probe recorded nothing: the instrumented extension was not the one loaded")
    return records, ms


def child(args) -> int:
    import torch

    from bench.gemm.mlp_problems import ops  # builds or loads the instrumented extension

    tilings = [int(t) for t in args.tilings.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.wgrad:
        from bench.gemm.ragged_reduction import problems
        from moegemm.layout import GEMM_SM90

        for label, splits, N, K in chosen_problems(args, problems(False, None), "bench.gemm.ragged_reduction"):
            E, T = len(splits), sum(splits)
            plan = ops.make_plan(torch.tensor(splits, device="cuda"), T)
            _, _, qa, sa = ops.quantize_act(torch.randn(T, N, device="cuda", generator=gen).to(torch.bfloat16), plan, rows=False)
            _, _, qb, sb = ops.quantize_act(torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16), plan, rows=False)
            out = torch.zeros(E, N, K, device="cuda")
            for tiling in tilings:
                if args.bf16:
                    call = lambda: torch.ops.moegemm.gemm_fp8_ragged_reduction(qa, sa, qb, sb, plan, torch.bfloat16, GEMM_SM90, tiling)
                else:
                    call = lambda: torch.ops.moegemm.gemm_fp8_ragged_reduction_accumulate(qa, sa, qb, sb, plan, out, GEMM_SM90, tiling)
                # ids: at least the narrowest tiling's; meta: tokens | expert << 32 | SM << 44
                records, ms = probe_call(call, E * -(-N // 128) * -(-K // 128) + 2,
                                         lambda m: ((m >> 44) & 0xFFFF, m & 0xFFFFFFFF))
                mode = "bf16 out" if args.bf16 else "fp32 accumulated"
                summarize_wgrad(f"{label}, {mode}, tiling {tiling}", T, N, K, records, ms)
        return 0

    from bench.gemm.ragged_rows import problems

    sms = torch.cuda.get_device_properties(0).multi_processor_count  # --stages: the grid has at most one CTA per SM
    for label, splits, N, K in chosen_problems(args, problems(False), "bench.gemm.ragged_rows"):
        E, T = len(splits), sum(splits)
        plan = ops.make_plan(torch.tensor(splits, device="cuda"), T)
        qx, sx, _, _ = ops.quantize_act(torch.randn(T, K, device="cuda", generator=gen).to(torch.bfloat16), plan, cols=False)
        qw, sw, _, _ = ops.quantize_weight((torch.randn(E, N, K, device="cuda", generator=gen) * 0.05).to(torch.bfloat16))
        for tiling in tilings:
            call = lambda: torch.ops.moegemm.gemm_fp8_ragged_rows(qx, sx, qw, sw, plan, tiling)
            if args.stages:
                probe = torch.zeros(sms * STAGES * STAGE_RECORD, dtype=torch.int64, device="cuda")
                probed_run(call, probe)
                records = [r for cta in probe.view(sms, STAGES, STAGE_RECORD).cpu().tolist() for r in cta[FILL_STAGES:]]
                summarize_stages(f"{label}, tiling {tiling}", records)
                continue
            # ids: at least the narrowest tiling's (and a cluster's repeated last one); meta: rows | expert << 8 | SM << 40
            records, ms = probe_call(call, sum(-(-c // 128) for c in splits) * -(-N // 128) + 2,
                                     lambda m: ((m >> 40) & 0xFFFF, m & 0xFF))
            summarize(f"{label}, tiling {tiling}", T, N, K, records, ms)
            print_skew(splits, N, records)
    return 0


def main() -> int:
    args = parse_args()
    if os.environ.get("MOEGEMM_TILE_PROBE_COPY"):
        return child(args)
    require_cuda_gpu(PROG, hopper=True)
    work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="moegemm_tile_probe_"))
    try:
        instrumented_copy(work, args.stages, args.wgrad)
        env = dict(os.environ, MOEGEMM_TILE_PROBE_COPY="1", TORCH_EXTENSIONS_DIR=str(work / "torch_extensions"),
                   PYTHONPATH=os.pathsep.join([str(work)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        return subprocess.run([sys.executable, "-m", "bench.gemm.tile_probe", *sys.argv[1:]], cwd=work, env=env).returncode
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
