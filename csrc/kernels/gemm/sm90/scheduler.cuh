// The tile orders of moegemm's persistent GEMMs: ragged rows (fprop, dgrad), read from the plan
// (csrc/kernels/plan/plan.cuh), and ragged reduction (wgrad).
//
// Ragged rows:
// Expert e owns the 128-row blocks [blk[e], blk[e+1]) of the plan's third row; each M tile starts at a
// block of its expert (row tok[e] + 128 i), so no tile mixes experts' weights and nothing is padded:
// the rows of an expert's last tile that belong to the next expert are computed and not stored. Each
// row block is split into n_blocks column tiles of BLOCK_N.
//
// Tile ids run expert by expert; within an expert, in bands of kBandRows row blocks walked column by
// column, so that the SMs working at one time share a band of A rows and a few B column tiles in L2
// (16 rows measured at least as fast as 8 and 32 on the H200; docs/performance.md, Ragged-row GEMM).
// The grid walks the ids statically (no atomics), in clusters of kCluster CTAs: cluster c takes the id
// groups c, c + clusters, ... and its CTA of rank r the id kCluster * group + r (the last group may be
// short: its missing ids repeat the group's first tile, computed but not stored). A CTA's producer and
// consumers walk the same ids, the producer running ahead by the pipeline's depth. Consecutive ids mostly
// share an expert and a column tile (or, with one row block per band, a row block), which a cluster's
// CTAs load once for both (TMA multicast).
#pragma once

#include <cstdint>

#include "kernels/plan/plan.cuh"

namespace moegemm::sm90 {

struct RowTile {
  int expert;
  int row0;     // first row of the tile (a token index)
  int rows;     // rows of the tile that belong to `expert` (1..128)
  int n_block;  // column tile
};

constexpr int kBandRows = 16;

// Tile `local` of an m_blocks x n_blocks grid walked in bands of `band` row blocks, column by column within a
// band (the last band may be narrower): its row block m and column tile n.
struct GridTile {
  int m, n;
};
__host__ __device__ __forceinline__ GridTile banded_tile(int local, int m_blocks, int n_blocks, int band) {
  const int b = local / (band * n_blocks);
  const int band_rows = min(band, m_blocks - b * band);
  const int in_band = local - b * band * n_blocks;
  return {b * band + in_band % band_rows, in_band / band_rows};
}

// Tile ids are 32-bit: the launcher refuses problems of 2^31 tiles or more (block_capacity x column tiles).
struct RaggedRowTiles {
  const int32_t* tok;  // the plan's token starts [E + 1]
  const int32_t* blk;  // the plan's 128-row block starts [E + 1]
  int E;
  int n_blocks;

  __device__ __forceinline__ int count() const { return blk[E] * n_blocks; }

  // Tile `id` by a whole warp (every lane calls it with the same arguments), which walks a CTA's ids in
  // non-decreasing order: `from` holds the expert of the walk's previous id (-1 before the first) and is advanced to
  // this one's. Its owner is then usually one warp vote's load away (one per 32 experts passed; plan.cuh), not
  // log2(E) dependent loads as a binary search's, then one round of loads for its rows.
  __device__ __forceinline__ RowTile at_after(int id, int& from) const {
    const int b = id / n_blocks;
    from = from >= 0 ? walk_expert(blk, E, b, from) : expert_of(blk, E, b);
    return in_expert(id, from);
  }

 private:
  // tile `id` of expert e
  __device__ __forceinline__ RowTile in_expert(int id, int e) const {
    const int local = id - blk[e] * n_blocks;
    const GridTile t = banded_tile(local, blk[e + 1] - blk[e], n_blocks, kBandRows);
    const int row0 = tok[e] + t.m * kBlock;
    return {e, row0, min(kBlock, tok[e + 1] - row0), t.n};
  }
};

// What the CTAs of a 2-CTA cluster load once for both (TMA multicast): the weight tile when their tiles
// are one expert's at the same columns, the activation tile when they are the same rows.
enum class Shared : int { kNone, kB, kA };

__device__ __forceinline__ Shared shared_operand(const RowTile& t, const RowTile& u) {
  if (t.expert != u.expert) return Shared::kNone;
  if (t.n_block == u.n_block) return Shared::kB;
  return t.row0 == u.row0 ? Shared::kA : Shared::kNone;
}

// Ragged reduction: every expert owns the same m_blocks x n_blocks output tiles of its gradient [N, K]; the
// tokens of the expert are the tile's reduction, so its length is the expert's (none for an empty expert).
// Ids run expert by expert; within an expert row-major (band 0: the CTAs working at one time share a few A
// row tiles and stream the expert's B) or in bands of `band` row blocks walked column by column (they share
// about `band` row tiles and a few column tiles; heuristics.h chooses). The grid walks the ids dynamically:
// each CTA draws the next id from a tile counter when it needs one (fp8_ragged_reduction.cuh), so that the
// CTAs working at one time hold consecutive ids and a long reduction holds up only its own CTA.
struct ReductionTile {
  int expert;
  int m_block;
  int n_block;
};

// Tile ids are 32-bit: the launcher refuses problems of 2^31 tiles less two per CTA or more (the counter draws past the last).
struct RaggedReductionTiles {
  int E;
  int m_blocks;
  int n_blocks;
  int band;  // row blocks per band, 0 for row-major

  __device__ __forceinline__ int count() const { return E * m_blocks * n_blocks; }

  __device__ __forceinline__ ReductionTile at(int id) const {
    const int per_expert = m_blocks * n_blocks;
    const int e = id / per_expert, local = id - e * per_expert;
    if (band == 0) return {e, local / n_blocks, local % n_blocks};
    const GridTile t = banded_tile(local, m_blocks, n_blocks, band);
    return {e, t.m, t.n};
  }
};

}  // namespace moegemm::sm90
