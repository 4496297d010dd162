// The lab's variant tables (lab.h).
#include "lab.h"

namespace moegemm_lab {

std::vector<RaggedM>& ragged_m_variants() {
  static std::vector<RaggedM> v;
  return v;
}

std::vector<RaggedK>& ragged_k_variants() {
  static std::vector<RaggedK> v;
  return v;
}

}  // namespace moegemm_lab
