// sp_ulysses against one rank holding the whole sequence, shared by the CPU suite (thread-ranks)
// and the GPU suite (virtual ranks: thread-ranks whose tensors live on one GPU):
//   - attention: each rank's slice of out, lse, dq, dk, dv equals the single-rank op's rows;
//   - a whole training step of a tiny qwen3: loss and every parameter gradient (summed over the
//     ranks) equal the single-rank step's.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <mutex>
#include <random>

#include "config/manifest.h"
#include "lcx/comm.h"
#include "lcx/ops.h"
#include "lcx/slots/parallelism.h"
#include "models/model_util.h"
#include "loader/plugin_loader.h"
#include "support/test_util.h"

namespace lcx::test {

// sp_ulysses created for [distributed] sp = `sp`.
inline std::shared_ptr<Parallelism> load_ulysses(int sp) {
  return make_plugin<Parallelism>("sp_ulysses", "", Device::cpu(), nullptr, MeshShape{1, 1, sp});
}

// max |got - want| / (atol + rtol |want|) over the elements; <= 1 passes.
inline double excess(const std::vector<float>& got, const std::vector<float>& want, double rtol, double atol) {
  if (got.size() != want.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(static_cast<double>(got[i]) - want[i]) / (atol + rtol * std::fabs(want[i]));
    if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
  }
  return worst;
}


// Elementwise (rtol, atol) when l2 is 0, else relative L2 <= l2 (low-precision GPU runs).
struct Tolerance {
  double rtol = 1e-5, atol = 1e-5, l2 = 0;
  bool ok(const std::vector<float>& got, const std::vector<float>& want, double atol_scale = 1) const {
    return l2 > 0 ? rel_l2(got, want) <= l2 : excess(got, want, rtol, atol * atol_scale) <= 1.0;
  }
};

struct AttentionCase {
  int sp = 2;
  int64_t tokens_per_rank = 5, Hq = 16, Hkv = 2, d = 8;
  Device device = Device::cpu();
  DType dtype = DType::f32;
  Tolerance tol;
  bool reuse_forward = true;  // false: backward on copies, so the plugin moves its inputs again
  std::vector<int64_t> documents;  // packed documents' bounds over the whole sequence; empty: one
  int64_t window = 0;              // > 0: a sliding-window layer of this window
};

// The single-rank attention a parity case holds the ranks to: q, k, v and dout of [L, H, d] drawn
// from a normal generator seeded with `seed`, masked by `documents` when given, the forward and
// backward over the whole sequence, and what the ranks are given (their arguments, the model info).
struct SingleRankAttention {
  Tensor q, k, v, dout, out, lse, dq, dk, dv;
  AttentionArgs args;
  ParallelModelInfo info;
};
inline SingleRankAttention single_rank_attention(int64_t L, int64_t Hq, int64_t Hkv, int64_t d, DType dtype,
                                                 Device device, const std::vector<int64_t>& documents,
                                                 uint32_t seed, int64_t window = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  auto rnd = [&](Shape s) {
    std::vector<float> v(static_cast<size_t>(shape_numel(s)));
    for (auto& x : v) x = dist(rng);
    return Tensor::from_floats(v, std::move(s), dtype, device);
  };
  SingleRankAttention a;
  a.q = rnd({L, Hq, d});
  a.k = rnd({L, Hkv, d});
  a.v = rnd({L, Hkv, d});
  a.dout = rnd({L, Hq, d});
  a.args.scale = 1.f / std::sqrt(static_cast<float>(d));
  a.args.documents = documents;
  a.args.window = window;
  ops::AttentionParams p;
  p.scale = a.args.scale;
  p.documents = documents;
  p.window = window;
  a.out = Tensor::empty({L, Hq, d}, dtype, device);
  a.lse = Tensor::empty({Hq, L}, DType::f32, device);
  ops::attention_forward(a.q, a.k, a.v, a.out, a.lse, p);
  a.dq = Tensor::empty(a.q.shape(), dtype, device);
  a.dk = Tensor::empty(a.k.shape(), dtype, device);
  a.dv = Tensor::empty(a.v.shape(), dtype, device);
  ops::attention_backward(a.q, a.k, a.v, a.out, a.lse, a.dout, a.dq, a.dk, a.dv, p);
  a.info.num_heads = Hq;
  a.info.num_kv_heads = Hkv;
  a.info.head_dim = d;
  a.info.layer_types = {window > 0 ? "sliding_attention" : "full_attention", "full_attention"};
  a.info.sliding_window = window;
  return a;
}

// Runs single-rank attention over [L,H,d] and sp_ulysses over sp thread-ranks; every rank's
// rows must match. Returns nothing: failures are gtest expectations naming the case.
inline void check_attention(const AttentionCase& c) {
  const int sp = c.sp;
  const int64_t T = c.tokens_per_rank, L = T * sp, Hq = c.Hq, Hkv = c.Hkv, d = c.d;
  const std::string what = str("sp ", sp, ", Hq ", Hq, ", Hkv ", Hkv, ", d ", d, ", T/rank ", T, ", ",
                               dtype_name(c.dtype), c.reuse_forward ? "" : ", backward on copies",
                               c.documents.empty() ? "" : str(", ", c.documents.size() - 1, " documents"),
                               c.window > 0 ? str(", window ", c.window) : "");
  const SingleRankAttention ref = single_rank_attention(L, Hq, Hkv, d, c.dtype, c.device, c.documents,
                                                        static_cast<uint32_t>(1000 * sp + 10 * Hkv + d), c.window);
  const Tensor &q = ref.q, &k = ref.k, &v = ref.v, &dout = ref.dout, &out = ref.out, &lse = ref.lse, &dq = ref.dq,
               &dk = ref.dk, &dv = ref.dv;
  const AttentionArgs& args = ref.args;
  const ParallelModelInfo& info = ref.info;
  std::vector<std::shared_ptr<Parallelism>> plugins;
  for (int r = 0; r < sp; ++r) plugins.push_back(load_ulysses(sp));

  struct Got {
    Tensor out, lse, dq, dk, dv;
  };
  std::vector<Got> got(static_cast<size_t>(sp));
  run_in_process(sp, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = 1, .sp = sp});
    const int r = comm.rank();
    Parallelism& par = *plugins[static_cast<size_t>(r)];
    par.configure(info, &mesh);
    auto mine = [&](const Tensor& x) { return x.rows(r * T, (r + 1) * T).clone(); };
    Tensor qr = mine(q), kr = mine(k), vr = mine(v), dor = mine(dout);
    Got& g = got[static_cast<size_t>(r)];
    g.out = Tensor::empty({T, Hq, d}, c.dtype, c.device);
    g.lse = Tensor::empty({Hq, T}, DType::f32, c.device);
    g.dq = Tensor::empty({T, Hq, d}, c.dtype, c.device);
    g.dk = Tensor::empty({T, Hkv, d}, c.dtype, c.device);
    g.dv = Tensor::empty({T, Hkv, d}, c.dtype, c.device);
    // Two layers' worth, as the step calls it: the second forward replaces the first's buffers.
    par.attention_forward(qr, kr, vr, g.out, g.lse, args);
    par.attention_forward(qr, kr, vr, g.out, g.lse, args);
    if (c.reuse_forward) {
      par.attention_backward(qr, kr, vr, g.out, g.lse, dor, g.dq, g.dk, g.dv, args);
    } else {
      par.attention_backward(qr.clone(), kr.clone(), vr.clone(), g.out.clone(), g.lse.clone(), dor, g.dq, g.dk, g.dv,
                             args);
    }
  });

  const std::vector<float> lse_all = lse.to_floats();
  for (int r = 0; r < sp; ++r) {
    const Got& g = got[static_cast<size_t>(r)];
    auto rows = [&](const Tensor& x) { return x.rows(r * T, (r + 1) * T).to_floats(); };
    EXPECT_TRUE(c.tol.ok(g.out.to_floats(), rows(out))) << "out, rank " << r << ": " << what;
    EXPECT_TRUE(c.tol.ok(g.dq.to_floats(), rows(dq))) << "dq, rank " << r << ": " << what;
    EXPECT_TRUE(c.tol.ok(g.dk.to_floats(), rows(dk))) << "dk, rank " << r << ": " << what;
    EXPECT_TRUE(c.tol.ok(g.dv.to_floats(), rows(dv))) << "dv, rank " << r << ": " << what;
    std::vector<float> want_lse;
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t t = 0; t < T; ++t) want_lse.push_back(lse_all[static_cast<size_t>(h * L + r * T + t)]);
    EXPECT_TRUE(c.tol.ok(g.lse.to_floats(), want_lse)) << "lse, rank " << r << ": " << what;
  }
}

