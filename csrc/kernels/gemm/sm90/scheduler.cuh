// The tile order of moegemm's persistent ragged-row GEMMs, read from the plan (csrc/kernels/plan/plan.cuh).
//
// Expert e owns the 128-row blocks [blk[e], blk[e+1]) of the plan's third row; each M tile starts at a
// block of its expert (row tok[e] + 128 i), so no tile mixes experts' weights and nothing is padded:
// the rows of an expert's last tile that belong to the next expert are computed and not stored. Each
// row block is split into n_blocks column tiles of BLOCK_N.
//
// Tile ids run expert by expert; within an expert, in bands of kBandRows row blocks walked column by
// column, so that the SMs working at one time share a band of A rows and a few B column tiles in L2.
// CTA c takes ids c, c + gridDim.x, ... (static, no atomics): a CTA's producer and consumers walk the
// same ids, the producer running ahead by the pipeline's depth.
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

template <int kBandRows>
struct RaggedRowTiles {
  const int32_t* tok;  // the plan's token starts [E + 1] (shared memory)
  const int32_t* blk;  // the plan's 128-row block starts [E + 1] (shared memory)
  int E;
  int n_blocks;

  __device__ __forceinline__ int64_t count() const { return int64_t(blk[E]) * n_blocks; }

  __device__ __forceinline__ RowTile at(int64_t id) const {
    const int e = find_expert(blk, E, id / n_blocks);
    const int64_t local = id - int64_t(blk[e]) * n_blocks;
    const int m_blocks = blk[e + 1] - blk[e];
    const int band = static_cast<int>(local / (int64_t(kBandRows) * n_blocks));
    const int band_rows = min(kBandRows, m_blocks - band * kBandRows);
    const int in_band = static_cast<int>(local - int64_t(band) * kBandRows * n_blocks);
    const int m = band * kBandRows + in_band % band_rows;
    const int row0 = tok[e] + m * kBlock;
    return {e, row0, min(kBlock, tok[e + 1] - row0), in_band / band_rows};
  }
};

}  // namespace moegemm::sm90
