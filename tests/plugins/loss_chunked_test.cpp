// loss_chunked against core's full-logits loss: loss sum, valid count, grad of hidden and
// accumulated grad of the head, for tied and untied heads, ragged and tiny T, odd V and chunks with
// every label ignored. The plugin is loaded through the real loader from the build's plugin folder,
// so these tests exercise the .so a run would load.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "config/manifest.h"
#include "lcx/defaults.h"
#include "lcx/ops.h"
#include "lcx/plan.h"
#include "loader/plugin_loader.h"
#include "plugins/loss_chunked_cases.h"

namespace lcx {
namespace {

using test::load_chunked;
using test::LossCase;
using test::make_targets;
using test::random_tensor;

void expect_close(const Tensor& got, const Tensor& want, float rtol, float atol, const char* what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  auto g = got.to_floats(), w = want.to_floats();
  float worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    float excess = std::fabs(g[i] - w[i]) - (atol + rtol * std::fabs(w[i]));
    if (!(excess <= worst)) worst = std::isnan(excess) ? INFINITY : excess, worst_i = i;
  }
  EXPECT_EQ(worst, 0.f) << what << ": element " << worst_i << " got " << g[worst_i] << " want " << w[worst_i];
}

// Runs core's loss and the plugin on the same inputs and compares every output. fp32 storage: to
// fp32 rounding, element by element. bf16 storage: the plugin's GEMMs take the gradient in bf16
// (the kernel writes it so) where core's head gradient reads it in fp32, so the head gradient
// differs by bf16 rounding; grad_hidden is a bf16 GEMM from bf16 dlogits in both.
void compare(const LossCase& c, uint32_t seed) {
  SCOPED_TRACE(test::describe(c));
  const test::LossInputs in = test::make_inputs(c, seed);
  auto full = make_full_logits_loss();
  auto chunked = load_chunked(c.chunk_rows);
  const double scale = 1.0 / 37;  // as if the step had valid targets on other ranks too

  const test::LossOutputs ref = test::run_loss(*full, in, Device::cpu(), c.dtype, scale);
  const test::LossOutputs got = test::run_loss(*chunked, in, Device::cpu(), c.dtype, scale);

  EXPECT_EQ(got.result.valid, ref.result.valid);
  EXPECT_GT(ref.result.valid, 0);
  EXPECT_NEAR(got.result.loss_sum, ref.result.loss_sum, 1e-6 * std::fabs(ref.result.loss_sum));
  EXPECT_EQ(got.forward_only.valid, ref.result.valid);
  EXPECT_NEAR(got.forward_only.loss_sum, ref.result.loss_sum, 1e-6 * std::fabs(ref.result.loss_sum));
  if (c.dtype == DType::f32) {
    expect_close(got.grad_hidden, ref.grad_hidden, 1e-5f, 1e-7f, "grad_hidden");
    expect_close(got.grad_head, ref.grad_head, 1e-5f, 1e-7f, "grad_head");
  } else {
    EXPECT_LT(test::rel_l2(got.grad_hidden, ref.grad_hidden), 2e-3) << "grad_hidden";
    // The head gradient minus its starting value: what the loss added, bf16-rounded terms.
    Tensor added = got.grad_head.clone(), added_ref = ref.grad_head.clone();
    Tensor minus = in.grad_head0.clone();
    ops::scale_inplace(minus, -1.f);
    ops::add_inplace(added, minus);
    ops::add_inplace(added_ref, minus);
    EXPECT_LT(test::rel_l2(added, added_ref), 5e-3) << "grad_head";
  }
  const int64_t skipped = test::expect_skipped_rows_zero(got.grad_hidden, in.targets, c.chunk_rows);
  // A one-row last chunk may be ignored by chance; the cases with ignored ranges must skip.
  if (!c.ignored.empty()) {
    EXPECT_GT(skipped, 0) << "the case meant to have fully ignored chunks";
  }
}

TEST(LossChunked, UntiedHeadMatchesFullLogits) { compare({300, 32, 257, 64, false, {}}, 1); }

TEST(LossChunked, TiedHeadMatchesFullLogits) { compare({300, 32, 257, 64, true, {}}, 2); }

TEST(LossChunked, ChunksWithEveryLabelIgnored) {
  // Chunks 1 and 3 (rows 64..127, 192..255) have no valid label; the last, partial chunk too.
  compare({290, 24, 101, 64, false, {{64, 128}, {192, 256}, {256, 290}}}, 3);
  compare({290, 24, 101, 64, true, {{60, 200}}}, 4);
}

TEST(LossChunked, TNotAMultipleOfChunkRows) {
  compare({257, 16, 64, 32, false, {}}, 5);
  compare({1000, 16, 64, 256, true, {}}, 6);
}

TEST(LossChunked, TSmallerThanChunkRows) {
  compare({7, 16, 33, 256, false, {}}, 7);
  compare({1, 8, 33, 256, true, {}}, 8);
}

TEST(LossChunked, OddVocabulary) {
  compare({128, 20, 1, 32, false, {}}, 9);
  compare({128, 20, 997, 48, true, {}}, 10);
}

// bf16 storage, as on the GPU, over every case of the issue.
TEST(LossChunked, Bf16HiddenAndHead) {
  uint32_t seed = 15;
  for (const LossCase& c : test::issue_cases(DType::bf16)) compare(c, seed++);
}

TEST(LossChunked, ChunkOfOneRow) { compare({37, 8, 19, 1, false, {{5, 9}}}, 11); }

// The fused op against core's cross entropy on the same logits: per-row losses, and the gradient
// written in place over fp32 logits, into a separate fp32 tensor, or straight into bf16.
TEST(CrossEntropyChunk, MatchesCrossEntropyRowByRow) {
  for (int64_t V : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1001}}) {
    SCOPED_TRACE(str("V=", V));
    const int64_t n = 23;
    std::mt19937 rng(static_cast<uint32_t>(100 + V));
    Tensor logits = random_tensor({n, V}, rng, 3.f);
    Tensor targets = make_targets(n, V, rng, {{4, 6}}, 0.2);
    const float scale = 0.125f;
    Tensor want = Tensor::empty({n, V}, DType::f32);
    int64_t valid = 0;
    const double want_sum = ops::cross_entropy_forward_backward(logits, targets, scale, &want, &valid);

    Tensor loss = Tensor::empty({n}, DType::f32);
    Tensor sep = Tensor::empty({n, V}, DType::f32);
    ops::cross_entropy_chunk(logits, targets, scale, loss, &sep);
    expect_close(sep, want, 1e-6f, 1e-9f, "dlogits fp32");
    double sum = 0;
    const auto l = loss.to_floats();
    const int64_t* t = targets.data_as<const int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      sum += l[static_cast<size_t>(i)];
      if (t[i] == -100) {
        EXPECT_EQ(l[static_cast<size_t>(i)], 0.f) << "ignored row " << i;
      } else if (V > 1) {
        EXPECT_GT(l[static_cast<size_t>(i)], 0.f) << "row " << i;
      }
    }
    EXPECT_NEAR(sum, want_sum, 1e-6 * std::max(1.0, std::fabs(want_sum)));

    Tensor bf = Tensor::empty({n, V}, DType::bf16);
    ops::cross_entropy_chunk(logits, targets, scale, loss, &bf);
    expect_close(bf, want.to(DType::bf16), 0.f, 0.f, "dlogits bf16 (the fp32 gradient, rounded once)");

    Tensor fwd_loss = Tensor::empty({n}, DType::f32);
    ops::cross_entropy_chunk(logits, targets, scale, fwd_loss, nullptr);
    expect_close(fwd_loss, loss, 0.f, 0.f, "forward-only row losses");

    Tensor in_place = logits.clone();
    ops::cross_entropy_chunk(in_place, targets, scale, loss, &in_place);
    expect_close(in_place, want, 1e-6f, 1e-9f, "dlogits in place");
  }
}

