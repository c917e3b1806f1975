// The attention shapes every GPU attention test runs against the CPU twin: GQA, ragged tiles,
// query and key offsets of ring blocks, rows that see no key. Shared by the op table
// (backend_ops_test.cpp) and the tests that pin one kernel (ops_gpu_test.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "lcx/ops.h"

namespace lcx::test {

struct AttnCase {
  int64_t T, S, Hq, Hkv, d;
  bool causal;
  int64_t q_offset, k_offset;
};

inline constexpr AttnCase kAttentionShapes[] = {
    {130, 130, 4, 2, 64, true, 0, 0},   // causal, GQA, ragged last tile
    {70, 200, 4, 1, 64, true, 130, 0},  // the last 70 queries of a 200-token sequence
    {65, 100, 2, 2, 32, false, 0, 0},   // a full (non-causal) ring block
    {96, 96, 8, 2, 128, true, 0, 0},    // Qwen3's head_dim and group of 4
    {50, 50, 2, 1, 80, true, 0, 0},     // a head_dim padded inside its tile
    {40, 60, 2, 2, 64, true, 0, 20},    // the first 20 queries see no key: lse -inf, out 0
    {64, 64, 4, 2, 128, false, 128, 0}, // a ring block wholly in the past
};

// What the Hopper kernels take (bf16, head_dim 128) at sizes that cross their tiles (128 query or
// key rows a block, 64 a step) and their two pipeline stages: groups of 1-4 query heads, ragged
// blocks, a ring block's offsets either way, queries that see no key, full attention.
inline constexpr AttnCase kHopperShapes[] = {
    {300, 300, 8, 2, 128, true, 0, 0},   {1000, 1000, 4, 1, 128, true, 0, 0}, {200, 700, 4, 2, 128, true, 500, 0},
    {256, 384, 2, 2, 128, false, 0, 0},  {130, 130, 2, 1, 128, true, 0, 60},  {128, 256, 2, 1, 128, false, 512, 0},
    {640, 640, 4, 4, 128, true, 0, 0},   {77, 1500, 2, 1, 128, false, 0, 0},  {1100, 1100, 8, 2, 128, true, 0, 0},
};

// A case's mask and offsets as the ops take them.
inline ops::AttentionParams attention_params(const AttnCase& c) {
  ops::AttentionParams p;
  p.causal = c.causal;
  p.q_offset = c.q_offset;
  p.k_offset = c.k_offset;
  return p;
}

// Packed documents ([data] attend_across_documents = false): one sequence, each query seeing only
// its own document's keys (AttentionParams::documents, cumulative bounds).
struct DocCase {
  int64_t Hq, Hkv, d;
  bool causal;
  std::vector<int64_t> bounds;  // {0, ..., T}
};

inline const DocCase kDocumentShapes[] = {
    {4, 2, 64, true, {0, 70, 71, 150, 230}},          // a one-token document, ragged tiles
    {8, 2, 128, true, {0, 5, 200, 203, 333, 400}},    // Qwen3's head_dim, long and short ones
    {2, 2, 64, false, {0, 64, 100}},                  // full attention within each document
    {4, 1, 128, true, {0, 300}},                      // one document: the mask changes nothing
    // bf16 runs these on cuDNN's padded batches (kernels/attention/cudnn/documents.cpp):
    {32, 8, 128, true, {0, 1, 100, 227, 355, 483, 700, 1100}},  // Qwen3-8B's heads; 5 docs of <= 128 rows: 4 + 1
    {8, 2, 128, true, {0, 4500, 4513, 4700}},                   // a long one (padded to 8,192) beside short ones
};

}  // namespace lcx::test
