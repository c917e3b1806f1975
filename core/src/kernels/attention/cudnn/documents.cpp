// Document-masked attention on cuDNN as batches. The documents of one call whose query rows and
// key rows are the same rows (one GPU, or whole sequences after an all-to-all) are grouped by
// kernels/document_batches.h: lengths rounded up to their length class S, batches of a power-of-two B
// documents, so the cached plans are keyed by (2^i, S) pairs and a new mix of lengths each step
// reuses them. Each batch is one cuDNN call over B elements of S rows, causal attention with a
// padding mask of each element's real rows (seq_len, which lets its flash engines skip the padded
// tiles). cuDNN reads and writes the documents where they lie: its ragged offsets
// (attention_cudnn.cpp) place element b at the document's first row of q, k, v, out and their
// gradients, and it touches only the element's real rows, so no copies of q, k, v (and out, dout,
// dq, dk, dv) are made: on the H200 those gathers and scatters were 10-14% of the time of 64 short
// documents at 131,072 tokens. Read in place, padded query rows cost no work either, so the classes
// are octaves (few, large calls). Only the LSE still moves, between lcx's [Hq, T] and cuDNN's
// padded stats [B, Hq, S] (a 2/d part of the rows' bytes). Where cuDNN refuses a ragged plan
// (before Hopper, cuDNN before 9.5) the batch's documents are regrouped in fine classes (padding
// computed there, so kept small), gathered into zero-padded buffers, run on the padded plan and the
// real rows scattered back. A ring's piece of a query chunk against an earlier key chunk (queries
// and keys at other rows, every key of a document before its queries) runs the same way with full
// attention: its documents grouped by their (query, key) pair of lengths (document_pair_batches),
// each side with its own tables and cuDNN told each element's seq_q and seq_kv. The per-document
// tables of all of a call's batches (lengths, first rows, ragged offsets) are uploaded once. A
// padded row never changes a real one: its keys are masked, and its queries' rows are dropped (in
// the backward its dout is zero or unread and its scores masked, so it adds nothing to dK, dV). A
// batch cuDNN refuses (or every batch, under [run] attention = "hopper", "mma" or "reference",
// without libcudnn, for dtypes or head sizes it does not take) is reported back unhandled:
// attention_blocks.cpp runs its documents on the own kernels, so the rows of those documents must stay untouched here. The batches allocate their
// buffers, tables and cuDNN workspaces, and hand their copies and cuDNN calls to `launch`
// (kernels/launch.h).
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <numeric>
#include <utility>
#include <vector>

#include "cuda/check.h"
#include "kernels/attention/cudnn/attention_cudnn.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/attention/cudnn/document_pack.h"
#include "kernels/document_batches.h"

namespace lcx::ops::cuda {
namespace {

// 16-bit floats, rows of a multiple of 16 bytes, aligned: every document's first row then sits on
// the 16-byte alignment cuDNN's ragged tensors declare, and the gathers move rows as 16-byte words.
bool packable(std::initializer_list<const Tensor*> ts) {
  const DType t = (*ts.begin())->dtype();
  if (t != DType::bf16 && t != DType::f16) return false;
  for (const Tensor* x : ts)
    if (x->dtype() != t || x->dim() != 3 || (x->size(1) * x->size(2) * 2) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(x->data()) % 16 != 0)
      return false;
  return true;
}

// cuDNN's band mask counts a window from each element's first query and key rows, which are the
// same positions only in causal elements (a document's own rows); full elements (a ring's earlier
// key chunk) with a window run on the own kernels, which take the positions.
bool window_fits(const AttentionParams& p) { return p.window <= 0 || p.causal; }

// The batches of one call that cuDNN takes, with their tables on the device: batch i's query
// lengths at table(i, 0), first query rows at table(i, 1), and the same of its keys at 2 and 3
// (int32, B rounded up to 4), then for a ragged batch its query and key ragged offsets (int64,
// B + 1 rounded up to 2): each table 16-byte aligned (cuDNN reads the lengths and offsets).
struct Batches {
  std::vector<DocumentPairBatch> list;
  std::vector<char> ragged;  // per batch: in place (ragged plans) or through padded copies
  std::vector<int64_t> offsets;  // per batch: its first table's word
  Tensor tables;
  std::vector<char> handled;

  const int32_t* table(size_t i, int which) const {
    return tables.data_as<const int32_t>() + offsets[i] + which * round4(size(i));
  }
  // The ragged offsets of batch i's queries (which 0) or keys (1).
  const int64_t* ragged_offsets(size_t i, int which) const {
    return reinterpret_cast<const int64_t*>(table(i, 4)) + which * round2(size(i) + 1);
  }
  int64_t size(size_t i) const { return static_cast<int64_t>(list[i].docs.size()); }
  static int64_t round4(int64_t n) { return (n + 3) / 4 * 4; }
  static int64_t round2(int64_t n) { return (n + 1) / 2 * 2; }
  static int64_t words(int64_t B, bool ragged) { return 4 * round4(B) + (ragged ? 2 * 2 * round2(B + 1) : 0); }
};

// Batch i of a call: B documents padded to Sq query and Sk key rows, its tables on the device.
struct Batch {
  int64_t B, Sq, Sk;
  bool ragged;
  const int32_t *q_lens, *q_starts, *k_lens, *k_starts;
  const int64_t *q_at, *k_at;  // nullptr unless ragged