TEST(CrossEntropyChunk, RefusesWrongShapesAndTargets) {
  std::mt19937 rng(7);
  Tensor logits = random_tensor({4, 9}, rng, 1.f);
  Tensor targets = make_targets(4, 9, rng, {});
  Tensor loss = Tensor::empty({4}, DType::f32);
  Tensor short_loss = Tensor::empty({3}, DType::f32);
  EXPECT_NE(test::error_of([&] { ops::cross_entropy_chunk(logits, targets, 1.f, short_loss, nullptr); })
                .find("row_loss"),
            std::string::npos);
  Tensor bf_logits = logits.to(DType::bf16);
  EXPECT_NE(test::error_of([&] { ops::cross_entropy_chunk(bf_logits, targets, 1.f, loss, nullptr); }).find("must be fp32"),
            std::string::npos);
  targets.data_as<int64_t>()[2] = 9;
  EXPECT_NE(test::error_of([&] { ops::cross_entropy_chunk(logits, targets, 1.f, loss, nullptr); })
                .find("target 9 at row 2"),
            std::string::npos);
}

TEST(LossChunked, AllTargetsIgnoredGivesZero) {
  std::mt19937 rng(12);
  Tensor hidden = random_tensor({50, 8}, rng, 1.f), head = random_tensor({11, 8}, rng, 1.f);
  Tensor targets = make_targets(50, 11, rng, {{0, 50}});
  Tensor gh = random_tensor({50, 8}, rng, 1.f), gw = Tensor::zeros({11, 8}, DType::f32);
  LossResult r = load_chunked(16)->forward_backward(hidden, head, targets, 1.0, gh, gw);
  EXPECT_EQ(r.valid, 0);
  EXPECT_EQ(r.loss_sum, 0.0);
  for (float v : gh.to_floats()) ASSERT_EQ(v, 0.f);
  for (float v : gw.to_floats()) ASSERT_EQ(v, 0.f);
}

