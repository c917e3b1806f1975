// Two-dimensional sequence parallelism: sp_ulysses stacked over cp_ring on a cp x sp mesh, against
// one rank holding the whole sequence. Shared by the CPU suite (thread-ranks) and the GPU suite
// (virtual ranks: thread-ranks whose tensors live on one GPU):
//   - attention: each rank's rows of out, lse, dq, dk, dv (the rows its shard names) equal the
//     single-rank op's;
//   - a training step of a tiny qwen3: the loss and every parameter gradient summed over the
//     cp x sp ranks equal the single-rank step's.
// Either placement order ([distributed] order): each rank takes the shard of its seq_index, which
// under cp_inner differs from its world rank, so the communicators must group what the shards say.
#pragma once
#include "plugins/sp_ulysses_cases.h"

namespace lcx::test {

// sp_ulysses stacked over cp_ring, created for a [distributed] cp x sp mesh as core's
// resolve_slots stacks them.
inline std::shared_ptr<Parallelism> load_stacked(int cp, int sp, const std::string& ring_table = {}) {
  const MeshShape shape{1, cp, sp};
  auto ring = make_plugin<Parallelism>("cp_ring", ring_table, Device::cpu(), nullptr, shape);
  auto outer = make_plugin<Parallelism>("sp_ulysses", "", Device::cpu(), nullptr, shape);
  EXPECT_TRUE(outer->stacks_over(*ring));
  EXPECT_FALSE(ring->stacks_over(*outer));
  outer->set_inner(ring);
  return outer;
}

// The sequence positions a rank's shard holds, in its row order: the shard of a sequence whose
// token t is t, packed as `documents` say (cp_ring lays its chunks out by them).
inline std::vector<int32_t> shard_rows(const Parallelism& par, int64_t L, int seq_rank,
                                       const std::vector<int64_t>& documents = {}) {
  Sequence seq;
  seq.document_bounds = documents;
  seq.tokens = Tensor::empty({L}, DType::i32);
  seq.targets = Tensor::empty({L}, DType::i64);
  for (int64_t t = 0; t < L; ++t) {
    seq.tokens.data_as<int32_t>()[t] = static_cast<int32_t>(t);
    seq.targets.data_as<int64_t>()[t] = t;
  }
  const Shard s = par.shard(seq, seq_rank);
  return std::vector<int32_t>(s.tokens.data_as<int32_t>(), s.tokens.data_as<int32_t>() + s.tokens.size(0));
}

// Rows `ids` of x [L, ...] as a new [ids, ...] tensor on x's device.
inline Tensor gather_rows(const Tensor& x, const std::vector<int32_t>& ids) {
  const int64_t n = static_cast<int64_t>(ids.size()), row = x.numel() / x.size(0);
  Tensor host = Tensor::empty({n}, DType::i32);
  std::copy(ids.begin(), ids.end(), host.data_as<int32_t>());
  const Tensor id = x.device() == Device::cpu() ? host : host.to(x.device());
  Shape shape = x.shape();
  shape[0] = n;
  Tensor out = Tensor::empty(shape, x.dtype(), x.device());
  Tensor flat = out.view({n, row});
  ops::embedding_forward(id, x.view({x.size(0), row}), flat);
  return out;
}

struct Attention2dCase {
  int cp = 2, sp = 2;
  int64_t L = 32, Hq = 8, Hkv = 2, d = 8;
  Device device = Device::cpu();
  DType dtype = DType::f32;
  Tolerance tol;
  std::vector<int64_t> documents;  // packed documents' bounds over the whole sequence; empty: one
  MeshOrder order = MeshOrder::sp_inner;
  std::string ring_table;  // the cp_ring table
  int64_t window = 0;      // > 0: a sliding-window layer of this window
};

inline void check_attention_2d(const Attention2dCase& c) {
  const int n = c.cp * c.sp;
  const int64_t L = c.L, Hq = c.Hq, Hkv = c.Hkv, d = c.d;
  const std::string what = str("cp ", c.cp, " x sp ", c.sp, " ", mesh_order_name(c.order), ", Hq ", Hq, ", Hkv ", Hkv,
                               ", d ", d, ", L ", L, ", ", dtype_name(c.dtype),
                               c.documents.empty() ? "" : str(", ", c.documents.size() - 1, " documents"),
                               c.window > 0 ? str(", window ", c.window) : "");
  const SingleRankAttention ref = single_rank_attention(L, Hq, Hkv, d, c.dtype, c.device, c.documents,
                                                       static_cast<uint32_t>(100 * c.cp + 10 * c.sp + Hkv), c.window);
  const Tensor &q = ref.q, &k = ref.k, &v = ref.v, &dout = ref.dout, &out = ref.out, &lse = ref.lse, &dq = ref.dq,
               &dk = ref.dk, &dv = ref.dv;
  const AttentionArgs& args = ref.args;
  const ParallelModelInfo& info = ref.info;
  std::vector<std::shared_ptr<Parallelism>> plugins;
  for (int r = 0; r < n; ++r) plugins.push_back(load_stacked(c.cp, c.sp, c.ring_table));

  struct Got {
    std::vector<int32_t> rows;
    Tensor out, lse, dq, dk, dv;
  };
  std::vector<Got> got(static_cast<size_t>(n));
  run_in_process(n, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = c.cp, .sp = c.sp, .order = c.order});
    const int r = comm.rank();
    Parallelism& par = *plugins[static_cast<size_t>(r)];
    par.configure(info, &mesh);
    Got& g = got[static_cast<size_t>(r)];
    g.rows = shard_rows(par, L, seq_index(mesh.shape(), mesh.coord()), c.documents);
    const int64_t T = static_cast<int64_t>(g.rows.size());
    const Tensor qr = gather_rows(q, g.rows), kr = gather_rows(k, g.rows), vr = gather_rows(v, g.rows),
                 dor = gather_rows(dout, g.rows);
    g.out = Tensor::empty({T, Hq, d}, c.dtype, c.device);
    g.lse = Tensor::empty({Hq, T}, DType::f32, c.device);
    g.dq = Tensor::empty({T, Hq, d}, c.dtype, c.device);
    g.dk = Tensor::empty({T, Hkv, d}, c.dtype, c.device);
    g.dv = Tensor::empty({T, Hkv, d}, c.dtype, c.device);
    par.attention_forward(qr, kr, vr, g.out, g.lse, args);
    par.attention_backward(qr, kr, vr, g.out, g.lse, dor, g.dq, g.dk, g.dv, args);
  });

  const std::vector<float> lse_all = lse.to_floats();
  std::vector<int> held(static_cast<size_t>(L), 0);
  for (int r = 0; r < n; ++r) {
    const Got& g = got[static_cast<size_t>(r)];
    ASSERT_EQ(static_cast<int64_t>(g.rows.size()), L / n) << what;
    for (int32_t t : g.rows) ++held[static_cast<size_t>(t)];
    EXPECT_TRUE(c.tol.ok(g.out.to_floats(), gather_rows(out, g.rows).to_floats())) << "out, rank " << r << ": " << what;
    EXPECT_TRUE(c.tol.ok(g.dq.to_floats(), gather_rows(dq, g.rows).to_floats())) << "dq, rank " << r << ": " << what;
    EXPECT_TRUE(c.tol.ok(g.dk.to_floats(), gather_rows(dk, g.rows).to_floats())) << "dk, rank " << r << ": " << what;
    EXPECT_TRUE(c.tol.ok(g.dv.to_floats(), gather_rows(dv, g.rows).to_floats())) << "dv, rank " << r << ": " << what;
    std::vector<float> want_lse;
    for (int64_t h = 0; h < Hq; ++h)
      for (int32_t t : g.rows) want_lse.push_back(lse_all[static_cast<size_t>(h * L + t)]);
    EXPECT_TRUE(c.tol.ok(g.lse.to_floats(), want_lse)) << "lse, rank " << r << ": " << what;
  }
  for (int64_t t = 0; t < L; ++t) EXPECT_EQ(held[static_cast<size_t>(t)], 1) << "position " << t << ": " << what;
}

