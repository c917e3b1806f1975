// The memory plan's arithmetic: known figures (the guide's 19 GiB MLP intermediate at 1M tokens),
// the public shapes' parameter counts, each provider's terms, phases and peaks, the longest
// sequence that fits, the knobs, and the model shape read without weights.
#include <gtest/gtest.h>

#include <algorithm>

#include "decoder_config.h"
#include "config/manifest.h"
#include "kernels/cudnn_sizes.h"
#include "lcx/attention_cost.h"
#include "lcx/defaults.h"
#include "plan/plan.h"
#include "support/test_util.h"

namespace lcx {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::shared_ptr<Plugin> create_plugin(const std::string& name, const std::string& table = {}) {
  return test::make_plugin(name, table);
}

// The qwen3 module describes shapes without creating weights.
const Model& qwen3() {
  static std::shared_ptr<Plugin> module = create_plugin("qwen3");
  return dynamic_cast<const Model&>(*module);
}

// The slots a plan of the qwen3 module asks: the module with its attention half as one head
// group (the figures below count one group's tensors), core's defaults for the rest.
PlanSlots qwen3_slots() {
  static std::shared_ptr<Plugin> one_group = create_plugin("qwen3", "attention_head_groups = 1");
  PlanSlots s;
  s.model = dynamic_cast<const Model*>(one_group.get());
  s.model_name = "qwen3";
  return s;
}

ModelConfig preset(const std::string& name) {
  ModelSection s;
  s.init = name;
  return plan_model_config(s, qwen3());
}

PlanInputs inputs(const std::string& model, int64_t seq_len, int64_t cp = 1, const std::string& master = "fp32") {
  CoreConfig cfg;
  cfg.model.dtype = "bf16";
  cfg.train.master_dtype = master;
  cfg.distributed.cp = cp;
  return plan_inputs(cfg, preset(model), seq_len);
}

// The first term `id` (of `contributor`, when given); a failure when the plan has none.
const PlanTerm& term(const MemoryPlan& p, const std::string& id, const std::string& contributor = {}) {
  if (const PlanTerm* t = p.find(id, contributor)) return *t;
  static PlanTerm none;
  ADD_FAILURE() << "no term " << id << (contributor.empty() ? "" : " of " + contributor);
  return none;
}

int64_t sum_by(const MemoryPlan& p, const std::string& contributor, const std::string& phase) {
  int64_t n = 0;
  for (const auto& t : p.terms)
    if (t.contributor == contributor && t.phase == phase) n += t.bytes;
  return n;
}

TEST(PlanArithmetic, MlpIntermediateIs19GiBAtOneMillionTokens) {
  // The guide: at 1,048,576 tokens and I = 9728 each [T,I] bf16 tensor is 19 GB (20.4e9 bytes).
  const PlanInputs in = inputs("qwen3-4b", 1048576);
  ASSERT_EQ(in.tokens_per_rank, 1048576);
  const MemoryPlan p = build_plan(in, qwen3_slots());
  const int64_t one = 1048576LL * 9728 * 2;
  EXPECT_NEAR(static_cast<double>(one), 20.4e9, 0.05e9);
  EXPECT_NEAR(static_cast<double>(one) / kGiB, 19.0, 0.01);
  // Recompute holds gate, up and act; the backward adds dact, dgate, dup: six at once.
  EXPECT_EQ(term(p, "mlp_recompute", "whole").bytes, 3 * one);
  EXPECT_EQ(term(p, "mlp_backward", "whole").bytes, 3 * one);
  // The plain loss's logits dwarf everything at this length; with the chunked loss the layer's
  // MLP backward (six [T,I] beside the recomputed x1, h2) is the largest transient.
  EXPECT_EQ(p.largest_transient().phase, plan_phase::loss);
  auto chunked = create_plugin("loss_chunked");
  PlanSlots s = qwen3_slots();
  s.loss = dynamic_cast<const Loss*>(chunked.get());
  s.loss_name = "loss_chunked";
  EXPECT_EQ(build_plan(in, s).largest_transient().phase, plan_phase::mlp_backward);
}

TEST(PlanArithmetic, ParametersOfThePublicShapes) {
  struct Case {
    const char* name;
    int64_t params;
  } cases[] = {{"qwen3-0.6b", 596049920}, {"qwen3-4b", 4022468096}, {"qwen3-8b", 8190735360}};
  for (const auto& c : cases) {
    const MemoryPlan p = build_plan(inputs(c.name, 4096), qwen3_slots());
    EXPECT_EQ(p.category_bytes(PlanCategory::weights), 2 * c.params) << c.name;        // bf16
    EXPECT_EQ(p.category_bytes(PlanCategory::gradients), 4 * c.params) << c.name;      // fp32
    EXPECT_EQ(p.category_bytes(PlanCategory::master_weights), 4 * c.params) << c.name;  // fp32 master
    EXPECT_EQ(p.category_bytes(PlanCategory::optimizer), 8 * c.params) << c.name;       // two fp32 moments
  }
  EXPECT_NEAR(8190735360.0, 8.19e9, 0.005e9);
  // All-bf16 AdamW: no master, moments in bf16.
  const MemoryPlan b = build_plan(inputs("qwen3-8b", 4096, 1, "bf16"), qwen3_slots());
  EXPECT_EQ(b.category_bytes(PlanCategory::master_weights), 0);
  EXPECT_EQ(b.category_bytes(PlanCategory::optimizer), 4 * 8190735360LL);
}

TEST(PlanArithmetic, LayerTransientIsBelowThePeersMeasuredFigure) {
  // PyTorch measured about 210 KB per token inside one Qwen3-4B layer's recompute + backward.
  // lcx's layer_backward frees each buffer after its last reader, so its peak is the larger of two
  // moments, each below that figure: the MLP's backward (six [T,I], x1 and h2 [T,H], and with one
  // head group the attention's q, k, v, qr, kr, attn and fp32 norm rstd / LSE kept for its
  // backward) and the attention's (h1 [T,H], those tensors and dattn, dq, dk, dv; dx1 is written
  // over the caller's dy).
  const PlanInputs in = inputs("qwen3-4b", 65536);
  const MemoryPlan p = build_plan(in, qwen3_slots());
  const int64_t T = 65536, H = 2560, I = 9728, qd = 32 * 128, kvd = 8 * 128, f32 = 4 * (2 * 32 + 8);
  const int64_t mlp = sum_by(p, "qwen3", plan_phase::mlp_backward) + sum_by(p, "whole", plan_phase::mlp_backward);
  const int64_t attention = sum_by(p, "qwen3", plan_phase::backward);
  EXPECT_EQ(mlp, T * (6 * I * 2 + 2 * H * 2 + 4 + (3 * qd + 3 * kvd) * 2 + f32));
  EXPECT_EQ(attention, T * (H * 2 + 4 + (5 * qd + 5 * kvd) * 2 + f32));
  EXPECT_GT(mlp, attention);
  EXPECT_LT(static_cast<double>(mlp) / T, 0.8 * 210e3);
  // With one kv head per group (8 groups) the attention moment holds an eighth of those tensors.
  MemoryPlan g;
  test::make_plugin<Model>("qwen3", "attention_head_groups = 8")->plan(in, g);
  EXPECT_EQ(sum_by(g, "", plan_phase::backward), T * (H * 2 + 4 + (5 * qd + 5 * kvd) * 2 / 8 + f32 / 8));
  // The saved checkpoint is 5 KB per token per layer: [T,H] bf16 with H = 2560.
  EXPECT_EQ(p.category_bytes(PlanCategory::activations_gpu), 36LL * 65536 * 2560 * 2);
}

TEST(PlanArithmetic, EveryDefaultProviderContributes) {
  const MemoryPlan p = build_plan(inputs("qwen3-0.6b", 8192), qwen3_slots());
  for (const char* who : {"qwen3", "whole", "nll", "rope", "on_device", "single", "adamw", "step", "core"})
    EXPECT_TRUE(std::any_of(p.terms.begin(), p.terms.end(), [&](const PlanTerm& t) { return t.contributor == who; }))
        << who;
  EXPECT_EQ(term(p, "logits", "nll").bytes, 2LL * 8192 * 151936 * 4 + 8192 * 4);
  EXPECT_EQ(term(p, "rope_tables", "rope").bytes, 2LL * 8192 * 64 * 4);
  EXPECT_EQ(term(p, "attention_delta", "single").bytes, 16LL * 8192 * 4);
}

// [data] attend_across_documents = false (the default) masks attention per document: the single
// GPU's attention then runs cuDNN on padded batches of documents, whose buffers (at most T rows
// rounded up to a power of two) and per-document tables are planned in place of the unmasked
// call's accumulator and workspaces; attending across documents plans those instead.
TEST(PlanArithmetic, DocumentMasksPlanPaddedBatchesOnlyWhenMasked) {
  const int64_t T = 8192;
  CoreConfig cfg;
  cfg.model.dtype = "bf16";
  const PlanInputs masked = plan_inputs(cfg, preset("qwen3-0.6b"), T);
  EXPECT_TRUE(masked.documents_masked);
  const MemoryPlan p = build_plan(masked, qwen3_slots());
  // qwen3-0.6b: 16 query heads, head_dim 128, bf16; one head group.
  const int64_t hq = 16, d = 128;
  const PlanTerm& bwd = term(p, "document_mask_backward");
  EXPECT_EQ(bwd.phase, plan_phase::backward);
  EXPECT_EQ(bwd.contributor, "single");
  // The batches read and write the documents in place (cuDNN's ragged offsets): per padded row
  // only cuDNN's fp32 stats, softmax sums, dQ accumulator and workspace.
  EXPECT_EQ(bwd.bytes, T * (2 * hq * 4 + 2 * hq * d * 4) + 256);
  EXPECT_EQ(term(p, "document_mask_forward", "single").bytes, T * hq * 4 + 256);
  EXPECT_EQ(term(p, "document_tables", "single").bytes, 112 * T + (T + 1) * 8);
  // Rows round up to a power of two: 5,000 tokens plan 8,192 padded rows.
  EXPECT_EQ(cudnn_document_batch_bytes(false, hq, 5000, d), 8192 * hq * 4 + 256);
  EXPECT_EQ(p.find("attention_dq_accumulator"), nullptr);

  cfg.data.attend_across_documents = true;
  const PlanInputs across = plan_inputs(cfg, preset("qwen3-0.6b"), T);
  EXPECT_FALSE(across.documents_masked);
  const MemoryPlan q = build_plan(across, qwen3_slots());
  for (const char* id : {"document_mask_forward", "document_mask_backward", "document_tables"})
    EXPECT_EQ(q.find(id), nullptr) << id;
  EXPECT_EQ(term(q, "attention_dq_accumulator", "single").bytes, cudnn_dq_accumulator_bytes(hq, T, d));
  EXPECT_LT(q.peak().bytes, p.peak().bytes);
}

TEST(PlanArithmetic, ChunkedLossIsFarBelowFullLogits) {
  const PlanInputs in = inputs("qwen3-4b", 131072);
  PlanSlots full = qwen3_slots();
  auto plugin = create_plugin("loss_chunked");
  PlanSlots chunked = qwen3_slots();
  chunked.loss = dynamic_cast<const Loss*>(plugin.get());
  chunked.loss_name = "loss_chunked";
  ASSERT_NE(chunked.loss, nullptr);
  const MemoryPlan a = build_plan(in, full), b = build_plan(in, chunked);
  const int64_t full_loss = sum_by(a, "nll", plan_phase::loss), chunk_loss = sum_by(b, "loss_chunked", plan_phase::loss);
  // Plain fp32 logits alone are 80 GB at 128k tokens; the chunked loss's target is
  // under 1.5 GB.
  EXPECT_GE(full_loss, 131072LL * 151936 * 4 * 2);
  EXPECT_LT(static_cast<double>(chunk_loss), 1.5e9);
  EXPECT_GT(chunk_loss, 0);
  EXPECT_EQ(a.peak().phase, plan_phase::loss);
  EXPECT_LT(b.peak().bytes, a.peak().bytes);
  // chunk_rows sets the chunk: its bf16 gradient grows with the rows, its fp32 logits stay one
  // 256-row slice.
  auto rows = [&](int n) {
    auto p = create_plugin("loss_chunked", str("chunk_rows = ", n, "\n"));
    PlanSlots c = chunked;
    c.loss = dynamic_cast<const Loss*>(p.get());
    return sum_by(build_plan(in, c), "loss_chunked", plan_phase::loss);
  };
  EXPECT_EQ(rows(512) - rows(256), 256LL * 151936 * 2);
  EXPECT_EQ(rows(1024), chunk_loss);  // the default
}

// An offload of this shape: two layer inputs on the GPU, every input in pinned memory.
class HostStrategy final : public MemoryStrategy {
 public:
  void begin_step(int) override {}
  void save(int, const Tensor&) override {}
  Tensor fetch(int) override { return {}; }
  void keep(int, const Tensor&) override {}
  std::vector<Tensor> kept(int) override { return {}; }
  void release(int) override {}
  void end_step() override {}
  void plan(const PlanInputs& in, MemoryPlan& p) const override {
    const int64_t each = in.tokens_per_rank * in.model.hidden_size * 2;
    p.add("prefetched", "prefetched inputs", PlanCategory::activations_gpu, 2 * each, plan_phase::step);
    p.add("pinned_pool", "pinned pool", PlanCategory::activations_host, in.model.num_layers * each, plan_phase::step, true);
  }
};

TEST(PlanArithmetic, OffloadMovesActivationsToHost) {
  const PlanInputs in = inputs("qwen3-4b", 131072);
  const MemoryPlan gpu = build_plan(in, qwen3_slots());
  const int64_t each = 131072LL * 2560 * 2;
  HostStrategy strategy;
  PlanSlots s = qwen3_slots();
  s.memory = &strategy;
  s.memory_name = "offload";
  const MemoryPlan host = build_plan(in, s);
  EXPECT_EQ(host.category_bytes(PlanCategory::activations_gpu), 2 * each);
  EXPECT_EQ(host.category_bytes(PlanCategory::activations_host, true), 36 * each);
  EXPECT_EQ(host.host_peak(), 36 * each);
  EXPECT_EQ(host.host_bytes(plan_phase::optimizer), 0);
  EXPECT_EQ(gpu.peak().bytes - host.peak().bytes -
                (gpu.category_bytes(PlanCategory::reserve) - host.category_bytes(PlanCategory::reserve)),
            34 * each);
  EXPECT_EQ(gpu.host_peak(), 0);
}

// train.checkpoint_every = k: core's on_device holds ceil(L/k) inputs, the step plans the k - 1
// rebuilt inputs beside the backward (and, while the last is rebuilt, beside the forward's
// buffers), and the model's work grows by one forward of each unsaved layer: the cost model sees
// the time the memory buys.
TEST(PlanArithmetic, CheckpointEveryKLayersSavesInputsAndCostsAForward) {
  PlanInputs in = inputs("qwen3-4b", 65536);
  const int64_t TH = 65536LL * 2560 * 2;
  const MemoryPlan every = build_plan(in, qwen3_slots());
  for (int64_t k : {2, 3, 5}) {
    SCOPED_TRACE(str("every ", k));
    in.recipe.set_checkpoint_every(k);
    const MemoryPlan sparse = build_plan(in, qwen3_slots());
    const int64_t saved = (36 + k - 1) / k;
    EXPECT_EQ(sparse.category_bytes(PlanCategory::activations_gpu), saved * TH);
    for (const char* phase : {plan_phase::forward, plan_phase::mlp_backward, plan_phase::backward})
      EXPECT_EQ(sum_by(sparse, "step", phase) - sum_by(every, "step", phase), (k - 1) * TH) << phase;
    EXPECT_EQ(sum_by(sparse, "step", plan_phase::loss), sum_by(every, "step", plan_phase::loss));
    // One more forward of the 36 - saved unsaved layers: its attention forward exactly.
    const double per_layer = every.work.attention_forward_flops / 72;  // two attention forwards per layer
    EXPECT_DOUBLE_EQ(sparse.work.attention_forward_flops - every.work.attention_forward_flops,
                     static_cast<double>(36 - saved) * per_layer);
    EXPECT_GT(predicted_step_seconds(sparse.work), predicted_step_seconds(every.work));
    EXPECT_LT(sparse.peak().bytes, every.peak().bytes);
  }
  // Kept attention set by its key does not combine with k > 1: refused naming both keys.
  auto keeping = create_plugin("qwen3", "keep_attention = true");
  PlanSlots s = qwen3_slots();
  s.model = dynamic_cast<const Model*>(keeping.get());
  in.recipe.set_checkpoint_every(2);
  try {
    build_plan(in, s);
    ADD_FAILURE() << "keep_attention with checkpoint_every 2 was planned";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "qwen3.keep_attention");
    // The key it conflicts with, which only the message names.
    EXPECT_NE(std::string(e.what()).find("train.checkpoint_every = 2"), std::string::npos) << e.what();
  }
  // The search drops those candidates and keeps the others.
  for (const RecipeOption& o : rank_recipes(in, s, 141LL << 30, -1, 0)) EXPECT_EQ(o.recipe.checkpoint_every(), 1);
}

