// cp_ring checks shared by the CPU suite (in-process thread-ranks) and the GPU suite (the same
// thread-ranks on one GPU, "virtual ranks"): ring attention against single-rank attention over
// the whole sequence, and a whole training step with cp ranks against the single-rank step.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "config/manifest.h"
#include "lcx/comm.h"
#include "lcx/defaults.h"
#include "lcx/ops.h"
#include "models/model_util.h"
#include "loader/plugin_loader.h"
#include "train/step.h"
#include "support/test_util.h"

namespace lcx::test {

// cp_ring created for [distributed] cp = `cp`, with `table` as its own table.
inline std::shared_ptr<Parallelism> make_cp_ring(int cp, const std::string& table = {}) {
  return make_plugin<Parallelism>("cp_ring", table, Device::cpu(), nullptr, MeshShape{1, cp, 1});
}


inline Sequence iota_sequence(int64_t L, int documents = 1) {
  Sequence s;
  s.tokens = Tensor::empty({L}, DType::i32);
  s.targets = Tensor::empty({L}, DType::i64);
  for (int64_t i = 0; i < L; ++i) {
    s.tokens.data_as<int32_t>()[i] = static_cast<int32_t>(i);
    s.targets.data_as<int64_t>()[i] = i + 1;
  }
  s.document_count = documents;
  return s;
}

inline std::vector<int64_t> positions_of(const Shard& s) {
  const int64_t* p = s.positions.data_as<const int64_t>();
  return std::vector<int64_t>(p, p + s.positions.numel());
}

// The indices in the sequence of a shard's rows, for a sequence of iota_sequence's tokens.
inline std::vector<int64_t> indices_of(const Shard& s) {
  const int32_t* t = s.tokens.data_as<const int32_t>();
  return std::vector<int64_t>(t, t + s.tokens.numel());
}

struct AttnCase {
  int cp;
  int64_t chunk, Hq, Hkv, d;
  bool causal = true;
  std::vector<int64_t> documents = {};  // packed documents' bounds over the sequence; empty: one
  std::string ring_table = {};           // the cp_ring table the ranks are created with
  int64_t window = 0;                    // > 0: a sliding-window layer of this window
};

inline std::string describe(const AttnCase& c) {
  return str("cp=", c.cp, " chunk=", c.chunk, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d, c.causal ? " causal" : " full",
             c.documents.empty() ? "" : str(" ", c.documents.size() - 1, " documents"),
             c.window > 0 ? str(" window=", c.window) : "");
}

// Relative L2 errors of ring attention against one rank holding the whole sequence.
struct AttnErrors {
  double out = INFINITY, lse = INFINITY, dq = INFINITY, dk = INFINITY, dv = INFINITY;
};

// Inputs are rounded to `dtype`; the reference runs on the CPU in fp32 on the rounded values,
// the ring on `device` in `dtype` with c.cp in-process ranks.
inline AttnErrors ring_attention_errors(const AttnCase& c, Device device, DType dtype, uint32_t seed) {
  const int64_t L = 2 * c.cp * c.chunk;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  auto host = [&](Shape s) {
    std::vector<float> v(static_cast<size_t>(shape_numel(s)));
    for (auto& x : v) x = normal(rng);
    return Tensor::from_floats(v, s, dtype).to(DType::f32);  // rounded as the ring will see it
  };
  const Tensor q = host({L, c.Hq, c.d}), k = host({L, c.Hkv, c.d}), v = host({L, c.Hkv, c.d}),
               dout = host({L, c.Hq, c.d});
  AttentionArgs args;
  args.scale = 1.f / std::sqrt(static_cast<float>(c.d));
  args.causal = c.causal;
  args.documents = c.documents;
  args.window = c.window;

  ops::AttentionParams p;
  p.scale = args.scale;
  p.causal = c.causal;
  p.documents = c.documents;
  p.window = c.window;
  Tensor out = Tensor::empty({L, c.Hq, c.d}, DType::f32), lse = Tensor::empty({c.Hq, L}, DType::f32);
  Tensor dq = Tensor::empty(q.shape(), DType::f32), dk = Tensor::empty(k.shape(), DType::f32),
         dv = Tensor::empty(v.shape(), DType::f32);
  ops::attention_forward(q, k, v, out, lse, p);
  ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);

  // Each rank writes its rows at their global positions.
  std::vector<float> r_out(static_cast<size_t>(out.numel()), NAN), r_lse(static_cast<size_t>(lse.numel()), NAN),
      r_dq(static_cast<size_t>(dq.numel()), NAN), r_dk(static_cast<size_t>(dk.numel()), NAN),
      r_dv(static_cast<size_t>(dv.numel()), NAN);
  std::vector<std::shared_ptr<Parallelism>> plugins;
  for (int r = 0; r < c.cp; ++r) plugins.push_back(make_cp_ring(c.cp, c.ring_table));
  ParallelModelInfo info;
  info.num_heads = c.Hq;
  info.num_kv_heads = c.Hkv;
  info.head_dim = c.d;
  info.layer_types = {c.window > 0 ? "sliding_attention" : "full_attention", "full_attention"};
  info.sliding_window = c.window;
  Sequence seq = iota_sequence(L);
  seq.document_bounds = c.documents;  // shard() lays the chunks out by them, as attention does

