// What the GPU backend's fused attention (cuDNN) allocates beside a call's tensors: the formulas
// behind lcx/attention_cost.h attention_call_bytes, kept with the kernels so that the SDK names
// no backend.
#pragma once
#include <cstdint>

#include "kernels/document_batches.h"

namespace lcx {

// One call: a 256-byte forward workspace; in the backward an fp32 dQ accumulator [Hq,T,d] and
// cuDNN's own workspace as large again plus 256 bytes (cuDNN 9.19 on sm_90 at every length from
// 32k to 1M tokens, checked on the GPU by test_gpu). Hq and T are the call's: one head group's
// heads, one piece's query rows.
inline constexpr int64_t kCudnnForwardWorkspace = 256;
// The memory plan counts it for every forward, also where the automatic choice runs the own
// Hopper kernel instead (kernels/attention/dispatch.h kOwnForwardMinRows), which allocates nothing: a
// transient at most 256 bytes above what such a forward allocates.
inline int64_t cudnn_dq_accumulator_bytes(int64_t hq, int64_t T, int64_t d) { return hq * T * d * 4; }
inline int64_t cudnn_backward_workspace_bytes(int64_t hq, int64_t T, int64_t d) { return hq * T * d * 4 + 256; }

// Document-masked attention on the GPU (kernels/attention/cudnn/documents.cpp) runs cuDNN on
// batches of documents padded to a few sizes, read and written in place in the call's tensors
// through cuDNN's ragged offsets; the padded rows of one batch are at most the call's T rows
// rounded up to a power of two (or one least padded document, 128 rows). Per padded row a forward
// batch holds the stats [Hq] fp32 (the LSE in cuDNN's layout); a backward batch the stats and the
// softmax sums [Hq] fp32, the dQ accumulator [Hq,d] fp32 and cuDNN's workspace as large again
// (above). Batches run one after another, so this bounds the peak; it holds the unmasked call's
// accumulator and workspaces, which a masked step's call replaces. (Where cuDNN refuses the ragged
// plans the batches gather their rows into padded copies, which this does not count.)
inline int64_t cudnn_document_batch_bytes(bool backward, int64_t hq, int64_t T, int64_t d) {
  int64_t rows = ops::kMinPaddedRows;
  while (rows < T) rows *= 2;
  const int64_t per_row = backward ? 2 * hq * 4 + 2 * hq * d * 4 : hq * 4;
  return rows * per_row + 256;
}
// The per-document tables one masked call uploads and the host's document bounds (int64), at their
// worst of one document per token: per batch of B documents the query and key lengths and first
// rows (int32, B rounded up to 4) and the query and key ragged offsets (int64, B + 1 rounded up to
// 2), at most 32 bytes a document and 80 a batch, and no more batches than documents.
inline int64_t document_table_bytes(int64_t T) { return 112 * T + (T + 1) * 8; }

}  // namespace lcx
