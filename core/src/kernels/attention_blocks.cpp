// The attention algorithms between the ops' checks (ops.cpp) and the kernels: document-masked
// attention on the GPU, per document or as cuDNN's batches, and attention over blocks of rows in
// few calls (ops::attention_forward_blocks). The arguments are checked and the params resolved
// before these run.
#include "kernels/attention_blocks.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#ifdef LCX_HAVE_CUDA
#include "kernels/cuda/cuda_ops.h"
#endif

namespace lcx::ops {
namespace {

#ifdef LCX_HAVE_CUDA
// Document-masked attention on the GPU: the work is the sum of the documents' squared lengths.
// Where the queries and keys are the same rows (one GPU, whole sequences after an all-to-all), the
// documents run on cuDNN as padded batches of few shapes (kernels/document_batches.h,
// kernels/attention/cudnn/documents.cpp), whose plans a new mix of lengths reuses; in a ring's piece
// with queries and keys apart, so do the documents whose keys all precede their queries (full
// attention). What cuDNN does not take (a document's keys and queries interleaved, [run] attention
// naming one of lcx's own backends, no cuDNN, a refused shape) runs on lcx's own kernels once per
// document, on row slices, the dispatch (kernels/attention/dispatch.h) choosing which. Each document's query
// rows meet its key rows at their own positions; queries of a document with no key here see nothing
// (out 0, lse -inf), keys of one with no query get no gradient. The LSE [Hq,T] is strided per
// document: a contiguous copy serves. Each document allocates what its kernels allocate; its work,
// the kernels' and the copies and fills here, goes to `launch`.
struct DocumentSlice {
  int64_t q_begin, q_end, k_begin, k_end;  // rows of q and of k
  int64_t q_pos, k_pos;                    // their first positions
};
std::vector<DocumentSlice> document_slices(const Tensor& q, const Tensor& k, const AttentionParams& p) {
  std::vector<DocumentSlice> out;
  const int64_t T = q.size(0), S = k.size(0);
  for (size_t i = 0; i + 1 < p.documents.size(); ++i) {
    const int64_t a = p.documents[i], b = p.documents[i + 1];
    const int64_t qb = std::clamp<int64_t>(a - p.q_offset, 0, T), qe = std::clamp<int64_t>(b - p.q_offset, 0, T);
    const int64_t kb = std::clamp<int64_t>(a - p.k_offset, 0, S), ke = std::clamp<int64_t>(b - p.k_offset, 0, S);
    if (qb < qe || kb < ke) out.push_back({qb, qe, kb, ke, p.q_offset + qb, p.k_offset + kb});
  }
  return out;
}

// The documents cuDNN's padded batches may take, with their query and key spans: all of them when
// the queries and keys are the same rows; else (a ring's query chunk against another key chunk)
// those with queries and keys whose attention is full: not causal, or every key of the document
// before every query. Those run with `full` (p not causal). Returns their indices into `slices`.
std::vector<size_t> cudnn_documents(const Tensor& q, const Tensor& k, const AttentionParams& p,
                                    const std::vector<DocumentSlice>& slices, std::vector<cuda::DocumentSpan>& q_spans,
                                    std::vector<cuda::DocumentSpan>& k_spans, AttentionParams& full) {
  std::vector<size_t> which;
  full = p;
  if (q.size(0) == k.size(0) && p.q_offset == p.k_offset) {
    for (size_t i = 0; i < slices.size(); ++i)
      if (slices[i].q_end > slices[i].q_begin) {
        which.push_back(i);
        q_spans.push_back({slices[i].q_begin, slices[i].q_end - slices[i].q_begin});
      }
    k_spans = q_spans;
    return which;
  }
  full.causal = false;
  for (size_t i = 0; i < slices.size(); ++i) {
    const DocumentSlice& s = slices[i];
    const int64_t nq = s.q_end - s.q_begin, nk = s.k_end - s.k_begin;
    if (nq == 0 || nk == 0 || (p.causal && s.k_pos + nk > s.q_pos)) continue;
    which.push_back(i);
    q_spans.push_back({s.q_begin, nq});
    k_spans.push_back({s.k_begin, nk});
  }
  return which;
}

// Marks the slices the padded batches ran; the rest go to the own kernels.
template <class Run>
std::vector<char> run_on_cudnn(const Tensor& q, const Tensor& k, const AttentionParams& p,
                               const std::vector<DocumentSlice>& slices, Run run) {
  std::vector<char> done(slices.size(), 0);
  std::vector<cuda::DocumentSpan> q_spans, k_spans;
  AttentionParams full;
  const std::vector<size_t> which = cudnn_documents(q, k, p, slices, q_spans, k_spans, full);
  if (which.empty()) return done;
  const std::vector<char> ran = run(full, q_spans, k_spans);
  for (size_t j = 0; j < which.size(); ++j) done[which[j]] = ran[j];
  return done;
}

AttentionParams one_document(const AttentionParams& p, const DocumentSlice& s) {
  AttentionParams r = p;
  r.documents = {};
  r.q_offset = s.q_pos;
  r.k_offset = s.k_pos;
  return r;
}

void attention_forward_by_document(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                                   const AttentionParams& p, Launch launch) {
  const std::vector<DocumentSlice> slices = document_slices(q, k, p);
  const std::vector<char> done =
      run_on_cudnn(q, k, p, slices, [&](const AttentionParams& r, const auto& q_spans, const auto& k_spans) {
        return cuda::attention_forward_documents(q, k, v, out, lse, r, q_spans, k_spans, launch);
      });
  // Queries with no key here (in a ring's piece, the documents of the query chunk that the key
  // chunk does not hold; most of them with short documents) see nothing: out 0, LSE -inf. Such
  // documents follow one another in q's rows, so each run of them is one zero fill and one column
  // copy from a single -inf block uploaded once per call on the stream (a host copy per document,
  // each a wait on the device, cost a ring's piece of short documents more than its attention).
  std::vector<std::pair<int64_t, int64_t>> unseen;  // runs of query rows
  for (size_t i = 0; i < slices.size(); ++i) {
    const DocumentSlice& s = slices[i];
    const int64_t n = s.q_end - s.q_begin;
    if (n == 0 || done[i]) continue;
    if (s.k_begin == s.k_end) {
      if (!unseen.empty() && unseen.back().second == s.q_begin) unseen.back().second = s.q_end;
      else unseen.emplace_back(s.q_begin, s.q_end);
      continue;
    }
    Tensor o = out.rows(s.q_begin, s.q_end);
    Tensor l = Tensor::empty({q.size(1), n}, DType::f32, q.device());
    cuda::attention_forward_own(q.rows(s.q_begin, s.q_end), k.rows(s.k_begin, s.k_end), v.rows(s.k_begin, s.k_end),
                                o, l, one_document(p, s), launch);
    launch([&] { cuda::copy_columns(l, 0, lse, s.q_begin, n); });
  }
  if (unseen.empty()) return;
  int64_t widest = 0;
  for (const auto& [b, e] : unseen) widest = std::max(widest, e - b);
  Tensor none = Tensor::empty({q.size(1), widest}, DType::f32, q.device());
  launch([&] {
    cuda::upload(std::vector<float>(static_cast<size_t>(none.numel()), -INFINITY).data(), none);
    for (const auto& [b, e] : unseen) {
      out.rows(b, e).zero();
      cuda::copy_columns(none, 0, lse, b, e - b);
    }
  });
}

void attention_backward_by_document(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                    const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                    const AttentionParams& p, Launch launch) {
  const std::vector<DocumentSlice> slices = document_slices(q, k, p);
  const std::vector<char> done =
      run_on_cudnn(q, k, p, slices, [&](const AttentionParams& r, const auto& q_spans, const auto& k_spans) {
        return cuda::attention_backward_documents(q, k, v, out, lse, dout, dq, dk, dv, r, q_spans, k_spans, launch);
      });
  for (size_t i = 0; i < slices.size(); ++i) {
    const DocumentSlice& s = slices[i];
    if (done[i]) continue;
    const int64_t n = s.q_end - s.q_begin;
    Tensor dqs = dq.rows(s.q_begin, s.q_end), dks = dk.rows(s.k_begin, s.k_end), dvs = dv.rows(s.k_begin, s.k_end);
    if (n == 0 || s.k_begin == s.k_end) {
      launch([&] {
        if (n > 0) dqs.zero();
        if (s.k_begin < s.k_end) {
          dks.zero();
          dvs.zero();
        }
      });
      continue;
    }
    Tensor l = Tensor::empty({q.size(1), n}, DType::f32, q.device());
    launch([&] { cuda::copy_columns(lse, s.q_begin, l, 0, n); });
    cuda::attention_backward_own(q.rows(s.q_begin, s.q_end), k.rows(s.k_begin, s.k_end), v.rows(s.k_begin, s.k_end),
                                 out.rows(s.q_begin, s.q_end), l, dout.rows(s.q_begin, s.q_end), dqs, dks, dvs,
                                 one_document(p, s), launch);
  }
}

#endif

// One block as a plain call on row slices; its LSE columns through a contiguous copy.
void forward_block(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale,
                   bool causal, const AttentionBlock& b) {
  Tensor o = out.rows(b.q_begin, b.q_begin + b.q_rows);
  Tensor l = Tensor::empty({q.size(1), b.q_rows}, DType::f32, q.device());
  attention_forward(q.rows(b.q_begin, b.q_begin + b.q_rows), k.rows(b.k_begin, b.k_begin + b.k_rows),
                    v.rows(b.k_begin, b.k_begin + b.k_rows), o, l, block_params(scale, causal));
  copy_columns(l, 0, lse, b.q_begin, b.q_rows);
}

void backward_block(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                    const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, float scale, bool causal,
                    const AttentionBlock& b) {
  const int64_t q0 = b.q_begin, q1 = b.q_begin + b.q_rows, k0 = b.k_begin, k1 = b.k_begin + b.k_rows;
  Tensor l = Tensor::empty({q.size(1), b.q_rows}, DType::f32, q.device());
  copy_columns(lse, q0, l, 0, b.q_rows);
  Tensor dqs = dq.rows(q0, q1), dks = dk.rows(k0, k1), dvs = dv.rows(k0, k1);
  attention_backward(q.rows(q0, q1), k.rows(k0, k1), v.rows(k0, k1), out.rows(q0, q1), l, dout.rows(q0, q1), dqs, dks,
                     dvs, block_params(scale, causal));
}

#ifdef LCX_HAVE_CUDA
// The blocks as cuDNN's document batches take them (each block one document), in runs whose query
// rows and key rows both ascend (the layout of cuDNN's packed callers, whose ragged offsets we
// mirror: a ring's rounds make one run); per block whether it ran there.
template <class Run>
std::vector<char> blocks_on_cudnn(std::span<const AttentionBlock> blocks, Run run) {
  std::vector<size_t> order;
  for (size_t i = 0; i < blocks.size(); ++i)
    if (blocks[i].q_rows > 0 && blocks[i].k_rows > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return blocks[a].q_begin < blocks[b].q_begin; });
  std::vector<char> done(blocks.size(), 0);
  for (size_t from = 0; from < order.size();) {
    std::vector<cuda::DocumentSpan> q_spans, k_spans;
    size_t to = from;
    for (; to < order.size(); ++to) {
      const AttentionBlock& b = blocks[order[to]];
      if (!k_spans.empty() && b.k_begin < k_spans.back().begin + k_spans.back().length) break;
      q_spans.push_back({b.q_begin, b.q_rows});
      k_spans.push_back({b.k_begin, b.k_rows});
    }
    const std::vector<char> ran = run(q_spans, k_spans);
    for (size_t j = from; j < to; ++j) done[order[j]] = ran[j - from];
    from = to;
  }
  return done;
}
#endif

}  // namespace