// The kv head counts worth testing for sp ranks and Hq query heads: replicated (Hkv < sp), one
// per rank (Hkv == sp) and several per rank (Hkv > sp).
inline std::vector<int64_t> kv_cases(int sp, int64_t Hq) {
  std::vector<int64_t> out;
  for (int64_t h : {int64_t{1}, int64_t{sp / 2}, int64_t{sp}, int64_t{2 * sp}, Hq})
    if (h >= 1 && Hq % h == 0 && std::find(out.begin(), out.end(), h) == out.end()) out.push_back(h);
  return out;
}

struct StepCase {
  int sp = 2;
  int64_t L = 48, Hq = 8, Hkv = 2, d = 8, hidden = 32, vocab = 96;
  Device device = Device::cpu();
  DType weight_dtype = DType::f32;
  std::string loss = "loss_chunked";  // or "nll"
  std::string rope_yarn_table;        // non-empty: rope_yarn with this table instead of core's rope
  bool offload = false;               // the offload plugin instead of core's on-device strategy
  Tolerance tol{2e-5, 2e-6, 0};  // atol is relative to each tensor's largest gradient
  double loss_rtol = 1e-5;
  std::vector<int64_t> documents;  // packed documents' bounds ([data] attend_across_documents = false)
};

struct Slots {
  std::shared_ptr<Model> model;
  std::shared_ptr<Loss> loss;
  std::shared_ptr<PositionalEncoding> rope;
  std::shared_ptr<MemoryStrategy> memory;
  std::shared_ptr<Parallelism> parallel;
  StepSlots slots() { return {*model, *loss, *rope, *memory, *parallel}; }
};

