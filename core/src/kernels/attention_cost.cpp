// lcx/attention_cost.h from the GPU backend's rules: cuDNN's buffers (kernels/cudnn_sizes.h) and
// its batches of documents, read in place (kernels/document_batches.h, octave classes).
#include "lcx/attention_cost.h"

#include <vector>

#include "kernels/cudnn_sizes.h"

namespace lcx {

static_assert(kAttentionTileRows == ops::kMinPaddedRows);

AttentionBytes attention_call_bytes(int64_t hq, int64_t T, int64_t d, bool masked) {
  if (masked)
    return {cudnn_document_batch_bytes(false, hq, T, d), cudnn_document_batch_bytes(true, hq, T, d),
            document_table_bytes(T)};
  return {kCudnnForwardWorkspace, cudnn_dq_accumulator_bytes(hq, T, d) + cudnn_backward_workspace_bytes(hq, T, d), 0};
}

AttentionWork attention_work(std::span<const int64_t> q_lengths, std::span<const int64_t> k_lengths, bool same_rows,
                             int64_t window) {
  const ops::PaddedWork w = ops::padded_work(std::vector<int64_t>(q_lengths.begin(), q_lengths.end()),
                                             std::vector<int64_t>(k_lengths.begin(), k_lengths.end()), same_rows,
                                             ops::LengthClasses::octave, window);
  return {w.pairs, w.calls, w.call_octaves, w.query_tiles};
}

}  // namespace lcx
