// What one call of lcx::ops' attention costs on this build's GPU backend, for a Parallelism
// plugin: the bytes the call allocates beside its tensors (for its plan) and the work it does over
// given documents (to weigh its shards). Core defines both from how its backend runs the call; a
// plugin asks, and never computes them itself.
#pragma once
#include <cstdint>
#include <span>

namespace lcx {

// What one attention call of hq query heads over T query rows with head dimension d allocates
// beside its inputs and outputs: during its forward, during its backward (accumulators and
// workspace), and through the step (what a document-masked call keeps from its forward for its
// backward). masked: the call is masked by document (PlanInputs::documents_masked), whose
// documents the backend runs apart; then these replace the unmasked call's.
struct AttentionBytes {
  int64_t forward = 0, backward = 0, step = 0;
};
AttentionBytes attention_call_bytes(int64_t hq, int64_t T, int64_t d, bool masked = false);

// The (query, key) pairs causal attention over n rows computes: n (n + 1) / 2, or under a sliding
// window of W keys (window > 0) sum over rows of min(W, row + 1): about n x W once n passes W.
inline int64_t causal_pairs(int64_t n, int64_t window = 0) {
  if (window <= 0 || n <= window) return n * (n + 1) / 2;
  return window * (window + 1) / 2 + (n - window) * window;
}

// The query rows the backend's attention works on at a time: a call's query_tiles count them.
inline constexpr int64_t kAttentionTileRows = 128;

// What one document-masked attention call computes: the (query, key) pairs, padding included; the
// backend's kernel calls; call_octaves, over the calls, the octaves of each call's key rows above
// 512 (a call costs beyond its pairs about one wave of tiles, which grows with the keys its tiles
// read: a call of 32,768 keys counts 6, one of 512 or fewer none); and query_tiles, the
// documents' query rows in tiles of kAttentionTileRows (each a thread block of the forward; the
// backward passes over each query row), which short documents pay far more of per pair.
struct AttentionWork {
  int64_t pairs = 0, calls = 0, call_octaves = 0, query_tiles = 0;
};
// Document i has q_lengths[i] query rows and k_lengths[i] key rows; same_rows: its queries and
// keys are the same rows (causal within each document; k_lengths is then not read), else every
// query attends to every key of its document. Documents without rows are left out. window > 0: a
// sliding window of W keys (same_rows: causal_pairs; else each query sees at most W keys).
AttentionWork attention_work(std::span<const int64_t> q_lengths, std::span<const int64_t> k_lengths, bool same_rows,
                             int64_t window = 0);

}  // namespace lcx