// train.rebuild_each (k >= 3): one rebuilt input beside the backward instead of k - 1, two beside a
// A sliding_attention layer's attention work is its window's pairs (about T x W per head), not
// the causal half of T x seq: half the layers windowed at W = 128 take the other half's time.
TEST(PlanArithmetic, WindowedLayersCountTheirWindowsPairs) {
  PlanInputs in = inputs("qwen3-4b", 131072);
  const MemoryPlan full = build_plan(in, qwen3_slots());
  for (size_t l = 0; l < in.model.layer_types.size(); l += 2) in.model.layer_types[l] = "sliding_attention";
  in.model.sliding_window = 128;
  const MemoryPlan half = build_plan(in, qwen3_slots());
  const double seq = 131072, window_row = static_cast<double>(causal_pairs(131072, 128)) / seq;
  const double want = (window_row + seq / 2) / (2 * (seq / 2));
  EXPECT_NEAR(half.work.attention_forward_flops / full.work.attention_forward_flops, want, 1e-12);
  EXPECT_NEAR(half.work.attention_backward_flops / full.work.attention_backward_flops, want, 1e-12);
  EXPECT_LT(want, 0.51);
}

// rebuild's forward; n(n-1)/2 forwards a segment of n instead of n - 1. The search takes it only
// where holding the segment does not fit; [train] rebuild_each set is the one value declared.
TEST(PlanArithmetic, RebuildEachHoldsOneInputAndCostsForwards) {
  PlanInputs in = inputs("qwen3-4b", 65536);
  const int64_t TH = 65536LL * 2560 * 2;
  in.recipe.set_checkpoint_every(6);
  const MemoryPlan hold = build_plan(in, qwen3_slots());
  in.recipe.set(Recipe::kCoreProvider, Recipe::kRebuildEach, 1, true);
  ASSERT_TRUE(in.recipe.rebuild_each());
  const MemoryPlan each = build_plan(in, qwen3_slots());
  for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
    EXPECT_EQ(sum_by(hold, "step", phase) - sum_by(each, "step", phase), 4 * TH) << phase;
  EXPECT_EQ(sum_by(hold, "step", plan_phase::forward) - sum_by(each, "step", plan_phase::forward), 3 * TH);
  // 36 layers in 6 segments of 6: 15 forwards each instead of 5.
  EXPECT_EQ(in.recipe.rebuilt_forwards(36), 90);
  const double per_layer = hold.work.attention_forward_flops / (36 + 36 + 30);
  EXPECT_NEAR(each.work.attention_forward_flops - hold.work.attention_forward_flops, 60 * per_layer, 1e-6 * per_layer * 60);
  EXPECT_GT(predicted_step_seconds(each.work), predicted_step_seconds(hold.work));
  EXPECT_LE(each.peak().bytes, hold.peak().bytes);
  // Below k = 3 there is nothing to choose: k = 2 holds one rebuilt input either way.
  in.recipe.set_checkpoint_every(2);
  EXPECT_FALSE(in.recipe.rebuild_each());
  EXPECT_EQ(in.recipe.rebuilt_forwards(36), 18);
  in.recipe.set_checkpoint_every(7);
  EXPECT_EQ(in.recipe.rebuilt_forwards(36), 5 * 21 + 0);  // five segments of 7 and the last layer alone
  // The knob: both values under "auto", in order; the key's value alone when set; none for k < 3.
  auto knob = [&](int64_t k, int64_t key) -> std::optional<std::vector<int64_t>> {
    PlanInputs at = inputs("qwen3-4b", 65536);
    at.recipe.set_checkpoint_every(k);
    at.rebuild_each = key;
    for (const DeclaredKnob& d : declared_knobs(at, qwen3_slots(), k))
      if (d.knob.name == Recipe::kRebuildEach) return d.knob.values;
    return std::nullopt;
  };
  EXPECT_EQ(knob(3, -1), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(knob(4, 1), (std::vector<int64_t>{1}));
  EXPECT_EQ(knob(2, -1), std::nullopt);
  PlanInputs at = inputs("qwen3-4b", 65536);
  at.rebuild_each = 1;
  EXPECT_TRUE(unplanned_recipe(at, qwen3_slots(), 3).rebuild_each());
  at.rebuild_each = -1;
  EXPECT_FALSE(unplanned_recipe(at, qwen3_slots(), 3).rebuild_each());
}

// The search: spacings 1, 2, 3, 4, 6, 8, 12 for 36 layers (kept attention with k = 1 alone), and
// for a memory strategy that places by the recipe, the most saved inputs on the GPU that fit.
TEST(PlanArithmetic, RecipeSearchPlacesTheMostInputsThatFit) {
  const PlanInputs in = inputs("qwen3-4b", 262144, 1, "bf16");
  auto offload = create_plugin("offload");
  auto chunked = create_plugin("loss_chunked");
  PlanSlots s = qwen3_slots();
  s.memory = dynamic_cast<const MemoryStrategy*>(offload.get());
  s.memory_name = "offload";
  s.loss = dynamic_cast<const Loss*>(chunked.get());
  s.loss_name = "loss_chunked";
  const int64_t gpu = 100LL << 30;
  const std::vector<RecipeOption> options = rank_recipes(in, s, gpu, -1, 0);
  std::vector<int64_t> spacings;
  for (const RecipeOption& o : options) {
    if (std::find(spacings.begin(), spacings.end(), o.recipe.checkpoint_every()) == spacings.end())
      spacings.push_back(o.recipe.checkpoint_every());
    if (o.recipe.get("qwen3", "keep_attention", 0)) {
      EXPECT_EQ(o.recipe.checkpoint_every(), 1);
    }
    EXPECT_GE(o.recipe.get("offload", "gpu_layers", -1), 0);
    EXPECT_LE(o.recipe.get("offload", "gpu_layers", -1), o.recipe.saved_layers(36));
    EXPECT_TRUE(o.fits) << recipe_name(o.recipe) << ": " << format_bytes(o.gpu_peak);  // the GPU's room is found, never passed
    // One more input on the GPU would not fit, unless every saved input is there already.
    if (o.recipe.get("offload", "gpu_layers", -1) < o.recipe.saved_layers(36)) {
      PlanInputs more = in;
      more.recipe = o.recipe;
      more.recipe.set("offload", "gpu_layers", more.recipe.get("offload", "gpu_layers", -1) + 1);
      EXPECT_GT(build_plan(more, s).peak().bytes, gpu) << recipe_name(o.recipe);
    }
  }
  std::sort(spacings.begin(), spacings.end());
  EXPECT_EQ(spacings, (std::vector<int64_t>{1, 2, 3, 4, 6, 8, 12}));
  // The memory strategy's host bytes are those of the inputs it does not keep on the GPU.
  const int64_t each = 262144LL * 2560 * 2;
  for (const RecipeOption& o : options)
    if (!o.recipe.get("qwen3", "keep_attention", 0)) {
      EXPECT_EQ(o.host_peak, (o.recipe.saved_layers(36) - o.recipe.get("offload", "gpu_layers", -1)) * each) << recipe_name(o.recipe);
    }
  // A fixed train.checkpoint_every is the search's input; core's on_device places nothing.
  for (const RecipeOption& o : rank_recipes(in, qwen3_slots(), gpu, -1, 3)) {
    EXPECT_EQ(o.recipe.checkpoint_every(), 3);
    EXPECT_EQ(o.recipe.get("offload", "gpu_layers", -1), -1);
  }
  // A host budget: the fastest that pins at most 40 GiB, and the longest length with the search.
  const Recipe chosen = choose_recipe(in, s, gpu, 40LL << 30, 0);
  PlanInputs with = in;
  with.recipe = chosen;
  EXPECT_LE(build_plan(with, s).host_peak(), 40LL << 30);
  const int64_t longest = longest_fitting_seq(in, s, gpu, 40LL << 30, 16, 0);
  EXPECT_GT(longest, longest_fitting_seq(in, s, gpu, 40LL << 30, 16, 1));
}

// Tiles of the MLP and chunks of the loss: with room, the search takes the largest (one tile of the
// shard, 4,096-row chunks: the least work); under a budget that the leanest rows of the same recipe
// just fit, rows no larger, each the largest that still fits. Keys set in the manifest win: nothing
// is left to choose. The rows never multiply the candidates listed.
TEST(PlanArithmetic, RecipeSearchTakesTheLargestTilesAndChunksThatFit) {
  // One unmasked sequence: document masks' padded batches would set the peak in the attention
  // backward, where neither the tiles nor the chunks weigh.
  PlanInputs in = inputs("qwen3-4b", 131072, 1, "bf16");
  in.documents_masked = false;
  auto with_rows = [](const std::string& tile, const std::string& chunk) {
    static std::vector<std::shared_ptr<Plugin>> made;
    made.push_back(create_plugin("tiled_mlp", tile));
    made.push_back(create_plugin("loss_chunked", chunk));
    PlanSlots s = qwen3_slots();
    s.mlp = dynamic_cast<const MlpStrategy*>(made[made.size() - 2].get());
    s.mlp_name = "tiled_mlp";
    s.loss = dynamic_cast<const Loss*>(made.back().get());
    s.loss_name = "loss_chunked";
    return s;
  };
  const PlanSlots s = with_rows("", "");
  auto peak = [&](const Recipe& r, const PlanSlots& slots) {
    PlanInputs with = in;
    with.recipe = r;
    return build_plan(with, slots).peak().bytes;
  };
  const Recipe big = choose_recipe(in, s, 141LL << 30, -1, 0);
  EXPECT_EQ(big.get("tiled_mlp", "tile_rows", 0), 131072);
  EXPECT_EQ(big.get("loss_chunked", "chunk_rows", 0), 4096);

  Recipe lean = big;
  lean.set("tiled_mlp", "tile_rows", 4096);
  lean.set("loss_chunked", "chunk_rows", 256);
  const int64_t budget = peak(lean, s);
  ASSERT_LT(budget, peak(big, s));
  const Recipe tight = choose_recipe(in, s, budget, -1, 0);
  EXPECT_LE(peak(tight, s), budget) << recipe_name(tight);
  EXPECT_LE(tight.get("tiled_mlp", "tile_rows", 0), big.get("tiled_mlp", "tile_rows", 0));
  EXPECT_LE(tight.get("loss_chunked", "chunk_rows", 0), big.get("loss_chunked", "chunk_rows", 0));
  EXPECT_TRUE(tight.get("tiled_mlp", "tile_rows", 0) < big.get("tiled_mlp", "tile_rows", 0) || tight.get("loss_chunked", "chunk_rows", 0) < big.get("loss_chunked", "chunk_rows", 0))
      << recipe_name(tight);
  // Each the largest that fits beside the other: the next size up of either passes the budget.
  const std::vector<int64_t> tiles{4096, 8192, 16384, 32768, 131072}, chunks{256, 1024, 4096};
  auto next = [](const std::vector<int64_t>& v, int64_t x) {
    auto it = std::upper_bound(v.begin(), v.end(), x);
    return it == v.end() ? int64_t{0} : *it;
  };
  if (const int64_t up = next(tiles, tight.get("tiled_mlp", "tile_rows", 0))) {
    Recipe r = tight;
    r.set("tiled_mlp", "tile_rows", up);
    EXPECT_GT(peak(r, s), budget) << recipe_name(r);
  }
  if (const int64_t up = next(chunks, tight.get("loss_chunked", "chunk_rows", 0))) {
    Recipe r = tight;
    r.set("loss_chunked", "chunk_rows", up);
    EXPECT_GT(peak(r, s), budget) << recipe_name(r);
  }

  // Keys set: the providers plan their own rows whatever the recipe, so the search leaves them be.
  const PlanSlots keyed = with_rows("tile_rows = 8192", "chunk_rows = 256");
  const Recipe fixed = choose_recipe(in, keyed, 141LL << 30, -1, 0);
  EXPECT_FALSE(fixed.find("tiled_mlp", "tile_rows")) << recipe_name(fixed);
  EXPECT_FALSE(fixed.find("loss_chunked", "chunk_rows")) << recipe_name(fixed);
  PlanInputs planned = in;
  planned.recipe = fixed;
  const MemoryPlan plan = build_plan(planned, keyed);
  EXPECT_EQ(term(plan, "mlp_backward", "tiled_mlp").bytes, 3 * 8192 * in.model.intermediate_size * 2);
  EXPECT_EQ(term(plan, "chunk_dlogits", "loss_chunked").bytes, 256 * in.model.vocab_size * 2);
  EXPECT_EQ(rank_recipes(in, s, 141LL << 30, -1, 0).size(), rank_recipes(in, keyed, 141LL << 30, -1, 0).size());
}

// Expert parallelism (ep 8 across dp 8, parameters replicated): a rank holds an eighth of each
// sparse layer's experts, with their gradients and AdamW state, the router and every other
// parameter whole; its experts' buffers are sized for the worst case, every token of the group's
// 8 ranks routed to its experts (T*k*8 rows).
TEST(PlanArithmetic, ExpertParallelDividesTheExperts) {
  CoreConfig cfg;
  cfg.model.dtype = "bf16";
  const ModelConfig m = preset("qwen3-30b-a3b");
  const PlanInputs one = plan_inputs(cfg, m, 8192);
  cfg.distributed.dp = 8;
  cfg.distributed.ep = 8;
  const PlanInputs eight = plan_inputs(cfg, m, 8192);
  ASSERT_EQ(eight.ep, 8);
  ASSERT_EQ(parameter_shards(eight), 1);
  const MemoryPlan a = build_plan(one, qwen3_slots()), b = build_plan(eight, qwen3_slots());
  const int64_t E = decoder::moe(m).num_experts, H = m.hidden_size, Im = decoder::moe(m).moe_intermediate_size, k = decoder::moe(m).num_experts_per_tok;
  const int64_t experts = decoder::sparse_layers(m) * 3 * E * Im * H;
  EXPECT_EQ(b.parameters, a.parameters - experts / 8 * 7);
  EXPECT_EQ(term(b, "parameters", "qwen3").bytes, b.parameters * 2);
  EXPECT_EQ(term(b, "gradients", "qwen3").bytes, b.parameters * 4);
  EXPECT_EQ(term(b, "adamw_moments", "adamw").bytes, 2 * b.parameters * 4);
  EXPECT_EQ(term(b, "master_weights", "adamw").bytes, b.parameters * 4);
  EXPECT_EQ(term(b, "moe_wgrad_scratch", "qwen3").bytes, E / 8 * Im * H * 2);
  EXPECT_EQ(b.find("gathered_layer", "qwen3"), nullptr);  // nothing sharded, nothing gathered
  const int64_t T = 8192, tk = T * k, R = tk * 8;
  const int64_t routing = T * E * (2 + 4) + T * k * 8 + tk * 8;
  EXPECT_EQ(term(b, "moe_forward", "qwen3").bytes, routing + std::max(R * (H + 3 * Im), (tk + R) * H) * 2);
  const int64_t widest = std::max({3 * H + 3 * Im, 2 * H + 4 * Im, H + 5 * Im});
  const int64_t widest_ep = std::max({R * (2 * H + 3 * Im) + tk * H, R * (2 * H + 4 * Im), R * (H + 5 * Im)});
  EXPECT_EQ(term(b, "moe_backward", "qwen3").bytes, routing + T * k * 4 + widest_ep * 2 + T * E * 2);
  EXPECT_EQ(term(a, "moe_backward", "qwen3").bytes, routing + T * k * 4 + tk * widest * 2 + T * E * 2);
  std::printf("qwen3-30b-a3b at 8,192 tokens: parameters a rank %.2f GiB (ep 1) -> %.2f GiB (ep 8); MoE backward buffers "
              "%.2f GiB -> %.2f GiB (worst case T*k*8 rows)\n",
              static_cast<double>(term(a, "parameters", "qwen3").bytes) / kGiB,
              static_cast<double>(term(b, "parameters", "qwen3").bytes) / kGiB,
              static_cast<double>(term(a, "moe_backward", "qwen3").bytes) / kGiB,
              static_cast<double>(term(b, "moe_backward", "qwen3").bytes) / kGiB);
}

TEST(PlanArithmetic, ContextParallelDividesTokensPerRank) {
  const PlanInputs one = inputs("qwen3-8b", 1048576, 1), eight = inputs("qwen3-8b", 1048576, 8);
  EXPECT_EQ(eight.tokens_per_rank, 131072);
  EXPECT_EQ(eight.world_size, 8);
  const MemoryPlan a = build_plan(one, qwen3_slots()), b = build_plan(eight, qwen3_slots());
  EXPECT_EQ(term(a, "mlp_recompute").bytes, 8 * term(b, "mlp_recompute").bytes);
  EXPECT_EQ(a.category_bytes(PlanCategory::activations_gpu), 8 * b.category_bytes(PlanCategory::activations_gpu));
  // ZeRO-3 over the mesh: a rank keeps an eighth of the states, and gathers one layer at a time.
  EXPECT_EQ(b.category_bytes(PlanCategory::optimizer), (8190735360LL + 7) / 8 * 8);
  EXPECT_GT(term(b, "gathered_layer_grads", "qwen3").bytes, 0);
  // The ring's buffers are cp_ring's own terms; core adds no communication of its own for cp.
  for (const auto& t : b.terms)
    if (t.category == PlanCategory::communication) {
      EXPECT_EQ(t.contributor, "qwen3") << t.name;
    }
  auto ring = test::make_plugin<Parallelism>("cp_ring", "", Device::cpu(), nullptr, MeshShape{1, 8, 1});
  PlanSlots r = qwen3_slots();
  r.parallel = ring.get();
  r.parallel_name = "cp_ring";
  EXPECT_GT(sum_by(build_plan(eight, r), "cp_ring", plan_phase::backward), 0);
  // Zigzag sharding pads to a multiple of 2 x cp.
  EXPECT_EQ(inputs("qwen3-8b", 1000, 8).seq_len, 1008);
  EXPECT_EQ(inputs("qwen3-8b", 1000, 8).tokens_per_rank, 126);
}

TEST(PlanArithmetic, PhasesAndPeak) {
  MemoryPlan p;
  p.contributor = "t";
  p.add("w", "w", PlanCategory::weights, 10, plan_phase::always);
  p.add("saved", "saved", PlanCategory::activations_gpu, 5, plan_phase::step);
  p.add("fwd", "fwd", PlanCategory::transient, 3, plan_phase::forward);
  p.add("bwd", "bwd a", PlanCategory::transient, 7, plan_phase::backward);
  p.add("bwd", "bwd b", PlanCategory::transient, 1, plan_phase::backward);
  p.add("ctx", "ctx", PlanCategory::reserve, 2, plan_phase::always);
  p.add("pinned", "pinned", PlanCategory::activations_host, 40, plan_phase::step, true);
  p.add("nothing", "nothing", PlanCategory::transient, 0, plan_phase::loss);
  EXPECT_EQ(p.terms.size(), 7u);  // a zero term is dropped
  EXPECT_EQ(p.gpu_bytes(plan_phase::forward), 20);
  EXPECT_EQ(p.gpu_bytes(plan_phase::backward), 25);
  EXPECT_EQ(p.gpu_bytes(plan_phase::backward, false), 23);
  EXPECT_EQ(p.gpu_bytes(plan_phase::optimizer), 12);  // the step's terms are gone
  EXPECT_EQ(p.peak().phase, plan_phase::backward);
  EXPECT_EQ(p.peak().bytes, 25);
  EXPECT_EQ(p.largest_transient().bytes, 8);
  EXPECT_EQ(p.host_peak(), 40);
  EXPECT_EQ(p.host_bytes(plan_phase::optimizer), 0);
  EXPECT_EQ(p.terms.front().contributor, "t");
  // Looked up by id (the first of that id, in the order added), of a contributor when named.
  ASSERT_NE(p.find("bwd"), nullptr);
  EXPECT_EQ(p.find("bwd")->bytes, 7);
  EXPECT_EQ(p.find("bwd", "t")->name, "bwd a");
  EXPECT_EQ(p.find("bwd", "other"), nullptr);
  EXPECT_EQ(p.find("nothing"), nullptr);  // dropped
  EXPECT_EQ(p.find("bwd a"), nullptr);     // a display name is no id
}

TEST(PlanArithmetic, LongestSequenceIsTheEdgeOfFitting) {
  const PlanInputs in = inputs("qwen3-0.6b", 4096);
  const int64_t gpu = 40LL << 30;
  const int64_t longest = longest_fitting_seq(in, qwen3_slots(), gpu, 16);
  ASSERT_GT(longest, 0);
  EXPECT_EQ(longest % 16, 0);
  auto peak_at = [&](int64_t seq) {
    CoreConfig cfg;
    cfg.model.dtype = "bf16";
    return build_plan(plan_inputs(cfg, in.model, seq), qwen3_slots()).peak().bytes;
  };
  EXPECT_LE(peak_at(longest), gpu);
  EXPECT_GT(peak_at(longest + 16), gpu);
  EXPECT_EQ(longest_fitting_seq(in, qwen3_slots(), 1LL << 20, 16), 0);  // not even the weights fit
}

TEST(PlanArithmetic, KnobsNameWhatWouldFit) {
  // Qwen3-4B at 128k on one 80 GiB GPU with the plain loss does not fit; the chunked loss and a
  // shorter sequence are named with their peaks.
  const PlanInputs in = inputs("qwen3-4b", 131072, 1, "bf16");
  const int64_t gpu = 100LL << 30;
  ASSERT_GT(build_plan(in, qwen3_slots()).peak().bytes, gpu);
  PluginLoader loader({test::build_plugin_dir()});
  const auto knobs = plan_knobs(in, qwen3_slots(), &loader, gpu, 1);
  // A knob by what it does: the one plugin it loads (and no key), or a key it sets.
  auto loading = [&](const std::string& plugin) -> const PlanKnob* {
    for (const auto& k : knobs)
      if (k.loads == std::vector<std::string>{plugin} && k.sets.empty()) return &k;
    return nullptr;
  };
  auto setting = [&](const std::string& key) -> const PlanKnob* {
    for (const auto& k : knobs)
      for (const auto& [set, value] : k.sets)
        if (set == key) return &k;
    return nullptr;
  };
  const PlanKnob* chunked = loading("loss_chunked");
  ASSERT_NE(chunked, nullptr);
  // The knob's words are the plugin's own offer; core names no plugin.
  EXPECT_EQ(chunked->action, str("load loss_chunked (", create_plugin("loss_chunked")->plan_offer(), ")"));
  EXPECT_LT(chunked->peak, build_plan(in, qwen3_slots()).peak().bytes);
  const PlanKnob* cp = setting("distributed.cp");
  ASSERT_NE(cp, nullptr);
  EXPECT_TRUE(cp->fits);
  const PlanKnob* seq = setting("data.seq_len");
  ASSERT_NE(seq, nullptr);
  EXPECT_TRUE(seq->fits);
  EXPECT_LE(seq->peak, gpu);
  // offload keeps prefetch + 1 of the 36 layer inputs on the GPU.
  const PlanKnob* offload = loading("offload");
  ASSERT_NE(offload, nullptr);
  EXPECT_LT(offload->peak, build_plan(in, qwen3_slots()).peak().bytes);
}

// Where no length fits as loaded (Qwen3-8B fine-tuned whole in 24 GiB), the fixes name
// an installed adapter, and the providers together with the longest sequence that fits with them.
TEST(PlanArithmetic, NothingFitsOffersAnAdapterAndAShorterSequence) {
  const PlanInputs in = inputs("qwen3-8b", 1 << 20);
  const int64_t gpu = 24LL << 30;
  ASSERT_EQ(longest_fitting_seq(in, qwen3_slots(), gpu, 1), 0);
  PluginLoader loader({test::build_plugin_dir()});
  const auto knobs = plan_knobs(in, qwen3_slots(), &loader, gpu, 1);
  const PlanKnob* adapter = nullptr;
  const PlanKnob* shorter = nullptr;
  for (const auto& k : knobs) {
    if (k.loads == std::vector<std::string>{"lora"} && k.sets.empty()) adapter = &k;
    if (k.loads.size() > 1 && k.sets.size() == 1 && k.sets[0].first == "data.seq_len") shorter = &k;
  }
  ASSERT_NE(adapter, nullptr);
  EXPECT_EQ(adapter->action, "load lora (its adapters trained, the base frozen)");
  EXPECT_LT(adapter->peak, build_plan(in, qwen3_slots()).peak().bytes);
  ASSERT_NE(shorter, nullptr);
  EXPECT_TRUE(shorter->fits);
  EXPECT_LE(shorter->peak, gpu);
  EXPECT_NE(std::find(shorter->loads.begin(), shorter->loads.end(), "lora"), shorter->loads.end());
  EXPECT_LT(std::stoll(shorter->sets[0].second), in.seq_len);
  EXPECT_NE(shorter->action.find(", and lower data.seq_len to " + shorter->sets[0].second), std::string::npos)
      << shorter->action;
}

TEST(PlanArithmetic, OutOfMemoryReportNamesTheKnob) {
  CoreConfig cfg;
  cfg.model.dtype = "bf16";
  cfg.data.seq_len = 131072;
  cfg.plugins.dir = test::build_plugin_dir();
  SlotSet slots;
  slots.model = test::make_plugin<Model>("qwen3");
  const std::string text = format_out_of_memory(cfg, slots, preset("qwen3-4b"), 80LL << 30, "cudaMalloc of 1 byte");
  for (const char* s : {"out of GPU memory: cudaMalloc of 1 byte", "does NOT fit", "what would make it fit",
                        "load loss_chunked", "lower data.seq_len to", "largest transient"})
    EXPECT_NE(text.find(s), std::string::npos) << s << "\n" << text;
}

TEST(PlanSizes, ParsesGpuMemory) {
  EXPECT_EQ(parse_memory_size("80GB"), 80LL << 30);
  EXPECT_EQ(parse_memory_size("141GiB"), 141LL << 30);
  EXPECT_EQ(parse_memory_size("81920MiB"), 80LL << 30);
  EXPECT_EQ(parse_memory_size("1.5tb"), 3LL << 39);
  EXPECT_EQ(parse_memory_size("4096"), 4096);
  EXPECT_EQ(parse_memory_size(" 16 GB"), 16LL << 30);
  // Only decimal numbers (stod alone reads "0x10GB" as 16 GiB).
  EXPECT_EQ(parse_memory_size("1e3"), 1000);
  for (const char* bad : {"eighty", "80XB", "-1GB", "0GB", "", "0x10GB", "0X10", "inf", "nanGB", "GB", "1.2.3GB", "1e+GB"})
    EXPECT_THROW(parse_memory_size(bad), Error) << bad;
  try {
    parse_memory_size("80XB");
    ADD_FAILURE() << "80XB was read as a size";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "--gpu-memory");
    EXPECT_FALSE(e.fix().empty());
  }
}

