// One training sequence as the data pipeline yields it, and one rank's share of it as the
// Parallelism slot cuts it. Data and parallelism both speak these; neither owns them.
#pragma once
#include <cstdint>
#include <vector>

#include "lcx/tensor.h"

namespace lcx {

// One training sequence on the host, before sharding.
struct Sequence {
  Tensor tokens;   // int32 [L]
  Tensor targets;  // int64 [L], shifted: targets[t] = tokens[t+1], -100 where ignored
  int document_count = 1;  // how many documents were packed into it
  // Where its documents begin and end when each attends only to itself ([data]
  // attend_across_documents = false): cumulative, {0, end of the first, ..., L}. Empty when every
  // token attends to all earlier ones (the key is true). A document's last token is its EOS.
  std::vector<int64_t> document_bounds;
};

struct Shard {
  Tensor tokens;     // int32 [T] this rank's tokens
  Tensor targets;    // int64 [T]
  Tensor positions;  // int64 [T] positions in the sequence (sequence_position)
  // int64 [T]: each row's index in the sequence (a rank's chunks of it, in the order it holds them),
  // by which per-element randomness (the adapters' dropout) is drawn, so that a mesh draws what
  // one rank does; undefined reads as 0 .. T-1.
  Tensor indices;
  int64_t global_length = 0;
  // The whole sequence's document_bounds (not this rank's share): attention compares them with
  // the tokens' indices in the sequence, wherever its rows came from.
  std::vector<int64_t> document_bounds;
};

// The rotary position of the token at `index` of a sequence: its index, or with document bounds
// its distance from the start of its document, so positions restart at each document. A document
// continued from the previous sequence restarts too: it cannot attend to its earlier part, and a
// rotary score depends only on the distance between two positions, so restarting changes nothing
// but keeps positions within seq_len.
inline int64_t sequence_position(const std::vector<int64_t>& document_bounds, int64_t index) {
  if (document_bounds.empty()) return index;
  int64_t lo = 0, hi = static_cast<int64_t>(document_bounds.size()) - 1;  // bounds[lo] <= index
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (document_bounds[static_cast<size_t>(mid)] <= index ? lo : hi) = mid;
  }
  return index - document_bounds[static_cast<size_t>(lo)];
}

// Shard::indices of `count` rows from `begin` of a sequence, written from `at` (int64 on the host).
inline void fill_indices(Tensor& indices, int64_t at, int64_t begin, int64_t count) {
  int64_t* p = indices.data_as<int64_t>() + at;
  for (int64_t i = 0; i < count; ++i) p[i] = begin + i;
}

// The positions of `count` tokens from `begin` of a sequence, written from `at` of `positions`
// (int64 on the host): how every Parallelism provider fills its shard's positions.
inline void fill_positions(Tensor& positions, int64_t at, const std::vector<int64_t>& document_bounds, int64_t begin,
                           int64_t count) {
  int64_t* p = positions.data_as<int64_t>() + at;
  for (int64_t i = 0; i < count; ++i) p[i] = sequence_position(document_bounds, begin + i);
}

}  // namespace lcx