  run_in_process(c.cp, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = c.cp, .sp = 1});
    Parallelism& par = *plugins[static_cast<size_t>(comm.rank())];
    par.configure(info, &mesh);
    const Shard sh = par.shard(seq, mesh.coord().cp);
    const std::vector<int64_t> pos = indices_of(sh);
    const int64_t T = static_cast<int64_t>(pos.size());
    auto gather = [&](const Tensor& g) {
      Tensor t = Tensor::empty({T, g.size(1), g.size(2)}, DType::f32);
      for (int64_t i = 0; i < T; ++i) {
        const int64_t at = pos[static_cast<size_t>(i)];
        t.rows(i, i + 1).copy_from(g.rows(at, at + 1));
      }
      return t.to(dtype).to(device);
    };
    const Tensor lq = gather(q), lk = gather(k), lv = gather(v), ldo = gather(dout);
    Tensor lo = Tensor::empty(lq.shape(), dtype, device), ll = Tensor::empty({c.Hq, T}, DType::f32, device);
    par.attention_forward(lq, lk, lv, lo, ll, args);
    Tensor ldq = Tensor::empty(lq.shape(), dtype, device), ldk = Tensor::empty(lk.shape(), dtype, device),
           ldv = Tensor::empty(lv.shape(), dtype, device);
    par.attention_backward(lq, lk, lv, lo, ll, ldo, ldq, ldk, ldv, args);
    auto scatter = [&](const Tensor& t, std::vector<float>& dst) {
      const std::vector<float> f = t.to_floats();
      const int64_t row = t.numel() / T;
      for (int64_t i = 0; i < T; ++i)
        std::copy(f.begin() + i * row, f.begin() + (i + 1) * row, dst.begin() + pos[static_cast<size_t>(i)] * row);
    };
    scatter(lo, r_out);
    scatter(ldq, r_dq);
    scatter(ldk, r_dk);
    scatter(ldv, r_dv);
    const std::vector<float> lf = ll.to_floats();
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t i = 0; i < T; ++i)
        r_lse[static_cast<size_t>(h * L + pos[static_cast<size_t>(i)])] = lf[static_cast<size_t>(h * T + i)];
  });
  AttnErrors e;
  e.out = rel_l2(r_out, out.to_floats());
  e.lse = rel_l2(r_lse, lse.to_floats());
  e.dq = rel_l2(r_dq, dq.to_floats());
  e.dk = rel_l2(r_dk, dk.to_floats());
  e.dv = rel_l2(r_dv, dv.to_floats());
  return e;
}

// Packed documents whose default (time) layout moves its chunks' bounds (balance.h
// even_bounds), per ring size: chunks of unequal rows on every rank, 4,096 tokens.
inline const std::vector<std::pair<int, std::vector<int64_t>>> kMovedBounds = {
    {2, {0, 1344, 2752, 4096}}, {4, {0, 1, 50, 97, 300, 2500, 4096}}, {8, {0, 700, 4096}}};

inline void expect_ring_attention(const AttnCase& c, Device device, DType dtype, double tol, uint32_t seed = 7) {
  const AttnErrors e = ring_attention_errors(c, device, dtype, seed);
  EXPECT_LE(e.out, tol) << describe(c) << ": out";
  EXPECT_LE(e.lse, tol) << describe(c) << ": lse";
  EXPECT_LE(e.dq, tol) << describe(c) << ": dq";
  EXPECT_LE(e.dk, tol) << describe(c) << ": dk";
  EXPECT_LE(e.dv, tol) << describe(c) << ": dv";
}

// A tiny Qwen3 (GQA 4: 4 query heads, 1 kv head) for whole-step checks.
inline const char* kTinyQwen3 = R"({"vocab_size":64,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,
  "num_attention_heads":4,"num_key_value_heads":1,"head_dim":16,"rope_theta":10000.0,"tie_word_embeddings":false})";

// Random tokens with next-token targets, a few ignored (as padding and masked labels leave them).
inline Sequence random_sequence(int64_t L, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> tok(0, static_cast<int>(vocab) - 1);
  Sequence s;
  s.tokens = Tensor::empty({L}, DType::i32);
  s.targets = Tensor::empty({L}, DType::i64);
  for (int64_t i = 0; i < L; ++i) s.tokens.data_as<int32_t>()[i] = tok(rng);
  for (int64_t i = 0; i < L; ++i)
    s.targets.data_as<int64_t>()[i] = i + 1 < L && i % 7 != 3 ? s.tokens.data_as<int32_t>()[i + 1] : -100;
  return s;
}

inline int64_t valid_targets(const Sequence& s) {
  int64_t n = 0;
  for (int64_t i = 0; i < s.targets.numel(); ++i) n += s.targets.data_as<int64_t>()[i] != -100;
  return n;
}