  Batch(const Batches& all, size_t i)
      : B(all.size(i)), Sq(all.list[i].q_rows), Sk(all.list[i].k_rows), ragged(all.ragged[i] != 0),
        q_lens(all.table(i, 0)), q_starts(all.table(i, 1)), k_lens(all.table(i, 2)), k_starts(all.table(i, 3)),
        q_at(ragged ? all.ragged_offsets(i, 0) : nullptr), k_at(ragged ? all.ragged_offsets(i, 1) : nullptr) {}
  // Padded rows of a query-side (Sq) or key-side (Sk) tensor like t with `heads` heads, unfilled.
  Tensor rows(bool queries, int64_t heads, const Tensor& t) const {
    return Tensor::empty({B * (queries ? Sq : Sk), heads, t.size(2)}, t.dtype(), t.device());
  }
  // cuDNN's stats of the batch's queries [B, Hq, Sq] fp32, unfilled.
  Tensor stats(const Tensor& q) const { return Tensor::empty({B, q.size(1), Sq}, DType::f32, q.device()); }
  void pack_inputs(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& qp, Tensor& kp, Tensor& vp) const {
    pack_documents(q, qp, q_starts, q_lens, B, Sq);
    pack_documents(k, kp, k_starts, k_lens, B, Sk);
    pack_documents(v, vp, k_starts, k_lens, B, Sk);
  }
};

// The documents `which` (indices into the spans) grouped by class: where queries and keys are the
// same rows by one length (document_batches), the others by their pair of lengths. The batches'
// docs index the spans.
std::vector<DocumentPairBatch> grouped(const std::vector<DocumentSpan>& q_spans,
                                       const std::vector<DocumentSpan>& k_spans, const std::vector<size_t>& which,
                                       LengthClasses classes) {
  std::vector<int64_t> q_lengths, k_lengths;
  for (size_t i : which) {
    q_lengths.push_back(q_spans[i].length);
    k_lengths.push_back(k_spans[i].length);
  }
  std::vector<DocumentPairBatch> out;
  if (q_spans != k_spans) {
    out = document_pair_batches(q_lengths, k_lengths, classes);
  } else {
    for (DocumentBatch& b : document_batches(q_lengths, classes)) out.push_back({b.rows, b.rows, std::move(b.docs)});
  }
  for (DocumentPairBatch& b : out)
    for (size_t& i : b.docs) i = which[i];
  return out;
}

// The documents as ragged batches of octave classes where cuDNN takes their plans (padding costs
// no work there); the documents of a refused batch (a cuDNN without ragged plans, or ragged reads
// switched off) regrouped in fine classes as padded batches; what cuDNN refuses then is left to the
// caller. The documents of a batch come in the order of the spans (the grouping keeps it), so each
// side's offsets ascend, the layout cuDNN's THD callers give it.
Batches batches_for(bool backward, const Tensor& q, const Tensor& k, const AttentionParams& p,
                    const std::vector<DocumentSpan>& q_spans, const std::vector<DocumentSpan>& k_spans) {
  Batches out;
  out.handled.assign(q_spans.size(), 0);
  const int64_t Hq = q.size(1), Hkv = k.size(1), d = q.size(2);
  int64_t words = 0;
  auto add = [&](const std::vector<size_t>& which, bool ragged) {
    std::vector<size_t> refused;
    for (DocumentPairBatch& b : grouped(q_spans, k_spans, which, ragged ? LengthClasses::octave : LengthClasses::fine)) {
      const int64_t B = static_cast<int64_t>(b.docs.size());
      if (!lcx::cuda::cudnn_batch_attention_ready(backward, ragged, B, b.q_rows, b.k_rows, Hq, Hkv, d, q.dtype(),
                                                  p.causal, p.window > 0)) {
        refused.insert(refused.end(), b.docs.begin(), b.docs.end());
        continue;
      }
      for (size_t i : b.docs) out.handled[i] = 1;
      out.offsets.push_back(words);
      out.ragged.push_back(ragged);
      words += Batches::words(B, ragged);
      out.list.push_back(std::move(b));
    }
    std::sort(refused.begin(), refused.end());
    return refused;
  };
  std::vector<size_t> all(q_spans.size());
  std::iota(all.begin(), all.end(), size_t{0});
  const std::vector<size_t> refused = add(all, true);
  if (!refused.empty()) add(refused, false);
  if (out.list.empty()) return out;
  Tensor host = Tensor::zeros({words}, DType::i32);
  int32_t* t = host.data_as<int32_t>();
  for (size_t i = 0; i < out.list.size(); ++i) {
    const auto& docs = out.list[i].docs;
    const int64_t B = out.size(i), R = Batches::round4(B);
    int32_t* table = t + out.offsets[i];
    int64_t* q_at = reinterpret_cast<int64_t*>(table + 4 * R);
    int64_t* k_at = q_at + Batches::round2(B + 1);
    for (int64_t j = 0; j < B; ++j) {
      const DocumentSpan &qs = q_spans[docs[static_cast<size_t>(j)]], &ks = k_spans[docs[static_cast<size_t>(j)]];
      table[j] = static_cast<int32_t>(qs.length);
      table[R + j] = static_cast<int32_t>(qs.begin);
      table[2 * R + j] = static_cast<int32_t>(ks.length);
      table[3 * R + j] = static_cast<int32_t>(ks.begin);
      if (!out.ragged[i]) continue;
      q_at[j] = qs.begin * Hq * d;
      k_at[j] = ks.begin * Hkv * d;
      q_at[j + 1] = (qs.begin + qs.length) * Hq * d;
      k_at[j + 1] = (ks.begin + ks.length) * Hkv * d;
    }
  }
  // Not Tensor::to: its synchronous copy waited for the whole device once per call (once per
  // piece of a ring), draining the queue.
  out.tables = Tensor::empty({words}, DType::i32, q.device());
  upload(host.data(), out.tables);
  return out;
}

}  // namespace

std::vector<char> attention_forward_documents(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                                              Tensor& lse, const AttentionParams& p,
                                              const std::vector<DocumentSpan>& q_spans,
                                              const std::vector<DocumentSpan>& k_spans, Launch launch) {
  if (!packable({&q, &k, &v, &out}) || !window_fits(p)) return std::vector<char>(q_spans.size(), 0);
  const Batches batches = batches_for(false, q, k, p, q_spans, k_spans);
  const int64_t Hq = q.size(1), Hkv = k.size(1);
  for (size_t i = 0; i < batches.list.size(); ++i) {
    const Batch b(batches, i);
    Tensor stats = b.stats(q);
    if (b.ragged) {
      lcx::cuda::cudnn_batch_attention_forward(q, k, v, out, stats, b.q_lens, b.k_lens, b.q_at, b.k_at, b.B, b.Sq,
                                               b.Sk, p, launch);
    } else {
      Tensor qp = b.rows(true, Hq, q), kp = b.rows(false, Hkv, q), vp = b.rows(false, Hkv, q), op = b.rows(true, Hq, q);
      launch([&] { b.pack_inputs(q, k, v, qp, kp, vp); });
      lcx::cuda::cudnn_batch_attention_forward(qp, kp, vp, op, stats, b.q_lens, b.k_lens, nullptr, nullptr, b.B, b.Sq,
                                               b.Sk, p, launch);
      launch([&] { unpack_documents(op, out, b.q_starts, b.q_lens, b.B, b.Sq); });
    }
    launch([&] { unpack_lse(stats, lse, b.q_starts, b.q_lens, b.B, b.Sq); });
  }
  return batches.handled;
}

std::vector<char> attention_backward_documents(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                               const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                                               Tensor& dv, const AttentionParams& p,
                                               const std::vector<DocumentSpan>& q_spans,
                                               const std::vector<DocumentSpan>& k_spans, Launch launch) {
  if (!packable({&q, &k, &v, &out, &dout, &dq, &dk, &dv}) || !window_fits(p)) return std::vector<char>(q_spans.size(), 0);
  const Batches batches = batches_for(true, q, k, p, q_spans, k_spans);
  const int64_t Hq = q.size(1), Hkv = k.size(1);
  for (size_t i = 0; i < batches.list.size(); ++i) {
    const Batch b(batches, i);
    Tensor stats = b.stats(q);
    launch([&] { pack_lse(lse, stats, b.q_starts, b.q_lens, b.B, b.Sq); });
    if (b.ragged) {
      lcx::cuda::cudnn_batch_attention_backward(q, k, v, out, stats, dout, dq, dk, dv, b.q_lens, b.k_lens, b.q_at,
                                                b.k_at, b.B, b.Sq, b.Sk, p, launch);
      continue;
    }
    Tensor qp = b.rows(true, Hq, q), kp = b.rows(false, Hkv, q), vp = b.rows(false, Hkv, q), op = b.rows(true, Hq, q);
    Tensor dop = b.rows(true, Hq, q), dqp = b.rows(true, Hq, q), dkp = b.rows(false, Hkv, q), dvp = b.rows(false, Hkv, q);
    launch([&] {
      b.pack_inputs(q, k, v, qp, kp, vp);
      pack_documents(out, op, b.q_starts, b.q_lens, b.B, b.Sq);
      pack_documents(dout, dop, b.q_starts, b.q_lens, b.B, b.Sq);
    });
    lcx::cuda::cudnn_batch_attention_backward(qp, kp, vp, op, stats, dop, dqp, dkp, dvp, b.q_lens, b.k_lens, nullptr,
                                              nullptr, b.B, b.Sq, b.Sk, p, launch);
    launch([&] {
      unpack_documents(dqp, dq, b.q_starts, b.q_lens, b.B, b.Sq);
      unpack_documents(dkp, dk, b.k_starts, b.k_lens, b.B, b.Sk);
      unpack_documents(dvp, dv, b.k_starts, b.k_lens, b.B, b.Sk);
    });
  }
  return batches.handled;
}

}  // namespace lcx::ops::cuda
