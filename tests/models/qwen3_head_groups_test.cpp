// attention_head_groups: the attention half of a layer run one group of kv heads (with their
// query heads) at a time gives the one-group layer's output, input gradient and every parameter
// gradient, while the layer backward's peak falls, as the plan's layer terms say it does; so does
// attention_keep_outputs (each group's output and LSE kept from the recompute), at a higher peak.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>

#include "lcx/plan.h"
#include "models/model_util.h"

namespace lcx {
namespace {


// GQA with 8 query heads over 4 kv heads; head_dim 32 so the attention tensors outweigh the MLP's
// and the groups show in the peak.
const nlohmann::json kSpec = {{"vocab_size", 64},          {"hidden_size", 64},       {"intermediate_size", 64},
                              {"num_hidden_layers", 2},    {"num_attention_heads", 8}, {"num_key_value_heads", 4},
                              {"head_dim", 32},            {"rope_theta", 10000.0},    {"tie_word_embeddings", false},
                              {"initializer_range", 0.2}};
constexpr int64_t kT = 96;

Tensor random_rows(int64_t T, int64_t H, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::vector<float> v(static_cast<size_t>(T * H));
  for (float& f : v) f = nd(rng);
  return Tensor::from_floats(v, {T, H}, DType::f32);
}

// One layer's forward output, backward dx and parameter grads for a [qwen3] table.
struct LayerRun {
  std::vector<float> y, dx;
  std::map<std::string, std::vector<float>> grads;
  int64_t backward_peak = 0;  // allocator bytes above what was live when layer_backward began
  std::shared_ptr<Model> model;
};

LayerRun run_layer(const std::string& table, int layer = 1) {
  LayerRun r;
  r.model = test::make_qwen3(table);
  r.model->init_random(kSpec.dump(), 17, Device::cpu(), DType::f32);
  test::DefaultSlots s(*r.model);
  std::vector<int64_t> ids(kT);
  for (int64_t t = 0; t < kT; ++t) ids[static_cast<size_t>(t)] = (t * 7) % 64;
  const Shard shard = test::shard_from_labels(ids, ids);
  const RopeTables rope = s.rope->tables(shard.positions, Device::cpu());
  StepContext ctx{&rope, s.parallel.get(), Device::cpu(), nullptr};
  const int64_t H = r.model->config().hidden_size;
  const Tensor x = random_rows(kT, H, 3), dy = random_rows(kT, H, 4);
  Tensor y = Tensor::empty({kT, H}, DType::f32), dx = Tensor::empty({kT, H}, DType::f32);
  r.model->layer_forward(layer, x, y, ctx);
  r.model->zero_grad();
  Allocator& a = allocator_for(Device::cpu());
  const int64_t live = a.stats().live_bytes;
  a.reset_peak();
  r.model->layer_backward(layer, x, dy, dx, ctx);
  r.backward_peak = a.stats().peak_bytes - live;
  r.y = y.to_floats();
  r.dx = dx.to_floats();
  for (Parameter* p : r.model->parameters()) r.grads[p->name] = p->grad.to_floats();
  return r;
}

// Largest |a - b| over largest |b|: the error relative to the tensor's scale.
double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return scale > 0 ? diff / scale : diff;
}

TEST(Qwen3HeadGroups, EveryGroupCountGivesTheOneGroupLayer) {
  const LayerRun one = run_layer("attention_head_groups = 1");
  for (const char* table : {"attention_head_groups = 2", "attention_head_groups = 4", "",
                            "attention_head_groups = 2\nattention_keep_outputs = true",
                            "attention_head_groups = 4\nattention_keep_outputs = true"}) {
    const LayerRun g = run_layer(table);
    EXPECT_LT(relative_error(g.y, one.y), 1e-5) << table;
    EXPECT_LT(relative_error(g.dx, one.dx), 1e-5) << table;
    int checked = 0;
    for (const auto& [name, want] : one.grads) {
      if (name.find("layers.1.") == std::string::npos) continue;  // the other layer's grads stay zero
      double norm = 0;
      for (float v : want) norm += static_cast<double>(v) * v;
      EXPECT_GT(norm, 0) << name;  // every parameter of the layer carries a gradient
      EXPECT_LT(relative_error(g.grads.at(name), want), 1e-5) << table << " " << name;
      ++checked;
    }
    EXPECT_EQ(checked, 11);
  }
}

// The plan's layer terms for a model's own plan and the whole MLP: the larger of the two backward
// moments (the MLP's, the attention's), without the caller's dy, dx and the CUDA-only delta.
int64_t planned_layer_backward(const Model& m) {
  PlanInputs in;
  in.model = m.config();
  in.seq_len = in.tokens_per_rank = kT;
  in.weight_dtype = DType::f32;
  MemoryPlan p;
  m.plan(in, p);
  make_whole_mlp()->plan(in, p);
  int64_t best = 0;
  for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward}) {
    int64_t n = 0;
    for (const auto& t : p.terms)
      if (t.phase == phase) n += t.bytes;
    best = std::max(best, n);
  }
  return best;
}

TEST(Qwen3HeadGroups, BackwardPeakFallsWithGroupsAsPlanned) {
  int64_t previous = 0;
  for (int64_t groups : {1, 2, 4}) {
    const LayerRun r = run_layer(str("attention_head_groups = ", groups));
    const int64_t planned = planned_layer_backward(*r.model);
    EXPECT_NEAR(static_cast<double>(planned), static_cast<double>(r.backward_peak), 0.05 * static_cast<double>(r.backward_peak))
        << groups << " groups: planned " << planned << " measured " << r.backward_peak;
    if (previous) {
      EXPECT_LT(r.backward_peak, previous) << groups << " groups";
    }
    previous = r.backward_peak;
  }
  // auto on one rank: one kv head per group.
  EXPECT_EQ(run_layer("").backward_peak, previous);
  // Keeping every group's output and LSE from the recompute holds more, as planned.
  for (int64_t groups : {2, 4}) {
    const LayerRun r = run_layer(str("attention_head_groups = ", groups, "\nattention_keep_outputs = true"));
    const int64_t planned = planned_layer_backward(*r.model);
    EXPECT_NEAR(static_cast<double>(planned), static_cast<double>(r.backward_peak), 0.05 * static_cast<double>(r.backward_peak))
        << groups << " groups, outputs kept: planned " << planned << " measured " << r.backward_peak;
    EXPECT_GT(r.backward_peak, run_layer(str("attention_head_groups = ", groups)).backward_peak);
  }
}

TEST(Qwen3HeadGroups, CountsThatDoNotDivideTheKvHeadsAreRefusedByName) {
  const test::Thrown e = test::thrown_by([] {
    auto m = test::make_qwen3("attention_head_groups = 3");
    m->init_random(kSpec.dump(), 1, Device::cpu(), DType::f32);
  });
  EXPECT_EQ(e.key, "qwen3.attention_head_groups");
  EXPECT_EQ(e.fix, "use \"auto\" or a divisor of 4");  // the model's 4 key/value heads
  for (const char* bad : {"attention_head_groups = 0", "attention_head_groups = \"many\""})
    EXPECT_EQ(test::thrown_by([&] { test::make_qwen3(bad); }).key, "qwen3.attention_head_groups") << bad;
  EXPECT_FALSE(test::thrown_by([] { test::make_qwen3("attention_head_groups = \"auto\""); }).thrown);
}

}  // namespace
}  // namespace lcx