struct StepOutcome {
  double loss_sum = 0;
  int64_t valid = 0;
  std::map<std::string, std::vector<float>> grads;
};

// The Loss, PositionalEncoding and MemoryStrategy a step uses: core's defaults, or plugins (each
// rank its own).
struct StepPlugins {
  std::function<std::shared_ptr<Loss>()> loss = [] { return std::shared_ptr<Loss>(make_full_logits_loss()); };
  std::function<std::shared_ptr<PositionalEncoding>()> rope = [] {
    return std::shared_ptr<PositionalEncoding>(make_default_rope());
  };
  std::function<std::shared_ptr<MemoryStrategy>()> memory = [] {
    return std::shared_ptr<MemoryStrategy>(make_on_device_memory());
  };
  std::string model_spec = kTinyQwen3;
  std::string model_table;  // the [qwen3] table, e.g. attention_head_groups = 2
  // Another model than the qwen3 module, made and filled (a family of the decoder library made in
  // the test).
  std::function<std::shared_ptr<Model>(Device, DType)> model;
};

inline std::shared_ptr<Model> tiny_model(Device device, DType dtype, const StepPlugins& with = {}) {
  if (with.model) return with.model(device, dtype);
  auto m = make_qwen3(with.model_table);
  m->init_random(with.model_spec, 11, device, dtype);
  return m;
}

inline StepOutcome grads_of(Model& m, double loss_sum, int64_t valid) {
  StepOutcome o;
  o.loss_sum = loss_sum;
  o.valid = valid;
  for (Parameter* p : m.parameters()) o.grads[p->name] = p->grad.to_floats();
  return o;
}

// One rank holding the sequence through core's single-rank parallelism.
inline StepOutcome single_rank_step(const Sequence& seq, Device device, DType dtype, const StepPlugins& with = {}) {
  auto model = tiny_model(device, dtype, with);
  auto loss = with.loss();
  auto rope = with.rope();
  auto memory = with.memory();
  auto parallel = make_single_rank();
  StepSlots slots{*model, *loss, *rope, *memory, *parallel};
  configure_slots(slots);
  const Shard sh = parallel->shard(seq, 0);
  model->zero_grad();
  const StepResult r = train_step(slots, sh, 1.0 / static_cast<double>(valid_targets(seq)), device);
  return grads_of(*model, r.loss_sum, r.valid);
}

// cp in-process ranks as the trainer runs them: each binds its mesh, takes its shard, steps with
// grad_scale = 1 / (valid targets of the whole sequence), then the grads and the loss are summed
// over the ranks. Rank 0's result.
inline StepOutcome cp_step(const Sequence& seq, int cp, Device device, DType dtype, const StepPlugins& with = {},
                           const std::string& ring_table = {}) {
  struct Rank {
    std::shared_ptr<Model> model;
    std::shared_ptr<Parallelism> parallel;
    std::shared_ptr<Loss> loss;
    std::shared_ptr<PositionalEncoding> rope;
    std::shared_ptr<MemoryStrategy> memory;
  };
  std::vector<Rank> ranks(static_cast<size_t>(cp));
  for (Rank& r : ranks) {
    r.model = tiny_model(device, dtype, with);
    r.parallel = make_cp_ring(cp, ring_table);
    r.loss = with.loss();
    r.rope = with.rope();
    r.memory = with.memory();
  }
  const double scale = 1.0 / static_cast<double>(valid_targets(seq));
  StepOutcome result;
  run_in_process(cp, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = cp, .sp = 1});
    Rank& r = ranks[static_cast<size_t>(comm.rank())];
    StepSlots slots{*r.model, *r.loss, *r.rope, *r.memory, *r.parallel};
    slots.mesh = &mesh;
    configure_slots(slots);
    const Shard sh = r.parallel->shard(seq, mesh.coord().cp);
    r.model->zero_grad();
    const StepResult sr = train_step(slots, sh, scale, device);
    double sums[2] = {sr.loss_sum, static_cast<double>(sr.valid)};
    mesh.seq().all_reduce(std::span<double>(sums, 2));
    for (Parameter* p : r.model->parameters()) mesh.cp().all_reduce(p->grad);
    if (comm.rank() == 0) result = grads_of(*r.model, sums[0], static_cast<int64_t>(sums[1]));
  });
  return result;
}

// Loss within loss_tol (relative), every parameter's gradient within grad_tol (relative L2).
inline void expect_same_step(const StepOutcome& got, const StepOutcome& want, double loss_tol, double grad_tol,
                             const std::string& what) {
  EXPECT_EQ(got.valid, want.valid) << what;
  EXPECT_NEAR(got.loss_sum, want.loss_sum, loss_tol * std::abs(want.loss_sum)) << what;
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (const auto& [name, g] : want.grads) {
    const auto it = got.grads.find(name);
    ASSERT_NE(it, got.grads.end()) << what << ": " << name;
    EXPECT_LE(rel_l2(it->second, g), grad_tol) << what << ": grad of " << name;
  }
}

}  // namespace lcx::test
