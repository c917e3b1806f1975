// Document-masked attention on cuDNN as padded batches. The documents of one call whose query rows
// and key rows are the same rows (one GPU, or whole sequences after an all-to-all) are grouped by
// lcx/document_batches.h: lengths rounded up to a quarter step of their octave S (a 32nd for
// long documents), batches of a power-of-two B documents, so the cached plans are keyed by (2^i, S)
// pairs, few per octave, and a new mix of lengths each step reuses them. Each batch is one cuDNN call over [B, S] padded rows: the documents' q, k, v (and
// out, dout, the LSE for the backward) are gathered into zero-padded buffers, cuDNN runs causal
// attention with a padding mask of each element's real rows (seq_len, which lets its flash engines
// skip the padded tiles; on the H200 the backward did, the forward paid for the padded query
// rows), and the real rows are scattered back. A ring's piece of a query chunk against an earlier
// key chunk (queries and keys at other rows, every key of a document before its queries) runs the
// same way with full attention: its documents grouped by their (query, key) pair of padded lengths
// (document_pair_batches), each side gathered with its own tables and cuDNN told each element's
// seq_q and seq_kv. The per-document start/length tables of all of a call's batches are uploaded
// once. A padded row never changes a real one: its keys are masked, and its queries' rows are
// dropped (in the backward its dout is zero and its scores masked, so it adds nothing to dK, dV).
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
#include "lcx/document_batches.h"

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

// The batches of one call that cuDNN takes, with their tables on the device: batch i's query
// lengths at table(i, 0), first query rows at table(i, 1), and the same of its keys at 2 and 3,
// each 16-byte aligned (cuDNN reads the lengths).
struct Batches {
  std::vector<DocumentPairBatch> list;
  std::vector<int64_t> offsets;
  Tensor tables;
  std::vector<char> handled;

  const int32_t* table(size_t i, int which) const {
    return tables.data_as<const int32_t>() + offsets[i] + which * round4(static_cast<int64_t>(list[i].docs.size()));
  }
  static int64_t round4(int64_t n) { return (n + 3) / 4 * 4; }
};

// Batch i of a call: B documents padded to Sq query and Sk key rows, its tables on the device.
struct Batch {
  int64_t B, Sq, Sk;
  const int32_t *q_lens, *q_starts, *k_lens, *k_starts;

  Batch(const Batches& all, size_t i)
      : B(static_cast<int64_t>(all.list[i].docs.size())), Sq(all.list[i].q_rows), Sk(all.list[i].k_rows),
        q_lens(all.table(i, 0)), q_starts(all.table(i, 1)), k_lens(all.table(i, 2)), k_starts(all.table(i, 3)) {}
  // Padded rows of a query-side (Sq) or key-side (Sk) tensor like t with `heads` heads, unfilled.
  Tensor rows(bool queries, int64_t heads, const Tensor& t) const {
    return Tensor::empty({B * (queries ? Sq : Sk), heads, t.size(2)}, t.dtype(), t.device());
  }
  void pack_inputs(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& qp, Tensor& kp, Tensor& vp) const {
    pack_documents(q, qp, q_starts, q_lens, B, Sq);
    pack_documents(k, kp, k_starts, k_lens, B, Sk);
    pack_documents(v, vp, k_starts, k_lens, B, Sk);
  }
};

// Documents whose queries and keys are the same rows group by one length (document_batches);
// the others by their pair of lengths.
std::vector<DocumentPairBatch> grouped(const std::vector<DocumentSpan>& q_spans,
                                       const std::vector<DocumentSpan>& k_spans) {
  std::vector<int64_t> q_lengths, k_lengths;
  for (const DocumentSpan& s : q_spans) q_lengths.push_back(s.length);
  for (const DocumentSpan& s : k_spans) k_lengths.push_back(s.length);
  if (q_spans != k_spans) return document_pair_batches(q_lengths, k_lengths);
  std::vector<DocumentPairBatch> out;
  for (DocumentBatch& b : document_batches(q_lengths)) out.push_back({b.rows, b.rows, std::move(b.docs)});
  return out;
}

