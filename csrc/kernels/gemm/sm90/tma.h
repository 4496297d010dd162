// Host side of moegemm's own sm90 kernels: TMA descriptors (2-D and 3-D tensor maps).
// The driver's cuTensorMapEncodeTiled is looked up once through the runtime (no link against libcuda).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/common/cuda_check.h"

namespace moegemm::sm90 {

// A row-major 2-D tensor [rows, cols] of `elem_bytes`-byte elements with `row_bytes` between rows, read
// or written in boxes of box_rows x box_cols, with the given shared-memory swizzle. Elements outside the
// tensor read as zeros and are not written.
struct Tensor2d {
  const void* ptr;
  CUtensorMapDataType dtype;
  int elem_bytes;
  uint64_t rows, cols, row_bytes;
  uint32_t box_rows, box_cols;
  CUtensorMapSwizzle swizzle;
};

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found),
               "cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled)");
    if (found != cudaDriverEntryPointSuccess || p == nullptr)
      throw std::runtime_error("moegemm: the CUDA driver has no cuTensorMapEncodeTiled (a Hopper driver is needed)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// `mats` such tensors, `mat_bytes` apart ([mats, rows, cols]), read or written in boxes of one matrix's
// box_rows x box_cols.
struct Tensor3d {
  Tensor2d mat;
  uint64_t mats, mat_bytes;
};

inline CUtensorMap encode_tensor_map(const Tensor2d& t, uint32_t rank, uint64_t mats, uint64_t mat_bytes, const char* what) {
  CUtensorMap map{};
  const cuuint64_t dims[3] = {t.cols, t.rows, mats};
  const cuuint64_t strides[2] = {t.row_bytes, mat_bytes};
  const cuuint32_t box[3] = {t.box_cols, t.box_rows, 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(&map, t.dtype, rank, const_cast<void*>(t.ptr), dims, strides, box, elem_strides,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, t.swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw std::runtime_error(std::string("moegemm: ") + what + ": cuTensorMapEncodeTiled failed");
  return map;
}

inline CUtensorMap make_tensor_map(const Tensor2d& t, const char* what) { return encode_tensor_map(t, 2, 1, 0, what); }
inline CUtensorMap make_tensor_map_3d(const Tensor3d& t, const char* what) { return encode_tensor_map(t.mat, 3, t.mats, t.mat_bytes, what); }

}  // namespace moegemm::sm90