inline Slots make_slots(const StepCase& c, std::shared_ptr<Parallelism> parallel) {
  Slots s;
  s.model = make_qwen3();
  s.model->init_random(str(R"({"vocab_size":)", c.vocab, R"(,"hidden_size":)", c.hidden,
                           R"(,"intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":)", c.Hq,
                           R"(,"num_key_value_heads":)", c.Hkv, R"(,"head_dim":)", c.d,
                           R"(,"max_position_embeddings":32,"rope_theta":10000.0,"tie_word_embeddings":false})"),
                       11, c.device, c.weight_dtype);
  s.loss = c.loss == "nll" ? std::shared_ptr<Loss>(make_full_logits_loss())
                           : make_plugin<Loss>("loss_chunked", "chunk_rows = 5");
  s.rope = c.rope_yarn_table.empty() ? std::shared_ptr<PositionalEncoding>(make_default_rope())
                                     : make_plugin<PositionalEncoding>("rope_yarn", c.rope_yarn_table);
  s.memory = c.offload ? make_plugin<MemoryStrategy>("offload", "")
                       : std::shared_ptr<MemoryStrategy>(make_on_device_memory());
  s.parallel = std::move(parallel);
  return s;
}

// The sequence a step case trains: random token ids, next-token targets with a run of ignored
// targets across a shard boundary and the last one ignored (as the data gives), and the count of
// valid targets.
struct StepSequence {
  Sequence seq;
  int64_t valid = 0;
};
inline StepSequence step_sequence(const StepCase& c) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab) - 1);
  StepSequence s;
  s.seq.tokens = Tensor::empty({c.L}, DType::i32);
  s.seq.targets = Tensor::empty({c.L}, DType::i64);
  s.seq.document_bounds = c.documents;
  for (int64_t t = 0; t < c.L; ++t) s.seq.tokens.data_as<int32_t>()[t] = tok(rng);
  for (int64_t t = 0; t < c.L; ++t) {
    const bool ignored = t + 1 == c.L || (t >= c.L / 2 - 3 && t < c.L / 2 + 2);
    s.seq.targets.data_as<int64_t>()[t] = ignored ? -100 : s.seq.tokens.data_as<int32_t>()[(t + 1) % c.L];
    s.valid += !ignored;
  }
  return s;
}

// Every rank's summed gradients against the single rank's, tensor by tensor; each reference
// gradient must be nonzero, and atol is relative to its largest entry (entries near zero carry
// summation noise).
inline void expect_rank_grads(const Slots& one, const std::vector<Slots>& ranks, const Tolerance& tol,
                              const std::string& what) {
  const std::vector<Parameter*> ps = one.model->parameters();
  for (size_t r = 0; r < ranks.size(); ++r) {
    const std::vector<Parameter*> qs = ranks[r].model->parameters();
    ASSERT_EQ(ps.size(), qs.size());
    for (size_t i = 0; i < ps.size(); ++i) {
      const std::vector<float> w = ps[i]->grad.to_floats();
      float norm = 0;
      for (float x : w) norm = std::max(norm, std::fabs(x));
      ASSERT_GT(norm, 0.f) << ps[i]->name << " has no gradient: " << what;
      EXPECT_TRUE(tol.ok(qs[i]->grad.to_floats(), w, std::max(1.f, norm))) << ps[i]->name << ", rank " << r << ": " << what;
    }
  }
}