TEST(LossChunked, RefusesBadChunkRows) {
  PluginLoader loader({test::build_plugin_dir()});
  Manifest m = Manifest::parse("[loss_chunked]\nchunk_rows = 0\n", "bad.toml");
  PluginArgs args{"loss_chunked", m.section("loss_chunked"), Device::cpu()};
  try {
    loader.create("loss_chunked", args);
    FAIL() << "chunk_rows = 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_rows"), std::string::npos) << e.what();
  }
}

// chunk_rows is "auto" or a count: another string fails naming the key, what was found and the fix.
TEST(LossChunked, RefusesAStringOtherThanAuto) {
  try {
    test::make_plugin<Loss>("loss_chunked", "chunk_rows = \"big\"");
    FAIL() << "chunk_rows = \"big\" was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("loss_chunked.chunk_rows: 'big' is neither \"auto\" nor an integer"), std::string::npos) << what;
    EXPECT_NE(e.fix().find("\"auto\" (the plan's choice"), std::string::npos) << e.fix();
  }
  EXPECT_NO_THROW(test::make_plugin<Loss>("loss_chunked", "chunk_rows = \"auto\""));
}

TEST(LossChunked, RefusesMismatchedShapes) {
  std::mt19937 rng(13);
  Tensor hidden = random_tensor({10, 8}, rng, 1.f), head = random_tensor({11, 9}, rng, 1.f);
  Tensor targets = make_targets(10, 11, rng, {});
  EXPECT_THROW(load_chunked(4)->forward(hidden, head, targets), Error);
}

// The point of the plugin: the transient memory of the loss is one chunk's logits, not T of them.
// Measured on the CPU allocator, which accounts every tensor byte.
TEST(LossChunked, PeakTransientMemoryIsOneChunk) {
  const int64_t T = 4096, H = 64, V = 1001, C = 128;
  std::mt19937 rng(14);
  Tensor hidden = random_tensor({T, H}, rng, 1.f), head = random_tensor({V, H}, rng, 0.5f);
  Tensor targets = make_targets(T, V, rng, {});
  Tensor gh = Tensor::empty({T, H}, DType::f32), gw = Tensor::zeros({V, H}, DType::f32);
  auto full = make_full_logits_loss();
  auto chunked = load_chunked(C);
  Allocator& cpu = allocator_for(Device::cpu());

  auto transient_peak = [&](Loss& loss) {
    const int64_t live = cpu.stats().live_bytes;
    cpu.reset_peak();
    loss.forward_backward(hidden, head, targets, 1.0 / T, gh, gw);
    return cpu.stats().peak_bytes - live;
  };
  const int64_t full_peak = transient_peak(*full);
  const int64_t chunked_peak = transient_peak(*chunked);
  const int64_t logits_bytes = T * V * 4;
  const int64_t chunk_logits_bytes = C * V * 4;
  std::cout << "[ memory   ] T=" << T << " V=" << V << " chunk_rows=" << C << ": full-logits peak " << full_peak
            << " B, chunked peak " << chunked_peak << " B (" << static_cast<double>(full_peak) / chunked_peak
            << "x less)\n";
  EXPECT_GE(full_peak, 2 * logits_bytes);  // logits and dlogits, both [T,V] fp32
  // One chunk's logits (an fp32 head takes its gradient in place) and the per-token losses; the
  // CPU GEMM widens nothing here, so nothing else may appear.
  EXPECT_GE(chunked_peak, chunk_logits_bytes);
  EXPECT_LE(chunked_peak, chunk_logits_bytes + T * 4);
  EXPECT_LT(chunked_peak * 30, full_peak);
}

