// Document-masked attention on cuDNN as padded batches. The documents of one call whose query rows
// and key rows are the same rows (one GPU, or whole sequences after an all-to-all) are grouped by
// kernels/document_batches.h: lengths rounded up to a quarter step of their octave S, batches of
// a power-of-two B documents, so the cached plans are keyed by (2^i, S) pairs, four S per octave,
// and a new mix of lengths each step reuses them. Each batch is one cuDNN call over [B, S] padded rows: the documents' q, k, v (and
// out, dout, the LSE for the backward) are gathered into zero-padded buffers, cuDNN runs causal
// attention with a padding mask of each element's real rows (seq_len, which lets its flash engines
// skip the padded tiles; on the H200 the backward did, the forward paid for the padded query rows), and the real rows are scattered
// back. The per-document start/length tables of all of a call's batches are uploaded once. A
// padded row never changes a real one: its keys are masked, and its queries' rows are dropped
// (in the backward its dout is zero and its scores masked, so it adds nothing to dK, dV).
// A batch cuDNN refuses (or every batch, under LCX_ATTENTION=own, without libcudnn, for dtypes or
// head sizes it does not take) is reported back unhandled: ops.cpp runs its documents on the own
// kernels. Under a rehearsal's cut (kernels/attention_cut.h) the batches allocate their buffers,
// tables and cuDNN workspaces and launch nothing.
#include <cstdint>
#include <initializer_list>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "kernels/attention_cut.h"
#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/document_pack.h"
#include "kernels/document_batches.h"

namespace lcx::ops::cuda {
namespace {

// The gathers move rows as 16-byte words: 16-bit floats, rows of a multiple of 16 bytes, aligned.
bool packable(std::initializer_list<const Tensor*> ts) {
  const DType t = (*ts.begin())->dtype();
  if (t != DType::bf16 && t != DType::f16) return false;
  for (const Tensor* x : ts)
    if (x->dtype() != t || x->dim() != 3 || (x->size(1) * x->size(2) * 2) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(x->data()) % 16 != 0)
      return false;
  return true;
}

// The batches of one call that cuDNN takes, with their tables on the device: batch i's lengths at
// lens(i) and its first rows at starts(i), each 16-byte aligned (cuDNN reads the lengths).
struct Batches {
  std::vector<DocumentBatch> list;
  std::vector<int64_t> offsets;
  Tensor tables;
  std::vector<char> handled;