// The trainer runs of the parity tests: a token file of one 40-token pattern repeated 12 times
// (sequences a short run learns), and each step's (loss, grad_norm) from a run's metrics.jsonl.
inline void write_repeating_tokens(const std::filesystem::path& file) {
  std::mt19937 rng(5);
  std::vector<uint32_t> pattern(40);
  for (auto& x : pattern) x = rng() % 256;
  std::ofstream out(file, std::ios::binary);
  for (int r = 0; r < 12; ++r) out.write(reinterpret_cast<const char*>(pattern.data()), pattern.size() * 4);
}
inline std::vector<std::pair<double, double>> loss_and_norm(const std::filesystem::path& run_dir) {
  std::vector<std::pair<double, double>> steps;
  std::ifstream in(run_dir / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;  // an evaluation's row
    steps.emplace_back(j.at("loss").get<double>(), j.at("grad_norm").get<double>());
  }
  return steps;
}

// The whole sequence's step on one rank: the reference the ranks' summed loss and grads must equal.
struct ReferenceStep {
  StepSequence ss;
  double scale = 0;  // 1 / the whole sequence's valid targets, every rank's grad_scale
  Slots one;
  StepResult want;
};
inline ReferenceStep reference_step(const StepCase& c) {
  ReferenceStep r{step_sequence(c)};
  r.scale = 1.0 / static_cast<double>(r.ss.valid);
  r.one = make_slots(c, std::shared_ptr<Parallelism>(make_single_rank()));
  StepSlots slots = r.one.slots();
  configure_slots(slots);
  r.one.model->zero_grad();
  r.want = train_step(slots, r.one.parallel->shard(r.ss.seq, 0), r.scale, c.device);
  return r;
}

// One rank's step of a parity case: its shard `index` of the sequence, trained with the whole
// sequence's scale, its parameter grads then summed over `group` as the trainer's all-reduce does.
inline StepResult rank_step(Slots& s, Mesh& mesh, Communicator& group, const Sequence& seq, int index, double scale,
                            Device device) {
  StepSlots slots = s.slots();
  slots.mesh = &mesh;
  configure_slots(slots);
  s.model->zero_grad();
  const StepResult got = train_step(slots, s.parallel->shard(seq, index), scale, device);
  for (Parameter* p : s.model->parameters()) group.all_reduce(p->grad);
  return got;
}

// One training step of the whole sequence on one rank, then the same sequence over sp ranks
// (each: its shard, train_step with the whole sequence's mean, then the grads summed over the
// ranks as the trainer's all-reduce does). Loss sums and every gradient must agree.
inline void check_step(const StepCase& c) {
  const std::string what = str("sp ", c.sp, ", Hq ", c.Hq, ", Hkv ", c.Hkv, ", ", c.loss,
                               c.documents.empty() ? "" : str(", ", c.documents.size() - 1, " documents"),
                               c.rope_yarn_table.empty() ? "" : ", rope_yarn", c.offload ? ", offload" : "", ", ", device_name(c.device), " ",
                               dtype_name(c.weight_dtype));
  const ReferenceStep ref = reference_step(c);
  const Sequence& seq = ref.ss.seq;
  const int64_t valid = ref.ss.valid;
  const StepResult& want = ref.want;
  ASSERT_EQ(want.valid, valid) << what;

  std::vector<Slots> ranks;
  for (int r = 0; r < c.sp; ++r) ranks.push_back(make_slots(c, load_ulysses(c.sp)));
  std::vector<double> loss_sum(static_cast<size_t>(c.sp));
  std::vector<int64_t> valid_sum(static_cast<size_t>(c.sp));
  run_in_process(c.sp, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = 1, .sp = c.sp});
    const int r = comm.rank();
    const StepResult got = rank_step(ranks[static_cast<size_t>(r)], mesh, mesh.sp(), seq, r, ref.scale, c.device);
    double sums[2] = {got.loss_sum, static_cast<double>(got.valid)};
    mesh.sp().all_reduce(std::span<double>(sums, 2));
    loss_sum[static_cast<size_t>(r)] = sums[0];
    valid_sum[static_cast<size_t>(r)] = static_cast<int64_t>(sums[1]);
  });

  for (int r = 0; r < c.sp; ++r) {
    EXPECT_NEAR(loss_sum[static_cast<size_t>(r)], want.loss_sum, c.loss_rtol * std::fabs(want.loss_sum)) << what;
    EXPECT_EQ(valid_sum[static_cast<size_t>(r)], valid) << what;
  }
  expect_rank_grads(ref.one, ranks, c.tol, what);
}

}  // namespace lcx::test