// With a bf16 head the chunk's gradient is bf16 and whole, its fp32 logits one 256-row slice.
TEST(LossChunked, PeakWithBf16HeadIsOneSliceOfLogitsAndOneChunkOfGradient) {
  const int64_t T = 3000, H = 32, V = 1001;
  std::mt19937 rng(17);
  Tensor hidden = random_tensor({T, H}, rng, 1.f).to(DType::bf16), head = random_tensor({V, H}, rng, 0.5f).to(DType::bf16);
  Tensor targets = make_targets(T, V, rng, {});
  Tensor gh = Tensor::empty({T, H}, DType::bf16), gw = Tensor::zeros({V, H}, DType::f32);
  Allocator& cpu = allocator_for(Device::cpu());
  for (int64_t C : {int64_t{128}, int64_t{1024}}) {
    auto chunked = load_chunked(C);
    const int64_t live = cpu.stats().live_bytes;
    cpu.reset_peak();
    chunked->forward_backward(hidden, head, targets, 1.0 / T, gh, gw);
    const int64_t peak = cpu.stats().peak_bytes - live;
    EXPECT_EQ(peak, std::min<int64_t>(C, 256) * V * 4 + C * V * 2 + T * 4) << "chunk_rows " << C;
  }
}

// Under "auto" (the key absent or "auto") the chunk is the plan's, handed over by use_recipe
// (the knob loss_chunked.chunk_rows), else 1024; a count set in the manifest wins over the recipe. The CPU
// allocator's peak shows the chunk a call used (one slice of fp32 logits, the chunk's bf16 gradient),
// and the plan counts the same chunk from PlanInputs::recipe.
TEST(LossChunked, AutoTakesThePlansChunkAndAKeySetWins) {
  const int64_t T = 3000, H = 32, V = 1001;
  std::mt19937 rng(19);
  Tensor hidden = random_tensor({T, H}, rng, 1.f).to(DType::bf16), head = random_tensor({V, H}, rng, 0.5f).to(DType::bf16);
  Tensor targets = make_targets(T, V, rng, {});
  Tensor gh = Tensor::empty({T, H}, DType::bf16), gw = Tensor::zeros({V, H}, DType::f32);
  Allocator& cpu = allocator_for(Device::cpu());
  auto peak = [&](Loss& loss) {
    const int64_t live = cpu.stats().live_bytes;
    cpu.reset_peak();
    loss.forward_backward(hidden, head, targets, 1.0 / T, gh, gw);
    return cpu.stats().peak_bytes - live;
  };
  auto chunk = [&](int64_t C) { return std::min<int64_t>(C, 256) * V * 4 + C * V * 2 + T * 4; };
  auto planned = [&](const Loss& loss, const Recipe& r) {
    PlanInputs in;
    in.model.vocab_size = V;
    in.model.hidden_size = H;
    in.tokens_per_rank = in.seq_len = T;
    in.recipe = r;
    MemoryPlan plan;
    loss.plan(in, plan);
    return plan.gpu_bytes(plan_phase::loss, false);
  };
  Recipe r;
  r.set("loss_chunked", "chunk_rows", 128);
  for (const char* table : {"", "chunk_rows = \"auto\""}) {
    auto loss = test::make_plugin<Loss>("loss_chunked", table);
    EXPECT_EQ(peak(*loss), chunk(1024)) << table;
    EXPECT_EQ(planned(*loss, Recipe{}), chunk(1024)) << table;
    loss->use_recipe(r);
    EXPECT_EQ(peak(*loss), chunk(128)) << table;
    EXPECT_EQ(planned(*loss, r), chunk(128)) << table;
  }
  auto keyed = load_chunked(512);
  keyed->use_recipe(r);
  EXPECT_EQ(peak(*keyed), chunk(512));
  EXPECT_EQ(planned(*keyed, r), chunk(512));
}

// Each chunk's head-gradient GEMM reads and writes the fp32 [V,H] gradient: the plan's work counts
// it per chunk, so larger chunks are predicted faster (the chunk_rows sweep on the H200).
TEST(LossChunked, WorkCountsTheHeadGradientOncePerChunk) {
  PlanInputs in;
  in.model.vocab_size = 151936;
  in.model.hidden_size = 2560;
  in.tokens_per_rank = in.seq_len = 65536;
  auto loss = test::make_plugin<Loss>("loss_chunked");
  auto bytes = [&](int64_t C) {
    in.recipe.set("loss_chunked", "chunk_rows", C);
    MemoryPlan plan;
    loss->plan(in, plan);
    return plan.work.memory_bytes;
  };
  EXPECT_DOUBLE_EQ(bytes(256) - bytes(1024), (256 - 64) * 8.0 * 151936 * 2560);
  EXPECT_GT(bytes(1024), bytes(4096));
}

}  // namespace
}  // namespace lcx
