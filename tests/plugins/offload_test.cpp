// offload (MemoryStrategy): the CPU twin runs the GPU's bookkeeping with host-to-host copies, so
// CI holds it to core's on_device bit for bit, counts the layer inputs resident at once through
// the allocator, and checks the host-memory refusal and the plan; the GPU cases repeat the step
// and the round trip with real streams and pinned memory (skipped without a GPU).
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <random>

#include "lcx/pinned.h"
#include "lcx/plan.h"
#include "models/model_util.h"

namespace lcx {
namespace {

std::shared_ptr<MemoryStrategy> make_offload(const std::string& table, Device device = Device::cpu()) {
  return test::make_plugin<MemoryStrategy>("offload", table, device);
}

std::string tiny_spec(int layers, int hidden) {
  return nlohmann::json{{"vocab_size", 128},          {"hidden_size", hidden},      {"intermediate_size", 2 * hidden},
                        {"num_hidden_layers", layers}, {"num_attention_heads", 4},   {"num_key_value_heads", 2},
                        {"head_dim", hidden / 4},      {"tie_word_embeddings", false}}
      .dump();
}

Shard tokens_shard(int64_t T) {
  std::vector<int64_t> ids(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = (t * 37 + 11) % 128;
  return test::shard_from_labels(ids, ids);
}

struct StepOutcome {
  double loss = 0;
  std::vector<std::vector<float>> grads;
};

// Two steps (the second reuses the pinned pool); the outcome of the second. qwen3.keep_attention:
// each layer's attention outputs are kept from the forward and travel with its input.
StepOutcome run_steps(Model& model, MemoryStrategy& memory, const Shard& shard, Device device,
                      const Recipe& recipe = {}) {
  test::DefaultSlots s(model);
  StepSlots slots{model, *s.loss, *s.rope, memory, *s.parallel};
  slots.recipe = recipe;
  StepOutcome out;
  for (int step = 0; step < 2; ++step) {
    model.zero_grad();
    out.loss = train_step(slots, shard, 1.0 / static_cast<double>(shard.tokens.size(0)), device).loss_sum;
  }
  for (Parameter* p : model.parameters()) out.grads.push_back(p->grad.to_floats());
  return out;
}

// The most bytes of category `activations` live at once during `f`, from the allocator's events:
// checkpointed layer inputs (the step's and the strategy's) and the forward's layer outputs.
template <typename F>
int64_t activation_peak(Device d, F&& f) {
  MemoryRecorder& rec = allocator_for(d).recorder();
  rec.clear();
  rec.enable(true);
  f();
  rec.enable(false);
  int64_t live = 0, peak = 0;
  for (const MemoryEvent& e : rec.events())
    if (e.category == MemoryCategory::activations) peak = std::max(peak, live += e.delta);
  rec.clear();
  return peak;
}

class OffloadCpu : public ::testing::TestWithParam<DType> {};

TEST_P(OffloadCpu, StepIsBitIdenticalToOnDevice) {
  const Shard shard = tokens_shard(48);
  auto model = test::make_qwen3();
  model->init_random(tiny_spec(5, 32), 3, Device::cpu(), GetParam());
  auto on_device = make_on_device_memory();
  const StepOutcome want = run_steps(*model, *on_device, shard, Device::cpu());
  // Placement (gpu_layers, by key or by the recipe) and checkpoints every k layers change where
  // inputs wait and which are rebuilt, never a value.
  for (bool keep : {false, true})
    for (const char* table : {"prefetch = 0", "prefetch = 1", "", "prefetch = 8", "gpu_layers = 2", "gpu_layers = 9",
                              "prefetch = 1\ngpu_layers = 1", "gpu_layers = \"auto\""}) {
      auto offload = make_offload(table);
      const StepOutcome got =
          run_steps(*model, *offload, shard, Device::cpu(), test::recipe_of({{"qwen3.keep_attention", keep}, {"offload.gpu_layers", 3}}));
      EXPECT_EQ(got.loss, want.loss) << table << " keep " << keep;
      ASSERT_EQ(got.grads.size(), want.grads.size());
      for (size_t i = 0; i < want.grads.size(); ++i)
        EXPECT_EQ(got.grads[i], want.grads[i]) << table << " keep " << keep << ": " << model->parameters()[i]->name;
      EXPECT_EQ(offload->wait_seconds(), 0.0);  // the CPU's copies complete when issued
    }
  for (int64_t k : {2, 3, 6})
    for (const char* table : {"prefetch = 0", "", "gpu_layers = 1"}) {
      auto offload = make_offload(table);
      const StepOutcome got = run_steps(*model, *offload, shard, Device::cpu(), test::recipe_of({{"train.checkpoint_every", k}}));
      EXPECT_EQ(got.loss, want.loss) << table << " every " << k;
      for (size_t i = 0; i < want.grads.size(); ++i)
        EXPECT_EQ(got.grads[i], want.grads[i]) << table << " every " << k << ": " << model->parameters()[i]->name;
    }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OffloadCpu, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(OffloadCpuBookkeeping, AtMostPrefetchPlusOneInputsResident) {
  const int L = 6;
  const int64_t T = 64, H = 32;
  const Shard shard = tokens_shard(T);
  auto model = test::make_qwen3();
  model->init_random(tiny_spec(L, H), 4, Device::cpu(), DType::f32);
  const int64_t each = T * H * 4;
  auto on_device = make_on_device_memory();
  // The measurement sees core's default keep every input: all L, plus the layer output being written.
  EXPECT_EQ(activation_peak(Device::cpu(), [&] { run_steps(*model, *on_device, shard, Device::cpu()); }),
            (L + 1) * each);
  for (int p : {0, 1, 2, 3}) {
    auto offload = make_offload(str("prefetch = ", p));
    const int64_t peak = activation_peak(Device::cpu(), [&] { run_steps(*model, *offload, shard, Device::cpu()); });
    // prefetch + 1 inputs the strategy holds, plus the forward's layer output. On the CPU a copy
    // out completes when issued, so the forward holds one input; the backward's window of
    // prefetch + 1 loaded inputs sets the peak once it exceeds the forward's two tensors.
    EXPECT_LE(peak, (p + 2) * each) << "prefetch " << p;
    EXPECT_EQ(peak, std::max(2, p + 1) * each) << "prefetch " << p;
  }
}

// gpu_layers = N: the last N saved inputs stay on the device, the pool pins only the others, and
// the plan's terms are what the allocators counted: the pinned bytes exactly, the device's inputs
// as an upper bound (the plan's prefetch window is "at most"; the forward's output is the step's).
TEST(OffloadCpuBookkeeping, GpuLayersStayOnTheDeviceAndThePoolShrinks) {
  const int L = 6;
  const int64_t T = 64, H = 32, each = T * H * 4;
  const Shard shard = tokens_shard(T);
  auto model = test::make_qwen3();
  model->init_random(tiny_spec(L, H), 4, Device::cpu(), DType::f32);
  PlanInputs in;
  in.model = model->config();
  in.tokens_per_rank = in.seq_len = T;
  in.weight_dtype = DType::f32;
  struct Case {
    int64_t n, k, resident_peak;  // gpu_layers, checkpoint_every, the inputs live at once (hand count)
  };
  // prefetch 2. Forward: the resident inputs and the output being written; backward: the fetched
  // layer's and those below it still resident or loaded ahead (a window of 3).
  for (const Case c : {Case{0, 1, 3}, Case{1, 1, 3}, Case{3, 1, 4}, Case{6, 1, 7}, Case{2, 2, 3}, Case{3, 2, 4}}) {
    SCOPED_TRACE(str("gpu_layers ", c.n, ", every ", c.k));
    for (bool by_key : {true, false}) {
      auto offload = make_offload(by_key ? str("gpu_layers = ", c.n) : std::string());
      Recipe recipe = test::recipe_of({{"train.checkpoint_every", c.k}, {"offload.gpu_layers", by_key ? 0 : c.n}});  // the key wins over the recipe
      const int64_t pinned_before = pinned_allocator().stats().live_bytes;
      const int64_t peak = activation_peak(Device::cpu(), [&] { run_steps(*model, *offload, shard, Device::cpu(), recipe); });
      const int64_t pinned = pinned_allocator().stats().live_bytes - pinned_before;
      in.recipe = recipe;
      MemoryPlan plan;
      offload->plan(in, plan);
      const int64_t saved = (L + c.k - 1) / c.k, moved = saved - std::min<int64_t>(c.n, saved);
      EXPECT_EQ(pinned, moved * each);
      EXPECT_EQ(plan.host_peak(), pinned);
      EXPECT_EQ(plan.category_bytes(PlanCategory::activations_gpu), std::max(saved - moved, std::min<int64_t>(moved, 3)) * each);
      if (c.k == 1) {
        EXPECT_EQ(peak, c.resident_peak * each);
        EXPECT_LE(peak, plan.category_bytes(PlanCategory::activations_gpu) + each);
      }
    }
  }
}

// prefetch = 0 beside a resident input: the step's hint loads nothing, so the backward of the
// resident layer holds its input alone (the plan counts the larger of residents and window, one
// input here; an 8B 1M rehearsal on the H200 measured a moved input loaded beside it before).
TEST(OffloadCpuBookkeeping, NoPrefetchLoadsNothingBesideTheResidents) {
  const int L = 6;
  const int64_t T = 64, H = 32, each = T * H * 4;
  auto offload = make_offload("prefetch = 0\ngpu_layers = 1");
  offload->use_recipe(Recipe{});
  offload->begin_step(L);
  for (int l = 0; l < L; ++l) offload->save(l, Tensor::zeros({T, H}, DType::f32, Device::cpu(), MemoryCategory::activations));
  const int64_t during = activation_peak(Device::cpu(), [&] {
    offload->fetch(L - 1);
    offload->prefetch(L - 2);  // the step's hint for the next layer
  });
  EXPECT_EQ(during, 0) << "a moved input was loaded beside the resident one";
  offload->release(L - 1);
  const int64_t moved = activation_peak(Device::cpu(), [&] { offload->fetch(L - 2); });
  EXPECT_EQ(moved, each);  // loaded when used
  offload->release(L - 2);
  offload->end_step();
  PlanInputs in;
  in.model.num_layers = L;
  in.model.hidden_size = H;
  in.tokens_per_rank = in.seq_len = T;
  in.weight_dtype = DType::f32;
  MemoryPlan plan;
  offload->plan(in, plan);
  EXPECT_EQ(plan.category_bytes(PlanCategory::activations_gpu), each);
}

TEST(OffloadCpuBookkeeping, RoundTripReturnsTheSavedBytesInAnyFetchOrder) {
  const int L = 7;
  std::mt19937 rng(5);
  std::normal_distribution<float> dist;
  std::vector<Tensor> inputs;
  for (int l = 0; l < L; ++l) {
    std::vector<float> v(6 * 10);
    for (float& x : v) x = dist(rng);
    inputs.push_back(Tensor::from_floats(v, {6, 10}, DType::bf16));
  }
  auto offload = make_offload("prefetch = 2");
  for (int step = 0; step < 2; ++step) {
    offload->begin_step(L);
    for (int l = 0; l < L; ++l) offload->save(l, inputs[static_cast<size_t>(l)]);
    for (int l = L - 1; l >= 0; --l) {
      const Tensor got = offload->fetch(l);
      if (l > 0) offload->prefetch(l - 1);
      EXPECT_EQ(got.to_floats(), inputs[static_cast<size_t>(l)].to_floats()) << "layer " << l;
      offload->release(l);
    }
    offload->end_step();
  }
  offload->begin_step(L);
  EXPECT_THROW(offload->fetch(3), Error);  // never saved in this step
}

TEST(OffloadCpuBookkeeping, RefusesAPoolBeyondTheHostLimitWithTheFigure) {
  const int L = 4;
  const int64_t T = 1088, H = 64;  // 4 fp32 inputs of 272 KiB: 1.0625 MiB
  auto model = test::make_qwen3();
  model->init_random(tiny_spec(L, H), 6, Device::cpu(), DType::f32);
  const Shard shard = tokens_shard(T);
  auto offload = make_offload("max_host_mib = 1");
  try {
    run_steps(*model, *offload, shard, Device::cpu());
    FAIL() << "a pool of more than 1 MiB was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("4 layer inputs of 272.0 KiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offload.max_host_mib"), std::string::npos) << msg;
    EXPECT_EQ(e.key(), "offload");
  }
  auto roomy = make_offload("max_host_mib = 2");
  EXPECT_NO_THROW(run_steps(*model, *roomy, shard, Device::cpu()));
}

TEST(OffloadCpuBookkeeping, PlanPutsTheInputsOnTheHost) {
  PlanInputs in;
  in.model.num_layers = 36;
  in.model.hidden_size = 2560;
  in.tokens_per_rank = in.seq_len = 131072;
  in.weight_dtype = DType::bf16;
  const int64_t each = 131072LL * 2560 * 2;
  for (int p : {0, 2, 5}) {
    auto offload = make_offload(str("prefetch = ", p));
    EXPECT_FALSE(offload->plan_offer().empty());
    MemoryPlan plan;
    offload->plan(in, plan);
    EXPECT_EQ(plan.category_bytes(PlanCategory::activations_gpu), (p + 1) * each);
    EXPECT_EQ(plan.category_bytes(PlanCategory::activations_host, true), 36 * each);
    EXPECT_EQ(plan.host_peak(), 36 * each);
  }
}

TEST(OffloadCpuBookkeeping, RefusesABadPrefetchByName) {
  for (const char* bad :
       {"prefetch = -1", "prefetch = 100", "prefetch = \"some\"", "prefetch = true", "max_host_mib = -5", "prefech = 2",
        "gpu_layers = -1", "gpu_layers = \"most\""}) {
    try {
      make_offload(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      const std::string key = std::string(bad).substr(0, std::string(bad).find(' '));
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(make_offload("prefetch = \"auto\""));  // the plan's choice, as by default
}

#define LCX_SKIP_WITHOUT_GPU() \
  if (!::lcx::cuda_available()) GTEST_SKIP() << "no CUDA device visible"

bool same(const StepOutcome& a, const StepOutcome& b) { return a.loss == b.loss && a.grads == b.grads; }

TEST(OffloadGpu, StepMatchesOnDevice) {
  LCX_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda();
  const int L = 6;
  const int64_t T = 512, H = 128;
  const Shard shard = tokens_shard(T);
  auto model = test::make_qwen3();
  model->init_random(tiny_spec(L, H), 7, gpu, DType::bf16);
  auto on_device = make_on_device_memory();
  const StepOutcome a = run_steps(*model, *on_device, shard, gpu), b = run_steps(*model, *on_device, shard, gpu);
  const bool deterministic = same(a, b);
  // Attention kept from the forward on the device: the same step, no attention forward recomputed.
  const StepOutcome kept_on_device = run_steps(*model, *on_device, shard, gpu, test::recipe_of({{"qwen3.keep_attention", 1}}));
  if (deterministic)
    EXPECT_TRUE(same(kept_on_device, a)) << "loss " << kept_on_device.loss << " vs " << a.loss;
  else
    EXPECT_NEAR(kept_on_device.loss, a.loss, 1e-3 * std::abs(a.loss));
  // Kept attention outputs ([T,Hq,d] bf16 and fp32 LSE [Hq,T] per layer) travel with the inputs.
  const int64_t kept_each = T * H * 2 + 4 * T * 4;
  for (bool keep : {false, true})
    for (int p : {0, 2}) {
      auto offload = make_offload(str("prefetch = ", p), gpu);
      int64_t peak = 0;
      StepOutcome got;
      peak = activation_peak(gpu, [&] { got = run_steps(*model, *offload, shard, gpu, test::recipe_of({{"qwen3.keep_attention", keep}})); });
      EXPECT_LE(peak, (p + 2) * (T * H * 2 + (keep ? kept_each : 0))) << "prefetch " << p << " keep " << keep;
      EXPECT_GE(offload->wait_seconds(), 0.0);
      if (deterministic) {
        EXPECT_TRUE(same(got, a)) << "prefetch " << p << ": loss " << got.loss << " vs " << a.loss;
      } else {  // the GPU's own kernels differ run to run here; hold offload to that spread
        EXPECT_NEAR(got.loss, a.loss, 1e-3 * std::abs(a.loss)) << "prefetch " << p;
      }
    }
}

TEST(OffloadGpu, RoundTripThroughPinnedMemory) {
  LCX_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda();
  const int L = 9;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist;
  std::vector<Tensor> inputs;
  std::vector<std::vector<float>> want;
  for (int l = 0; l < L; ++l) {
    std::vector<float> v(4096 * 256);
    for (float& x : v) x = dist(rng);
    inputs.push_back(Tensor::from_floats(v, {4096, 256}, DType::bf16, gpu));
    want.push_back(inputs.back().to_floats());
  }
  auto offload = make_offload("prefetch = 2", gpu);
  for (int step = 0; step < 3; ++step) {
    offload->begin_step(L);
    for (int l = 0; l < L; ++l) offload->save(l, inputs[static_cast<size_t>(l)]);
    for (int l = L - 1; l >= 0; --l) {
      const Tensor got = offload->fetch(l);
      EXPECT_EQ(got.to_floats(), want[static_cast<size_t>(l)]) << "step " << step << " layer " << l;
      offload->release(l);
    }
    offload->end_step();
    EXPECT_GE(offload->wait_seconds(), 0.0);
  }
  EXPECT_TRUE(pinned_is_page_locked());
}

}  // namespace
}  // namespace lcx
