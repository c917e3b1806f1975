// A transformers fixture's token ids and labels (expected.safetensors) as lcx's sequence: HF labels
// are unshifted, so targets[t] = labels[t + 1]; with document_bounds, the packed documents each
// attend to themselves. The MoE families' tests read their fixtures through it.
#pragma once
#include <cstdint>
#include <vector>

#include "lcx/safetensors.h"
#include "lcx/sequence.h"
#include "lcx/tensor.h"

namespace lcx::test {

inline std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.data_as<int64_t>()[i];
  return v;
}

// HF labels (unshifted, -100 ignored) -> lcx targets: targets[t] = labels[t + 1], the last ignored.
inline Sequence sequence_from_labels(const std::vector<int64_t>& ids, const std::vector<int64_t>& labels) {
  Sequence s;
  const int64_t T = static_cast<int64_t>(ids.size());
  s.tokens = Tensor::empty({T}, DType::i32);
  s.targets = Tensor::empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) {
    s.tokens.data_as<int32_t>()[t] = static_cast<int32_t>(ids[static_cast<size_t>(t)]);
    s.targets.data_as<int64_t>()[t] = t + 1 < T ? labels[static_cast<size_t>(t + 1)] : -100;
  }
  return s;
}

inline Sequence sequence_of(const safetensors::Checkpoint& expected) {
  Sequence s = sequence_from_labels(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)));
  if (expected.has("document_bounds")) {
    s.document_bounds = ints(expected.load("document_bounds", DType::i64));
    s.document_count = static_cast<int>(s.document_bounds.size()) - 1;
  }
  return s;
}

}  // namespace lcx::test