TEST(PlanModelShape, FromPresetJsonAndConfigJson) {
  const ModelConfig m8 = preset("qwen3-8b");
  EXPECT_EQ(m8.hidden_size, 4096);
  EXPECT_FALSE(m8.tie_word_embeddings);
  ModelSection s;
  s.init = R"({"preset": "qwen3-4b", "num_hidden_layers": 4})";
  const ModelConfig four = plan_model_config(s, qwen3());
  EXPECT_EQ(four.num_layers, 4);
  EXPECT_EQ(four.intermediate_size, 9728);
  s.init = R"({"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16})";
  const ModelConfig tiny = plan_model_config(s, qwen3());
  EXPECT_EQ(tiny.vocab_size, 1024);  // the qwen3 module's small default
  EXPECT_EQ(tiny.head_dim, 16);

  const auto dir = test::temp_dir("plan-model") / "SomeModel";
  test::write_file(dir / "config.json",
                   R"({"model_type": "qwen3", "vocab_size": 5000, "hidden_size": 256, "intermediate_size": 768,
                       "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 2,
                       "tie_word_embeddings": true})");
  ModelSection p;
  p.path = dir.string();
  std::string source;
  const ModelConfig c = plan_model_config(p, qwen3(), &source);
  EXPECT_EQ(c.vocab_size, 5000);
  EXPECT_EQ(c.head_dim, 128);  // Qwen3Config's default when config.json has no head_dim, as the module reads it
  EXPECT_NE(source.find("config.json"), std::string::npos);
}

TEST(PlanModelShape, MissingFolderNamedAfterAPublicModel) {
  ModelSection s;
  s.path = "models/Qwen3-8B";
  std::string source;
  const ModelConfig c = plan_model_config(s, qwen3(), &source);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_NE(source.find("has no config.json"), std::string::npos);
  s.path = "models/my-finetune";
  try {
    plan_model_config(s, qwen3());
    ADD_FAILURE() << "an unknown missing folder must be refused";
  } catch (const Error& e) {
    EXPECT_NE(e.fix().find("--set model.init=qwen3-8b"), std::string::npos) << e.fix();
  }
  ModelSection bad;
  bad.init = "qwen3-9b";
  EXPECT_THROW(plan_model_config(bad, qwen3()), Error);
}

}  // namespace
}  // namespace lcx