  const int32_t* lens(size_t i) const { return tables.data_as<const int32_t>() + offsets[i]; }
  const int32_t* starts(size_t i) const { return lens(i) + round4(static_cast<int64_t>(list[i].docs.size())); }
  static int64_t round4(int64_t n) { return (n + 3) / 4 * 4; }
};

Batches batches_for(bool backward, const Tensor& q, const Tensor& k, const AttentionParams& p,
                    const std::vector<DocumentSpan>& spans) {
  Batches out;
  out.handled.assign(spans.size(), 0);
  std::vector<int64_t> lengths;
  for (const DocumentSpan& s : spans) lengths.push_back(s.length);
  int64_t words = 0;
  for (DocumentBatch& b : document_batches(lengths)) {
    const int64_t B = static_cast<int64_t>(b.docs.size());
    if (!lcx::cuda::cudnn_padded_attention_ready(backward, B, b.rows, q.size(1), k.size(1), q.size(2), q.dtype(),
                                                 p.causal))
      continue;
    for (size_t i : b.docs) out.handled[i] = 1;
    out.offsets.push_back(words);
    words += 2 * Batches::round4(B);
    out.list.push_back(std::move(b));
  }
  if (out.list.empty()) return out;
  Tensor host = Tensor::zeros({words}, DType::i32);
  int32_t* t = host.data_as<int32_t>();
  for (size_t i = 0; i < out.list.size(); ++i) {
    const auto& docs = out.list[i].docs;
    const int64_t B = static_cast<int64_t>(docs.size());
    for (int64_t j = 0; j < B; ++j) {
      const DocumentSpan& s = spans[docs[static_cast<size_t>(j)]];
      t[out.offsets[i] + j] = static_cast<int32_t>(s.length);
      t[out.offsets[i] + Batches::round4(B) + j] = static_cast<int32_t>(s.begin);
    }
  }
  out.tables = host.to(q.device());
  return out;
}

}  // namespace

std::vector<char> attention_forward_documents(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                              Tensor& lse, const AttentionParams& p,
                                              const std::vector<DocumentSpan>& spans) {
  if (!packable({&q, &k, &v, &out})) return std::vector<char>(spans.size(), 0);
  const Batches batches = batches_for(false, q, k, p, spans);
  const bool cut = attention_cut();
  const int64_t Hq = q.size(1), Hkv = k.size(1), d = q.size(2);
  for (size_t i = 0; i < batches.list.size(); ++i) {
    const int64_t B = static_cast<int64_t>(batches.list[i].docs.size()), S = batches.list[i].rows;
    const int32_t *lens = batches.lens(i), *starts = batches.starts(i);
    Tensor qp = Tensor::empty({B * S, Hq, d}, q.dtype(), q.device());
    Tensor kp = Tensor::empty({B * S, Hkv, d}, q.dtype(), q.device());
    Tensor vp = Tensor::empty({B * S, Hkv, d}, q.dtype(), q.device());
    Tensor op = Tensor::empty({B * S, Hq, d}, q.dtype(), q.device());
    Tensor stats = Tensor::empty({B, Hq, S}, DType::f32, q.device());
    if (!cut) {
      pack_documents(q, qp, starts, lens, B, S);
      pack_documents(k, kp, starts, lens, B, S);
      pack_documents(v, vp, starts, lens, B, S);
    }
    lcx::cuda::cudnn_padded_attention_forward(qp, kp, vp, op, stats, lens, B, p);
    if (cut) continue;
    unpack_documents(op, out, starts, lens, B, S);
    unpack_lse(stats, lse, starts, lens, B, S);
  }
  return batches.handled;
}

std::vector<char> attention_backward_documents(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                               const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                               Tensor& dv, const AttentionParams& p,
                                               const std::vector<DocumentSpan>& spans) {
  if (!packable({&q, &k, &v, &out, &dout, &dq, &dk, &dv})) return std::vector<char>(spans.size(), 0);
  const Batches batches = batches_for(true, q, k, p, spans);
  const bool cut = attention_cut();
  const int64_t Hq = q.size(1), Hkv = k.size(1), d = q.size(2);
  for (size_t i = 0; i < batches.list.size(); ++i) {
    const int64_t B = static_cast<int64_t>(batches.list[i].docs.size()), S = batches.list[i].rows;
    const int32_t *lens = batches.lens(i), *starts = batches.starts(i);
    auto rows = [&](int64_t heads) { return Tensor::empty({B * S, heads, d}, q.dtype(), q.device()); };
    Tensor qp = rows(Hq), kp = rows(Hkv), vp = rows(Hkv), op = rows(Hq), dop = rows(Hq);
    Tensor dqp = rows(Hq), dkp = rows(Hkv), dvp = rows(Hkv);
    Tensor stats = Tensor::empty({B, Hq, S}, DType::f32, q.device());
    if (!cut) {
      pack_documents(q, qp, starts, lens, B, S);
      pack_documents(k, kp, starts, lens, B, S);
      pack_documents(v, vp, starts, lens, B, S);
      pack_documents(out, op, starts, lens, B, S);
      pack_documents(dout, dop, starts, lens, B, S);
      pack_lse(lse, stats, starts, lens, B, S);
    }
    lcx::cuda::cudnn_padded_attention_backward(qp, kp, vp, op, stats, dop, dqp, dkp, dvp, lens, B, p);
    if (cut) continue;
    unpack_documents(dqp, dq, starts, lens, B, S);
    unpack_documents(dkp, dk, starts, lens, B, S);
    unpack_documents(dvp, dv, starts, lens, B, S);
  }
  return batches.handled;
}

}  // namespace lcx::ops::cuda
