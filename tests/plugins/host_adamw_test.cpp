// host_adamw (Optimizer): its update, with the real worker thread, staging and events, held to
// core's AdamW over several steps with clipping and weight decay, on the CPU twin (every CI run)
// and on the GPU against the device AdamW (skipped, visibly, without a GPU); its refusals; its
// plan against the bytes it allocates.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "lcx/pinned.h"
#include "lcx/plan.h"
#include "models/model_util.h"
#include "slots/adamw.h"

namespace lcx {
namespace {

std::shared_ptr<Optimizer> make_host_adamw(const std::string& table = "threads = 3") {
  return test::make_plugin<Optimizer>("host_adamw", table);
}

std::string tiny_spec(int layers, int hidden) {
  return nlohmann::json{{"vocab_size", 128},          {"hidden_size", hidden},      {"intermediate_size", 2 * hidden},
                        {"num_hidden_layers", layers}, {"num_attention_heads", 4},   {"num_key_value_heads", 2},
                        {"head_dim", hidden / 4},      {"tie_word_embeddings", false}}
      .dump();
}

Shard tokens_shard(int64_t T, int64_t salt) {
  std::vector<int64_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = (t * 37 + 11 * salt) % 128;
  return test::shard_from_labels(ids, ids);
}

void fill(Tensor& t, float x) {
  t.copy_from(Tensor::from_floats(std::vector<float>(static_cast<size_t>(t.numel()), x), t.shape(), t.dtype()));
}

OptimizerConfig decayed() {
  OptimizerConfig c;
  c.weight_decay = 0.1;
  return c;
}

// The largest |a - b| / max(|b|, 1e-3) over the tensors: fp32 rounding keeps it near 1e-7.
double max_rel(const Tensor& a, const Tensor& b) {
  const std::vector<float> x = a.to_floats(), y = b.to_floats();
  EXPECT_EQ(x.size(), y.size());
  double worst = 0;
  for (size_t i = 0; i < std::min(x.size(), y.size()); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(x[i]) - y[i]) / std::max(std::abs(static_cast<double>(y[i])), 1e-3));
  return worst;
}

struct Compared {
  double worst_master = 0;  // over the steps, the masters' largest relative difference
  double worst_value = 0;   // the compute copies'
  double worst_norm = 0;    // the grad norms'
  int clipped = 0;          // steps whose norm was above max_norm
};

// Model `a` trains with host_adamw through real steps (its hooks copy the gradients down during
// the backward); model `b`, a copy of `a`, gets a's gradients and takes core's AdamW. Both clip by
// their own norm as the trainer does. The forward of each step after the first waits on the
// weights host_adamw updated in the background.
Compared compare_with_core(Device device, DType dtype, int steps, double max_norm,
                           const std::string& table = "threads = 3") {
  auto a = test::make_qwen3(), b = test::make_qwen3();
  a->init_random(tiny_spec(3, 32), 5, device, dtype);
  b->init_random(tiny_spec(3, 32), 5, device, dtype);
  a->zero_grad();  // the gradients the run would give them, which the optimizers read
  b->zero_grad();
  std::shared_ptr<Optimizer> host = make_host_adamw(table);
  host->configure(a->parameters(), decayed(), {});
  AdamW core(b->parameters(), decayed());
  test::DefaultSlots s(*a);
  s.slots.optimizer = host.get();
  Compared out;
  for (int step = 0; step < steps; ++step) {
    const Shard shard = tokens_shard(40, step + 1);
    a->zero_grad();
    train_step(s.slots, shard, 1.0 / 40, device);
    std::vector<Parameter*> pa = a->parameters(), pb = b->parameters();
    for (size_t k = 0; k < pa.size(); ++k) pb[k]->grad.copy_from(pa[k]->grad);
    const double na = host->grad_norm(), nb = core.grad_norm();
    out.worst_norm = std::max(out.worst_norm, std::abs(na - nb) / nb);
    if (nb > max_norm) {
      ++out.clipped;
      host->scale_grads(max_norm / (na + 1e-6));
      core.scale_grads(max_norm / (nb + 1e-6));
    }
    const double lr = 1e-2 * (step + 1);
    host->step(lr);
    core.step(lr);
    // Every other step the update is left in flight: the next forward waits on it layer by layer.
    if (step % 2 == 0 && step + 1 < steps) continue;
    const OptimizerState hs = host->state(), cs = core.state();
    EXPECT_EQ(hs.step, cs.step);
    EXPECT_EQ(hs.tensors.size(), cs.tensors.size());
    std::map<std::string, Tensor> by_name;
    for (const auto& [n, t] : cs.tensors) by_name[n] = t;
    for (const auto& [n, t] : hs.tensors) {
      EXPECT_TRUE(by_name.count(n)) << n;
      if (!by_name.count(n)) continue;
      const double d = max_rel(t, by_name[n]);
      if (n.ends_with(".master")) out.worst_master = std::max(out.worst_master, d);
    }
    for (size_t k = 0; k < pa.size(); ++k) out.worst_value = std::max(out.worst_value, max_rel(pa[k]->value, pb[k]->value));
  }
  return out;
}

class HostAdamWCpu : public ::testing::TestWithParam<DType> {};

TEST_P(HostAdamWCpu, EqualsCoreAdamWWithClippingAndDecay) {
  const Compared c = compare_with_core(Device::cpu(), GetParam(), 4, 0.05);
  EXPECT_GE(c.clipped, 2) << "the test must clip to test clipping";
  EXPECT_LT(c.worst_norm, 1e-12);
  // The same fp32 arithmetic in the same order: only the clip factor's last bit may differ.
  EXPECT_LT(c.worst_master, 1e-6);
  EXPECT_LT(c.worst_value, GetParam() == DType::bf16 ? 1e-2 : 1e-6);  // a master one ulp off may round to the next bf16
}

// staging = "ring" with slots of 2,620 bytes: every matrix goes through the ring in several pieces
// (655 fp32 gradients each), so a piece's offsets into master, moments and weights are tested.
TEST_P(HostAdamWCpu, RingEqualsCoreAdamW) {
  const Compared c =
      compare_with_core(Device::cpu(), GetParam(), 4, 0.05, "threads = 3\nstaging = \"ring\"\nring_mib = 0.01");
  EXPECT_GE(c.clipped, 2);
  EXPECT_LT(c.worst_norm, 1e-12);
  EXPECT_LT(c.worst_master, 1e-6);
  EXPECT_LT(c.worst_value, GetParam() == DType::bf16 ? 1e-2 : 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, HostAdamWCpu, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(HostAdamW, StateRoundTripsThroughCoreAdamW) {
  // A checkpoint moves between the two providers: host_adamw's state loaded into core's AdamW and
  // back gives the same next update.
  auto a = test::make_qwen3();
  a->init_random(tiny_spec(2, 16), 7, Device::cpu(), DType::f32);
  a->zero_grad();
  std::shared_ptr<Optimizer> host = make_host_adamw();
  host->configure(a->parameters(), decayed(), {});
  for (Parameter* p : a->parameters()) fill(p->grad, 0.25f);
  host->step(0.01);
  const OptimizerState st = host->state();
  auto b = test::make_qwen3();
  b->init_random(tiny_spec(2, 16), 8, Device::cpu(), DType::f32);  // other weights: load_state sets them
  b->zero_grad();
  AdamW core(b->parameters(), decayed());
  core.load_state(st);
  EXPECT_EQ(core.steps(), 1);
  std::shared_ptr<Optimizer> again = make_host_adamw("threads = 1");
  again->configure(b->parameters(), decayed(), {});
  again->load_state(core.state());
  for (Parameter* p : b->parameters()) fill(p->grad, -0.5f);
  for (Parameter* p : a->parameters()) fill(p->grad, -0.5f);
  host->step(0.02);
  again->step(0.02);
  again->synchronize();
  host->synchronize();
  std::vector<Parameter*> pa = a->parameters(), pb = b->parameters();
  for (size_t k = 0; k < pa.size(); ++k) EXPECT_EQ(pa[k]->value.to_floats(), pb[k]->value.to_floats()) << pa[k]->name;
}

TEST(HostAdamW, RefusesBf16MastersAndSeveralRanksByName) {
  auto a = test::make_qwen3();
  a->init_random(tiny_spec(1, 16), 1, Device::cpu(), DType::f32);
  std::shared_ptr<Optimizer> host = make_host_adamw();
  OptimizerConfig bf16 = decayed();
  bf16.master_dtype = "bf16";
  try {
    host->configure(a->parameters(), bf16, {});
    ADD_FAILURE() << "master_dtype bf16 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "train.master_dtype");
    EXPECT_NE(e.fix().find("master_dtype = \"fp32\""), std::string::npos) << e.fix();
  }
  for (bool sharded : {false, true}) {
    try {
      host->configure(a->parameters(), decayed(), OptimizerScope{4, sharded});
      ADD_FAILURE() << "4 ranks were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("one rank"), std::string::npos) << e.what();
      EXPECT_NE(e.fix().find("drop host_adamw"), std::string::npos) << e.fix();
      EXPECT_EQ(std::string(e.what()).find("ZeRO-3") != std::string::npos, sharded) << e.what();
    }
  }
  // --plan refuses it as the run's start does, so no plan offers a run that cannot start.
  PlanInputs in;
  in.model = a->config();
  in.seq_len = in.tokens_per_rank = 16;
  in.master_dtype = DType::bf16;
  MemoryPlan plan;
  a->plan(in, plan);
  try {
    host->plan(in, plan);
    ADD_FAILURE() << "the plan took master_dtype bf16";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "train.master_dtype");
  }
  EXPECT_THROW(make_host_adamw("threads = -1"), Error);
  EXPECT_THROW(make_host_adamw("thread = 2"), Error);  // a misspelt key
}

TEST(HostAdamW, PlanMatchesWhatItAllocates) {
  for (const bool ring : {false, true})
  for (DType dtype : {DType::f32, DType::bf16}) {
    auto model = test::make_qwen3();
    model->init_random(tiny_spec(3, 32), 2, Device::cpu(), dtype);
    PlanInputs in;
    in.model = model->config();
    in.seq_len = in.tokens_per_rank = 64;
    in.weight_dtype = dtype;
    MemoryPlan plan;
    model->plan(in, plan);
    std::shared_ptr<Optimizer> host = make_host_adamw(ring ? "staging = \"ring\"\nring_mib = 0.01" : "threads = 3");
    plan.contributor = "host_adamw";
    host->plan(in, plan);
    int64_t master = 0, moments = 0, staging = 0, gpu = 0;
    for (const PlanTerm& t : plan.terms) {
      if (t.contributor != "host_adamw") continue;
      if (!t.on_host) gpu += t.bytes;
      else if (t.category == PlanCategory::master_weights) master += t.bytes;
      else if (t.id == "pinned_staging") staging += t.bytes;
      else moments += t.bytes;
    }
    release_cached_pinned();
    const AllocatorStats cpu0 = allocator_for(Device::cpu()).stats(), pinned0 = pinned_allocator().stats();
    host->configure(model->parameters(), decayed(), {});
    const AllocatorStats cpu1 = allocator_for(Device::cpu()).stats(), pinned1 = pinned_allocator().stats();
    auto grew = [](const AllocatorStats& a, const AllocatorStats& b, MemoryCategory c) {
      return b.live_by_category[static_cast<int>(c)] - a.live_by_category[static_cast<int>(c)];
    };
    int64_t params = 0;
    for (Parameter* p : model->parameters()) params += p->value.numel();
    EXPECT_EQ(plan.parameters, params);
    EXPECT_EQ(gpu, 0);
    EXPECT_EQ(master, grew(cpu0, cpu1, MemoryCategory::master_weights)) << dtype_name(dtype);
    EXPECT_EQ(moments, grew(cpu0, cpu1, MemoryCategory::optimizer)) << dtype_name(dtype);
    EXPECT_EQ(staging, pinned1.live_bytes - pinned0.live_bytes) << dtype_name(dtype);
    if (ring)
      EXPECT_EQ(staging, 4 * 2620);  // 4 slots of 0.01 MiB / 4, rounded down to 4 bytes
    else
      EXPECT_EQ(staging, 4 * params);  // fp32 gradients are the larger
  }
}

// The GPU: host_adamw's update, its gradients copied down and weights copied up on a copy stream,
// against core's AdamW on the device, in bf16 with fp32 gradients.
TEST(HostAdamWGpu, EqualsDeviceAdamW) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU: host_adamw's GPU case not run";
  const Compared c = compare_with_core(Device::cuda(0), DType::bf16, 4, 0.05);
  EXPECT_GE(c.clipped, 2);
  EXPECT_LT(c.worst_norm, 1e-5);  // the device sums squares in fp32 per block: the clip factor differs in its last bits
  EXPECT_LT(c.worst_master, 1e-4);  // nvcc may fuse multiply-adds the CPU rounds apart
  EXPECT_LT(c.worst_value, 1e-2);
}

// The ring on the GPU: gradients read on the device for the norm and copied down through the
// slots during step(), while the next step's zeroing waits for the last copy.
TEST(HostAdamWGpu, RingEqualsDeviceAdamW) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU: host_adamw's GPU ring not run";
  const Compared c = compare_with_core(Device::cuda(0), DType::bf16, 4, 0.05, "staging = \"ring\"\nring_mib = 0.01");
  EXPECT_GE(c.clipped, 2);
  EXPECT_LT(c.worst_norm, 1e-12);  // both sum squares with the same device kernel
  EXPECT_LT(c.worst_master, 1e-4);
  EXPECT_LT(c.worst_value, 1e-2);
}

}  // namespace
}  // namespace lcx
