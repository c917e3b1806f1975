// The plan against a real step: the CPU allocator counts every byte a step allocates, so the
// transient peak the plan predicts for one qwen3 step (model, loss, rope, memory, parallelism and
// the step's own buffers) can be held against the peak the allocator measured, and the timeline
// of that step written.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "models/model_util.h"
#include "plan/plan.h"
#include "plan/timeline.h"

namespace lcx {
namespace {

struct StepCase {
  DType dtype;
  const char* loss;  // "nll" (core's) or a plugin name
  // train.checkpoint_every: the inputs between checkpoints rebuilt. A k dividing the 3 layers:
  // otherwise core's on_device plan is one [T,H] above the step (planner.cpp says why).
  int64_t checkpoint_every = 1;
  // The knobs tiled_mlp.tile_rows and loss_chunked.chunk_rows, as the plan hands them over: > 0 runs tiled_mlp
  // (its key "auto") with the recipe's tiles, and the loss's chunks from the recipe. Tiles large
  // enough that the MLP backward is still the peak: below, in bf16, the attention backward's is, where
  // the CPU kernels allocate less than the GPU's that the plan counts.
  int64_t tile_rows = 0, chunk_rows = 0;
  // > 0: the lora adapter of this rank on every projection, the base frozen.
  int64_t lora_rank = 0;
  // A qwen3_moe model: every layer sparse (8 experts, top-2), the load-balancing loss trained;
  // > 0: its tokens in tiles of this many ([qwen3] moe_tile_rows, as the plan hands it over).
  bool moe = false;
  int64_t moe_tile_rows = 0;
};

class PlanAgainstStep : public ::testing::TestWithParam<StepCase> {};

TEST_P(PlanAgainstStep, CpuPeakOfOneQwen3StepMatchesThePlan) {
  const StepCase c = GetParam();
  nlohmann::json spec = {{"vocab_size", 2000},       {"hidden_size", 128},        {"intermediate_size", 352},
                         {"num_hidden_layers", 3},   {"num_attention_heads", 4},  {"num_key_value_heads", 2},
                         {"head_dim", 32},           {"tie_word_embeddings", false}};
  if (c.moe) {
    spec["model_type"] = "qwen3_moe";
    spec["num_experts"] = 8;
    spec["num_experts_per_tok"] = 2;
    spec["moe_intermediate_size"] = 176;
    spec["output_router_logits"] = true;
  }
  auto model = test::make_qwen3();
  model->init_random(spec.dump(), 5, Device::cpu(), c.dtype);
  test::DefaultSlots s(*model);
  std::shared_ptr<Loss> chunked;
  if (std::string(c.loss) != "nll") chunked = test::make_plugin<Loss>(c.loss);
  std::shared_ptr<MlpStrategy> tiled;
  if (c.tile_rows > 0) tiled = test::make_plugin<MlpStrategy>("tiled_mlp");
  std::shared_ptr<Adapter> lora;
  if (c.lora_rank > 0) {
    lora = test::make_plugin<Adapter>("lora", str("r = ", c.lora_rank));
    lora->attach(*model, AdapterContext{Device::cpu(), c.dtype, 1, ""});
  }
  model->zero_grad();  // the trained parameters' gradients, as the run gives them
  StepSlots slots{*model, chunked ? *chunked : *s.loss, *s.rope, *s.memory, *s.parallel};
  slots.mlp = tiled.get();
  slots.adapter = lora.get();
  slots.recipe.set_checkpoint_every(c.checkpoint_every);
  slots.recipe.set("tiled_mlp", "tile_rows", c.tile_rows);
  slots.recipe.set("loss_chunked", "chunk_rows", c.chunk_rows);
  slots.recipe.set("qwen3", "moe_tile_rows", c.moe_tile_rows);
  const int64_t T = 512;
  std::vector<int64_t> ids(T), labels(T);
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = labels[static_cast<size_t>(t)] = (t * 37) % 2000;
  const Shard shard = test::shard_from_labels(ids, labels);

  Allocator& a = allocator_for(Device::cpu());
  // A frozen base's norms write their weight gradients into buffers made at the first backward
  // and kept (planned as always-live): one step first, so they are live before the measured one.
  if (lora) train_step(slots, shard, 1.0 / T, Device::cpu());
  const AllocatorStats before = a.stats();  // weights and grads are live already
  a.reset_peak();
  StepTimeline timeline(Device::cpu());
  train_step(slots, shard, 1.0 / T, Device::cpu());
  const int64_t measured = a.stats().peak_bytes - before.live_bytes;

  PlanInputs in;
  in.model = model->config();
  in.seq_len = in.tokens_per_rank = T;
  in.weight_dtype = c.dtype;
  in.recipe = slots.recipe;
  PlanSlots ps;
  ps.model = model.get();  // the module's own plan: its head groups (auto: one kv head each)
  ps.model_name = "qwen3";
  ps.loss = chunked.get();
  ps.loss_name = c.loss;
  ps.mlp = tiled.get();
  if (tiled) ps.mlp_name = "tiled_mlp";
  ps.adapter = lora.get();
  if (lora) ps.adapter_name = "lora";
  const MemoryPlan plan = build_plan(in, ps);
  int64_t persistent = 0;
  for (const auto& t : plan.terms)
    if (t.phase == plan_phase::always) persistent += t.bytes;
  const MemoryPlan::Peak peak = plan.peak(false);
  const int64_t planned = peak.bytes - (persistent - plan.category_bytes(PlanCategory::reserve));
  // The plan counts a little CUDA-only scratch the CPU kernels do not allocate (the attention
  // backward's delta, the cross entropy's per-row loss): within 1% of the measured step peak.
  EXPECT_NEAR(static_cast<double>(planned), static_cast<double>(measured), 0.01 * static_cast<double>(measured))
      << "planned " << planned << " measured " << measured << " (peak phase " << peak.phase << ")";

  const auto dir = test::temp_dir("plan-step");
  const TimelineFiles f = timeline.write(dir.string(), peak.bytes);
  std::ifstream in_json(f.json);
  const auto j = nlohmann::json::parse(in_json);
  EXPECT_GT(j["events"].size(), 50u);
  EXPECT_EQ(j["peak_bytes"].get<int64_t>(), a.stats().peak_bytes);
  EXPECT_FALSE(a.recorder().enabled());
  // One band per saved layer input (and the forward's layer outputs, which become the next inputs).
  std::ifstream in_svg(f.svg);
  const std::string svg((std::istreambuf_iterator<char>(in_svg)), std::istreambuf_iterator<char>());
  EXPECT_NE(svg.find(str("saved activation ", in.model.num_layers)), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(DtypesAndLosses, PlanAgainstStep,
                         ::testing::Values(StepCase{DType::f32, "nll"}, StepCase{DType::bf16, "nll"},
                                           StepCase{DType::f32, "loss_chunked"}, StepCase{DType::bf16, "loss_chunked"},
                                           StepCase{DType::f32, "nll", 3}, StepCase{DType::bf16, "loss_chunked", 3},
                                           StepCase{DType::bf16, "loss_chunked", 1, 384, 64},
                                           StepCase{DType::f32, "loss_chunked", 1, 200, 128},
                                           StepCase{DType::f32, "loss_chunked", 1, 0, 128, 48},
                                           StepCase{DType::bf16, "loss_chunked", 1, 384, 64, 48},
                                           StepCase{DType::bf16, "nll", 1, 0, 0, 16},
                                           // The sparse MLP's backward is the peak (chunked loss).
                                           StepCase{DType::f32, "loss_chunked", 1, 0, 128, 0, true},
                                           StepCase{DType::f32, "loss_chunked", 3, 0, 128, 0, true},
                                           StepCase{DType::f32, "loss_chunked", 1, 0, 128, 0, true, 200}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.dtype)) + "_" + info.param.loss +
                                  (info.param.checkpoint_every > 1 ? str("_every", info.param.checkpoint_every) : "") +
                                  (info.param.tile_rows > 0
                                       ? str("_tiles", info.param.tile_rows, "_chunks", info.param.chunk_rows)
                                       : "") +
                                  (info.param.lora_rank > 0 ? str("_lora", info.param.lora_rank) : "") +
                                  (info.param.moe ? "_moe" : "") +
                                  (info.param.moe_tile_rows > 0 ? str("_tiles", info.param.moe_tile_rows) : "");
                         });

}  // namespace
}  // namespace lcx