Batches batches_for(bool backward, const Tensor& q, const Tensor& k, const AttentionParams& p,
                    const std::vector<DocumentSpan>& q_spans, const std::vector<DocumentSpan>& k_spans) {
  Batches out;
  out.handled.assign(q_spans.size(), 0);
  int64_t words = 0;
  for (DocumentPairBatch& b : grouped(q_spans, k_spans)) {
    const int64_t B = static_cast<int64_t>(b.docs.size());
    if (!lcx::cuda::cudnn_padded_attention_ready(backward, B, b.q_rows, b.k_rows, q.size(1), k.size(1), q.size(2),
                                                 q.dtype(), p.causal))
      continue;
    for (size_t i : b.docs) out.handled[i] = 1;
    out.offsets.push_back(words);
    words += 4 * Batches::round4(B);
    out.list.push_back(std::move(b));
  }
  if (out.list.empty()) return out;
  Tensor host = Tensor::zeros({words}, DType::i32);
  int32_t* t = host.data_as<int32_t>();
  for (size_t i = 0; i < out.list.size(); ++i) {
    const auto& docs = out.list[i].docs;
    const int64_t B = static_cast<int64_t>(docs.size()), R = Batches::round4(B);
    for (int64_t j = 0; j < B; ++j) {
      const DocumentSpan &qs = q_spans[docs[static_cast<size_t>(j)]], &ks = k_spans[docs[static_cast<size_t>(j)]];
      int32_t* row = t + out.offsets[i] + j;
      row[0] = static_cast<int32_t>(qs.length);
      row[R] = static_cast<int32_t>(qs.begin);
      row[2 * R] = static_cast<int32_t>(ks.length);
      row[3 * R] = static_cast<int32_t>(ks.begin);
    }
  }
  // Not Tensor::to: its synchronous copy waited for the whole device once per call (once per
  // ring piece under cp_ring), draining the queue.
  out.tables = Tensor::empty({words}, DType::i32, q.device());
  upload(host.data(), out.tables);
  return out;
}

}  // namespace

std::vector<char> attention_forward_documents(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                              Tensor& lse, const AttentionParams& p,
                                              const std::vector<DocumentSpan>& q_spans,
                                              const std::vector<DocumentSpan>& k_spans) {
  if (!packable({&q, &k, &v, &out})) return std::vector<char>(q_spans.size(), 0);
  const Batches batches = batches_for(false, q, k, p, q_spans, k_spans);
  const bool cut = attention_cut();
  const int64_t Hq = q.size(1), Hkv = k.size(1);
  for (size_t i = 0; i < batches.list.size(); ++i) {
    const Batch b(batches, i);
    Tensor qp = b.rows(true, Hq, q), kp = b.rows(false, Hkv, q), vp = b.rows(false, Hkv, q), op = b.rows(true, Hq, q);
    Tensor stats = Tensor::empty({b.B, Hq, b.Sq}, DType::f32, q.device());
    if (!cut) b.pack_inputs(q, k, v, qp, kp, vp);
    lcx::cuda::cudnn_padded_attention_forward(qp, kp, vp, op, stats, b.q_lens, b.k_lens, b.B, p);
    if (cut) continue;
    unpack_documents(op, out, b.q_starts, b.q_lens, b.B, b.Sq);
    unpack_lse(stats, lse, b.q_starts, b.q_lens, b.B, b.Sq);
  }
  return batches.handled;
}

std::vector<char> attention_backward_documents(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                               const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                               Tensor& dv, const AttentionParams& p,
                                               const std::vector<DocumentSpan>& q_spans,
                                               const std::vector<DocumentSpan>& k_spans) {
  if (!packable({&q, &k, &v, &out, &dout, &dq, &dk, &dv})) return std::vector<char>(q_spans.size(), 0);
  const Batches batches = batches_for(true, q, k, p, q_spans, k_spans);
  const bool cut = attention_cut();
  const int64_t Hq = q.size(1), Hkv = k.size(1);
  for (size_t i = 0; i < batches.list.size(); ++i) {
    const Batch b(batches, i);
    Tensor qp = b.rows(true, Hq, q), kp = b.rows(false, Hkv, q), vp = b.rows(false, Hkv, q), op = b.rows(true, Hq, q);
    Tensor dop = b.rows(true, Hq, q), dqp = b.rows(true, Hq, q), dkp = b.rows(false, Hkv, q), dvp = b.rows(false, Hkv, q);
    Tensor stats = Tensor::empty({b.B, Hq, b.Sq}, DType::f32, q.device());
    if (!cut) {
      b.pack_inputs(q, k, v, qp, kp, vp);
      pack_documents(out, op, b.q_starts, b.q_lens, b.B, b.Sq);
      pack_documents(dout, dop, b.q_starts, b.q_lens, b.B, b.Sq);
      pack_lse(lse, stats, b.q_starts, b.q_lens, b.B, b.Sq);
    }
    lcx::cuda::cudnn_padded_attention_backward(qp, kp, vp, op, stats, dop, dqp, dkp, dvp, b.q_lens, b.k_lens, b.B, p);
    if (cut) continue;
    unpack_documents(dqp, dq, b.q_starts, b.q_lens, b.B, b.Sq);
    unpack_documents(dkp, dk, b.k_starts, b.k_lens, b.B, b.Sk);
    unpack_documents(dvp, dv, b.k_starts, b.k_lens, b.B, b.Sk);
  }
  return batches.handled;
}

}  // namespace lcx::ops::cuda