// One training step of the whole sequence on one rank, then over cp x sp ranks (each: its shard,
// train_step with the whole sequence's mean, then loss and grads summed over the sequence's ranks
// as the trainer's all-reduce does). Loss sums and every gradient must agree.
inline void check_step_2d(int cp, const StepCase& c, MeshOrder order = MeshOrder::sp_inner) {
  const int n = cp * c.sp;
  const std::string what = str("cp ", cp, " x sp ", c.sp, " ", mesh_order_name(order), ", Hq ", c.Hq, ", Hkv ", c.Hkv,
                               ", L ", c.L, c.documents.empty() ? "" : str(", ", c.documents.size() - 1, " documents"), ", ",
                               device_name(c.device), " ", dtype_name(c.weight_dtype));
  const ReferenceStep ref = reference_step(c);
  const Sequence& seq = ref.ss.seq;
  const StepResult& want = ref.want;
  ASSERT_EQ(want.valid, ref.ss.valid) << what;

  std::vector<Slots> ranks;
  for (int r = 0; r < n; ++r) ranks.push_back(make_slots(c, load_stacked(cp, c.sp)));
  std::vector<double> loss_sum(static_cast<size_t>(n));
  run_in_process(n, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = cp, .sp = c.sp, .order = order});
    const int r = comm.rank();
    const StepResult got = rank_step(ranks[static_cast<size_t>(r)], mesh, mesh.seq(), seq,
                                     seq_index(mesh.shape(), mesh.coord()), ref.scale, c.device);
    double sums[1] = {got.loss_sum};
    mesh.seq().all_reduce(std::span<double>(sums, 1));
    loss_sum[static_cast<size_t>(r)] = sums[0];
  });

  for (int r = 0; r < n; ++r)
    EXPECT_NEAR(loss_sum[static_cast<size_t>(r)], want.loss_sum, c.loss_rtol * std::fabs(want.loss_sum)) << what;
  expect_rank_grads(ref.one, ranks, c.tol, what);
}

}  // namespace lcx::test