#ifdef LCX_HAVE_CUDA
void gpu_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                           const AttentionParams& p, Launch launch) {
  if (!p.documents.empty()) return attention_forward_by_document(q, k, v, out, lse, p, launch);
  cuda::attention_forward(q, k, v, out, lse, p, launch);
}

void gpu_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p,
                            Launch launch) {
  if (!p.documents.empty()) return attention_backward_by_document(q, k, v, out, lse, dout, dq, dk, dv, p, launch);
  cuda::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p, launch);
}
#endif

void forward_blocks(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                    const AttentionParams& r, bool causal, std::span<const AttentionBlock> blocks, Launch launch) {
  std::vector<char> done(blocks.size(), 0);
#ifdef LCX_HAVE_CUDA
  if (cuda)
    done = blocks_on_cudnn(blocks, [&](const auto& q_spans, const auto& k_spans) {
      return cuda::attention_forward_documents(q, k, v, out, lse, r, q_spans, k_spans, launch);
    });
#else
  (void)cuda;
  (void)launch;
#endif
  for (size_t i = 0; i < blocks.size(); ++i)
    if (!done[i] && blocks[i].q_rows > 0 && blocks[i].k_rows > 0)
      forward_block(q, k, v, out, lse, r.scale, causal, blocks[i]);
}

void backward_blocks(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                     const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                     const AttentionParams& r, bool causal, std::span<const AttentionBlock> blocks, Launch launch) {
  std::vector<char> done(blocks.size(), 0);
#ifdef LCX_HAVE_CUDA
  if (cuda)
    done = blocks_on_cudnn(blocks, [&](const auto& q_spans, const auto& k_spans) {
      return cuda::attention_backward_documents(q, k, v, out, lse, dout, dq, dk, dv, r, q_spans, k_spans, launch);
    });
#else
  (void)cuda;
  (void)launch;
#endif
  for (size_t i = 0; i < blocks.size(); ++i)
    if (!done[i] && blocks[i].q_rows > 0 && blocks[i].k_rows > 0)
      backward_block(q, k, v, out, lse, dout, dq, dk, dv, r.scale, causal, blocks[i]);
}

}  // namespace lcx::ops
