// The copies around document-masked attention on cuDNN (documents.cpp): the LSE
// [heads, T] to and from cuDNN's stats [B, heads, S] for every batch, and, where cuDNN refuses a
// batch's ragged plan, documents' rows of a packed [T, heads, d] tensor into a padded batch
// [B, S, heads, d] (padding zero) and back. Batch element b is the
// document of starts[b] (its first row) and lens[b] (its rows, <= S); both int32 [B] on the device.
// Rows are moved as 16-byte words: the callers take rows of a multiple of 16 bytes, 16-byte aligned.
#pragma once
#include <cstdint>

#include "lcx/tensor.h"

namespace lcx::ops::cuda {

void pack_documents(const Tensor& src, Tensor& dst, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S);
// Only the real rows are written; src's padded rows are ignored.
void unpack_documents(const Tensor& src, Tensor& dst, const int32_t* starts, const int32_t* lens, int64_t B,
                      int64_t S);
void pack_lse(const Tensor& lse, Tensor& stats, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S);
void unpack_lse(const Tensor& stats, Tensor& lse, const int32_t* starts, const int32_t* lens, int64_t B, int64_t S);

}  // namespace lcx::ops::cuda
