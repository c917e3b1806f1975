// Run (train/run.h), the parts a command builds: each refuses what it cannot build, and the
// plan's recipe reaches the step that runs.
#include <gtest/gtest.h>

#include "lcx/defaults.h"
#include "models/model_util.h"
#include "train/run.h"

namespace lcx {
namespace {

// A Parallelism provider that does not mask documents (every in-tree one does).
class Unmasked final : public Parallelism {
 public:
  void configure(const ParallelModelInfo&, Mesh*) override {}
  int size() const override { return 1; }
  Shard shard(const Sequence&, int) const override { return {}; }
  void attention_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const AttentionArgs&) override {}
  void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          Tensor&, Tensor&, Tensor&, const AttentionArgs&) override {}
};

SlotSet qwen3_slots() {
  SlotSet s;
  s.model = test::make_qwen3();
  s.loss = make_full_logits_loss();
  s.positional = make_default_rope();
  s.memory = make_on_device_memory();
  s.parallel = make_single_rank();
  return s;
}

TEST(RunParts, RefusesAManifestWithoutAModelNamingWhatNeedsIt) {
  const CoreConfig cfg;
  try {
    lcx::Run run(cfg, SlotSet{}, Device::cpu(), {}, "the plan needs the model's shape");
    FAIL() << "a run without a model module was built";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "the manifest names no model module, and the plan needs the model's shape");
    EXPECT_EQ(e.key(), "model.module");
  }
}

TEST(RunParts, RefusesDocumentMasksToAProviderThatCannotMaskThem) {
  CoreConfig cfg;
  SlotSet slots = qwen3_slots();
  slots.parallel = std::make_shared<Unmasked>();
  slots.providers[LCX_SLOT_PARALLELISM].name = "unmasked";
  try {
    lcx::Run run(cfg, slots, Device::cpu());
    FAIL() << "packed documents went to a provider that would attend across them";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unmasked cannot mask documents"), std::string::npos) << e.what();
    EXPECT_EQ(e.key(), "data.attend_across_documents");
    EXPECT_NE(e.fix().find("attend_across_documents = true"), std::string::npos) << e.fix();
  }
  cfg.data.attend_across_documents = true;  // one continuous text: nothing to mask
  lcx::Run run(cfg, slots, Device::cpu());
}

TEST(RunParts, RefusesAModelWithNeitherPathNorInit) {
  const CoreConfig cfg;
  lcx::Run run(cfg, qwen3_slots(), Device::cpu());
  try {
    run.load_or_init_weights("");
    FAIL() << "weights came from nowhere";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "model.path");
  }
}

TEST(RunParts, InitializedWeightsRunThePlansRecipeInTheWeightsDtype) {
  CoreConfig cfg;
  cfg.model.dtype = "fp32";
  cfg.model.init = R"({"vocab_size": 500, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})";
  lcx::Run run(cfg, qwen3_slots(), Device::cpu());
  run.load_or_init_weights("");
  EXPECT_EQ(run.model().config().num_layers, 2);
  run.configure_step();
  ASSERT_TRUE(run.step().activation_dtype.has_value());
  EXPECT_EQ(*run.step().activation_dtype, DType::f32);

  // A GPU too small for anything: the plan's leanest recipe, and the step runs it.
  run.plan_step(run.model().config(), 256, 1, -1);
  const Recipe leanest = choose_recipe(plan_inputs(cfg, run.model().config(), 256), run.plan_slots(), 1, -1);
  EXPECT_EQ(run.planned().seq_len, 256);
  EXPECT_EQ(run.planned().recipe.get("qwen3", "attention_head_groups", 0), leanest.get("qwen3", "attention_head_groups", 0));
  EXPECT_EQ(run.planned().recipe.get("qwen3", "keep_attention", 0), leanest.get("qwen3", "keep_attention", 0));
  EXPECT_EQ(run.step().recipe.get("qwen3", "attention_head_groups", 0), leanest.get("qwen3", "attention_head_groups", 0));
  EXPECT_EQ(run.step().recipe.get("qwen3", "keep_attention", 0), leanest.get("qwen3", "keep_attention", 0));
}

}  // namespace
}  // namespace lcx
