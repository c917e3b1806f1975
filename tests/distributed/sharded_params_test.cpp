// ZeRO-3 sharding on thread-ranks: gather returns the exact full values, reduce_grads gives each
// rank the serial sum of its block, and AdamW over the shards equals AdamW over whole parameters.
#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "distributed/comm_cases.h"
#include "distributed/sharded_params.h"
#include "slots/adamw.h"

namespace lcx {
namespace {

// Sizes that do and do not divide by 2, 3 and 4, so the last ranks hold padding.
const std::vector<std::pair<std::string, Shape>> kShapes = {
    {"model.embed_tokens.weight", {5, 3}}, {"model.layers.0.mlp.up_proj.weight", {4, 4}},
    {"model.layers.0.input_layernorm.weight", {7}}, {"model.layers.1.self_attn.q_proj.weight", {3, 11}},
    {"model.norm.weight", {1}}};

float init_value(size_t p, int64_t i) { return std::sin(0.7f * static_cast<float>(i) + static_cast<float>(p)) * 0.5f; }
float grad_value(int step, int rank, size_t p, int64_t i) {
  return std::cos(0.3f * static_cast<float>(i * (rank + 2)) + static_cast<float>(p + step)) * 0.1f * static_cast<float>(rank + 1);
}

std::vector<Parameter> make_params(DType dt) {
  std::vector<Parameter> ps;
  for (size_t p = 0; p < kShapes.size(); ++p) {
    const auto& [name, shape] = kShapes[p];
    std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
    for (size_t i = 0; i < v.size(); ++i) v[i] = init_value(p, static_cast<int64_t>(i));
    Parameter x;
    x.name = name;
    x.value = Tensor::from_floats(v, shape, dt);
    x.grad = Tensor::zeros(shape, DType::f32);
    x.decay = name.find("norm") == std::string::npos;
    ps.push_back(std::move(x));
  }
  return ps;
}

std::vector<float> summed_grad(int step, int world, size_t p, int64_t n) {
  std::vector<float> acc(static_cast<size_t>(n), 0.0f);
  for (int r = 0; r < world; ++r)
    for (int64_t i = 0; i < n; ++i) acc[static_cast<size_t>(i)] += grad_value(step, r, p, i);
  return acc;
}

std::vector<std::string> all_names() {
  std::vector<std::string> n;
  for (const auto& s : kShapes) n.push_back(s.first);
  return n;
}

class Sharded : public ::testing::TestWithParam<int> {};

TEST_P(Sharded, GatherAndReduceScatterRoundTrip) {
  const int world = GetParam();
  for (DType dt : {DType::f32, DType::bf16}) {
    std::vector<Parameter> ref = make_params(dt);
    std::mutex mu;
    std::vector<std::string> problems;
    test::on_ranks(world, [&](Communicator& c) {
      auto note = [&](std::string s) {
        std::lock_guard lock(mu);
        problems.push_back(str("rank ", c.rank(), " ", dtype_name(dt), ": ", s));
      };
      std::vector<Parameter> ps = make_params(dt);
      std::vector<Parameter*> ptrs;
      for (auto& p : ps) ptrs.push_back(&p);
      ShardedParams sh(ptrs, c);
      for (auto& p : ps)
        if (p.value.defined() || p.grad.defined()) note(p.name + " still holds its full tensors");
      for (size_t p = 0; p < ps.size(); ++p) {
        const int64_t n = shape_numel(kShapes[p].second);
        if (sh.shard_numel(ps[p].name) != (n + world - 1) / world) note("shard size of " + ps[p].name);
      }
      auto layer0 = sh.names_with_prefix("model.layers.0.");
      if (layer0.size() != 2) note("names_with_prefix found " + std::to_string(layer0.size()));
      sh.gather(all_names(), true);
      sh.gather(layer0);  // already gathered: no second collective, nothing changes
      for (size_t p = 0; p < ps.size(); ++p) {
        if (ps[p].value.shape() != ref[p].value.shape() || ps[p].value.dtype() != dt ||
            ps[p].value.to_floats() != ref[p].value.to_floats())
          note("gathered value of " + ps[p].name);
        std::vector<float> g(static_cast<size_t>(ps[p].grad.numel()));
        for (size_t i = 0; i < g.size(); ++i) g[i] = grad_value(0, c.rank(), p, static_cast<int64_t>(i));
        ps[p].grad.copy_from(Tensor::from_floats(g, ps[p].grad.shape(), DType::f32));
      }
      sh.reduce_grads(all_names());
      sh.release(all_names());
      auto shards = sh.shards();
      for (size_t p = 0; p < ps.size(); ++p) {
        if (ps[p].value.defined() || ps[p].grad.defined()) note("release left " + ps[p].name);
        const int64_t n = shape_numel(kShapes[p].second), len = shards[p]->grad.numel();
        std::vector<float> want = summed_grad(0, world, p, n);
        std::vector<float> have = shards[p]->grad.to_floats();
        for (int64_t i = 0; i < len; ++i) {
          const int64_t g = c.rank() * len + i;
          if (have[static_cast<size_t>(i)] != (g < n ? want[static_cast<size_t>(g)] : 0.0f))
            note(str("shard grad of ", ps[p].name, " at ", i));
        }
      }
    });
    for (const auto& s : problems) ADD_FAILURE() << s;
  }
}

TEST_P(Sharded, AdamWOnShardsEqualsFullAdamW) {
  const int world = GetParam();
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  const int steps = 3;
  const double lr = 1e-2;

  std::vector<Parameter> ref = make_params(DType::f32);
  std::vector<Parameter*> ref_ptrs;
  for (auto& p : ref) ref_ptrs.push_back(&p);
  AdamW ref_opt(ref_ptrs, cfg);
  std::vector<double> ref_norms;
  for (int s = 0; s < steps; ++s) {
    for (size_t p = 0; p < ref.size(); ++p)
      ref[p].grad.copy_from(Tensor::from_floats(summed_grad(s, world, p, ref[p].grad.numel()), ref[p].grad.shape(), DType::f32));
    ref_norms.push_back(ref_opt.grad_norm());
    ref_opt.step(lr);
  }

  std::mutex mu;
  std::vector<std::string> problems;
  test::on_ranks(world, [&](Communicator& c) {
    std::vector<Parameter> ps = make_params(DType::f32);
    std::vector<Parameter*> ptrs;
    for (auto& p : ps) ptrs.push_back(&p);
    ShardedParams sh(ptrs, c);
    AdamW opt(sh.shards(), cfg);
    for (int s = 0; s < steps; ++s) {
      sh.zero_grads();
      // Groups of parameters gathered, given grads and reduced as the trainer does per layer;
      // odd steps overlap: the next group's gather is prefetched, reductions finish at the norm.
      const std::vector<std::string> prefixes = {"model.layers.", "model.embed", "model.norm"};
      const bool overlap = s % 2 == 1;
      for (size_t k = 0; k < prefixes.size(); ++k) {
        auto names = sh.names_with_prefix(prefixes[k]);
        sh.gather(names, true);
        if (overlap && k + 1 < prefixes.size()) sh.prefetch(sh.names_with_prefix(prefixes[k + 1]));
        for (size_t p = 0; p < ps.size(); ++p) {
          if (!ps[p].grad.defined()) continue;
          std::vector<float> g(static_cast<size_t>(ps[p].grad.numel()));
          for (size_t i = 0; i < g.size(); ++i) g[i] = grad_value(s, c.rank(), p, static_cast<int64_t>(i));
          ps[p].grad.copy_from(Tensor::from_floats(g, ps[p].grad.shape(), DType::f32));
        }
        if (overlap)
          sh.reduce_grads_async(names);
        else
          sh.reduce_grads(names);
        sh.release(names);
      }
      const double norm = sh.grad_norm();
      if (std::abs(norm - ref_norms[static_cast<size_t>(s)]) > 1e-12 * ref_norms[static_cast<size_t>(s)]) {
        std::lock_guard lock(mu);
        problems.push_back(str("rank ", c.rank(), " step ", s, " grad norm ", norm, " vs ", ref_norms[static_cast<size_t>(s)]));
      }
      opt.step(lr);
    }
    sh.gather(all_names());
    for (size_t p = 0; p < ps.size(); ++p)
      if (ps[p].value.to_floats() != ref[p].value.to_floats()) {
        std::lock_guard lock(mu);
        problems.push_back(str("rank ", c.rank(), ": ", ps[p].name, " differs from the full AdamW"));
      }
  });
  for (const auto& s : problems) ADD_FAILURE() << s;
}

INSTANTIATE_TEST_SUITE_P(Ranks, Sharded, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

}  // namespace
}  // namespace lcx
